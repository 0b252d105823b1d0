"""NIXL specifics: bad metadata, name mismatch, and the exit-segfault work-around."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch

from pdstate.pools.memory import BufferSpec, PrivateMemory
from pdstate.transfer.engines import InvalidEndpoint, NativeEngineError
from pdstate.transfer.engines.nixl import NixlEngine
from tests.support.engines import ENGINE_OPTIONS, require_engine
from tests.support.paths import REPO

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(60)]


@pytest.fixture(scope="module", autouse=True)
def _available() -> None:
    require_engine("nixl")


@pytest.fixture
def decode() -> Iterator[NixlEngine]:
    memory = PrivateMemory()
    memory.allocate("dst", [BufferSpec("b", (1 << 16,), torch.uint8)])
    engine = NixlEngine(**ENGINE_OPTIONS["nixl"])
    engine.start()
    engine.register(memory.regions())
    yield engine
    engine.close()


@pytest.fixture
def prefill() -> Iterator[NixlEngine]:
    engine = NixlEngine(**ENGINE_OPTIONS["nixl"])
    engine.start()
    yield engine
    engine.close()


def test_garbage_metadata_fails_at_connect(decode, prefill) -> None:
    with pytest.raises(NativeEngineError, match=r"^nixl add_remote_agent \(.+\) failed: nixlMismatchError"):
        prefill.connect({**decode.endpoint(), "metadata": b"garbage"})


def test_metadata_of_another_agent_is_refused(decode, prefill) -> None:
    endpoint = decode.endpoint()
    with pytest.raises(InvalidEndpoint, match=f"names agent 'someone-else' but its metadata is '{decode.agent_name}'"):
        prefill.connect({**endpoint, "agent_name": "someone-else"})


def test_agent_names_are_unique_per_start() -> None:
    a, b = NixlEngine(), NixlEngine()
    assert a.agent_name is None  # chosen at start(), from the pid and the engine id
    assert a.endpoint_keys == ("agent_name", "metadata") and b.supports_notify


def test_process_exits_cleanly_with_the_ucx_work_around() -> None:
    """Without UCX_MODULES=^ib this process dies with SIGSEGV at exit (see engines/nixl.py)."""
    script = textwrap.dedent(
        """
        import torch
        from pdstate.transfer.engines.nixl import UCX_ENV_WITHOUT_IB, NixlEngine
        from pdstate.pools.memory import Region
        buf = torch.zeros(4096, dtype=torch.uint8)
        engine = NixlEngine(ucx_env=UCX_ENV_WITHOUT_IB)
        engine.start()
        engine.register([Region("b", buf.data_ptr(), 4096)])
        engine.endpoint()
        engine.close()
        print("closed")
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}  # the engine must set it
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "closed"  # NIXL logs to stdout too
