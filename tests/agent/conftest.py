import shutil

import pytest

from tests.agent.support import SHM_DIR, PrefillProcess, fill, make_side


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


@pytest.fixture
def sides():
    """Two private-memory sides of the tiny layout, filled with different seeds (prefill 1, decode 2)."""
    p, d = make_side(False), make_side(False)
    fill(p.kv_args, 1)
    fill(d.kv_args, 2)
    yield p, d
    p.close()
    d.close()
