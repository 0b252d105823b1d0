"""The prefill worker: serves any number of decode workers over one ROUTER socket.

Threads: the control thread owns the socket, the allocator and every request record (its peer
table is ``runtime.prefill_peers``); one transfer thread (``runtime.transfer.TransferRunner``) runs
the (synthesised) prefill compute and the engine copy. They hand each other jobs and outcomes
through mailboxes (``runtime.mailbox``). Every request that entered ends SUCCESS or FAILED, its
pages freed exactly once, and leaves a record in ``finished`` (bounded) with its reason.

Ordering, which the decode relies on when it reuses pages of requests it gave up on: there is ONE
transfer thread and it finishes a job's engine transfer (or gets the engine's failure) before it
starts the next. (A small request on a synchronous engine runs on the control thread instead,
but only while the transfer thread has nothing queued or running, so copies stay one at a time.)
So every write for a request the decode sent before a re-handshake lands before any write for a
request it sends after, and a late write can only land in pages that a later request's own copy
overwrites before that request is verified. (An engine whose ``wait`` gives up
while its native transfer still runs must itself keep later transfers behind it, as the Mooncake
adapter's single worker does.)

A cancelled job (peer gone, abort, re-registration, shutdown) never reports success: if its copy
already ran, the decode is not going to verify it, so both sides record FAILED with the reason.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import zmq

from pdstate.errors import (
    AllocationError,
    AuthError,
    NotRegistered,
    PdStateError,
    ProtocolError,
    TransferFailed,
    VersionMismatch,
)
from pdstate.protocol import wire
from pdstate.protocol.handshake import PrefillHandshake
from pdstate.protocol.lifecycle import PeerState, RequestState, move
from pdstate.protocol.report import ErrorInfo
from pdstate.runtime import requests as rq
from pdstate.runtime import synth
from pdstate.runtime.commands import JobOutcome
from pdstate.runtime.control import ControlServer
from pdstate.runtime.hooks import WorkerHooks
from pdstate.runtime.mailbox import Mailbox
from pdstate.runtime.options import WorkerOptions
from pdstate.runtime.prefill_peers import PrefillPeers
from pdstate.runtime.prefill_shutdown import DRAINING, PrefillShutdown
from pdstate.runtime.records import Job, Peer
from pdstate.runtime.snapshot import PeerStatus, RequestStatus, WorkerSnapshot
from pdstate.runtime.transfer import TransferRunner
from pdstate.runtime.worker import WorkerBase, local_side, log, now

MAX_FINISHED = 10000  # terminal records kept for inspection (oldest dropped first)


class PrefillWorker(PrefillShutdown, PrefillPeers, WorkerBase):
    """A prefill worker and its two threads.

    Control thread (``_control_loop``): owns the ROUTER socket, the handshake, the allocator, the
    peer table and every job's lifetime: it creates jobs, hands them to the transfer thread
    (``RunJob``) or runs a small one itself, ends them (success, failure, cancellation), records
    them in ``finished`` and releases gone peers' engine state.
    Transfer thread (``TransferRunner.thread_main``): runs one job at a time, computing its state
    and copying it, and reports a ``JobOutcome`` to the control thread's mailbox.

    Shared, under ``_lock``: every job's ``state`` and ``cancelled`` (both threads), the queued
    count and the hooks; and, written only by the control thread but read by others (``status()``
    and the views over it): the ``peers``, ``jobs`` and ``finished`` tables, each peer's state and
    error, and the counters ``peak_in_flight`` and ``jobs_inline``. What a peer keeps for the
    control thread alone (``last_seen``, planner, engine peer) needs no lock. A job's plan,
    allocation and engine peer are fixed before it is handed over.
    """

    role = "prefill"

    def __init__(self, opts: WorkerOptions, hooks: WorkerHooks | None = None) -> None:
        super().__init__(opts, hooks)
        self.worker_id = opts.worker_id or "prefill"
        self.peers: dict[bytes, Peer] = {}
        self.jobs: dict[tuple[bytes, int], Job] = {}
        self.finished: OrderedDict[tuple[bytes, int], dict] = OrderedDict()
        self.peak_in_flight = 0  # most jobs held at once (bounded by ``max_inflight``)
        self.jobs_inline = 0  # jobs run on the control thread (see ``_inline``)
        self.endpoint = ""
        self._detached: set[str] = set()  # engine peers of gone decodes, released when idle
        self._draining = threading.Event()  # stop() with a drain: new requests are refused
        self._handlers = {  # what this worker accepts, by message type (``_on_frame``)
            wire.Register: self._on_register,
            wire.Heartbeat: self._on_heartbeat,
            wire.TransferRequest: self._on_request,
            wire.Abort: self._on_abort,
            wire.Reject: self._on_peer_reject,
            wire.Error: self._on_peer_error,
        }

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> PrefillWorker:
        """Build pools, engine and control socket, then start the threads.

        Raises ``LocalCheckFailed`` (own pair refused, with ``local_checks``), ``EngineError`` or
        ``zmq.ZMQError`` (bind); whatever was built before the failure is released first.
        """
        try:
            self._build()
        except BaseException:
            self._release()
            self.close_side()
            raise
        self._start_threads(
            (self._control_loop, "pdstate-prefill-control"),
            (self.runner.thread_main, "pdstate-prefill-transfer"),
        )
        log.info("prefill %s listening on %s (engine %s)", self.worker_id, self.endpoint, self.opts.engine)
        return self

    def _build(self) -> None:
        self._open_side()
        # The prefill initiates every write: the decode never addresses it, so it publishes no regions.
        self.local = local_side(self.opts, self.worker_id, self.incarnation, self.report, self.kv_args, {})
        self.handshake = PrefillHandshake(self.local)
        self.server = ControlServer(zmq.Context.instance(), self.opts.bind, self.opts.token)
        self.endpoint = self.server.open()
        self._inbox = Mailbox(pollable=True)  # JobOutcome from the transfer thread
        self.runner = TransferRunner(self, self._lock, self._inbox)

    def _release(self) -> None:
        """Close what ``_build`` got to (a failed start)."""
        for name in ("server", "_inbox"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()
        self.endpoint = ""

    # -- status (from any thread) -------------------------------------------------------------
    def status(self) -> WorkerSnapshot:
        with self._lock:
            return WorkerSnapshot(
                role=self.role,
                worker_id=self.worker_id,
                incarnation=self.incarnation,
                endpoint=self.endpoint,
                peers=tuple(
                    PeerStatus(p.worker_id, p.state, p.error, p.incarnation, p.fingerprint) for p in self.peers.values()
                ),
                requests=tuple(
                    RequestStatus(
                        j.room,
                        j.state,
                        j.seq_len,
                        j.started,
                        j.worker_id,
                        None if j.cancelled is None else j.cancelled.message,
                    )
                    for j in self.jobs.values()
                ),
                dead_threads=self._dead_threads(),
                peak_in_flight=self.peak_in_flight,
                jobs_inline=self.jobs_inline,
            )

    def peer_states(self) -> list[dict]:
        """What it recorded about every decode: id, incarnation, state, error."""
        return [p.as_dict() for p in self.status().peers]

    def jobs_snapshot(self) -> list[dict]:
        """The requests in flight: room, decode worker id, lifecycle state, cancellation."""
        return [r.as_dict() for r in self.status().requests]

    def finished_records(self) -> list[dict]:
        """Terminal records, oldest first (at most ``MAX_FINISHED``)."""
        with self._lock:
            return list(self.finished.values())

    # -- control thread -----------------------------------------------------------------------
    def _control_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.server.sock, zmq.POLLIN)
        poller.register(self._inbox.socket, zmq.POLLIN)
        interval_ms = max(10, int(self.opts.heartbeat_interval_s * 1000 / 4))
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(interval_ms))
                if self._inbox.socket in events:
                    for msg in self._inbox.drain():
                        if isinstance(msg, JobOutcome):
                            self._guarded(self._finish_job, msg)
                if self.server.sock in events:
                    for _ in range(256):
                        try:
                            got = self.server.sock.recv_multipart(flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if len(got) == 2:
                            self._guarded(self._on_frame, got[0], got[1])
                        else:
                            self._guarded(self._on_bad_multipart, got)
                self._guarded(self._timers)
        finally:
            self._end_all()

    def _guarded(self, handler, *args) -> None:
        """Run one step of the loop; a bug in it is logged, never the end of the control thread."""
        try:
            handler(*args)
        except Exception:
            log.exception("prefill control loop: %s failed", handler.__name__)

    def _on_frame(self, identity: bytes, frame: bytes) -> None:
        try:
            msg = wire.decode(frame, self.opts.token)
        except (ProtocolError, AuthError) as exc:
            self.stats.protocol_error()
            if isinstance(exc, VersionMismatch) and wire.envelope_kind(frame) == wire.Register.KIND:
                # A decode speaking another protocol version: refuse its handshake (PROTOCOL.md),
                # naming both versions, so it raises VersionMismatch and stays down, not ready.
                self.stats.handshake("rejected")
                log.error("rejected a register from %r: %s", identity[:64], exc)
                self.server.send(identity, wire.Reject(worker_id=self.worker_id, error=ErrorInfo.of(exc)))
                return
            log.warning("bad frame from %r: %s", identity[:64], exc)
            if wire.envelope_kind(frame) != wire.Error.KIND:  # never an error for an error (§7)
                self.server.send(identity, wire.Error(error=ErrorInfo.of(exc)))
            return
        peer = self.peers.get(identity)
        if peer is not None:
            peer.last_seen = now()
        handler = self._handlers.get(type(msg))
        if handler is None:
            err = ProtocolError(f"a prefill worker does not accept {msg.KIND} messages")
            self.server.send(identity, wire.Error(error=ErrorInfo.of(err)))
            return
        try:
            handler(identity, msg)
        except Exception as exc:  # a frame that slipped past validation must not kill the loop
            self.stats.protocol_error()
            log.exception("could not handle %s from %r", msg.KIND, identity[:64])
            if isinstance(msg, wire.Error):
                return
            room = getattr(msg, "room", None)
            err = ProtocolError(f"could not handle {msg.KIND}: {type(exc).__name__}: {exc}")
            self.server.send(identity, wire.Error(error=ErrorInfo.of(err), room=room))

    def _on_bad_multipart(self, parts: list[bytes]) -> None:
        """A DEALER sent a multipart message: one frame per message is the protocol."""
        self.stats.protocol_error()
        log.warning("bad message from %r: %d frames, expected 1", parts[0][:64] if parts else b"", len(parts) - 1)
        if len(parts) >= 1 and not any(wire.envelope_kind(p) == wire.Error.KIND for p in parts[1:]):
            err = ProtocolError(f"expected one frame per message, got {len(parts) - 1}")
            self.server.send(parts[0], wire.Error(error=ErrorInfo.of(err)))

    def _on_request(self, identity: bytes, msg: wire.TransferRequest) -> None:
        peer = self.peers.get(identity)
        if peer is None or peer.state != PeerState.ACCEPTED:
            err = NotRegistered()
            self.server.send(identity, wire.Error(error=ErrorInfo.of(err), room=msg.room))
            return
        if self._draining.is_set():
            self._refuse(identity, peer, msg.room, TransferFailed(DRAINING))
            return
        key = (identity, msg.room)
        if key in self.jobs:
            self.server.send(
                identity,
                wire.Error(error=ErrorInfo.of(ProtocolError(f"room {msg.room} is already in flight")), room=msg.room),
            )
            return
        if len(self.jobs) >= self.opts.max_inflight:
            self._busy(identity, msg.room)
            return
        capacity = rq.capacity_tokens(self.pools)
        if msg.seq_len > capacity:
            err = AllocationError(f"seq_len {msg.seq_len} exceeds the prefill pool of {capacity} tokens")
            self._refuse(identity, peer, msg.room, err)
            return
        try:
            alloc = self._allocate(msg.seq_len)
        except AllocationError:
            self._busy(identity, msg.room)
            return
        except PdStateError as exc:
            self._refuse(identity, peer, msg.room, exc)
            return
        try:
            dst_lists = [msg.dst_kv_pages.unpack()] + [p.unpack() for p in msg.dst_state_indices]
            plan = peer.planner.plan(alloc.lists, dst_lists)
        except PdStateError as exc:
            self._free(alloc)
            self._refuse(identity, peer, msg.room, exc)
            return
        deadline = now() + msg.deadline_s
        job = Job(identity, msg.room, msg.seq_len, alloc, plan, deadline, peer.worker_id, peer.engine_peer)
        inline = self._inline(plan.total_bytes)
        with self._lock:
            move(job, RequestState.WAITING_FOR_INPUT)
            self.jobs[key] = job
            self.peak_in_flight = max(self.peak_in_flight, len(self.jobs))
            self.jobs_inline += inline
        if inline:
            # Nothing is queued or copying, so running it here keeps the one-copy-at-a-time order
            # (only this thread hands out jobs); the engine cannot block on a peer.
            self._finish_job(self.runner.run(job))
            return
        self.runner.submit(job)
        # the TransferDone's digest depends only on the request: worked out while the job runs
        job.digest = synth.plan_digest(job.room, job.alloc.lists, self.kv_args)

    def _inline(self, nbytes: int) -> bool:
        """Run a job here: a small one on a synchronous engine, while the transfer thread is idle
        and no other frame waits (under load, jobs go to the transfer thread, so this thread keeps
        admitting, planning and answering Busy while one copies)."""
        return (
            self.engine.synchronous
            and nbytes <= self.opts.inline_max_bytes
            and not self.server.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN
            and self.runner.can_inline()
        )

    def _busy(self, identity: bytes, room: int) -> None:
        """Full (in-flight limit or pool): the decode retries later; nothing is queued here."""
        self.stats.busy()
        self.server.send(identity, wire.Busy(room=room, in_flight=len(self.jobs), limit=self.opts.max_inflight))

    def _refuse(self, identity: bytes, peer: Peer, room: int, exc: BaseException) -> None:
        """A request that entered but cannot be planned: FAILED at once with the exact error."""
        info = ErrorInfo.of(exc)
        self.stats.fail(info.message)
        self._record(identity, peer.worker_id, room, "failed", info, 0.0)
        self.server.send(identity, wire.TransferDone(room=room, status="failed", error=info))

    def _record(
        self, identity: bytes, worker_id: str, room: int, status: str, error: ErrorInfo | None, seconds: float
    ) -> None:
        rec = {
            "room": room,
            "peer": worker_id,
            "status": status,
            "seconds": seconds,
            "error": None if error is None else error.model_dump(),
        }
        with self._lock:
            self.finished[(identity, room)] = rec
            while len(self.finished) > MAX_FINISHED:
                self.finished.popitem(last=False)

    def _on_abort(self, identity: bytes, msg: wire.Abort) -> None:
        job = self.jobs.get((identity, msg.room))
        if job is None:
            # Finished already (its TransferDone is on its way), or never got here (e.g. it was
            # answered Busy). Say so: the decode holds the room's pages until it hears the room
            # is over on this side, and a second TransferDone for a finished room is ignored.
            log.debug("abort for room %s that is not in flight", msg.room)
            err = ErrorInfo(
                type="TransferFailed", message=f"room {msg.room} is not in flight here (abort: {msg.reason[:200]})"
            )
            self.server.send(identity, wire.TransferDone(room=msg.room, status="failed", error=err))
            return
        self._cancel(job, f"aborted by decode: {msg.reason}")

    def _finish_job(self, out: JobOutcome) -> None:
        job = self.jobs.get((out.peer, out.room))
        if job is None:
            return
        if out.error is not None:
            self.stats.engine_error(out.engine_failed)
            self._fail(job, out.error.message, out.error)
            return
        if job.cancelled is not None:
            # The copy ran, but the request was given up meanwhile: the decode will not verify
            # it, so it must not count as a success here either.
            self._fail(job, job.cancelled.message, job.cancelled)
            return
        with self._lock:
            move(job, RequestState.SUCCESS)
            del self.jobs[(out.peer, out.room)]
        seconds = now() - job.started
        self.stats.success(job.plan.total_bytes, out.copy_s)
        self._record(job.peer, job.worker_id, job.room, "success", None, seconds)
        digest = job.digest or synth.plan_digest(job.room, job.alloc.lists, self.kv_args)
        with self._pools_lock:
            # The decode waits on this message, not on our pages: they are freed after it is on
            # its way. ``free_counts`` takes this lock, so whoever has seen the TransferDone
            # (the decode, a test, an operator) also sees the pages back.
            self.server.send(
                job.peer,
                wire.TransferDone(
                    room=job.room,
                    status="success",
                    bytes=job.plan.total_bytes,
                    descriptors=len(job.plan),
                    digest=digest,
                    compute_s=out.compute_s,
                    copy_s=out.copy_s,
                ),
            )
            rq.free(self.pools, job.alloc)

    def _cancel(self, job: Job, reason: str, error_type: str = "TransferFailed") -> None:
        """End ``job``. Still queued: it fails now (the transfer thread will skip it). Already
        TRANSFERRING: the transfer thread owns it until it reports back, so no byte can move
        after the decode was told the request failed; its fault delay, if any, ends at once."""
        with self._lock:
            if job.cancelled is not None:
                return
            job.cancelled = ErrorInfo(type=error_type, message=reason)
            queued = job.state == RequestState.WAITING_FOR_INPUT
        job.cancel_event.set()
        if queued:
            self._fail(job, job.cancelled)

    def _fail(self, job: Job, reason: str | ErrorInfo, error: ErrorInfo | None = None) -> None:
        """Terminal failure (called with the transfer thread's report, or at shutdown)."""
        if isinstance(reason, ErrorInfo):
            reason, error = reason.message, reason
        with self._lock:
            if job.state.terminal:
                return
            move(job, RequestState.FAILED)
            self.jobs.pop((job.peer, job.room), None)
        self._free(job.alloc)
        self.stats.fail(reason)
        info = error or ErrorInfo(type="TransferFailed", message=reason)
        self._record(job.peer, job.worker_id, job.room, "failed", info, now() - job.started)
        self.server.send(job.peer, wire.TransferDone(room=job.room, status="failed", error=info))

    def _timers(self) -> None:
        t = now()
        self._detach_engine_peers()
        self._peer_timers(t)
        with self._lock:  # the transfer thread moves a job to TRANSFERRING
            late = [j for j in self.jobs.values() if t > j.deadline and j.state != RequestState.TRANSFERRING]
        for job in late:
            self._cancel(job, "deadline exceeded before the transfer started")
