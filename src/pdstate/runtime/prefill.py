"""The prefill worker: serves any number of decode workers over one ROUTER socket.

Threads: the control thread owns the socket, the allocator and every request record; one transfer
thread runs the (synthesised) prefill compute and the engine copy, and hands results back over an
inproc socket. Every request that entered ends SUCCESS or FAILED, its pages freed exactly once.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

import numpy as np
import zmq

from pdstate import wire
from pdstate.engines.base import create_engine
from pdstate.errors import AllocationError, AuthError, PdStateError, ProtocolError
from pdstate.handshake import PeerState, PrefillHandshake, RequestState, advance
from pdstate.layout import ErrorInfo
from pdstate.planner import TransferPlan, plan_request
from pdstate.runtime import requests as rq
from pdstate.runtime import synth
from pdstate.runtime.common import LocalCheckFailed, Stats, WorkerOptions, build_side, local_side, log, new_incarnation, now
from pdstate.runtime.control import ControlServer


@dataclass
class Peer:
    identity: bytes
    worker_id: str
    incarnation: str
    state: PeerState
    error: ErrorInfo | None = None
    kv: wire.KVDesc | None = None
    engine_peer: str | None = None
    last_seen: float = 0.0


@dataclass
class Job:
    peer: bytes
    room: int
    seq_len: int
    alloc: rq.Allocation
    plan: TransferPlan
    deadline: float
    state: RequestState = RequestState.BOOTSTRAPPING
    cancelled: str | None = None  # the reason, once cancelled
    started: float = field(default_factory=now)


class PrefillWorker:
    def __init__(self, opts: WorkerOptions) -> None:
        self.opts = opts
        self.worker_id = opts.worker_id or "prefill"
        self.incarnation = new_incarnation()
        self.stats = Stats()
        self.peers: dict[bytes, Peer] = {}
        self.jobs: dict[tuple[bytes, int], Job] = {}
        self.local_error: BaseException | None = None
        self.endpoint = ""
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._threads: list[threading.Thread] = []

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> "PrefillWorker":
        self.pools, self.report, self.kv_args, self.local_error = build_side(self.opts)
        if self.local_error is not None and self.opts.local_checks:
            raise LocalCheckFailed(str(self.local_error)) from self.local_error
        self.engine = create_engine(self.opts.engine, **self.opts.engine_options)
        self.engine.start()
        self.engine.register(self.pools.memory.regions())
        # The prefill initiates every write: the decode never addresses it, so it publishes no regions.
        self.local = local_side(self.opts, self.worker_id, self.incarnation, self.report, self.kv_args, {})
        self.handshake = PrefillHandshake(self.local)
        self.ctx = zmq.Context.instance()
        self.server = ControlServer(self.ctx, self.opts.bind, self.opts.token)
        self.endpoint = self.server.open()
        self._results_addr = f"inproc://pdstate-prefill-results-{id(self)}-{self.incarnation}"  # unique: ids are reused
        self._results_pull = self.ctx.socket(zmq.PULL)
        self._results_pull.bind(self._results_addr)
        for target, name in ((self._control_loop, "pdstate-prefill-control"), (self._transfer_loop, "pdstate-prefill-transfer")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        self._ready.set()
        log.info("prefill %s listening on %s (engine %s)", self.worker_id, self.endpoint, self.opts.engine)
        return self

    def stop(self) -> None:
        self._stop.set()
        self._queue.put(None)
        for t in self._threads:
            t.join(timeout=10)
        try:
            self.engine.close()
        finally:
            self.pools.close()

    def __enter__(self) -> "PrefillWorker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- status (read by the API) -------------------------------------------------------------
    def peer_states(self) -> list[dict]:
        return [
            {"id": p.worker_id, "incarnation": p.incarnation, "state": p.state.value,
             "error": None if p.error is None else p.error.model_dump()}
            for p in list(self.peers.values())
        ]

    def free_counts(self) -> dict[str, int]:
        return rq.free_counts(self.pools)

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
                        self._finish_job(*key)
                if self.server.sock in events:
                    for _ in range(256):
                        try:
                            got = self.server.sock.recv_multipart(flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if len(got) == 2:
                            self._on_frame(got[0], got[1])
                        else:
                            self._on_bad_multipart(got)
                self._timers()
        finally:
            for job in list(self.jobs.values()):
                job.cancelled = "prefill shutting down"
                self._fail(job, "prefill shutting down")
            self.server.close()
            self._results_pull.close(0)

    def _on_frame(self, identity: bytes, frame: bytes) -> None:
        try:
            msg = wire.decode(frame, self.opts.token)
        except (ProtocolError, AuthError) as exc:
            self.stats.protocol_errors += 1
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
        answer = self.handshake.receive(msg)
        peer = Peer(identity, msg.worker_id, msg.incarnation, PeerState.PENDING, last_seen=now())
        if isinstance(answer, wire.Accept):
            try:
                peer.engine_peer = self.engine.connect(msg.engine.endpoint)
            except PdStateError as exc:
                answer = wire.Reject(worker_id=self.worker_id, error=ErrorInfo.of(exc))
        if isinstance(answer, wire.Accept):
            peer.state, peer.kv = PeerState.ACCEPTED, msg.kv
            self.stats.handshakes["accepted"] += 1
            log.info("accepted decode %s (%s)", msg.worker_id, msg.incarnation)
        else:
            peer.state, peer.error = PeerState.REJECTED, answer.error
            self.stats.handshakes["rejected"] += 1
            log.error("rejected decode %s: %s: %s", msg.worker_id, answer.error.type, answer.error.message)
        old = self.peers.get(identity)
        if old is not None and old.incarnation != msg.incarnation:
            self._drop_peer(old, "decode re-registered")
        self.peers[identity] = peer
        self.server.send(identity, answer)

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
            err = ProtocolError("not registered: send a register message first")
            self.server.send(identity, wire.Error(error=ErrorInfo.of(err)))
            return
        self.server.send(identity, wire.Heartbeat(worker_id=self.worker_id, incarnation=self.incarnation, seq=msg.seq))

    def _on_request(self, identity: bytes, msg: wire.TransferRequest) -> None:
        peer = self.peers.get(identity)
        if peer is None or peer.state != PeerState.ACCEPTED:
            err = ProtocolError("not registered: send a register message first")
            self.server.send(identity, wire.Error(error=ErrorInfo.of(err), room=msg.room))
            return
        key = (identity, msg.room)
        if key in self.jobs:
            self.server.send(identity, wire.Error(error=ErrorInfo.of(ProtocolError(f"room {msg.room} is already in flight")), room=msg.room))
            return
        if len(self.jobs) >= self.opts.max_inflight:
            self.stats.transfers["busy"] += 1
            self.server.send(identity, wire.Busy(room=msg.room, in_flight=len(self.jobs), limit=self.opts.max_inflight))
            return
        names = rq.channel_names(self.kv_args)
        if msg.seq_len > rq.capacity_tokens(self.pools):
            self._refuse(identity, msg.room, AllocationError(f"seq_len {msg.seq_len} exceeds the prefill pool of {rq.capacity_tokens(self.pools)} tokens"))
            return
        try:
            alloc = rq.allocate(self.pools, names, msg.seq_len)
        except AllocationError:
            self.stats.transfers["busy"] += 1
            self.server.send(identity, wire.Busy(room=msg.room, in_flight=len(self.jobs), limit=self.opts.max_inflight))
            return
        except PdStateError as exc:
            self._refuse(identity, msg.room, exc)
            return
        try:
            dst_lists = [msg.dst_kv_pages.unpack()] + [p.unpack() for p in msg.dst_state_indices]
            plan = plan_request(self.kv_args, peer.kv, alloc.lists, dst_lists)
        except PdStateError as exc:
            rq.free(self.pools, alloc)
            self._refuse(identity, msg.room, exc)
            return
        job = Job(identity, msg.room, msg.seq_len, alloc, plan, now() + msg.deadline_s)
        job.state = advance(job.state, RequestState.WAITING_FOR_INPUT)
        self.jobs[key] = job
        self._queue.put(job)

    def _refuse(self, identity: bytes, room: int, exc: BaseException) -> None:
        self.stats.fail(str(exc))
        self.server.send(identity, wire.TransferDone(room=room, status="failed", error=ErrorInfo.of(exc)))

    def _on_abort(self, identity: bytes, msg: wire.Abort) -> None:
        job = self.jobs.get((identity, msg.room))
        if job is None:
            log.debug("abort for unknown room %s ignored", msg.room)
            return
        self._cancel(job, f"aborted by decode: {msg.reason}")

    def _finish_job(self, identity: bytes, room: int, error: ErrorInfo | None, seconds: float) -> None:
        job = self.jobs.get((identity, room))
        if job is None:
            return
        if error is not None:
            self.stats.engine_errors += error.type.startswith("Engine")
            self._fail(job, error.message, error)
            return
        job.state = advance(job.state, RequestState.SUCCESS)
        self.stats.transfers["success"] += 1
        self.stats.bytes += job.plan.total_bytes
        self.stats.latencies_s.append(seconds)
        del self.jobs[(identity, room)]
        rq.free(self.pools, job.alloc)
        digest = synth.plan_digest(room, job.alloc.lists, self.kv_args)
        self.server.send(identity, wire.TransferDone(
            room=room, status="success", bytes=job.plan.total_bytes, descriptors=len(job.plan), digest=digest))

    def _cancel(self, job: Job, reason: str) -> None:
        """Ask the transfer thread to end ``job``: it owns every queued job until it reports back,
        so no byte can move after the decode was told the request failed."""
        if job.cancelled is None:
            job.cancelled = reason

    def _fail(self, job: Job, reason: str, error: ErrorInfo | None = None) -> None:
        """Terminal failure (called with the transfer thread's report, or at shutdown)."""
        if job.state.terminal:
            return
        job.state = RequestState.FAILED
        self.jobs.pop((job.peer, job.room), None)
        rq.free(self.pools, job.alloc)
        self.stats.fail(reason)
        info = error or ErrorInfo(type="TransferFailed", message=reason)
        self.server.send(job.peer, wire.TransferDone(room=job.room, status="failed", error=info))

    def _drop_peer(self, peer: Peer, reason: str) -> None:
        peer.state = PeerState.GONE
        for (ident, _), job in list(self.jobs.items()):
            if ident == peer.identity:
                self._cancel(job, f"peer gone: {reason}")

    def _timers(self) -> None:
        t = now()
        for peer in list(self.peers.values()):
            if peer.state == PeerState.ACCEPTED and t - peer.last_seen > self.opts.peer_timeout_s:
                log.warning("decode %s gone: no message for %.1f s", peer.worker_id, t - peer.last_seen)
                self._drop_peer(peer, f"no heartbeat for {self.opts.peer_timeout_s:.1f} s")
        for job in list(self.jobs.values()):
            if t > job.deadline and job.state != RequestState.TRANSFERRING:
                self._cancel(job, "deadline exceeded before the transfer started")

    # -- transfer thread ----------------------------------------------------------------------
    def _transfer_loop(self) -> None:
        push = self.ctx.socket(zmq.PUSH)
        push.connect(self._results_addr)
        try:
            while True:
                job = self._queue.get()
                if job is None or self._stop.is_set():
                    return
                error, t0 = None, now()
                if job.cancelled is not None:
                    error = ErrorInfo(type="TransferFailed", message=job.cancelled)
                else:
                    try:
                        job.state = advance(job.state, RequestState.TRANSFERRING)
                        synth.fill_source(self.kv_args, job.room, job.alloc.lists)
                        peer = self.peers.get(job.peer)
                        if peer is None or peer.engine_peer is None:
                            raise PdStateError("peer gone before the transfer started")
                        handle = self.engine.submit(peer.engine_peer, job.plan)
                        self.engine.wait(handle, max(0.001, job.deadline - now()))
                    except Exception as exc:  # engine failures of every kind end the request
                        error = ErrorInfo.of(exc)
                push.send_pyobj((job.peer, job.room, error, now() - t0))
        finally:
            push.close(0)
