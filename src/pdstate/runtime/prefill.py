"""The prefill worker: serves any number of decode workers over one ROUTER socket.

Threads: the control thread owns the socket, the allocator and every request record; one transfer
thread (``runtime.transfer.TransferRunner``) runs the (synthesised) prefill compute and the engine
copy, and hands results back over an inproc socket. Every request that entered ends SUCCESS or
FAILED, its pages freed exactly once, and leaves a record in ``finished`` (bounded) with its
reason.

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
    PeerGone,
    ProtocolError,
    VersionMismatch,
)
from pdstate.protocol import wire
from pdstate.protocol.handshake import PrefillHandshake
from pdstate.protocol.lifecycle import PeerState, RequestState, advance
from pdstate.protocol.report import ErrorInfo
from pdstate.runtime import requests as rq
from pdstate.runtime import synth
from pdstate.runtime.common import Stats, WorkerBase, WorkerOptions, local_side, log, new_incarnation, now
from pdstate.runtime.control import ControlServer
from pdstate.runtime.records import Job, JobOutcome, Peer
from pdstate.runtime.transfer import TransferRunner
from pdstate.transfer.planner import PairPlanner

MAX_FINISHED = 10000  # terminal records kept for inspection (oldest dropped first)
MAX_IDLE_PEERS = 256  # rejected/gone peer records kept (accepted ones are always kept)


class PrefillWorker(WorkerBase):
    def __init__(self, opts: WorkerOptions) -> None:
        self.opts = opts
        self.worker_id = opts.worker_id or "prefill"
        self.incarnation = new_incarnation()
        self.stats = Stats()
        self.peers: dict[bytes, Peer] = {}
        self.jobs: dict[tuple[bytes, int], Job] = {}
        self.finished: OrderedDict[tuple[bytes, int], dict] = OrderedDict()
        self.peak_in_flight = 0  # most jobs held at once (bounded by ``max_inflight``)
        self.local_error: BaseException | None = None
        self.endpoint = ""
        # test knob (see ``WorkerOptions.fault_delay_before_copy_s``); a test may change it live
        self.fault_delay_before_copy_s = opts.fault_delay_before_copy_s
        self._stop = threading.Event()
        self._ready = threading.Event()
        # Makes "not cancelled? then TRANSFERRING" (transfer thread) and "cancel; still queued?"
        # (control thread) atomic, so a queued job can be failed at once, before its turn.
        self.claim = threading.Lock()
        self._detached: set[str] = set()  # engine peers of gone decodes, released when idle
        self.jobs_inline = 0  # jobs run on the control thread (see ``_inline``)
        self._freeing = threading.Lock()  # held from a success's TransferDone until its pages are free
        self._threads: list[threading.Thread] = []

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
            self._close_side()
            raise
        for target, name in (
            (self._control_loop, "pdstate-prefill-control"),
            (self.runner.thread_main, "pdstate-prefill-transfer"),
        ):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        self._ready.set()
        log.info("prefill %s listening on %s (engine %s)", self.worker_id, self.endpoint, self.opts.engine)
        return self

    def _build(self) -> None:
        self._open_side()
        # The prefill initiates every write: the decode never addresses it, so it publishes no regions.
        self.local = local_side(self.opts, self.worker_id, self.incarnation, self.report, self.kv_args, {})
        self.handshake = PrefillHandshake(self.local)
        self.ctx = zmq.Context.instance()
        self.server = ControlServer(self.ctx, self.opts.bind, self.opts.token)
        self.endpoint = self.server.open()
        self._results_addr = f"inproc://pdstate-prefill-results-{id(self)}-{self.incarnation}"  # unique: ids are reused
        self._results_pull = self.ctx.socket(zmq.PULL)
        self._results_pull.setsockopt(zmq.LINGER, 0)
        self._results_pull.bind(self._results_addr)
        self.runner = TransferRunner(self, self._results_addr)

    def _release(self) -> None:
        """Close the sockets ``_build`` got to (a failed start)."""
        pull = getattr(self, "_results_pull", None)
        if pull is not None:
            pull.close(0)
        server = getattr(self, "server", None)
        if server is not None:
            server.close()
        self.endpoint = ""

    def stop(self) -> None:
        self._stop.set()
        if getattr(self, "runner", None) is not None:
            self.runner.stop()
        for job in list(self.jobs.values()):  # wake a transfer thread waiting in a fault delay
            job.cancel_event.set()
        for t in self._threads:
            t.join(timeout=10)
        self._close_side()

    # -- status (read by the API) -------------------------------------------------------------
    def free_counts(self) -> dict[str, int]:
        with self._freeing:
            return super().free_counts()

    def peer_states(self) -> list[dict]:
        return [
            {
                "id": p.worker_id,
                "incarnation": p.incarnation,
                "state": p.state.value,
                "error": None if p.error is None else p.error.model_dump(),
            }
            for p in list(self.peers.values())
        ]

    def jobs_snapshot(self) -> list[dict]:
        """The requests in flight: room, decode worker id, lifecycle state, cancellation."""
        return [
            {
                "room": j.room,
                "peer": j.worker_id,
                "state": j.state.value,
                "cancelled": None if j.cancelled is None else j.cancelled.message,
            }
            for j in list(self.jobs.values())
        ]

    def finished_records(self) -> list[dict]:
        """Terminal records, oldest first (at most ``MAX_FINISHED``)."""
        return list(self.finished.values())

    # -- control thread -----------------------------------------------------------------------
    def _control_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.server.sock, zmq.POLLIN)
        poller.register(self._results_pull, zmq.POLLIN)
        interval_ms = max(10, int(self.opts.heartbeat_interval_s * 1000 / 4))
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(interval_ms))
                if self._results_pull in events:
                    while True:
                        try:
                            key = self._results_pull.recv_pyobj(flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._guarded(self._finish_job, key)
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
            for job in list(self.jobs.values()):
                self._cancel(job, "prefill shutting down")
                self._fail(job, job.cancelled)
            self.server.close()
            self._results_pull.close(0)

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
            self.stats.protocol_errors += 1
            if isinstance(exc, VersionMismatch) and wire.envelope_kind(frame) == wire.Register.KIND:
                # A decode speaking another protocol version: refuse its handshake (PROTOCOL.md),
                # naming both versions, so it raises VersionMismatch and stays down, not ready.
                self.stats.handshakes["rejected"] += 1
                log.error("rejected a register from %r: %s", identity[:64], exc)
                self.server.send(identity, wire.Reject(worker_id=self.worker_id, error=ErrorInfo.of(exc)))
                return
            log.warning("bad frame from %r: %s", identity[:64], exc)
            self.server.send(identity, wire.Error(error=ErrorInfo.of(exc)))
            return
        peer = self.peers.get(identity)
        if peer is not None:
            peer.last_seen = now()
        handler = {
            wire.Register: self._on_register,
            wire.Heartbeat: self._on_heartbeat,
            wire.TransferRequest: self._on_request,
            wire.Abort: self._on_abort,
            wire.Reject: self._on_peer_reject,
        }.get(type(msg))
        if handler is None:
            err = ProtocolError(f"a prefill worker does not accept {msg.KIND} messages")
            self.server.send(identity, wire.Error(error=ErrorInfo.of(err)))
            return
        try:
            handler(identity, msg)
        except Exception as exc:  # a frame that slipped past validation must not kill the loop
            self.stats.protocol_errors += 1
            log.exception("could not handle %s from %r", msg.KIND, identity[:64])
            room = getattr(msg, "room", None)
            err = ProtocolError(f"could not handle {msg.KIND}: {type(exc).__name__}: {exc}")
            self.server.send(identity, wire.Error(error=ErrorInfo.of(err), room=room))

    def _on_bad_multipart(self, parts: list[bytes]) -> None:
        """A DEALER sent a multipart message: one frame per message is the protocol."""
        self.stats.protocol_errors += 1
        log.warning("bad message from %r: %d frames, expected 1", parts[0][:64] if parts else b"", len(parts) - 1)
        if len(parts) >= 1:
            err = ProtocolError(f"expected one frame per message, got {len(parts) - 1}")
            self.server.send(parts[0], wire.Error(error=ErrorInfo.of(err)))

    def _on_register(self, identity: bytes, msg: wire.Register) -> None:
        for other in [p for p in self.peers.values() if p.worker_id == msg.worker_id and p.identity != identity]:
            self._drop_peer(other, f"decode {msg.worker_id} re-registered with incarnation {msg.incarnation}")
            del self.peers[other.identity]
        # The same incarnation registering again (it declared us gone, or was asked to) has
        # forgotten what it sent before: end those requests now rather than copy into its pages.
        for (ident, _), job in list(self.jobs.items()):
            if ident == identity:
                self._cancel(job, f"decode {msg.worker_id} registered again; its earlier requests were abandoned")
        answer = self.handshake.receive(msg)
        peer = Peer(identity, msg.worker_id, msg.incarnation, PeerState.PENDING, last_seen=now())
        if isinstance(answer, wire.Accept):
            try:
                peer.engine_peer = self.engine.connect(msg.engine.endpoint)
            except PdStateError as exc:
                answer = wire.Reject(worker_id=self.worker_id, error=ErrorInfo.of(exc))
        if isinstance(answer, wire.Accept):
            peer.state, peer.planner = PeerState.ACCEPTED, PairPlanner(self.kv_args, msg.kv)
            self.stats.handshakes["accepted"] += 1
            log.info("accepted decode %s (%s)", msg.worker_id, msg.incarnation)
        else:
            peer.state, peer.error = PeerState.REJECTED, answer.error
            self.stats.handshakes["rejected"] += 1
            log.error("rejected decode %s: %s: %s", msg.worker_id, answer.error.type, answer.error.message)
        old = self.peers.get(identity)
        if old is not None and old.incarnation != msg.incarnation:
            self._drop_peer(old, "decode re-registered")
        self.peers.pop(identity, None)
        self.peers[identity] = peer  # (re)inserted last: the pruning below drops the oldest
        self._prune_peers()
        self.server.send(identity, answer)

    def _prune_peers(self) -> None:
        """Keep every accepted peer and the latest ``MAX_IDLE_PEERS`` others (rejected, gone):
        a stream of bad registrations must not grow the table without bound."""
        idle = [ident for ident, p in self.peers.items() if p.state != PeerState.ACCEPTED]
        for ident in idle[: max(0, len(idle) - MAX_IDLE_PEERS)]:
            if not any(k[0] == ident for k in self.jobs):
                del self.peers[ident]

    def _on_peer_reject(self, identity: bytes, msg: wire.Reject) -> None:
        """The decode refused our own report (e.g. this prefill's draft has its own mapping)."""
        peer = self.peers.get(identity)
        if peer is not None:
            peer.state, peer.error = PeerState.REJECTED, msg.error
            self.stats.handshakes["accepted"] -= 1
            self.stats.handshakes["rejected"] += 1
            log.error("decode %s refused this prefill: %s: %s", peer.worker_id, msg.error.type, msg.error.message)

    def _on_heartbeat(self, identity: bytes, msg: wire.Heartbeat) -> None:
        peer = self.peers.get(identity)
        if peer is None or peer.state != PeerState.ACCEPTED or peer.incarnation != msg.incarnation:
            err = NotRegistered()
            self.server.send(identity, wire.Error(error=ErrorInfo.of(err)))
            return
        self.server.send(identity, wire.Heartbeat(worker_id=self.worker_id, incarnation=self.incarnation, seq=msg.seq))

    def _on_request(self, identity: bytes, msg: wire.TransferRequest) -> None:
        peer = self.peers.get(identity)
        if peer is None or peer.state != PeerState.ACCEPTED:
            err = NotRegistered()
            self.server.send(identity, wire.Error(error=ErrorInfo.of(err), room=msg.room))
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
        names = rq.channel_names(self.kv_args)
        if msg.seq_len > rq.capacity_tokens(self.pools):
            self._refuse(
                identity,
                peer,
                msg.room,
                AllocationError(
                    f"seq_len {msg.seq_len} exceeds the prefill pool of {rq.capacity_tokens(self.pools)} tokens"
                ),
            )
            return
        try:
            alloc = rq.allocate(self.pools, names, msg.seq_len)
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
            rq.free(self.pools, alloc)
            self._refuse(identity, peer, msg.room, exc)
            return
        job = Job(
            identity,
            msg.room,
            msg.seq_len,
            alloc,
            plan,
            now() + msg.deadline_s,
            worker_id=peer.worker_id,
            engine_peer=peer.engine_peer,
        )
        job.state = advance(job.state, RequestState.WAITING_FOR_INPUT)
        self.jobs[key] = job
        self.peak_in_flight = max(self.peak_in_flight, len(self.jobs))
        if self._inline(plan.total_bytes):
            # Nothing is queued or copying, so running it here keeps the one-copy-at-a-time order
            # (only this thread hands out jobs); the engine cannot block on a peer.
            self.jobs_inline += 1
            self._finish_job(self.runner.run(job))
            return
        self.runner.submit(job)

    def _inline(self, nbytes: int) -> bool:
        if not (
            self.engine.synchronous and nbytes <= self.opts.inline_max_bytes and self.fault_delay_before_copy_s <= 0
        ):
            return False
        return self.runner.idle()

    def _busy(self, identity: bytes, room: int) -> None:
        """Full (in-flight limit or pool): the decode retries later; nothing is queued here."""
        self.stats.transfers["busy"] += 1
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
        self.finished[(identity, room)] = {
            "room": room,
            "peer": worker_id,
            "status": status,
            "seconds": seconds,
            "error": None if error is None else error.model_dump(),
        }
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
            self.stats.engine_errors += out.engine_failed
            self._fail(job, out.error.message, out.error)
            return
        if job.cancelled is not None:
            # The copy ran, but the request was given up meanwhile: the decode will not verify
            # it, so it must not count as a success here either.
            self._fail(job, job.cancelled.message, job.cancelled)
            return
        job.state = advance(job.state, RequestState.SUCCESS)
        seconds = now() - job.started
        self.stats.transfers["success"] += 1
        self.stats.bytes += job.plan.total_bytes
        self.stats.latencies_s.append(out.copy_s)
        del self.jobs[(out.peer, out.room)]
        self._record(job.peer, job.worker_id, job.room, "success", None, seconds)
        digest = synth.plan_digest(job.room, job.alloc.lists, self.kv_args)
        with self._freeing:
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
        with self.claim:
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
        if job.state.terminal:
            return
        job.state = RequestState.FAILED
        self.jobs.pop((job.peer, job.room), None)
        rq.free(self.pools, job.alloc)
        self.stats.fail(reason)
        info = error or ErrorInfo(type="TransferFailed", message=reason)
        self._record(job.peer, job.worker_id, job.room, "failed", info, now() - job.started)
        self.server.send(job.peer, wire.TransferDone(room=job.room, status="failed", error=info))

    def _drop_peer(self, peer: Peer, reason: str) -> None:
        peer.state = PeerState.GONE
        if peer.engine_peer is not None:
            self._detached.add(peer.engine_peer)
        for (ident, _), job in list(self.jobs.items()):
            if ident == peer.identity:
                self._cancel(job, f"peer gone: {reason}", PeerGone.__name__)

    def _detach_engine_peers(self) -> None:
        """Release the engine state (shm mappings, remote agents) of gone peers once no job can
        still use it and no accepted peer reconnected to the same engine."""
        if not self._detached:
            return
        in_use = {p.engine_peer for p in self.peers.values() if p.state == PeerState.ACCEPTED}
        busy = {job.engine_peer for job in self.jobs.values()}
        for eid in list(self._detached):
            if eid in in_use:
                self._detached.discard(eid)  # the same decode engine came back: keep it
            elif eid not in busy:
                self._detached.discard(eid)
                try:
                    self.engine.disconnect(eid)
                except Exception:
                    log.warning("releasing engine peer %s failed", eid, exc_info=True)

    def _timers(self) -> None:
        t = now()
        self._detach_engine_peers()
        for peer in list(self.peers.values()):
            if peer.state == PeerState.ACCEPTED and t - peer.last_seen > self.opts.peer_timeout_s:
                log.warning("decode %s gone: no message for %.1f s", peer.worker_id, t - peer.last_seen)
                self._drop_peer(peer, f"no heartbeat for {self.opts.peer_timeout_s:.1f} s")
        for job in list(self.jobs.values()):
            if t > job.deadline and job.state != RequestState.TRANSFERRING:
                self._cancel(job, "deadline exceeded before the transfer started")
