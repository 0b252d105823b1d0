"""Shared helpers of the integration tests: worker processes, events, sentinel images.

Worker processes are real processes on 127.0.0.1 (port 0). Most tests start them with
``launcher="fork"`` (forked from a fork server that already imported torch and the runtime, so a
worker starts in a fraction of a second on this small machine); the tests that are about the
``python -m pdstate.devtools.processes`` entry point itself (exit status and stderr of a failed local check, the
``pdstate demo`` command) use real ``subprocess`` launches.
"""

from __future__ import annotations

import ctypes
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from pdstate.devtools.processes import WorkerProcess
from pdstate.errors import EngineUnavailable
from pdstate.pools.memory import Region
from pdstate.pools.presets import PoolSettings, preset
from pdstate.runtime import synth
from pdstate.runtime.common import WorkerOptions
from pdstate.runtime.hooks import WorkerHooks
from pdstate.transfer.engines.base import create_engine
from pdstate.transfer.planner import channels_of

TINY = preset("tiny")
SENTINEL = 0xA5

# Options both sides pass to their engine on one host (as in tests/engines/conftest.py).
ENGINE_OPTIONS: dict[str, dict[str, Any]] = {
    "shm": {},
    "loopback": {},
    "mooncake": {"host": "127.0.0.1"},
    "nixl": {"ucx_env": {"UCX_MODULES": "^ib"}},
}

ENGINE_PARAMS = [
    pytest.param("shm", id="shm"),
    pytest.param("loopback", id="loopback"),
    pytest.param("mooncake", id="mooncake", marks=pytest.mark.mooncake),
    pytest.param("nixl", id="nixl", marks=pytest.mark.nixl),
]

# Short timers: a refused or gone peer is noticed quickly, and waits stay bounded.
FAST = dict(heartbeat_interval_s=0.2, peer_timeout_s=3.0, request_deadline_s=20.0)


def require_engine(name: str) -> None:
    """Skip the test cleanly when the engine's native package is missing."""
    try:
        create_engine(name, **ENGINE_OPTIONS.get(name, {}))  # constructs only; nothing starts
    except EngineUnavailable as exc:
        pytest.skip(str(exc))


def options(role: str, settings: PoolSettings = TINY, engine: str = "shm", **kw: Any) -> WorkerOptions:
    kw = {**FAST, **kw}
    kw.setdefault("engine_options", ENGINE_OPTIONS.get(engine, {}))
    return WorkerOptions(role=role, pool=settings, engine=engine, **kw)


class Workers:
    """Starts worker processes and closes every one of them at the end of the test."""

    def __init__(self) -> None:
        self.started: list[WorkerProcess] = []

    def prefill(
        self, settings: PoolSettings = TINY, launcher: str = "fork", hooks: WorkerHooks | None = None, **kw: Any
    ) -> tuple[WorkerProcess, str]:
        w = self._start(options("prefill", settings, **kw), launcher, hooks)
        ev = w.read_event(60)
        assert ev["event"] == "listening", ev
        return w, ev["endpoint"]

    def decode(self, endpoint: str, settings: PoolSettings = TINY, launcher: str = "fork", **kw: Any) -> WorkerProcess:
        return self._start(options("decode", settings, peer=endpoint, **kw), launcher)

    def spawn(self, role: str, settings: PoolSettings = TINY, launcher: str = "fork", **kw: Any) -> WorkerProcess:
        """A worker of either role, without waiting for anything."""
        return self._start(options(role, settings, **kw), launcher)

    def _start(self, opts: WorkerOptions, launcher: str, hooks: WorkerHooks | None = None) -> WorkerProcess:
        w = WorkerProcess(opts, launcher=launcher, hooks=hooks)
        self.started.append(w)
        return w

    def close_all(self) -> None:
        for w in reversed(self.started):
            w.close(timeout_s=15)
        self.started.clear()


def first_event(w: WorkerProcess, timeout_s: float = 30.0) -> dict:
    """The decode's handshake outcome: ``ready`` or ``refused``."""
    ev = w.read_event(timeout_s)
    assert ev["event"] in ("ready", "refused"), ev
    return ev


def wait_until(what: str, probe: Callable[[], Any], timeout_s: float = 10.0, pause_s: float = 0.02) -> Any:
    """Poll ``probe`` until it returns something truthy; fail with ``what`` past the deadline."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(pause_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}; last probe: {last!r}")


def peer_record(prefill: WorkerProcess, worker_id: str, state: str | None = None, timeout_s: float = 10.0) -> dict:
    """What the prefill recorded about decode ``worker_id`` (once decided, or in ``state``)."""

    def probe():
        peers = prefill.command({"cmd": "peers"}, "peers")["peers"]
        for p in peers:
            if p["id"] == worker_id and (p["state"] == state if state else p["state"] != "pending"):
                return p
        return None

    return wait_until(f"the prefill's record of {worker_id} ({state or 'decided'})", probe, timeout_s)


def run_batch(
    decode: WorkerProcess, lengths: list[int], concurrency: int = 1, timeout_s: float = 60.0
) -> tuple[list[dict], dict]:
    """Run ``lengths`` on a ready decode process; returns ``(results, batch_done event)``."""
    decode.send(json.dumps({"cmd": "run", "lengths": lengths, "concurrency": concurrency}))
    results = []
    while True:
        ev = decode.read_event(timeout_s)
        if ev["event"] == "batch_done":
            return results, ev
        assert ev["event"] == "result", ev
        results.append(ev)


def assert_all_verified(results: list[dict], lengths: list[int]) -> None:
    assert sorted(r["seq_len"] for r in results) == sorted(lengths)
    bad = [r for r in results if not (r["status"] == "success" and r["verified"])]
    assert not bad, bad


# --- byte images of the decode pools ------------------------------------------------------------


def fill_regions(regions: list[Region], byte: int = SENTINEL) -> None:
    for r in regions:
        ctypes.memset(r.base_ptr, byte, r.nbytes)


def region_bytes(r: Region) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * r.nbytes).from_address(r.base_ptr)).copy()


def expected_images(regions: list[Region], desc, room: int, lists: list[np.ndarray]) -> list[np.ndarray]:
    """Every region as it must be after ``room`` landed on a sentinel-filled pool: the room's
    deterministic content in exactly the items its index lists address, the sentinel elsewhere."""
    images = [np.full(r.nbytes, SENTINEL, dtype=np.uint8) for r in regions]
    owner = [np.zeros(r.nbytes, dtype=bool) for r in regions]
    order = sorted(range(len(regions)), key=lambda i: regions[i].base_ptr)
    bases = np.array([regions[i].base_ptr for i in order], dtype=np.int64)
    for c, (chan, idx) in enumerate(zip(channels_of(desc), lists)):
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size == 0:
            continue
        for j, (ptr, n, item) in enumerate(zip(chan.ptrs.tolist(), chan.lens.tolist(), chan.items.tolist())):
            assert item % 8 == 0, (chan.name, item)
            assert int(idx.max()) * item + item <= n, f"{chan.name}[{j}]: index past the buffer"
            k = int(np.searchsorted(bases, ptr, side="right")) - 1
            r = order[max(k, 0)]
            assert k >= 0 and ptr + n <= regions[r].base_ptr + regions[r].nbytes, (
                f"{chan.name}[{j}] outside every region"
            )
            words = synth.item_bases(room, c, j, idx.size)[:, None] + np.arange(item // 8, dtype=np.uint64)
            offsets = (ptr - regions[r].base_ptr + idx * item)[:, None] + np.arange(item)
            assert not owner[r][offsets].any(), f"{chan.name}[{j}]: destination items overlap another's"
            owner[r][offsets] = True
            images[r][offsets] = words.astype("<u8").view(np.uint8).reshape(idx.size, item)
    return images


def compare_images(regions: list[Region], expected: list[np.ndarray]) -> str | None:
    """``None`` when every region equals its expected image; else where the first difference is."""
    for r, exp in zip(regions, expected):
        got = region_bytes(r)
        if not np.array_equal(got, exp):
            off = int(np.flatnonzero(got != exp)[0])
            where = "outside the request's destination" if exp[off] == SENTINEL else "inside the destination"
            return (
                f"region {r.name}: byte {off} is {got[off]:#04x}, expected {exp[off]:#04x} ({where}); "
                f"{int((got != exp).sum())} bytes differ"
            )
    return None
