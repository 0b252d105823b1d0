"""Workers for the tests: their options, worker processes, their events and status commands.

Worker processes are real processes on 127.0.0.1 (port 0). Most tests start them with
``launcher="fork"`` (forked from a fork server that already imported torch and the workers, so a
worker starts in a fraction of a second on this small machine); the tests that are about the
``python -m pdstate.devtools.processes`` entry point itself (exit status and stderr of a failed
local check, the ``pdstate demo`` command) use real ``subprocess`` launches. Every wait polls with
a deadline.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pdstate.devtools.processes import WorkerProcess
from pdstate.pools.presets import PoolSettings
from pdstate.worker.options import WorkerHooks, WorkerOptions
from tests.support.engines import ENGINE_OPTIONS
from tests.support.pools import TINY
from tests.support.waiting import wait_until

# Short timers: a refused or gone peer is noticed quickly, and waits stay bounded.
FAST = dict(heartbeat_interval_s=0.2, peer_timeout_s=3.0, request_deadline_s=20.0)


def options(role: str, settings: PoolSettings = TINY, engine: str = "shm", **kw: Any) -> WorkerOptions:
    """A worker's options: ``FAST`` timers and the same-host engine options, unless ``kw`` says."""
    kw = {**FAST, **kw}
    kw.setdefault("engine_options", ENGINE_OPTIONS.get(engine, {}))
    return WorkerOptions(role=role, pool=settings, engine=engine, **kw)


def pdstate_command() -> list[str]:
    """How to run the ``pdstate`` command of this environment."""
    exe = Path(sys.executable).parent / "pdstate"  # the console script of this environment
    if exe.exists():
        return [str(exe)]
    found = shutil.which("pdstate")
    return [found] if found else [sys.executable, "-m", "pdstate.cli"]


def demo_summary(args: list[str], cwd: Path, timeout_s: float) -> dict:
    """Run ``pdstate demo --json ARGS``; it exits 0 and prints one line: its summary."""
    out = subprocess.run(
        [*pdstate_command(), "demo", "--json", *args], capture_output=True, text=True, timeout=timeout_s, cwd=cwd
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, out.stdout
    return json.loads(lines[0])


# --- serve's workers in this process -------------------------------------------------------------


def wait_accepted(decode, timeout_s: float = 10.0) -> None:
    """Until an in-process decode worker's default prefill accepted it."""
    wait_until("the decode accepted", lambda: decode.status().peer.state.value == "accepted", timeout_s)


def transfer(decode, seq_len: int, timeout_s: float = 60.0, **kw: Any):
    """One request on an in-process decode worker; its ``TransferResult``."""
    return decode.submit(seq_len, **kw).result(timeout_s)


@contextmanager
def served_pair(
    settings: PoolSettings = TINY,
    engine: str = "shm",
    hooks: WorkerHooks | None = None,
    prefill: dict[str, Any] | None = None,
    **kw: Any,
) -> Iterator[tuple[Any, Any]]:
    """``pdstate serve``'s prefill and decode workers in this process (threads, their own pools,
    the control socket over TCP), the decode accepted; both stopped on leaving. ``kw``: options of
    both; ``prefill``: the prefill's own (``max_inflight=1``, ...)."""
    from pdstate.worker.decode import AgentDecodeWorker
    from pdstate.worker.prefill import AgentPrefillWorker

    with AgentPrefillWorker(options("prefill", settings, engine, **kw, **(prefill or {})), hooks=hooks) as p:
        with AgentDecodeWorker(options("decode", settings, engine, peer=p.endpoint, **kw)) as d:
            wait_accepted(d)
            yield p, d


# --- worker processes ---------------------------------------------------------------------------


class Workers:
    """Starts worker processes and closes every one of them (``close_all``, or on leaving a
    ``with`` block), thawing a frozen one first."""

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

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_all()

    def close_all(self) -> None:
        for w in self.started:
            if w.returncode is None:  # a frozen worker must be thawed to hear its EOF
                try:
                    os.kill(w.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        for w in reversed(self.started):
            w.close(timeout_s=15)
        self.started.clear()


def kill(w: WorkerProcess, sig: int = signal.SIGKILL) -> float:
    """Send ``sig`` to the worker; returns the monotonic time it was sent."""
    t = time.monotonic()
    os.kill(w.pid, sig)
    return t


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def segments(pid: int) -> list[str]:
    """The shared-memory segments process ``pid`` created (and has not unlinked)."""
    return sorted(glob.glob(f"/dev/shm/pdstate-{pid}-*"))


def leaked(before: dict[str, int], after: dict[str, int]) -> int:
    """Pages/slots missing from a pool's free counts (0 when every allocation came back)."""
    return sum(max(0, before[k] - after.get(k, 0)) for k in before)


# --- a decode process: events and batches ------------------------------------------------------


def first_event(w: WorkerProcess, timeout_s: float = 30.0) -> dict:
    """The decode's handshake outcome: ``ready`` or ``refused``."""
    ev = w.read_event(timeout_s)
    assert ev["event"] in ("ready", "refused"), ev
    return ev


def start_batch(d: WorkerProcess, lengths: list[int], concurrency: int, deadline_s: float | None = None) -> None:
    cmd: dict[str, Any] = {"cmd": "run", "lengths": lengths, "concurrency": concurrency}
    if deadline_s is not None:
        cmd["deadline_s"] = deadline_s
    d.send(json.dumps(cmd))


def collect_batch(d: WorkerProcess, timeout_s: float = 60.0) -> tuple[list[dict], dict, float]:
    """The results of a started batch, its ``batch_done`` event and when that arrived."""
    results = []
    while True:
        ev = d.read_event(timeout_s)
        if ev["event"] == "batch_done":
            return results, ev, time.monotonic()
        assert ev["event"] == "result", ev
        results.append(ev)


def run_batch(
    decode: WorkerProcess, lengths: list[int], concurrency: int = 1, timeout_s: float = 60.0
) -> tuple[list[dict], dict]:
    """Run ``lengths`` on a ready decode process; returns ``(results, batch_done event)``."""
    start_batch(decode, lengths, concurrency)
    results, done, _ = collect_batch(decode, timeout_s)
    return results, done


def assert_all_verified(results: list[dict], lengths: list[int]) -> None:
    assert sorted(r["seq_len"] for r in results) == sorted(lengths)
    bad = [r for r in results if not (r["status"] == "success" and r["verified"])]
    assert not bad, bad


def decode_stats(d: WorkerProcess) -> dict[str, Any]:
    return d.command({"cmd": "stats"}, "stats")


def wait_decode(d: WorkerProcess, what: str, pred, timeout_s: float = 15.0) -> dict:
    return wait_until(what, lambda: (lambda s: s if pred(s) else None)(decode_stats(d)), timeout_s, pause_s=0.02)


# --- a prefill process: peers and requests ------------------------------------------------------


def peer_record(prefill: WorkerProcess, worker_id: str, state: str | None = None, timeout_s: float = 10.0) -> dict:
    """What the prefill recorded about decode ``worker_id`` (once decided, or in ``state``)."""

    def probe():
        peers = prefill.command({"cmd": "peers"}, "peers")["peers"]
        for p in peers:
            if p["id"] == worker_id and (p["state"] == state if state else p["state"] != "pending"):
                return p
        return None

    return wait_until(f"the prefill's record of {worker_id} ({state or 'decided'})", probe, timeout_s)


def prefill_requests(p: WorkerProcess) -> dict[str, Any]:
    return p.command({"cmd": "requests"}, "requests")


def wait_transferring(p: WorkerProcess, worker_id: str, jobs: int, timeout_s: float = 20.0) -> list[dict]:
    """Until ``jobs`` requests of decode ``worker_id`` are in flight on the prefill and one of them
    is TRANSFERRING (its copy held by ``faults.hold_copies``)."""

    def probe():
        mine = [j for j in prefill_requests(p)["in_flight"] if j["peer"] == worker_id]
        return mine if len(mine) >= jobs and any(j["state"] == "transferring" for j in mine) else None

    return wait_until(f"{jobs} requests of {worker_id} in flight, one transferring", probe, timeout_s)


def wait_prefill_settled(p: WorkerProcess, worker_id: str, count: int, timeout_s: float) -> tuple[list[dict], dict]:
    """Until nothing of ``worker_id`` is in flight on the prefill and it holds ``count`` terminal
    records of it; returns ``(records, free counts)``."""

    def probe():
        r = prefill_requests(p)
        recs = [f for f in r["finished"] if f["peer"] == worker_id]
        busy = [j for j in r["in_flight"] if j["peer"] == worker_id]
        return (recs, r["free"]) if not busy and len(recs) >= count else None

    return wait_until(f"the prefill's records of {worker_id}", probe, timeout_s, pause_s=0.01)
