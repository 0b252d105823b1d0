"""Engines for the tests: same-host options, the engine parameters, and the engine contract's rig.

``ENGINE_PARAMS``: every engine; mooncake/nixl params carry their markers, and ``require_engine``
skips with the install hint when the package (or libibverbs) is missing. The contract's rig
(its fixtures are in ``tests/engines/test_contract.py``): a ``Source`` of two registered regions of random bytes, a
decode side (``decode_peer``) whose two destination regions are reset to the sentinel, and a
``Pair``: a started prefill engine connected to that decode side, with plan/expectation helpers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from pdstate.pools.memory import BufferSpec, PrivateMemory, Region
from pdstate.transfer.engines import EngineUnavailable, TransferEngine, create_engine, engine_class
from pdstate.transfer.engines.nixl import UCX_ENV_WITHOUT_IB
from pdstate.transfer.engines.shm import prove_endpoint
from pdstate.transfer.plan import TransferPlan
from tests.support.decode_peer import LocalDecode, RemoteDecode
from tests.support.images import SENTINEL

ENGINE_PARAMS = [
    pytest.param("shm", id="shm"),
    pytest.param("loopback", id="loopback"),
    pytest.param("mooncake", id="mooncake", marks=pytest.mark.mooncake),
    pytest.param("nixl", id="nixl", marks=pytest.mark.nixl),
]

# Options both sides pass to their engine on one host. NIXL: without UCX's IB modules, so the
# pytest process does not segfault at exit (see src/pdstate/transfer/engines/nixl.py).
ENGINE_OPTIONS: dict[str, dict[str, Any]] = {
    "shm": {},
    "loopback": {},
    "mooncake": {"host": "127.0.0.1"},
    "nixl": {"ucx_env": dict(UCX_ENV_WITHOUT_IB)},
}

# Whether a transfer to a peer that died after connect fails (shm cannot tell: writes land in
# the orphaned segment file; peer liveness is the control channel's job).
DETECTS_PEER_LOSS = {"loopback": True, "shm": False, "mooncake": True, "nixl": True}

SRC_SIZES = (12 << 20, 1 << 20)
SRC_SEED = 20240607


def require_engine(name: str) -> None:
    """Skip the test cleanly when the engine's native package is missing."""
    try:
        engine_class(name)
    except EngineUnavailable as exc:
        pytest.skip(str(exc))


def new_decode(name: str) -> LocalDecode | RemoteDecode:
    """The decode side of the contract: in this process for loopback, a child process otherwise."""
    cls = LocalDecode if name == "loopback" else RemoteDecode
    return cls(name, ENGINE_OPTIONS[name])


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

    @classmethod
    def random(cls) -> Source:
        """Two regions (``SRC_SIZES``) of seeded random bytes, in private memory."""
        memory = PrivateMemory()
        rng = np.random.default_rng(SRC_SEED)
        arrays = []
        for i, n in enumerate(SRC_SIZES):
            (t,) = memory.allocate(f"src{i}", [BufferSpec("bytes", (n,), torch.uint8)])
            a = t.numpy()
            a[:] = rng.integers(0, 256, n, dtype=np.uint8)
            arrays.append(a)
        return cls(memory, arrays, memory.regions())


def proven(engine: TransferEngine, endpoint: dict, owner: str | None = None) -> dict:
    """``endpoint`` answering a fresh challenge of ``engine`` when it needs one (shm). The tests run
    as the segments' owner uid, so they can read the secrets, as the decode itself does."""
    if not engine.proves_ownership or endpoint.get("engine") != engine.name:
        return endpoint
    return {**endpoint, **prove_endpoint(endpoint, engine.challenge(owner or ""), owner or "")}


class Pair:
    """A started prefill engine connected to a decode side, plus plan/expectation helpers."""

    def __init__(self, name: str, source: Source, decode: LocalDecode | RemoteDecode) -> None:
        self.name = name
        self.source = source
        self.decode = decode
        self.engine: TransferEngine = create_engine(name, **ENGINE_OPTIONS[name])
        self.engine.start()
        self.engine.register(source.regions)
        self.peer_id = self.engine.connect(proven(self.engine, decode.endpoint))
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
