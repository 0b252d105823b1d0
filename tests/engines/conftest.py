"""Fixtures for the engine contract suite: one decode side per engine, a fresh prefill per test.

``engine_name`` is parametrised over every engine; mooncake/nixl params carry their markers and
are skipped with the install hint when the package (or libibverbs) is missing. ``pair`` gives a
started prefill engine with two registered source regions (random bytes), connected to a decode
side whose two destination regions are reset to the 0xA5 sentinel before each test. Both
engines live for the module; tests that close or break an engine use ``Pair``/``fresh_decode``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pdstate.pools.memory import BufferSpec, PrivateMemory, Region
from pdstate.transfer.engines import EngineUnavailable, TransferEngine, create_engine, engine_class
from pdstate.transfer.plan import TransferPlan
from tests.engines._decode_peer import SENTINEL, LocalDecode, RemoteDecode

REPO_ROOT = Path(__file__).resolve().parents[2]
SRC_SIZES = (12 << 20, 1 << 20)
SRC_SEED = 20240607

ENGINE_PARAMS = [
    pytest.param("loopback", id="loopback"),
    pytest.param("shm", id="shm"),
    pytest.param("mooncake", id="mooncake", marks=pytest.mark.mooncake),
    pytest.param("nixl", id="nixl", marks=pytest.mark.nixl),
]

# Options both sides pass to create_engine. NIXL: without UCX's IB modules, so the pytest
# process does not segfault at exit (see src/pdstate/engines/nixl.py).
ENGINE_OPTIONS: dict[str, dict[str, Any]] = {
    "loopback": {},
    "shm": {},
    "mooncake": {"host": "127.0.0.1"},
    "nixl": {"ucx_env": {"UCX_MODULES": "^ib"}},
}

# Whether a transfer to a peer that died after connect fails (shm cannot tell: writes land in
# the orphaned segment file; peer liveness is the control channel's job).
DETECTS_PEER_LOSS = {"loopback": True, "shm": False, "mooncake": True, "nixl": True}


def require_engine(name: str) -> None:
    try:
        engine_class(name)
    except EngineUnavailable as exc:
        pytest.skip(str(exc))


def new_decode(name: str) -> LocalDecode | RemoteDecode:
    cls = LocalDecode if name == "loopback" else RemoteDecode
    return cls(name, ENGINE_OPTIONS[name])


@pytest.fixture(scope="module", params=ENGINE_PARAMS)
def engine_name(request: pytest.FixtureRequest) -> str:
    require_engine(request.param)
    return request.param


@pytest.fixture(scope="module")
def decode(engine_name: str) -> Iterator[LocalDecode | RemoteDecode]:
    side = new_decode(engine_name)
    yield side
    side.close()


@pytest.fixture
def fresh_decode(engine_name: str) -> Iterator[LocalDecode | RemoteDecode]:
    """A decode side of its own, for tests that stop or kill it."""
    side = new_decode(engine_name)
    yield side
    side.close()


@dataclass
class Descs:
    """Descriptors as (region index, offset) pairs; ``Pair`` turns them into addresses."""

    s_reg: np.ndarray
    s_off: np.ndarray
    d_reg: np.ndarray
    d_off: np.ndarray
    length: np.ndarray

    @classmethod
    def of(cls, rows: list[tuple[int, int, int, int, int]]) -> Descs:
        cols = np.array(rows, dtype=np.int64).reshape(-1, 5).T
        return cls(*cols)


@dataclass
class Source:
    memory: PrivateMemory
    arrays: list[np.ndarray]
    regions: list[Region]


@pytest.fixture(scope="session")
def source() -> Iterator[Source]:
    memory = PrivateMemory()
    rng = np.random.default_rng(SRC_SEED)
    arrays = []
    for i, n in enumerate(SRC_SIZES):
        (t,) = memory.allocate(f"src{i}", [BufferSpec("bytes", (n,), torch.uint8)])
        a = t.numpy()
        a[:] = rng.integers(0, 256, n, dtype=np.uint8)
        arrays.append(a)
    yield Source(memory, arrays, memory.regions())
    memory.close()


class Pair:
    """A started prefill engine connected to a decode side, plus plan/expectation helpers."""

    def __init__(self, name: str, source: Source, decode: LocalDecode | RemoteDecode) -> None:
        self.name = name
        self.source = source
        self.decode = decode
        self.engine: TransferEngine = create_engine(name, **ENGINE_OPTIONS[name])
        self.engine.start()
        self.engine.register(source.regions)
        self.peer_id = self.engine.connect(decode.endpoint)
        self._sbase = np.array([r.base_ptr for r in source.regions], dtype=np.uint64)
        self._dbase = np.array([r.base_ptr for r in decode.dst_regions], dtype=np.uint64)

    def plan(self, d: Descs) -> TransferPlan:
        u = np.uint64
        return TransferPlan.from_arrays(
            self._sbase[d.s_reg] + d.s_off.astype(u), self._dbase[d.d_reg] + d.d_off.astype(u), d.length
        )

    def expected(self, d: Descs) -> list[np.ndarray]:
        out = [np.full(r.nbytes, SENTINEL, dtype=np.uint8) for r in self.decode.dst_regions]
        for sr, so, dr, do, n in zip(*(c.tolist() for c in (d.s_reg, d.s_off, d.d_reg, d.d_off, d.length))):
            out[dr][do : do + n] = self.source.arrays[sr][so : so + n]
        return out

    def untouched(self) -> list[np.ndarray]:
        return self.expected(Descs.of([]))

    def transfer(self, d: Descs, timeout_s: float = 15.0) -> None:
        handle = self.engine.submit(self.peer_id, self.plan(d))
        self.engine.wait(handle, timeout_s)

    def assert_destination(self, expected: list[np.ndarray]) -> None:
        actual = self.decode.read()
        for i, (got, want) in enumerate(zip(actual, expected)):
            if not np.array_equal(got, want):
                bad = np.flatnonzero(got != want)
                raise AssertionError(
                    f"destination region {i}: {bad.size} bytes differ, first at offset {bad[0]} "
                    f"(got 0x{got[bad[0]]:02x}, want 0x{want[bad[0]]:02x})"
                )

    def close(self) -> None:
        self.engine.close()


@pytest.fixture(scope="module")
def _module_pair(engine_name: str, source: Source, decode: LocalDecode | RemoteDecode) -> Iterator[Pair]:
    # One prefill engine per engine and module: engines are meant to be reused across requests,
    # and Mooncake's native destructor alone takes about 1 s. Tests that break or close an
    # engine build a Pair of their own.
    p = Pair(engine_name, source, decode)
    yield p
    p.close()


@pytest.fixture
def pair(_module_pair: Pair) -> Pair:
    _module_pair.decode.reset()
    return _module_pair
