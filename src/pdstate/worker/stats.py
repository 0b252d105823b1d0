"""A worker's counters (``Stats``) and its bounded latency window (``RecentLatencies``).

The control thread counts through ``Stats``' methods, each under the counters' lock; other
threads (the metrics scrape, a status command) read ``snapshot()``, a consistent copy.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

LATENCY_WINDOW = 4096
MAX_FAILURE_REASONS = 256


class RecentLatencies(deque):
    """The latest ``maxlen`` latencies (seconds), plus ``total``: how many were ever appended.

    A bounded deque, so a long-running worker's memory stays flat. ``since(seen)`` returns, under
    a lock, the values appended after the first ``seen`` ones (at most ``maxlen`` of them) and the
    new total, so a reader on another thread (the metrics scrape) never double-counts or misses
    values that are still in the window.
    """

    def __init__(self, iterable: Iterable[float] = (), maxlen: int | None = LATENCY_WINDOW) -> None:
        super().__init__(iterable, maxlen)
        self._lock = threading.Lock()
        self.total = len(self)

    def append(self, value: float) -> None:
        with self._lock:
            super().append(value)
            self.total += 1

    def since(self, seen: int) -> tuple[list[float], int]:
        with self._lock:
            total = self.total
            new = min(max(0, total - seen), len(self))
            return (list(self)[len(self) - new :] if new else []), total

    def snapshot(self) -> RecentLatencies:
        """A copy with the same window and ``total``."""
        with self._lock:
            r = RecentLatencies(self, self.maxlen)
            r.total = self.total
        return r

    def __reduce__(self):  # copy/deepcopy/pickle (e.g. ``dataclasses.asdict``): no lock inside
        return (type(self), (list(self), self.maxlen))


@dataclass
class Stats:
    handshakes: dict[str, int] = field(default_factory=lambda: {"accepted": 0, "rejected": 0})
    transfers: dict[str, int] = field(default_factory=lambda: {"success": 0, "failed": 0, "busy": 0})
    bytes: int = 0
    engine_errors: int = 0
    protocol_errors: int = 0
    auth_failures: int = 0  # refused CURVE handshakes and control frames refused for their auth tag (the agent's count)
    decodes_dropped: int = 0  # prefill: decodes dropped for withholding verdicts (the agent's count)
    waiting_refused: int = 0  # prefill: decodes' requests refused, too many waiting for senders (the agent's count)
    latencies_s: RecentLatencies = field(default_factory=RecentLatencies)
    failure_reasons: dict[str, int] = field(default_factory=dict)
    # failed transfers by (kind: the error's class, factor: the layout factor a refusal names, else
    # the class again: ``logs.refusal_factor``), and transfers verified by the level that ran
    failures: dict[tuple[str, str], int] = field(default_factory=dict)
    verified: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def handshake(self, outcome: str, n: int = 1) -> None:
        with self._lock:
            self.handshakes[outcome] += n

    def protocol_error(self) -> None:
        with self._lock:
            self.protocol_errors += 1

    def busy(self) -> None:
        with self._lock:
            self.transfers["busy"] += 1

    def success(self, nbytes: int, latency_s: float, verify: str | None = None) -> None:
        with self._lock:
            self.transfers["success"] += 1
            self.bytes += nbytes
            if verify:
                self.verified[verify] = self.verified.get(verify, 0) + 1
        self.latencies_s.append(latency_s)

    def engine_error(self, n: int = 1) -> None:
        with self._lock:
            self.engine_errors += n

    def fail(self, reason: str, kind: str | None = None, factor: str | None = None) -> None:
        """One failed transfer; ``kind`` (the error's class) and ``factor`` (what a refusal is
        about) count it in ``failures`` too."""
        with self._lock:
            self.transfers["failed"] += 1
            _bump(self.failure_reasons, reason.split(":")[0][:80], "other")
            if kind is not None:
                _bump(self.failures, (kind[:80], (factor or kind)[:80]), ("other", "other"))

    def snapshot(self) -> Stats:
        """A consistent copy (its own lock), for a reader on another thread."""
        with self._lock:
            return Stats(
                handshakes=dict(self.handshakes),
                transfers=dict(self.transfers),
                bytes=self.bytes,
                engine_errors=self.engine_errors,
                protocol_errors=self.protocol_errors,
                auth_failures=self.auth_failures,
                decodes_dropped=self.decodes_dropped,
                waiting_refused=self.waiting_refused,
                latencies_s=self.latencies_s.snapshot(),
                failure_reasons=dict(self.failure_reasons),
                failures=dict(self.failures),
                verified=dict(self.verified),
            )

    def as_dict(self) -> dict:
        """A JSON-ready copy of the counters (latencies summarised, not listed)."""
        s = self.snapshot()
        return {
            "handshakes": s.handshakes,
            "transfers": s.transfers,
            "bytes": s.bytes,
            "engine_errors": s.engine_errors,
            "protocol_errors": s.protocol_errors,
            "auth_failures": s.auth_failures,
            "decodes_dropped": s.decodes_dropped,
            "waiting_refused": s.waiting_refused,
            "latencies_s": [],
            "latency_count": s.latencies_s.total,
            "failure_reasons": s.failure_reasons,
            "failures": [{"kind": k, "factor": f, "count": n} for (k, f), n in s.failures.items()],
            "verified": s.verified,
        }


def _bump(counts: dict, key, other) -> None:
    """``counts[key] += 1``, at most ``MAX_FAILURE_REASONS`` keys (then ``other``): hostile peers
    must not grow the map without bound."""
    if key not in counts and len(counts) >= MAX_FAILURE_REASONS:
        key = other
    counts[key] = counts.get(key, 0) + 1
