"""What both workers share: options, pool/report/engine construction, stats, the loop clock."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from pdstate.errors import LocalCheckFailed, error_from_wire
from pdstate.pools.kvargs import fill_kv_args
from pdstate.pools.memory import PrivateMemory, SharedMemory, sweep_stale_segments
from pdstate.pools.presets import PoolSettings, build_worker_pools
from pdstate.pools.reporting import build_report
from pdstate.protocol import wire
from pdstate.protocol.handshake import LocalSide
from pdstate.protocol.report import ErrorInfo, LayoutReport

log = logging.getLogger("pdstate")


@dataclass(frozen=True)
class WorkerOptions:
    role: str  # "prefill" | "decode"
    pool: PoolSettings
    engine: str = "shm"
    engine_options: dict[str, Any] = field(default_factory=dict)
    bind: str = "tcp://127.0.0.1:0"  # prefill
    peer: str = ""  # decode
    worker_id: str = ""
    token: bytes | None = None
    heartbeat_interval_s: float = 1.0
    peer_timeout_s: float = 5.0
    request_deadline_s: float = 30.0
    max_inflight: int = 64
    local_checks: bool = True
    # decode: how the bytes that landed are checked against the room's synthetic content:
    # "full" reads every byte (one pass over the request), "sample" the first word of every item
    # and the last of every run of items (O(items)); see ``runtime.synth``
    verify: str = "full"
    # prefill: a request of at most this many bytes, on a synchronous engine (shm), is computed and
    # copied on the control thread when the transfer thread is idle: two thread hand-offs saved on
    # the smallest requests, at most a millisecond or two of the control loop (0: never)
    inline_max_bytes: int = 2 << 20
    # Test knob (fault injection), never set by the config file: the prefill's transfer thread
    # waits this long after computing a request's state and before the engine copy, so a test can
    # kill or freeze a process while requests are TRANSFERRING. The wait ends early when the
    # request is cancelled (peer gone, abort, re-registration, shutdown).
    fault_delay_before_copy_s: float = 0.0


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

    def __reduce__(self):  # copy/deepcopy/pickle (e.g. ``dataclasses.asdict``): no lock inside
        return (type(self), (list(self), self.maxlen))


@dataclass
class Stats:
    handshakes: dict[str, int] = field(default_factory=lambda: {"accepted": 0, "rejected": 0})
    transfers: dict[str, int] = field(default_factory=lambda: {"success": 0, "failed": 0, "busy": 0})
    bytes: int = 0
    engine_errors: int = 0
    protocol_errors: int = 0
    latencies_s: RecentLatencies = field(default_factory=RecentLatencies)
    failure_reasons: dict[str, int] = field(default_factory=dict)

    def fail(self, reason: str) -> None:
        self.transfers["failed"] += 1
        key = reason.split(":")[0][:80]
        if key not in self.failure_reasons and len(self.failure_reasons) >= MAX_FAILURE_REASONS:
            key = "other"  # hostile peers must not grow this map without bound
        self.failure_reasons[key] = self.failure_reasons.get(key, 0) + 1

    def as_dict(self) -> dict:
        """A JSON-ready copy of the counters (latencies summarised, not listed)."""
        return {
            "handshakes": dict(self.handshakes),
            "transfers": dict(self.transfers),
            "bytes": self.bytes,
            "engine_errors": self.engine_errors,
            "protocol_errors": self.protocol_errors,
            "latencies_s": [],
            "latency_count": self.latencies_s.total,
            "failure_reasons": dict(self.failure_reasons),
        }


def settle(fut: Future, result: Any = None, exc: BaseException | None = None) -> bool:
    """Complete ``fut`` unless it is already done or its caller cancelled it (even concurrently,
    between a ``done()`` check and the call): never raises ``InvalidStateError`` into the worker's
    control thread. Returns whether this call completed it."""
    if fut.done():
        return False
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except InvalidStateError:
        return False
    return True


# A worker runs a control thread and a transfer thread that hand work to each other; with the
# interpreter's default 5 ms switch interval a hand-off can wait that long behind a thread holding
# the GIL in a numpy loop. The edges (procs, serve, bench) call this once at start.
CONTROL_SWITCH_INTERVAL_S = 0.0005


def tune_interpreter() -> None:
    import sys

    sys.setswitchinterval(CONTROL_SWITCH_INTERVAL_S)


def new_incarnation() -> str:
    return secrets.token_hex(8)


def build_side(opts: WorkerOptions):
    """Pools (in shared memory for a decode on the shm engine), report, KVArgs and local check.

    Returns ``(pools, report, kv_args, local_error)``. ``local_error`` is the upstream refusal of
    this side's own pair, or ``None``.
    """
    if opts.role == "decode" and opts.engine == "shm":
        sweep_stale_segments()
        memory = SharedMemory()
    else:
        memory = PrivateMemory()
    pools = build_worker_pools(opts.pool, memory)
    report, kv_args = build_report(pools.target, pools.draft)
    err = None
    if not report.local_check.ok:
        err = error_from_wire(report.local_check.error.type, report.local_check.error.message)
        if kv_args is None and not opts.local_checks:
            kv_args = fill_kv_args(pools.target, pools.draft, check=False)
    return pools, report, kv_args, err


def local_side(
    opts: WorkerOptions, worker_id: str, incarnation: str, report: LayoutReport, kv_args, endpoint: dict
) -> LocalSide:
    return LocalSide(
        worker_id=worker_id,
        incarnation=incarnation,
        report=report,
        kv=None if kv_args is None else wire.KVDesc.of(kv_args),
        engine=wire.EngineDesc(name=opts.engine, endpoint=endpoint),
        heartbeat_interval_s=opts.heartbeat_interval_s,
        peer_timeout_s=opts.peer_timeout_s,
    )


def error_info(exc: BaseException) -> ErrorInfo:
    return ErrorInfo.of(exc)


now = time.monotonic


class WorkerBase:
    """What both workers share: their side (pools, report, KVArgs, engine), its release, ``with``.

    Subclasses set ``self.opts`` and implement ``start()`` / ``stop()``.
    """

    opts: WorkerOptions

    def _open_side(self) -> None:
        """Pools, report and local check, then the engine with the pools' regions registered.

        Raises ``LocalCheckFailed`` when this side's own pair is refused and ``local_checks`` is on.
        """
        from pdstate.transfer.engines.base import create_engine

        self.pools, self.report, self.kv_args, self.local_error = build_side(self.opts)
        if self.local_error is not None and self.opts.local_checks:
            raise LocalCheckFailed(str(self.local_error)) from self.local_error
        self.engine = create_engine(self.opts.engine, **self.opts.engine_options)
        self.engine.start()
        self.engine.register(self.pools.memory.regions())
        self._spans = [(r.base_ptr, r.nbytes) for r in self.pools.memory.regions()]

    def _close_side(self) -> None:
        """Close the engine, then the pools (removing shm segments); tolerant of a partial start."""
        for name in ("engine", "pools"):
            obj = getattr(self, name, None)
            if obj is not None:
                try:
                    obj.close()
                except Exception:  # keep releasing the rest; the first error is what matters
                    log.warning("closing %s failed", name, exc_info=True)

    def free_counts(self) -> dict[str, int]:
        from pdstate.runtime import requests as rq

        return rq.free_counts(self.pools)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
