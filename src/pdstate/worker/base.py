"""What ``pdstate serve``'s two workers share: their side (pools, report, KVArgs, local check),
an allocator that callers may wait on, the counters, and the request records kept for
``/v1/transfers/{room}`` and status.

The workers (``worker.prefill``, ``worker.decode``) are callers of the embeddable agent
(``pdstate.agent``) like any serving engine: they own the pools, allocate and free the pages
(``worker.requests``), and hand the agent index lists. The synthetic content (``worker.synth``)
is their stand-in for the model. They present the status surface ``status.source.WorkerStatus``
reads (``status()``, ``stats``, ``free_counts()``, ``lookup()``, ``submit()``, ``reregister()``,
``stop()``).
"""

from __future__ import annotations

import asyncio
import secrets
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

from pdstate.errors import AgentClosed, AllocationError, LocalCheckFailed, PrefillBusy, error_from_wire
from pdstate.pools.kvargs import fill_kv_args
from pdstate.pools.memory import PrivateMemory, SharedMemory, sweep_stale_segments
from pdstate.pools.presets import build_worker_pools
from pdstate.pools.reporting import build_report
from pdstate.transfer.engines.registry import ENGINES
from pdstate.worker import requests as rq
from pdstate.worker.options import WorkerOptions
from pdstate.worker.stats import Stats
from pdstate.worker.status import RequestStatus

MAX_FINISHED = 10000  # finished requests kept for lookups (oldest dropped first)

now = time.monotonic

# A worker's request loop and the agent's I/O thread hand work to each other; with the
# interpreter's default 5 ms switch interval a hand-off can wait that long behind a thread holding
# the GIL in a numpy loop. The edges (serve, worker processes, bench) call this once at start.
SWITCH_INTERVAL_S = 0.0005


def tune_interpreter() -> None:
    sys.setswitchinterval(SWITCH_INTERVAL_S)


def new_incarnation() -> str:
    return secrets.token_hex(8)


def settle(fut: Future, result: Any = None, exc: BaseException | None = None) -> bool:
    """Complete ``fut`` unless it is already done or its caller cancelled it (even concurrently,
    between a ``done()`` check and the call): never raises ``InvalidStateError``. Returns whether
    this call completed it."""
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


def build_side(opts: WorkerOptions):
    """Pools (in shared memory for a decode on the shm engine), report, KVArgs and local check.

    Returns ``(pools, report, kv_args, local_error)``. ``local_error`` is the upstream refusal of
    this side's own pair, or ``None``.
    """
    if opts.role == "decode" and ENGINES[opts.engine].shared_memory:
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


class AgentStats(Stats):
    """``worker.stats.Stats`` whose handshake and auth-failure counts are the agent's own (read
    at snapshot); ``agent()`` returns the agent or ``None``."""

    def __init__(self, agent: Callable[[], object]) -> None:
        super().__init__()
        self._agent = agent

    def snapshot(self) -> Stats:
        s = super().snapshot()
        agent = self._agent()
        s.handshakes = dict(agent.handshakes) if agent is not None else {}
        s.auth_failures = agent.auth_failures.count if agent is not None else 0
        s.decodes_dropped = agent.withheld.count if hasattr(agent, "withheld") else 0  # (a prefill agent)
        s.waiting_refused = agent.waiting_refused if hasattr(agent, "waiting_refused") else 0
        return s


class PagePool:
    """The side's allocator behind a condition: ``allocate(seq_len, wait_s)`` waits (up to
    ``wait_s``) for pages other requests free; ``try_allocate`` never waits (``None``: full);
    ``free`` wakes the waiters. Safe from any thread.

    ``owner`` (a prefill: the decode asking) and ``share``: the owner may hold at most that
    fraction of each of the pools' resources (full and SWA tokens, request slots) once it holds
    one request; a request that would pass it is refused at once (``PrefillBusy``) rather than
    kept, so one decode cannot take every page from the others."""

    def __init__(self, pools) -> None:
        self.pools = pools
        self.names: list[str] | None = None
        self._freed = threading.Condition()
        self.waiting = 0
        self._total = rq.free_counts(pools)  # a fresh pool: everything free
        self._held: dict[str, dict[str, int]] = {}  # owner -> what it holds, by resource

    def try_allocate(self, names: list[str], seq_len: int, owner: str = "", share: float = 1.0) -> rq.Allocation | None:
        """The request's pages now, or ``None`` while the pool is full (never waits); raises
        ``AllocationError`` for a request larger than the whole pool (and ``PrefillBusy`` past
        the owner's share, as ``allocate``)."""
        self._fits(seq_len)
        with self._freed:
            try:
                return self._take(names, seq_len, owner, share)
            except AllocationError:
                return None

    def _fits(self, seq_len: int) -> None:
        capacity = rq.capacity_tokens(self.pools)
        if seq_len > capacity:
            raise AllocationError(f"seq_len {seq_len} exceeds the pool of {capacity} tokens")

    def allocate(
        self, names: list[str], seq_len: int, wait_s: float = 0.0, owner: str = "", share: float = 1.0
    ) -> rq.Allocation:
        self._fits(seq_len)
        deadline = time.monotonic() + wait_s
        with self._freed:
            self.waiting += 1
            try:
                while True:
                    try:
                        return self._take(names, seq_len, owner, share)
                    except AllocationError:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise
                        self._freed.wait(left)
            finally:
                self.waiting -= 1

    def _take(self, names: list[str], seq_len: int, owner: str, share: float) -> rq.Allocation:
        """Allocate (under the condition) and count it against ``owner`` (``AllocationError``: full)."""
        before = rq.free_counts(self.pools)
        alloc = rq.allocate(self.pools, names, seq_len)
        after = rq.free_counts(self.pools)
        alloc.usage = {k: before[k] - after[k] for k in after}
        held = self._held.get(owner, {})
        mine = {k: held.get(k, 0) + n for k, n in alloc.usage.items()}
        if owner and share < 1.0 and held:  # (its first request may be any size)
            self._check_share(owner, alloc, mine, share)
        self._held[owner] = mine
        return alloc

    def _check_share(self, owner: str, alloc: rq.Allocation, mine: dict[str, int], share: float) -> None:
        for k, total in self._total.items():
            limit = max(1, int(total * share))
            if mine[k] > limit:
                rq.free(self.pools, alloc)
                raise PrefillBusy(
                    f"decode {owner} would hold {mine[k]} of this prefill's {total} {k}; its share is {limit} "
                    f"(control.decode_share {share:g})"
                )

    def free(self, alloc: rq.Allocation, owner: str = "") -> None:
        with self._freed:
            rq.free(self.pools, alloc)
            left = {k: v - alloc.usage.get(k, 0) for k, v in self._held.pop(owner, {}).items()}
            if any(v > 0 for v in left.values()):
                self._held[owner] = left
            self._freed.notify_all()

    def counts(self) -> dict[str, int]:
        with self._freed:
            return rq.free_counts(self.pools)


class Timers:
    """One thread running an event loop: a worker's request steps run there one at a time, and
    its deadlines, backoffs and fences are timers on it (no thread per request, none asleep
    through a wait). ``post`` is safe from any thread; ``at``/``later`` only on the loop's own."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def post(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Run ``fn(*args)`` on the loop soon; False once the loop has stopped."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # closed
            return False
        return True

    def later(self, delay_s: float, fn: Callable[..., Any], *args: Any) -> asyncio.TimerHandle:
        return self.loop.call_later(max(0.0, delay_s), fn, *args)

    def at(self, when: float, fn: Callable[..., Any], *args: Any) -> asyncio.TimerHandle:
        """``fn(*args)`` at ``when`` (``time.monotonic()``'s clock)."""
        return self.later(when - time.monotonic(), fn, *args)

    def stop(self) -> None:
        """Run what was posted before, then end the thread. Idempotent."""
        if self.post(self.loop.stop):
            self._thread.join()
            self.loop.close()


class AgentWorker:
    """The side and the bookkeeping of one agent worker (subclassed per role).

    Set in ``start()`` before any request and never reassigned: ``pools``, ``report``, ``kv_args``,
    ``local_error``, ``agent``. ``_lock`` guards ``_live`` (in-flight requests by room),
    ``finished`` and ``peak_in_flight``; the counters have their own lock (``stats``).
    """

    role = ""

    def __init__(self, opts: WorkerOptions) -> None:
        self.opts = opts
        self.incarnation = new_incarnation()
        self.local_error: BaseException | None = None
        self.agent = None
        self.transport: dict = {}  # the agent engine's, once started (``AgentLifetime.transport``)
        self.pools = None
        self.stats = AgentStats(lambda: self.agent)
        self.finished: OrderedDict[int, object] = OrderedDict()
        self.peak_in_flight = 0
        self._live: dict[int, RequestStatus] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _open_side(self) -> None:
        self.pools, self.report, self.kv_args, self.local_error = build_side(self.opts)
        if self.local_error is not None and self.opts.local_checks:
            raise LocalCheckFailed(str(self.local_error)) from self.local_error
        self.page_pool = PagePool(self.pools)
        self.names = rq.channel_names(self.kv_args)

    def _open_agent(self, cls, **role_options) -> None:
        """The side, then the agent (``cls``) over it with this worker's options; what was built
        is released when either fails."""
        o = self.opts
        try:
            self._open_side()
            self.agent = cls(
                self.kv_args,
                report=self.report,
                engine=o.engine,
                engine_options=o.engine_options,
                worker_id=self.worker_id,
                heartbeat_interval_s=o.heartbeat_interval_s,
                peer_timeout_s=o.peer_timeout_s,
                token=o.token,
                key_dir=o.key_dir,
                verify=o.transfer_verify,
                **role_options,
            )
        except BaseException:
            self.close_side()
            raise
        self.incarnation, self.transport = self.agent.incarnation, self.agent.transport()

    # -- requests -----------------------------------------------------------------------------
    def _enter(self, status: RequestStatus) -> bool:
        """Record a request as in flight; False when its room already is."""
        with self._lock:
            if status.room in self._live:
                return False
            self._live[status.room] = status
            self.peak_in_flight = max(self.peak_in_flight, len(self._live))
            return True

    def _leave(self, room: int, record) -> None:
        with self._lock:
            self._live.pop(room, None)
            self.finished[room] = record
            self.finished.move_to_end(room)
            while len(self.finished) > MAX_FINISHED:
                self.finished.popitem(last=False)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._live)

    def _requests(self) -> tuple[RequestStatus, ...]:
        with self._lock:
            return tuple(sorted(self._live.values(), key=lambda r: r.started))

    def free_counts(self) -> dict[str, int]:
        if self._closed or self.pools is None:
            return {}
        return self.page_pool.counts()

    def _ask_agent(self, read, default):
        """``read(agent)`` while the agent serves, else (closed, stopping, its thread ended)
        ``default``: status readers on other threads never raise for a worker going down."""
        if self._closed or self.agent is None or not self.agent.alive:
            return default
        try:
            return read(self.agent)
        except (AgentClosed, TimeoutError):
            return default

    def _dead_threads(self) -> tuple[str, ...]:
        if self.agent is None or self.agent.alive or self._closed:
            return ()
        return (f"pdstate-{self.role}-agent",)

    # -- lifecycle ----------------------------------------------------------------------------
    def close_side(self) -> None:
        """Close the agent (its engine), then the pools. Idempotent; tolerant of a partial start."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.agent is not None:
                self.agent.close()
        finally:
            if self.pools is not None:
                self.pools.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self):  # pragma: no cover - per role
        raise NotImplementedError

    def stop(self) -> None:  # pragma: no cover - per role
        raise NotImplementedError


__all__ = [
    "AgentStats",
    "AgentWorker",
    "MAX_FINISHED",
    "PagePool",
    "Timers",
    "build_side",
    "new_incarnation",
    "now",
    "settle",
    "tune_interpreter",
]
