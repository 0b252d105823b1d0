"""``pdstate serve``'s prefill: a ``PrefillAgent`` over this worker's pools, computing a request
(``worker.synth``'s content, the stand-in for the model) only once a decode asks for it.

No thread runs per request: a request's lifecycle lives on the worker's one request loop
(``base.Timers``, as the decode's does). A decode's ``AgentRequest`` for a room this worker has
no sender for reaches ``_on_request`` (the agent's I/O thread): it refuses at once when the
worker drains (``prefill shutting down``), when the decode named no token count, or when
``max_inflight`` requests are in flight (``PrefillBusy``: the decode asks again); otherwise it
posts the request to the loop. There the request takes its source pages (or waits in line, up to
the request deadline, for pages that ending requests free; a request that cannot fit fails with
``AllocationError``), has them filled, sends them through a ``KVSender`` (in ``chunks`` chunks,
the state with the last) and frees them once the sender is terminal (the agent fences a failed
one first: nothing reads the pages after); the sender's done callback brings its end to the loop,
and a timer aborts a sender with no verdict past ``request_deadline_s + peer_timeout_s``.

The fill is the one step off the loop: it is CPU work (one pass over the request's bytes, tens of
milliseconds for a large ``dsv4-flash`` request) that would hold every other request's steps
while it ran. It runs on one compute thread fed by a queue (``COMPUTE_THREADS``), which posts the
result back to the loop; the request's state never leaves the loop. A request of at most
``INLINE_FILL_BYTES`` is filled on the loop itself (shorter than the two hand-offs it saves).

A filled request reaches the engine in one thread hand-off: before its fill is queued the loop
makes its sender (as a serving engine makes it at bootstrap, before the forward pass; the agent
adds it while the fill runs) and the feed of its chunks, and the compute thread posts that feed to
the agent's I/O thread as soon as the pages are filled, beside the fill's result to the loop
(measured: the loop's wake-up and its send step, 0.3-0.6 ms at 8k tokens on a loaded 2-core
host, came between the fill and the engine). The pages stay the fill's until its result is back
on the loop: a sender that ends meanwhile (its decode's abort, a gone decode, the agent closing)
ends the request only then, so no page is freed while the fill writes it. With the
``delay_before_copy_s`` hook set, the sender is made after the fill and the hold, as before.

Stopping (``stop()``, SIGTERM through ``pdstate serve``): new requests are refused; with
``drain_s`` the requests in flight get that long to finish; then the agent fails the rest with
``prefill shutting down`` and says ``Goodbye`` to every decode, the compute thread and the loop
end (every request left ends with that reason), and the pools (shared memory included) are
released.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from pdstate import logs
from pdstate.errors import (
    AgentClosed,
    EngineError,
    PdStateError,
    PeerGone,
    PrefillBusy,
    ProtocolError,
    RoomInFlight,
    TransferTimedOut,
    error_from_wire,
)
from pdstate.protocol.lifecycle import PeerState, RequestState
from pdstate.protocol.peers import PeerSnapshot
from pdstate.protocol.report import ErrorInfo
from pdstate.worker import requests as rq
from pdstate.worker import synth
from pdstate.worker.base import AgentWorker, Timers, now
from pdstate.worker.options import NO_HOOKS, WorkerHooks, WorkerOptions
from pdstate.worker.status import PeerStatus, RequestStatus, WorkerSnapshot

log = logging.getLogger("pdstate.worker.prefill")

SHUTTING_DOWN = "prefill shutting down"
COMPUTE_THREADS = 1  # the synthetic compute's one thread; requests wait their turn in its queue
# a request of at most this many bytes is filled on the request loop itself: its fill (well under
# a millisecond) costs less than the two thread hand-offs to the compute thread and back
INLINE_FILL_BYTES = 2 << 20
HOLD_POLL_S = 0.02  # ``delay_before_copy_s``: how often a held request looks whether it was given up

AUTH_RECENT_S = 60.0  # a frame refused for its auth tag, a decode dropped: named on /readyz this long


@dataclass(eq=False)
class Job:
    """One request of this prefill on its request loop (touched only there, after ``_on_request``)."""

    status: RequestStatus
    t0: float = field(default_factory=time.perf_counter)
    alloc: rq.Allocation | None = None
    sender: Any = None  # its KVSender, once its pages were filled
    compute_s: float = 0.0
    hold_end: float | None = None  # ``delay_before_copy_s``: when the hold ends
    error: BaseException | None = None  # why it was ended while its sender was live
    done: bool = False
    filling: bool = False  # its fill runs on the compute thread, its sender made: its pages are the fill's
    ended_filling: bool = False  # its sender ended while it filled: the request ends once the fill is back
    timers: list = field(default_factory=list)  # page deadline, hold, verdict deadline


class AgentPrefillWorker(AgentWorker):
    """The prefill of ``pdstate serve``. ``start()`` builds pools and agent; ``stop()`` drains."""

    role = "prefill"

    def __init__(self, opts: WorkerOptions, chunks: int = 1, hooks: WorkerHooks | None = None) -> None:
        super().__init__(opts)
        self.hooks = hooks or NO_HOOKS  # test seams; swapped whole (one reference) by ``set_hooks``
        self.worker_id = opts.worker_id or "prefill"
        self.chunks = max(1, chunks)
        self.endpoint = ""
        self._draining = threading.Event()
        self._drain_end = float("inf")  # set (before ``_draining``) by ``stop``
        self._timers = Timers("pdstate-prefill-requests")
        self._compute = ThreadPoolExecutor(max_workers=COMPUTE_THREADS, thread_name_prefix="pdstate-prefill-compute")
        # request loop only:
        self._jobs: dict[int, Job] = {}  # room -> request, until it ends
        self._for_pages: deque[Job] = deque()  # in line for pages, first come first served

    def start(self) -> AgentPrefillWorker:
        """Raises ``LocalCheckFailed`` (own pair refused, with ``local_checks``), ``EngineError``
        or ``zmq.ZMQError`` (bind); what was built before is released first."""
        from pdstate.agent import PrefillAgent

        o = self.opts
        self._open_agent(
            PrefillAgent,
            bind=o.bind,
            check_local=o.local_checks,
            bootstrap_timeout_s=o.request_deadline_s,
            on_request=self._on_request,
            verdict_timeout_s=o.verdict_timeout_s,
            advertise=tuple(o.advertise),
        )
        self.endpoint = self.agent.address
        log.info("prefill %s listening on %s (engine %s, agent)", self.worker_id, self.endpoint, o.engine)
        return self

    def stop(self) -> None:
        """Refuse new requests, let those in flight finish for up to ``drain_s``, then end the
        rest (``prefill shutting down``), say goodbye and release everything. Idempotent."""
        self._drain_end = time.monotonic() + self.opts.drain_s
        self._draining.set()
        while self.in_flight() and time.monotonic() < self._drain_end:
            time.sleep(0.01)
        self.close_side()

    def close_side(self) -> None:
        """The agent closes first (every live sender fails; its callback is posted to the loop),
        then the compute thread ends (what it runs finishes, what waits for it is dropped), then
        the loop ends every request left: no step touches the pools after this. Idempotent."""
        if self._closed:
            return
        try:
            if self.agent is not None:
                told, ended = self._audience()
                self.agent.close(SHUTTING_DOWN)
                log.info("prefill %s stopping: told %d decode(s), ended %d request(s)", self.worker_id, told, ended)
        finally:
            self._compute.shutdown(wait=True, cancel_futures=True)
            self._timers.post(self._fail_all)
            self._timers.stop()
            super().close_side()

    def _audience(self) -> tuple[int, int]:
        """The decodes a goodbye reaches now, and the requests it ends."""
        return len(self._ask_agent(lambda a: a.decodes(), [])), self.in_flight()

    # -- the agent's I/O thread ---------------------------------------------------------------
    def _on_request(self, room: int, seq_len: int | None, decode: str) -> None:
        if self._draining.is_set():
            raise AgentClosed(SHUTTING_DOWN)
        if seq_len is None:
            raise ProtocolError(
                f"room {room}: this prefill computes a request when asked and needs its token count "
                "(KVReceiver.init(seq_len=...))"
            )
        n = self.in_flight()
        if n >= self.opts.max_inflight:
            self.stats.busy()
            raise PrefillBusy(f"prefill busy: {n} requests in flight (max_inflight {self.opts.max_inflight})")
        job = Job(RequestStatus(room, RequestState.BOOTSTRAPPING, seq_len, now(), peer=decode))
        if not self._enter(job.status):
            raise RoomInFlight(f"room {room} is already in flight on this prefill")
        if not self._timers.post(self._step, self._begin, job):  # the loop has stopped
            self._done(job, None, AgentClosed(SHUTTING_DOWN))
            raise AgentClosed(SHUTTING_DOWN)

    # -- the request loop: each step of a request -----------------------------------------------
    def _step(self, fn, job: Job, *args) -> None:
        """Run one step of ``job``; an exception ends the request with it."""
        if job.done:
            return
        try:
            fn(job, *args)
        except Exception as exc:  # AgentClosed at shutdown, a refused chunk, pages that never came
            self._end(job, exc)

    def _begin(self, job: Job) -> None:
        self._jobs[job.status.room] = job
        job.timers.append(self._timers.later(self.opts.request_deadline_s, self._step, self._expire, job))
        job.alloc = self._try_allocate(job, self._share())  # PrefillBusy past its decode's share
        if job.alloc is None:  # pages other requests still hold are waited for (their senders end soon)
            self._for_pages.append(job)
        else:
            self._start_compute(job)

    def _try_allocate(self, job: Job, share: float) -> rq.Allocation | None:
        return self.page_pool.try_allocate(self.names, job.status.seq_len, owner=job.status.peer, share=share)

    def _expire(self, job: Job) -> None:
        """The request deadline while in line for pages: the allocator's own refusal (still full)."""
        if job.alloc is not None:
            return
        self._for_pages.remove(job)
        s = job.status
        job.alloc = self.page_pool.allocate(self.names, s.seq_len, owner=s.peer, share=self._share())
        self._start_compute(job)  # (pages freed just now)

    def _start_compute(self, job: Job) -> None:
        if self._nbytes(job.alloc.lists) <= INLINE_FILL_BYTES:  # small: no hand-off to the compute thread
            self._computed(job, self._fill_now(job))
            return
        feed = None
        if self.hooks.delay_before_copy_s <= 0:  # no hold: the compute thread feeds the sender made now
            feed = self._open_sender(job)
            job.filling = True
        try:
            self._compute.submit(self._fill, job, feed)
        except RuntimeError as exc:  # shutting down: the compute thread takes no more
            job.filling = False  # (no fill runs: its sender is aborted, its pages freed once fenced)
            raise AgentClosed(SHUTTING_DOWN) from exc

    def _nbytes(self, lists: list[np.ndarray]) -> int:
        """The bytes a request's index lists address (main KV pages, then each state component's items)."""
        kv = self.kv_args
        n = len(lists[0]) * sum(kv.kv_item_lens)
        return n + sum(len(idx) * sum(items) for idx, items in zip(lists[1:], kv.state_item_lens))

    def _fill_now(self, job: Job) -> BaseException | None:
        """The stand-in for the model, on this thread; returns its error."""
        error = None
        try:
            synth.fill_source(self.kv_args, job.status.room, job.alloc.lists)
        except Exception as exc:
            error = exc
        job.compute_s = time.perf_counter() - job.t0
        return error

    def _fill(self, job: Job, feed: Callable[[], None] | None) -> None:
        """The compute thread: the stand-in for the model; its outcome goes back to the loop. With
        ``feed`` (the chunks of the sender the loop made), a filled request's chunks go straight to
        the agent's I/O thread from here (no wait for the loop), its result to the loop beside them."""
        error = self._fill_now(job)
        if feed is None:
            self._timers.post(self._step, self._computed, job, error)
            return
        if error is None:
            try:
                self.agent.post(feed)
            except AgentClosed:
                pass  # closing: the agent fails the sender, the loop ends the request once fenced
        self._timers.post(self._filled, job, error)

    def _filled(self, job: Job, error: BaseException | None) -> None:
        """The fill of a request whose sender the compute thread fed is back: the pages are the
        sender's alone now; a sender that ended meanwhile ends the request now."""
        job.filling = False
        if job.done:  # pragma: no cover - a filling request is never finished (``_end`` waits for this)
            return
        if error is not None:
            self._step(self._computed, job, error)  # ends it: its live sender aborted, or it ended already
            return
        self._moved(job.status, RequestState.TRANSFERRING)
        if job.ended_filling:
            self._step(self._sent, job)

    def _computed(self, job: Job, error: BaseException | None) -> None:
        if error is not None:
            raise error
        self._moved(job.status, RequestState.TRANSFERRING)
        self._hold(job)

    def _hold(self, job: Job) -> None:
        """The test seam ``delay_before_copy_s``: wait (a timer) before sending, ending early once
        the decode gave the request up (or is gone) or this worker stops."""
        delay = self.hooks.delay_before_copy_s
        if delay > 0:
            if job.hold_end is None:
                job.hold_end = time.monotonic() + delay
            left = job.hold_end - time.monotonic()
            if left > 0 and not self._draining.is_set() and self._given_up(job.status) is None:
                job.timers.append(self._timers.later(min(left, HOLD_POLL_S), self._step, self._hold, job))
                return
        self._send(job)

    def _send(self, job: Job) -> None:
        self.agent.post(self._open_sender(job))

    def _open_sender(self, job: Job) -> Callable[[], None]:
        """Make ``job``'s sender (its add posted to the agent's I/O thread) and return the feed of
        its chunks, for that thread to run (``agent.post``)."""
        # its decode aborted, or went, while this one waited or computed; or this worker stops
        given_up = self._given_up(job.status) or self._past_drain()
        if given_up is not None:
            raise given_up  # refused at the agent (a gone decode's request still waits there)
        pages = job.alloc.lists[0]
        parts = np.array_split(pages, min(self.chunks, max(1, pages.size)))
        # the sender's add and its chunks go to the agent's I/O thread as posts (one wake-up of it,
        # no round trip): the sender is this job's from here on, so an end meanwhile aborts it
        sender = job.sender = self.agent.sender(job.status.room, int(pages.size), posted=True)
        sender.add_done_callback(lambda _s: self._timers.post(self._step, self._sent, job))
        limit = self.opts.request_deadline_s + self.opts.peer_timeout_s
        job.timers.append(self._timers.later(limit, self._step, self._overdue, job))
        state = job.alloc.lists[1:]
        return lambda: self._feed(job, sender, parts, state)

    def _feed(self, job: Job, sender, parts: list[np.ndarray], state: list[np.ndarray]) -> None:
        """The agent's I/O thread, right after it added ``sender``: its chunks, the state with the
        last (``send`` runs at once on this thread). A refused add or chunk goes back to the loop,
        which ends the request with it as when it was refused there."""
        if sender.posted_error is not None:  # the add was refused: no chunk goes
            self._timers.post(self._step, self._unmade, job, sender.posted_error)
            return
        try:
            for part in parts[:-1]:
                sender.send(part)
            sender.send(parts[-1], state)
        except Exception as exc:
            self._timers.post(self._step, self._refused, job, exc)

    def _unmade(self, job: Job, error: BaseException) -> None:
        """The agent refused the sender's add: it never was the agent's (no byte of it moves), so
        the request ends as one without a sender (its decode told)."""
        job.sender = None
        raise error

    def _refused(self, job: Job, error: BaseException) -> None:
        raise error

    def _overdue(self, job: Job) -> None:
        if not job.sender.state.terminal:
            self._abort(job.sender, f"prefill: no verdict within {self.opts.request_deadline_s:g} s")

    def _sent(self, job: Job) -> None:
        """The sender ended (the agent's completion, brought to the loop): fenced, so its pages
        go back (once its fill, if it still runs, is back: ``_filled``)."""
        if job.filling:
            job.ended_filling = True
            return
        if job.sender.posted_error is not None:  # its add was refused (``_feed`` posts the same, for any error)
            self._unmade(job, job.sender.posted_error)
        error = job.error or job.sender.failure_exception()
        if isinstance(error, AgentClosed) and self._draining.is_set():  # (one closed before its add ran, too)
            error = AgentClosed(SHUTTING_DOWN)
        self._finish(job, error)

    def _end(self, job: Job, exc: BaseException) -> None:
        """End ``job`` with ``exc``: told to its decode while it has no sender; a live sender is
        aborted first and ends the request from its done callback, once fenced."""
        if job.done:
            return
        error = AgentClosed(SHUTTING_DOWN) if isinstance(exc, AgentClosed) and self._draining.is_set() else exc
        sender = job.sender
        if sender is None:
            self._refuse(job.status.room, error)
        elif not sender.state.terminal:
            job.error = error
            self._abort(sender, str(error))
            return
        elif job.filling:  # the fill still writes its pages: the request ends once it is back
            job.error = job.error or error
            job.ended_filling = True
            return
        self._finish(job, error)

    def _abort(self, sender, reason: str) -> None:
        try:
            sender.abort(reason, timeout_s=0)
        except (TransferTimedOut, AgentClosed, TimeoutError):
            pass  # not fenced yet (or closed meanwhile): its done callback comes once it is

    def _finish(self, job: Job, error: BaseException | None) -> None:
        job.done = True
        for t in job.timers:
            t.cancel()
        self._jobs.pop(job.status.room, None)
        if job in self._for_pages:
            self._for_pages.remove(job)
        freed = False
        if job.alloc is not None and (job.sender is None or job.sender.state.terminal):
            self.page_pool.free(job.alloc, owner=job.status.peer)  # nothing reads these pages any more
            freed = True
        elif job.alloc is not None:  # pragma: no cover - a wedged engine: keep the pages out of use
            log.error(
                "room %d: the sender is still %s after its abort; its pages stay allocated",
                job.status.room,
                job.sender.state.value,
            )
        self._done(job, job.sender, error)
        if freed:
            self._give_pages()

    def _give_pages(self) -> None:
        """Pages came back: hand them to the requests in line, in order (each that fits)."""
        if not self._for_pages:
            return
        share = self._share()
        for job in list(self._for_pages):
            try:
                alloc = self._try_allocate(job, share)
            except PdStateError as exc:  # past its decode's share now
                self._end(job, exc)
                continue
            if alloc is not None:
                self._for_pages.remove(job)
                job.alloc = alloc
                self._step(self._start_compute, job)

    def _fail_all(self) -> None:
        """At close (the agent and the compute thread ended first): end every request left."""
        for job in list(self._jobs.values()):
            job.filling = False  # no fill runs any more (one cancelled in the queue never ran)
            self._end(job, AgentClosed(SHUTTING_DOWN))

    def _share(self) -> float:
        """The most of the pools one decode may hold now: ``decode_share`` while another decode
        is registered, else all of them."""
        others = self._ask_agent(lambda a: a.decode_count, 0) > 1  # (no round trip to the I/O thread)
        return self.opts.decode_share if others else 1.0

    def set_hooks(self, hooks: WorkerHooks) -> None:
        """Swap the fault-injection hooks (tests); requests computed later see the new ones."""
        self.hooks = hooks

    def _past_drain(self) -> PdStateError | None:
        """A request not sent yet when the drain's time is up is not sent at all: it ends with
        ``prefill shutting down`` (with ``drain_s = 0``, every request not yet sending)."""
        if self._draining.is_set() and time.monotonic() >= self._drain_end:
            return AgentClosed(SHUTTING_DOWN)
        return None

    def _given_up(self, status: RequestStatus) -> PdStateError | None:
        """Why the request is not to be sent after all: its decode's abort or refusal, or the
        decode gone (silent past ``peer_timeout_s``, or said goodbye) since it asked."""
        refused = self.agent.refusal(status.room)
        if refused is not None:
            return refused
        if self.agent.alive and self.agent.requested(status.room):  # its request waits (read without the I/O thread):
            return None  # its decode is not gone (a gone decode's waiting requests are dropped with it)
        for d in self._ask_agent(lambda a: a.peers(), []):
            if d.id == status.peer and d.state is PeerState.GONE:
                err = d.error or ErrorInfo(type="PeerGone", message=f"decode {status.peer} is gone")
                return error_from_wire(err.type, err.message)
        if self.agent.alive and not self.agent.requested(status.room):  # dropped: its decode registered again
            return PeerGone(f"decode {status.peer} registered again or went before room {status.room} was sent")
        return None

    def _moved(self, status: RequestStatus, state: RequestState) -> None:
        with self._lock:
            if status.room in self._live:
                self._live[status.room] = replace(self._live[status.room], state=state)

    def _refuse(self, room: int, error: BaseException) -> None:
        try:
            self.agent.refuse(room, error)
        except (AgentClosed, TimeoutError):
            pass  # closed meanwhile: the decode was told "prefill shutting down"

    def _done(self, job: Job, sender, error: BaseException | None) -> None:
        status, seconds = job.status, time.perf_counter() - job.t0
        metrics = {} if sender is None else sender.metrics
        ok = error is None and sender is not None and sender.state is RequestState.SUCCESS
        if ok:
            self.stats.success(int(metrics.get("bytes", 0)), seconds, metrics.get("verify"))
        else:
            reason = str(error) if error is not None else f"ended {sender.state.value if sender else 'unsent'}"
            kind = None if error is None else type(error).__name__
            self.stats.fail(reason, kind, None if kind is None else logs.refusal_factor(kind, reason))
            if isinstance(error, EngineError):  # counted by class (``TransferTimedOut`` is one)
                self.stats.engine_error()
        logs.request_end(
            log,
            room=status.room,
            peer=status.peer,
            nbytes=int(metrics.get("bytes", 0)),
            ms=seconds * 1e3,
            outcome="ok" if ok else f"failed: {type(error).__name__}" if error is not None else reason,
            verification=str(metrics.get("verify", "off")),
        )
        self._leave(
            status.room,
            {
                "room": status.room,
                "decode": status.peer,
                "seq_len": status.seq_len,
                "status": "success" if ok else "failed",
                "error": None if ok or error is None else ErrorInfo.of(error).model_dump(),
                "bytes": int(metrics.get("bytes", 0)),
                "seconds": round(seconds, 6),
                "compute_s": round(job.compute_s, 6),
            },
        )

    # -- status (any thread) ------------------------------------------------------------------
    def status(self) -> WorkerSnapshot:
        peers = tuple(_peer(d) for d in self._ask_agent(lambda a: a.peers(), []))
        loop_dead = () if self._closed or self._timers.alive else ("pdstate-prefill-requests",)
        return WorkerSnapshot(
            role=self.role,
            worker_id=self.worker_id,
            incarnation=self.incarnation,
            endpoint="" if self._closed else self.endpoint,
            peers=peers,
            requests=self._requests(),
            dead_threads=self._dead_threads() + loop_dead,
            peak_in_flight=self.peak_in_flight,
            auth_error=self._ask_agent(lambda a: a.auth_failures.recent(AUTH_RECENT_S), None),
            dropped=self._ask_agent(lambda a: a.withheld.recent(AUTH_RECENT_S), None),
        )

    def finished_records(self) -> list[dict]:
        with self._lock:
            return list(self.finished.values())


def _peer(d: PeerSnapshot) -> PeerStatus:
    return PeerStatus(d.id, d.state, d.error, d.incarnation, d.fingerprint)


__all__ = ["AgentPrefillWorker"]
