"""Helpers of the reliability tests: fault timers, process probes, request bookkeeping, the summary.

Worker processes come from ``tests.integration.helpers.Workers`` (forked from the fork server,
so a worker starts in a fraction of a second). Every wait polls with a deadline; nothing sleeps
to synchronise.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from pdstate.devtools.processes import WorkerProcess
from tests.integration.helpers import TINY, wait_until

# The tiny preset with room for a few requests in flight at once (tiny holds ~one 1000-token one).
ROOMY = TINY.with_(full_tokens=16384, swa_tokens=8192, max_num_reqs=16)

HEARTBEAT_S = 0.2
PEER_TIMEOUT_S = 1.0
# Short timers: a dead or frozen peer is declared gone after PEER_TIMEOUT_S of silence.
FAULT = dict(heartbeat_interval_s=HEARTBEAT_S, peer_timeout_s=PEER_TIMEOUT_S, request_deadline_s=20.0)
# How late after the timeout a detection may come: one heartbeat/timer tick, a status poll, and
# scheduling noise on a small, busy machine.
DETECT_SLACK_S = 0.75
# The prefill's copy waits this long (fault injection) so a test can act while requests are
# TRANSFERRING; cancellation (peer gone, abort, re-registration) ends the wait early.
LONG_DELAY_S = 30.0


# --- the summary table ------------------------------------------------------------------------


@dataclass
class Row:
    scenario: str
    requests: int = 0
    succeeded: int = 0
    failed_with_reason: int = 0
    lost: int = 0
    leaked: int = 0
    detect_s: float | None = None
    note: str = ""


@dataclass
class Summary:
    rows: list[Row] = field(default_factory=list)

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        return row

    def table(self) -> str:
        head = ("scenario", "requests", "succeeded", "failed w/ reason", "lost", "leaked", "time to detect", "note")
        body = [
            (
                r.scenario,
                str(r.requests),
                str(r.succeeded),
                str(r.failed_with_reason),
                str(r.lost),
                str(r.leaked),
                "-" if r.detect_s is None else f"{r.detect_s:.2f} s",
                r.note,
            )
            for r in self.rows
        ]
        widths = [max(len(x) for x in col) for col in zip(head, *body)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
        lines += [fmt.format(*b) for b in body]
        return "\n".join(lines)


SUMMARY = Summary()


def tally(scenario: str, outcomes: list[dict], leaked: int = 0, detect_s: float | None = None, note: str = "") -> Row:
    """Count request outcomes (dicts with ``status`` and ``error``) into a summary row.

    A request is *lost* unless it ended ``success`` (verified, where the record says) or
    ``failed`` with an error that has a type and a message."""
    ok = [o for o in outcomes if o["status"] == "success" and o.get("verified", True)]
    failed = [
        o
        for o in outcomes
        if o["status"] == "failed" and o.get("error") and o["error"].get("type") and o["error"].get("message")
    ]
    row = Row(
        scenario, len(outcomes), len(ok), len(failed), len(outcomes) - len(ok) - len(failed), leaked, detect_s, note
    )
    return SUMMARY.add(row)


# --- processes ---------------------------------------------------------------------------------


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def segments(pid: int) -> list[str]:
    return sorted(glob.glob(f"/dev/shm/pdstate-{pid}-*"))


def kill(w: WorkerProcess, sig: int = signal.SIGKILL) -> float:
    """Send ``sig`` to the worker; returns the monotonic time it was sent."""
    t = time.monotonic()
    os.kill(w.pid, sig)
    return t


def leaked(before: dict[str, int], after: dict[str, int]) -> int:
    """Pages/slots missing from a pool's free counts (0 when every allocation came back)."""
    return sum(max(0, before[k] - after.get(k, 0)) for k in before)


# --- prefill and decode status -----------------------------------------------------------------


def prefill_requests(p: WorkerProcess) -> dict[str, Any]:
    return p.command({"cmd": "requests"}, "requests")


def set_fault_delay(p: WorkerProcess, delay_s: float) -> None:
    p.command({"cmd": "fault", "delay_before_copy_s": delay_s}, "fault")


def wait_transferring(p: WorkerProcess, worker_id: str, jobs: int, timeout_s: float = 20.0) -> list[dict]:
    """Until ``jobs`` requests of decode ``worker_id`` are in flight on the prefill and one of them
    is TRANSFERRING (its copy waits in the fault delay)."""

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


def decode_stats(d: WorkerProcess) -> dict[str, Any]:
    return d.command({"cmd": "stats"}, "stats")


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


def wait_decode(d: WorkerProcess, what: str, pred, timeout_s: float = 15.0) -> dict:
    return wait_until(what, lambda: (lambda s: s if pred(s) else None)(decode_stats(d)), timeout_s, pause_s=0.02)
