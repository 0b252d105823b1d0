"""``WorkerBase``: what both workers share — their side (pools, report, KVArgs, engine), their
threads, the locks other threads read them under, and the small helpers of the runtime."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

from pdstate.errors import LocalCheckFailed, error_from_wire
from pdstate.pools.kvargs import fill_kv_args
from pdstate.pools.memory import PrivateMemory, SharedMemory, sweep_stale_segments
from pdstate.pools.presets import build_worker_pools
from pdstate.pools.reporting import build_report
from pdstate.protocol import wire
from pdstate.protocol.handshake import LocalSide
from pdstate.protocol.report import LayoutReport
from pdstate.runtime import requests as rq
from pdstate.runtime.hooks import NO_HOOKS, WorkerHooks
from pdstate.runtime.options import WorkerOptions
from pdstate.runtime.stats import Stats

log = logging.getLogger("pdstate")

now = time.monotonic


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


class WorkerBase:
    """What both workers share.

    Set before the worker's threads start and never reassigned (read from any thread): ``opts``,
    ``worker_id``, ``incarnation``, ``pools``, ``report``, ``kv_args``, ``local_error``,
    ``engine``. ``stats`` counts under its own lock. ``_lock`` guards the records other threads
    read (each worker's docstring lists them); ``_pools_lock`` guards the allocator, so
    ``free_counts`` from another thread never reads it half-updated; ``_hooks`` (test seams) are
    read and swapped under ``_lock``. The two locks are never held together.
    """

    opts: WorkerOptions

    def __init__(self, opts: WorkerOptions, hooks: WorkerHooks | None = None) -> None:
        self.opts = opts
        self.incarnation = new_incarnation()
        self.stats = Stats()
        self.local_error: BaseException | None = None
        self._hooks = hooks or NO_HOOKS
        self._lock = threading.Lock()
        self._pools_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._side_closed = False

    # -- threads ------------------------------------------------------------------------------
    def _start_threads(self, *threads: tuple[Callable[[], None], str]) -> None:
        for target, name in threads:
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def _dead_threads(self) -> tuple[str, ...]:
        return tuple(t.name for t in self._threads if not t.is_alive())

    # -- test seams ---------------------------------------------------------------------------
    @property
    def hooks(self) -> WorkerHooks:
        with self._lock:
            return self._hooks

    def set_hooks(self, hooks: WorkerHooks) -> None:
        """Swap the fault-injection hooks of a running worker (tests); later jobs see the new ones."""
        with self._lock:
            self._hooks = hooks

    # -- side ---------------------------------------------------------------------------------
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

    def close_side(self) -> None:
        """Close the engine, then the pools (removing shm segments). Idempotent and tolerant of a
        partial start: ``stop()`` calls it, and so may whoever saw ``start()`` raise."""
        if self._side_closed:
            return
        self._side_closed = True
        for name in ("engine", "pools"):
            obj = getattr(self, name, None)
            if obj is not None:
                try:
                    obj.close()
                except Exception:  # keep releasing the rest; the first error is what matters
                    log.warning("closing %s failed", name, exc_info=True)

    # -- the allocator, shared with readers on other threads ------------------------------------
    def _allocate(self, seq_len: int) -> rq.Allocation:
        with self._pools_lock:
            return rq.allocate(self.pools, rq.channel_names(self.kv_args), seq_len)

    def _free(self, alloc: rq.Allocation) -> None:
        with self._pools_lock:
            rq.free(self.pools, alloc)

    def free_counts(self) -> dict[str, int]:
        with self._pools_lock:
            return rq.free_counts(self.pools)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
