"""``pdstate serve``'s decode: a ``DecodeAgent`` over this worker's pools (in shared memory on
the shm engine), receiving a request from the prefill its caller names (default ``control.peer``).

``submit(tokens, room, prefill=...)`` enters the request and returns its future (the one map from
an HTTP request to its outcome: room -> future). No thread runs per request: each step runs on
the worker's one request loop (``base.Timers``), and the agent's completion callback
(``KVReceiver.add_done_callback``) brings the end of a transfer there. The request takes its pages
(or waits in line, up to its deadline, for pages that ending requests free), asks the prefill
through a ``KVReceiver`` (``seq_len`` included: the prefill computes on demand), gets the verdict
(the agent compares the digests of the bytes sent and landed), then checks what landed against
the room's synthetic content (``checks.verify``: ``full`` or ``sample``) and frees the pages. A
prefill that answers ``PrefillBusy`` is asked again once one of this decode's requests ended (a
slot it held is free) or, at the latest, after a backoff (a timer), until the deadline. A request
past its deadline (a timer) is aborted; the abort is fenced (the prefill confirms nothing more of
it lands) before its pages are freed; one the prefill never confirms (a second timer) fails with
``AgentTimeout``. A gone prefill fails its requests at once. Pages go back to the pool only once
nothing of their request can land (``KVReceiver.fenced``): a prefill that said goodbye fenced
first, a restarted one is proven gone, but one gone silent (missed heartbeats: it, or this decode,
was frozen or slow) may still be copying. Its requests' pages are quarantined (counted on
``/v1/compat`` and in ``pdstate_quarantined_requests``) until it confirms each one, which it does
once its fence holds and this decode asked again after registering with it again, until a new
process holds its address, or (shm) until its process exits: the control session it had
completed closes. Never on a timer.

The default prefill is dialled at start and again whenever it is gone (``/readyz`` follows it);
any other is dialled on first use, at most ``MAX_PREFILLS`` at once (an idle one is closed to make
room).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from concurrent.futures import Future

from pdstate import logs
from pdstate.errors import (
    AgentClosed,
    AgentTimeout,
    PdStateError,
    PrefillBusy,
    RoomInFlight,
    TooManyPrefills,
    TransferFailed,
    TransferTimedOut,
    UnknownRoom,
    error_from_wire,
)
from pdstate.protocol.lifecycle import PeerState, RequestState
from pdstate.protocol.peers import PrefillSnapshot
from pdstate.protocol.report import ErrorInfo
from pdstate.worker import requests as rq
from pdstate.worker import synth
from pdstate.worker.base import AgentWorker, Timers, now, settle
from pdstate.worker.options import WorkerOptions
from pdstate.worker.status import PeerStatus, RequestStatus, TransferResult, WorkerSnapshot

log = logging.getLogger("pdstate.worker.decode")

MAX_PREFILLS = 64
BUSY_BACKOFF_S = rq.BUSY_BACKOFF_S
SHUTTING_DOWN = "decode shutting down"


class AgentDecodeWorker(AgentWorker):
    """The decode of ``pdstate serve``. ``start()`` builds pools and agent and dials
    ``control.peer``; ``submit`` runs one request; ``stop()`` fails what is in flight."""

    role = "decode"

    def __init__(self, opts: WorkerOptions) -> None:
        super().__init__(opts)
        self.worker_id = opts.worker_id or f"decode-{secrets.token_hex(3)}"
        self._stop = threading.Event()
        self._timers = Timers("pdstate-decode-requests")
        self._futures: dict[int, Future] = {}  # room -> its future, until it completes (under _lock)
        self._quarantine: dict[int, rq.Allocation] = {}  # room -> pages its prefill may still write, under _lock
        # request loop only:
        self._pending: dict[int, rq.Pending] = {}  # room -> request, until it ends
        self._for_pages: deque[rq.Pending] = deque()  # in line for pages, first come first served
        self._busy: dict[int, rq.Pending] = {}  # waiting out a busy prefill
        # room -> a request kept running (``hold``): changed on the request loop, under _lock
        self._running: dict[int, rq.Running] = {}
        self.migrations = None  # the migrating side (``worker.migrate.Migrations``), made on first use
        self._migrations_lock = threading.Lock()
        self._listeners: set[str] = set()  # migrating decodes' listeners dialled (under _lock)

    def start(self) -> AgentDecodeWorker:
        """Raises ``LocalCheckFailed`` (own pair refused, with ``local_checks``) or ``EngineError``;
        what was built before is released first (no segment outlives it)."""
        from pdstate.agent import DecodeAgent

        o = self.opts
        self._open_agent(
            DecodeAgent,
            handshake_timeout_s=max(10.0, o.peer_timeout_s),
            transfer_timeout_s=max(o.request_deadline_s, 1.0) + o.peer_timeout_s,
            dead_prefill_release_s=o.dead_prefill_release_s,
        )
        self.agent.connect(o.peer)
        watcher = threading.Thread(target=self._watch, name="pdstate-decode-watch", daemon=True)
        watcher.start()
        self._watcher = watcher
        return self

    def close_side(self) -> None:
        """Fail the requests in flight (``decode shutting down``) and release everything. Idempotent."""
        if self._closed:
            return
        self._stop.set()
        with self._migrations_lock:  # none is made after this
            pass
        try:
            if self.migrations is not None:
                self.migrations.close()  # its senders fenced: nothing reads the pages after
            if self.agent is not None:
                self.agent.close()  # every live receiver fails: its callback ends its request
        finally:
            self._timers.post(self._fail_all)
            self._timers.stop()  # no request step touches the pools after this
            with self._lock:
                left = list(self._futures.items())
            for room, fut in left:
                settle(fut, _failed(room, 0, SHUTTING_DOWN, self.opts.peer))
            super().close_side()

    def _watch(self) -> None:
        """Register again with every gone prefill, each pass, until it is back (or this stops)."""
        pause = max(0.02, self.opts.heartbeat_interval_s / 2)
        while not self._stop.wait(pause):
            try:
                known = self.agent.prefills()
                for address in [self.opts.peer, *known]:
                    p = known.get(address)
                    if address in self._listeners and address != self.opts.peer:
                        self._drop_listener(address, p)  # dialled for migrations only, never again
                    elif p is None or p.state is PeerState.GONE:
                        self.agent.connect(address)
                    elif _held_elsewhere(p, self.opts.peer_timeout_s):
                        self.agent.reregister(address)
            except (AgentClosed, TimeoutError):
                return
            except Exception:  # keep watching: readiness depends on it
                log.exception("decode watcher")

    def _unquarantine(self, room: int, alloc: rq.Allocation) -> None:
        """The prefill confirmed (or is proven gone): the pages are this decode's again."""
        with self._lock:
            if self._quarantine.get(room) is not alloc:
                return
            del self._quarantine[room]
        log.info("room %d: its prefill's fence holds; %s pages back", room, _size(alloc))
        self._free(alloc)

    def quarantined(self) -> int:
        """Requests whose pages wait for their prefill's fence (it may still write them)."""
        with self._lock:
            return len(self._quarantine)

    def quarantined_pages(self) -> int:
        """Their main-KV pages (the first channel's), kept out of the free pool until fenced."""
        with self._lock:
            return sum(len(a.lists[0]) for a in self._quarantine.values() if a.lists)

    # -- API for other threads ----------------------------------------------------------------
    def submit(
        self,
        seq_len: int,
        room: int | None = None,
        deadline_s: float | None = None,
        verify: str | None = None,
        prefill: str | None = None,
        *,
        hold: bool = False,
        steps: int = 0,
        step: int = 0,
        migrated: bool = False,
    ) -> Future:
        """One request of ``seq_len`` tokens from ``prefill`` (a ``tcp://host:port`` control
        address; default ``control.peer``); the future's result is a ``TransferResult``, or
        ``RoomInFlight`` when ``room`` already has a request in flight (or running) here.

        ``hold``: once landed and verified the request stays running here (``running()``), and
        ``steps`` synthetic decode steps advance it. ``step``: the decode step its content is at
        (a request another decode migrates here, ``migrated``: its listener's link is closed once
        that listener is gone, and never redialled)."""
        rq.check_submit(seq_len, verify, prefill)
        if steps < 0 or step < 0 or (steps and not hold):
            raise ValueError("steps and step must not be negative, and steps need hold")
        fut: Future = Future()
        room = room if room is not None else secrets.randbits(63)
        prefill = prefill or self.opts.peer
        status = RequestStatus(room, RequestState.BOOTSTRAPPING, seq_len, now(), peer=prefill)
        if self._stop.is_set():
            settle(fut, _failed(room, seq_len, SHUTTING_DOWN, prefill))
            return fut
        with self._lock:
            running = room in self._running
        if running or not self._enter(status):
            settle(fut, exc=RoomInFlight(f"room {room} is already in flight" + (" (running)" if running else "")))
            return fut
        with self._lock:
            self._futures[room] = fut
        res = TransferResult(room, "failed", seq_len, prefill=prefill, verify_level=self.opts.transfer_verify)
        req = rq.Pending(status, fut, verify or self.opts.verify, deadline_s or self.opts.request_deadline_s, res)
        req.hold, req.steps, req.step = hold, steps, step
        if migrated:
            with self._lock:
                self._listeners.add(prefill)
        if not self._timers.post(self._step, self._begin, req):  # stopped meanwhile
            self._finish(status, fut, _failed(room, seq_len, SHUTTING_DOWN, prefill))
        return fut

    def reregister(self) -> None:
        """Register again with every prefill this decode knows (the default one first)."""
        for address in [self.opts.peer, *(a for a in self.agent.prefills() if a != self.opts.peer)]:
            self.agent.reregister(address)

    def lookup(self, room: int) -> TransferResult | RequestStatus | None:
        with self._lock:
            res = self.finished.get(room)
            return res if res is not None else self._live.get(room)

    def status(self) -> WorkerSnapshot:
        known: dict[str, PrefillSnapshot] = self._ask_agent(lambda a: a.prefills(), {})
        default = known.get(self.opts.peer)
        peers = [_peer(self.opts.peer, default)] + [_peer(a, d) for a, d in known.items() if a != self.opts.peer]
        loop_dead = () if self._closed or self._timers.alive else ("pdstate-decode-requests",)
        return WorkerSnapshot(
            role=self.role,
            worker_id=self.worker_id,
            incarnation=self.incarnation,
            endpoint=self.opts.peer,
            peers=tuple(peers),
            requests=self._requests(),
            dead_threads=self._dead_threads() + loop_dead,
            peak_in_flight=self.peak_in_flight,
            waiting=0 if self._closed else len(self._for_pages),
            quarantined=self.quarantined(),
            quarantined_pages=self.quarantined_pages(),
            handshake_s=None if default is None else default.handshake_s,
        )

    # -- the request loop: each step of a request -----------------------------------------------
    def _step(self, fn, req: rq.Pending, *args) -> None:
        """Run one step of ``req``; an exception ends the request with it."""
        if req.done:
            return
        try:
            fn(req, *args)
        except Exception as exc:
            self._end(req, exc)

    def _begin(self, req: rq.Pending) -> None:
        req.t0, req.end = time.perf_counter(), time.monotonic() + req.deadline_s
        self._pending[req.status.room] = req
        if self._stop.is_set():
            raise AgentClosed(SHUTTING_DOWN)
        prefill = req.status.peer
        known = self.agent.prefills()  # one snapshot: room for a new prefill, and whether it is down
        self._make_room(prefill, known)
        self._refuse_if_down(prefill, known)
        req.timers.append(self._timers.at(req.end, self._step, self._expire, req))
        # a prefill gone while this request waits for pages fails it in ``receiver`` (redial_gone=False)
        req.alloc = self.page_pool.try_allocate(self.names, req.status.seq_len)
        if req.alloc is None:
            self._for_pages.append(req)
        else:
            self._ask(req)

    def _ask(self, req: rq.Pending) -> None:
        """Ask the prefill for the room (again, after a ``PrefillBusy``); its end comes back
        through the receiver's done callback."""
        room, alloc = req.status.room, req.alloc
        req.recv = recv = self.agent.receiver(req.status.peer, room, redial_gone=False)  # the watcher redials
        recv.init(alloc.lists[0], alloc.lists[1:], seq_len=req.status.seq_len)
        recv.add_done_callback(lambda r: self._timers.post(self._step, self._landed, req, r))

    def _landed(self, req: rq.Pending, recv) -> None:
        """The receiver ended (the agent's completion, brought to the request loop)."""
        if recv is not req.recv:
            return
        if req.why is None and isinstance(recv.failure_exception(), PrefillBusy):
            if time.monotonic() + req.backoff < req.end and not self._stop.is_set():
                self.stats.busy()
                self._busy[req.status.room] = req
                req.timers.append(self._timers.later(req.backoff, self._step, self._again, req))
                req.backoff = min(BUSY_BACKOFF_S[1], req.backoff * 2)
                return
        if req.why is not None and recv.state is not RequestState.SUCCESS:  # (a verdict may come first)
            raise TransferFailed(req.why)  # its pages go back once fenced (``_end``)
        self._verify(req, recv)

    def _again(self, req: rq.Pending) -> None:
        """Ask a busy prefill again: one of this decode's requests ended, or the backoff passed."""
        if self._busy.pop(req.status.room, None) is None:
            return
        if self._stop.is_set():
            raise AgentClosed(SHUTTING_DOWN)
        self._ask(req)

    def _expire(self, req: rq.Pending) -> None:
        """The deadline: no pages yet, or the prefill still busy, end the request; a transfer in
        flight is aborted, and ends when the prefill confirms the abort (its fence)."""
        if req.alloc is None:
            self._for_pages.remove(req)
            req.alloc = self.page_pool.allocate(self.names, req.status.seq_len)  # AllocationError: still full
            raise TransferFailed("deadline exceeded")  # (freed pages came just now)
        recv = req.recv
        if self._busy.pop(req.status.room, None) is not None or recv.state.terminal:
            return self._verify(req, recv)
        why = "deadline exceeded"
        if recv.state is RequestState.BOOTSTRAPPING:
            why = f"deadline exceeded: no handshake answer from the prefill at {req.status.peer}"
        req.why = why
        try:
            recv.abort("deadline exceeded on decode", timeout_s=0)
        except TransferTimedOut:  # not fenced yet: its callback ends it when the prefill confirms
            req.timers.append(self._timers.later(self.opts.peer_timeout_s + 5, self._step, self._unfenced, req))

    def _unfenced(self, req: rq.Pending) -> None:
        if req.recv.state.terminal:
            return
        raise AgentTimeout(
            f"{req.why}; the prefill at {req.status.peer} did not confirm the abort within "
            f"{self.opts.peer_timeout_s + 5:g} s"
        )

    def _verify(self, req: rq.Pending, recv) -> None:
        res, m = req.res, recv.metrics
        res.verify_level = str(m.get("verify", self.opts.transfer_verify))
        res.bytes, res.descriptors = int(m.get("bytes", 0)), int(m.get("descriptors", 0))
        res.transfer_s, res.copy_s = float(m.get("transfer_s", 0.0)), float(m.get("copy_s", 0.0))
        if recv.state is not RequestState.SUCCESS:
            raise recv.failure_exception() or TransferFailed(f"room {req.status.room} ended {recv.state.value}")
        t1 = time.perf_counter()
        lists = req.alloc.lists
        problem = synth.verify_running(self.kv_args, req.status.room, req.step, lists, req.verify, self.pools.memory)
        res.verify_s = time.perf_counter() - t1
        if problem is not None:
            raise TransferFailed(problem)
        res.status, res.verified = "success", True
        if req.hold:
            self._keep(req)
        self._end(req)

    def _end(self, req: rq.Pending, exc: BaseException | None = None) -> None:
        """End ``req`` (with ``exc``, or as its result says): its pages, counters, log line, future."""
        if req.done:
            return
        req.done = True
        for t in req.timers:
            t.cancel()
        room, prefill, res = req.status.room, req.status.peer, req.res
        self._pending.pop(room, None)
        self._busy.pop(room, None)
        if exc is not None:
            res.status, res.verified = "failed", False
            res.error = (
                ErrorInfo.of(exc)
                if isinstance(exc, PdStateError)
                else ErrorInfo(type=type(exc).__name__, message=str(exc))
            )
        if req.alloc is not None:
            recv, alloc = req.recv, req.alloc
            if recv is None or recv.fenced:
                self._free(alloc)
            else:  # its prefill may still write them: out of use until it confirms or is proven gone
                log.warning("room %d: %s may still write its pages; they wait for its fence", room, prefill)
                with self._lock:
                    self._quarantine[room] = alloc
                recv.add_fence_callback(lambda _r: self._timers.post(self._unquarantine, room, alloc))
        res.seconds = time.perf_counter() - req.t0 if req.t0 else 0.0
        if res.status == "success":
            self.stats.success(res.bytes, res.seconds, res.verify_level)
        elif res.error is not None:
            kind = res.error.type
            self.stats.fail(res.error.message, kind, logs.refusal_factor(kind, res.error.message))
        else:
            self.stats.fail("failed")
        logs.request_end(
            log,
            room=room,
            peer=prefill,
            nbytes=res.bytes,
            ms=res.seconds * 1e3,
            outcome="ok" if res.error is None else f"failed: {res.error.type}",
            verification=f"{res.verify_level}+{req.verify if res.verified else 'none'}",
        )
        self._finish(req.status, req.fut, res)
        for other in list(self._busy.values()):  # a prefill slot this request held is free again
            self._timers.post(self._step, self._again, other)

    def _drop_listener(self, address: str, p: PrefillSnapshot | None) -> None:
        """A migrating decode's listener (on the watcher's thread): its link stays while it
        serves (the next migration from that decode, a drain's, needs no new handshake) and is
        closed once it is gone or refused this decode (``forget`` keeps it while one of its
        requests is unfenced: the next pass asks again). Never dialled again by the watcher."""
        if p is not None and p.state not in (PeerState.GONE, PeerState.REJECTED):
            return
        if p is None or self.agent.forget(address):
            with self._lock:
                self._listeners.discard(address)

    # -- running requests (``hold``): on the request loop -------------------------------------
    def _keep(self, req: rq.Pending) -> None:
        """The landed request stays running: its pages move to ``_running`` (``_end`` frees none),
        then its ``steps`` run."""
        room = req.status.room
        r = rq.Running(room, req.status.seq_len, req.alloc, req.step, now(), req.status.peer)
        req.alloc = None
        with self._lock:
            self._running[room] = r
        self._advance(r, req.steps)
        req.res.held, req.res.step = True, r.step

    def _advance(self, r: rq.Running, n: int) -> None:
        for _ in range(n):
            r.step += 1
            synth.advance(self.kv_args, r.room, r.step, r.alloc.lists)

    def _held(self, room: int, idle: bool = True) -> rq.Running:
        r = self._running.get(room)
        if r is None:
            raise UnknownRoom(f"no running request in room {room}")
        if idle and r.migrating:
            raise RoomInFlight(f"room {room} is migrating")
        return r

    def _on_loop(self, fn, *args) -> Future:
        """``fn(*args)`` on the request loop; its result (or exception) in the future."""
        fut: Future = Future()

        def run() -> None:
            try:
                settle(fut, fn(*args))
            except BaseException as exc:  # the caller's to read
                settle(fut, exc=exc)

        if self._stop.is_set() or not self._timers.post(run):
            settle(fut, exc=AgentClosed(SHUTTING_DOWN))
        return fut

    def running(self) -> list[dict]:
        """The requests kept running here, oldest first."""
        with self._lock:
            rs = sorted(self._running.values(), key=lambda r: r.since)
        t = now()
        return [r.as_dict(t) for r in rs]

    def advance(self, room: int, steps: int = 1) -> Future:
        """Run ``steps`` synthetic decode steps of running request ``room`` (``UnknownRoom``;
        ``RoomInFlight`` while it migrates); the result is its record."""

        def run() -> dict:
            r = self._held(room)
            self._advance(r, steps)
            return r.as_dict(now())

        return self._on_loop(run)

    def release(self, room: int) -> Future:
        """End running request ``room``: its pages go back (``UnknownRoom``; ``RoomInFlight``
        while it migrates)."""

        def run() -> dict:
            r = self._held(room)
            return self._drop(r)

        return self._on_loop(run)

    def _drop(self, r: rq.Running) -> dict:
        with self._lock:
            del self._running[r.room]
        self._free(r.alloc)
        return r.as_dict(now())

    def row_digest(self, room: int) -> Future:
        """``synth.rows_digest`` of running request ``room``'s items, with its record (a paused
        one too: nothing writes it)."""

        def run() -> dict:
            r = self._held(room, idle=False)
            return {**r.as_dict(now()), "digest": synth.rows_digest(self.kv_args, r.alloc.lists)}

        return self._on_loop(run)

    def pause(self, room: int) -> Future:
        """Stop stepping ``room`` for a migration: the result is ``(seq_len, step, lists)``; its
        pages stay untouched until ``resume`` or ``moved``."""

        def run() -> tuple:
            r = self._held(room)
            r.migrating = True
            return r.seq_len, r.step, r.alloc.lists

        return self._on_loop(run)

    def resume(self, room: int) -> Future:
        """The migration failed: ``room`` runs here again, unchanged."""

        def run() -> None:
            r = self._running.get(room)
            if r is not None:
                r.migrating = False

        return self._on_loop(run)

    def moved(self, room: int) -> Future:
        """The target verified ``room`` and runs it (the sender's fence held): its pages go back."""
        return self._on_loop(lambda: self._drop(self._held(room, idle=False)))

    def migrations_of(self):
        """The migrating side, made on first use (``worker.migrate.Migrations``)."""
        from pdstate.worker.migrate import Migrations

        with self._migrations_lock:  # (building it binds a socket: not under ``_lock``)
            if self._stop.is_set():
                raise AgentClosed(SHUTTING_DOWN)
            if self.migrations is None:
                self.migrations = Migrations(self)
            return self.migrations

    def _free(self, alloc: rq.Allocation) -> None:
        """Free pages (on the request loop) and hand them to the requests in line, in order."""
        self.page_pool.free(alloc)
        while self._for_pages:
            req = self._for_pages[0]
            req.alloc = self.page_pool.try_allocate(self.names, req.status.seq_len)
            if req.alloc is None:
                return
            self._for_pages.popleft()
            self._step(self._ask, req)

    def _fail_all(self) -> None:
        """At close (the agent closed first): end every request left with ``decode shutting down``."""
        self._for_pages.clear()
        for req in list(self._pending.values()):
            self._end(req, AgentClosed(SHUTTING_DOWN))

    def _refuse_if_down(self, prefill: str, known: dict[str, PrefillSnapshot]) -> None:
        """A gone prefill (until it accepts again), or one that refused this decode within the
        last ``peer_timeout_s``, fails the request at once with its reason (an older refusal is
        asked again: the prefill may have been fixed)."""
        p = known.get(prefill)
        if p is None:
            return
        recent = p.registered_s_ago < self.opts.peer_timeout_s
        if p.state is PeerState.GONE or (p.state is PeerState.REJECTED and recent):
            info = p.error or ErrorInfo(type="PeerGone", message=f"prefill {prefill} is gone")
            raise error_from_wire(info.type, info.message)

    def _make_room(self, prefill: str, known: dict[str, PrefillSnapshot]) -> None:
        """At most ``MAX_PREFILLS`` prefills connected: close an idle one for a new address."""
        if prefill in known or len(known) < MAX_PREFILLS:
            return
        for address in known:
            if address != self.opts.peer and self.agent.forget(address):
                return
        raise TooManyPrefills(f"this decode already uses {MAX_PREFILLS} prefills, each with requests in flight")

    stop = close_side

    def _finish(self, status: RequestStatus, fut: Future, res: TransferResult) -> None:
        self._leave(status.room, res)
        with self._lock:
            self._futures.pop(status.room, None)
        settle(fut, res)


def _held_elsewhere(p: PrefillSnapshot, peer_timeout_s: float) -> bool:
    """A refusal that passes by itself: the prefill still holds this decode's former connection
    (``WorkerIdInUse``, after this decode was frozen or its socket renewed) until it times it out;
    asked again once that long went by."""
    held = p.error is not None and p.error.type == "WorkerIdInUse"
    return p.state is PeerState.REJECTED and held and p.registered_s_ago > peer_timeout_s


def _size(alloc: rq.Allocation) -> str:
    return "+".join(str(len(x)) for x in alloc.lists)


def _failed(room: int, seq_len: int, reason: str, prefill: str) -> TransferResult:
    return TransferResult(
        room, "failed", seq_len, error=ErrorInfo(type="TransferFailed", message=reason), prefill=prefill
    )


def _peer(address: str, d: PrefillSnapshot | None) -> PeerStatus:
    if d is None:
        return PeerStatus(address, PeerState.PENDING)
    return PeerStatus(address, d.state, d.error, d.incarnation or None, d.fingerprint)


__all__ = ["AgentDecodeWorker", "MAX_PREFILLS"]
