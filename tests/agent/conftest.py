import shutil

import pytest

from tests.agent.support import SHM_DIR, PrefillProcess


@pytest.fixture
def prefills():
    """Start prefill child processes: ``prefills(seed, **options)``; all stopped at teardown."""
    started: list[PrefillProcess] = []

    def start(seed: int, **options) -> PrefillProcess:
        p = PrefillProcess(seed, **options)
        started.append(p)
        return p

    yield start
    for p in started:
        p.close()


@pytest.fixture(scope="session", autouse=True)
def _segment_dir():
    yield
    shutil.rmtree(SHM_DIR, ignore_errors=True)
