"""The decode worker: registers with one prefill, then asks it for requests' state.

The control thread owns the DEALER socket, the allocator and every request record. Other threads
call ``submit``/``transfer``; commands reach the control thread through a queue and an inproc
wake-up socket. A request is marked SUCCESS only after ``TransferDone`` arrived *and* the bytes
that landed verified against the room's deterministic content.

Pages of a request that failed while the prefill may still be writing into them (deadline, abort)
are quarantined until the prefill reports the room finished or is declared gone, so a late write
can never land in another request's pages. ("Gone" may be a frozen prefill that comes back: the
pages are reused only after a new handshake, and the prefill copies every request sent after that
handshake after every request sent before it; see ``runtime.prefill``.)
"""

from __future__ import annotations

import os
import queue
import secrets
import threading
from collections import deque
from concurrent.futures import Future

import zmq

from pdstate.errors import (
    AllocationError,
    AuthError,
    NotRegistered,
    PdStateError,
    ProtocolError,
    VersionMismatch,
    error_from_wire,
)
from pdstate.protocol import wire
from pdstate.protocol.handshake import DecodeHandshake
from pdstate.protocol.lifecycle import PeerState, RequestState, advance
from pdstate.protocol.report import ErrorInfo
from pdstate.runtime import requests as rq
from pdstate.runtime import synth
from pdstate.runtime.common import Stats, WorkerBase, WorkerOptions, local_side, log, new_incarnation, now, settle
from pdstate.runtime.control import ControlClient
from pdstate.runtime.records import Request, TransferResult

MAX_FINISHED = 10000  # results kept for ``/v1/transfers/{room}`` (oldest dropped first)
BUSY_BACKOFF_S = (0.002, 0.1)  # first and longest wait before re-sending a request answered Busy


class DecodeWorker(WorkerBase):
    def __init__(self, opts: WorkerOptions) -> None:
        self.opts = opts
        self.worker_id = opts.worker_id or f"decode-{secrets.token_hex(3)}"
        self.incarnation = new_incarnation()
        self.stats = Stats()
        self.requests: dict[int, Request] = {}
        self.finished: dict[int, TransferResult] = {}
        self.quarantine: dict[int, rq.Allocation] = {}
        self.peak_in_flight = 0  # most requests entered and not finished at once
        self.peer_state = PeerState.PENDING
        self.peer_error: ErrorInfo | None = None
        self.prefill_incarnation: str | None = None
        self.handshake_s: float | None = None
        self.local_error: BaseException | None = None
        self._accepted = threading.Event()
        self._answered = threading.Event()
        self._stop = threading.Event()
        self._commands: queue.Queue = queue.Queue()
        self._waiting: deque[Request] = deque()
        self._thread: threading.Thread | None = None
        self._wake_lock = threading.Lock()
        self._wake_r = self._wake_w = -1

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> DecodeWorker:
        """Build pools (sweeping stale shm segments first), engine and control client, then start
        the control thread (which sends the register).

        Raises ``LocalCheckFailed`` (own pair refused, with ``local_checks``) or ``EngineError``;
        whatever was built before the failure is released first (no segment outlives it).
        """
        try:
            self._open_side()
            endpoint = self.engine.endpoint()
        except BaseException:
            self._close_side()
            raise
        self.local = local_side(self.opts, self.worker_id, self.incarnation, self.report, self.kv_args, endpoint)
        self.handshake = DecodeHandshake(self.local)
        self.ctx = zmq.Context.instance()
        self.client = ControlClient(
            self.ctx, self.opts.peer, f"{self.worker_id}/{self.incarnation}".encode(), self.opts.token
        )
        # Wake-ups from other threads: a non-blocking pipe the control thread polls. (A fresh
        # inproc PUSH socket per wake-up raced with the loop closing its end at stop(), raising
        # zmq.Again, and churned through the context's socket limit under many submits.)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._control_loop, name="pdstate-decode-control", daemon=True)
        self._thread.start()
        return self

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Block until the handshake is answered; raises the refusal, or ``TimeoutError``."""
        if not self._answered.wait(timeout_s):
            raise TimeoutError(f"no handshake answer from {self.opts.peer} within {timeout_s:.1f} s")
        if self.peer_state != PeerState.ACCEPTED:
            raise error_from_wire(self.peer_error.type, self.peer_error.message)

    def stop(self) -> None:
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=10)
            with self._wake_lock:
                os.close(self._wake_w)
                self._wake_w = -1
        self._close_side()

    @property
    def ready(self) -> bool:
        return self.peer_state == PeerState.ACCEPTED

    # -- API for other threads ----------------------------------------------------------------
    def submit(
        self, seq_len: int, room: int | None = None, deadline_s: float | None = None, verify: str | None = None
    ) -> Future:
        """Ask for one request's state; ``verify`` ("full" | "sample") overrides ``opts.verify``."""
        if verify not in (None, "full", "sample"):
            raise ValueError(f"verify must be 'full' or 'sample', not {verify!r}")
        if seq_len < 0:
            raise ValueError(f"seq_len must not be negative, got {seq_len} (0: an empty transfer)")
        fut: Future = Future()
        room = room if room is not None else secrets.randbits(63)
        self._commands.put(
            ("submit", room, seq_len, deadline_s or self.opts.request_deadline_s, fut, verify or self.opts.verify)
        )
        self._wake()
        return fut

    def transfer(self, seq_len: int, room: int | None = None, deadline_s: float | None = None) -> TransferResult:
        d = deadline_s or self.opts.request_deadline_s
        return self.submit(seq_len, room, d).result(timeout=d + self.opts.peer_timeout_s + 5)

    def reregister(self) -> None:
        self._commands.put(("reregister",))
        self._wake()

    def rehandshake(self, timeout_s: float = 30.0) -> float:
        """Register again and wait for the answer; returns the handshake's seconds (or raises the
        refusal). Used by operators after fixing a prefill, and by the benchmark."""
        self._answered.clear()
        self.reregister()
        self.wait_ready(timeout_s)
        return self.handshake_s

    def snapshot(self) -> dict:
        """Peer state and request bookkeeping, for status commands (read from any thread)."""
        return {
            "peer_state": self.peer_state.value,
            "prefill_incarnation": self.prefill_incarnation,
            "in_flight": len(self.requests),
            "waiting": len(self._waiting),
            "quarantined": len(self.quarantine),
            "peak_in_flight": self.peak_in_flight,
        }

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_w < 0:
                return  # stopped
            try:
                os.write(self._wake_w, b"\0")
            except (BlockingIOError, BrokenPipeError):
                pass  # a wake-up is already pending (pipe full), or the loop has ended

    # -- control thread -----------------------------------------------------------------------
    def _control_loop(self) -> None:
        self.client.open()
        poller = zmq.Poller()
        poller.register(self.client.sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        self._send_register()
        next_hb = now() + self.opts.heartbeat_interval_s
        self._last_heard = now()
        tick_ms = max(5, int(self.opts.heartbeat_interval_s * 1000 / 4))
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(tick_ms))
                if self._wake_r in events:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                while True:
                    try:
                        cmd = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    self._guarded(self._on_command, cmd)
                if self.client.sock in events:
                    for _ in range(256):
                        try:
                            frame = self.client.sock.recv(flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._guarded(self._on_frame, frame)
                t = now()
                if t >= next_hb:
                    next_hb = t + self.opts.heartbeat_interval_s
                    self._guarded(self._heartbeat, t)
                self._guarded(self._timers, t)
        finally:
            for req in list(self.requests.values()):
                self._finish(req, "failed", error=ErrorInfo(type="TransferFailed", message="decode shutting down"))
            self.client.close()
            os.close(self._wake_r)

    def _guarded(self, handler, arg) -> None:
        """Run one handler; a bug in it is logged and counted, and never ends the control loop
        (which would leave every request of this decode waiting forever)."""
        try:
            handler(arg)
        except Exception:
            self.stats.protocol_errors += 1
            log.exception("decode control loop: %s failed", handler.__name__)

    def _send_register(self) -> None:
        self._register_sent = now()
        self.client.send(self.handshake.register_message())

    def _heartbeat(self, t: float) -> None:
        if self.peer_state == PeerState.ACCEPTED:
            self.client.send(wire.Heartbeat(worker_id=self.worker_id, incarnation=self.incarnation, seq=int(t * 1000)))
            if t - self._last_heard > self.opts.peer_timeout_s:
                self._peer_gone(f"prefill gone: no heartbeat for {self.opts.peer_timeout_s:.1f} s")
        elif self.peer_state in (PeerState.PENDING, PeerState.GONE):
            self._send_register()  # (re)register until answered; a rejected decode waits to be asked

    def _peer_gone(self, reason: str) -> None:
        log.warning("%s", reason)
        self.peer_state = PeerState.GONE
        self._accepted.clear()
        for alloc in self.quarantine.values():  # the old prefill can no longer write into them
            rq.free(self.pools, alloc)
        self.quarantine.clear()
        for req in list(self.requests.values()):
            self._finish(req, "failed", error=ErrorInfo(type="PeerGone", message=reason))

    def _on_command(self, cmd) -> None:
        if cmd[0] == "reregister":
            self.peer_state = PeerState.PENDING
            self._send_register()
            return
        _, room, seq_len, deadline_s, fut, verify = cmd
        if room in self.requests:
            settle(fut, exc=ValueError(f"room {room} is already in flight"))
            return
        req = Request(room, seq_len, fut, now() + deadline_s, verify=verify)
        self.requests[room] = req
        self.peak_in_flight = max(self.peak_in_flight, len(self.requests))
        if self.peer_state != PeerState.ACCEPTED:
            reason = (
                "prefill not connected" if self.peer_error is None else f"handshake refused: {self.peer_error.message}"
            )
            self._finish(req, "failed", error=ErrorInfo(type="PeerGone", message=reason))
            return
        if seq_len > rq.capacity_tokens(self.pools):
            err = AllocationError(
                f"seq_len {seq_len} exceeds the decode pool of {rq.capacity_tokens(self.pools)} tokens"
            )
            self._finish(req, "failed", error=ErrorInfo.of(err))
            return
        self._waiting.append(req)
        self._admit()

    def _admit(self) -> None:
        """Allocate waiting requests in arrival order while the pools have room, and send them."""
        while self._waiting:
            req = self._waiting[0]
            if req.state.terminal:
                self._waiting.popleft()
                continue
            try:
                req.alloc = rq.allocate(self.pools, rq.channel_names(self.kv_args), req.seq_len)
            except AllocationError:
                return  # wait for a finished request to free pages (or for the deadline)
            except PdStateError as exc:
                self._waiting.popleft()
                self._finish(req, "failed", error=ErrorInfo.of(exc))
                continue
            self._waiting.popleft()
            req.message = wire.TransferRequest(
                room=req.room,
                seq_len=req.seq_len,
                dst_kv_pages=wire.PackedIndices.pack(req.alloc.lists[0]),
                dst_state_indices=[wire.PackedIndices.pack(x) for x in req.alloc.lists[1:]],
                deadline_s=max(0.001, req.deadline - now()),
            )
            req.state = advance(req.state, RequestState.WAITING_FOR_INPUT)
            req.sent_at = now()
            self.client.send(req.message)

    def _on_frame(self, frame: bytes) -> None:
        try:
            msg = wire.decode(frame, self.opts.token)
        except (ProtocolError, AuthError) as exc:
            self.stats.protocol_errors += 1
            log.warning("bad frame from prefill: %s", exc)
            if isinstance(exc, (AuthError, VersionMismatch)) and self.peer_state == PeerState.PENDING:
                # The answer to our register cannot be authenticated (the tokens differ, or one
                # side has none) or is in another protocol version. Waiting longer cannot help;
                # refuse like a Reject would.
                self._refused(ErrorInfo.of(exc))
            return
        self._last_heard = now()
        if isinstance(msg, (wire.Accept, wire.Reject)):
            self._on_handshake(msg)
        elif isinstance(msg, wire.Heartbeat):
            if self.prefill_incarnation is not None and msg.incarnation != self.prefill_incarnation:
                self._peer_gone(f"prefill restarted (incarnation {self.prefill_incarnation} -> {msg.incarnation})")
                self._send_register()
        elif isinstance(msg, wire.TransferDone):
            self._on_done(msg)
        elif isinstance(msg, wire.Busy):
            req = self.requests.get(msg.room)
            if req is not None and req.resend_at is None:
                # exponential backoff: a full prefill is not hammered by every waiting request
                self.stats.transfers["busy"] += 1
                first, longest = BUSY_BACKOFF_S
                req.resend_at = now() + min(longest, first * (2 ** min(req.busy_count, 16)))
                req.busy_count += 1
        elif isinstance(msg, wire.Error):
            if msg.room is not None and msg.room in self.requests:
                self._finish(self.requests[msg.room], "failed", error=msg.error)
            elif msg.error.type == NotRegistered.__name__:
                if self.peer_state == PeerState.ACCEPTED:
                    self._peer_gone("prefill forgot this decode (restarted or timed it out)")
                self._send_register()
            elif self.peer_state == PeerState.PENDING:
                # Only a register is outstanding: the prefill could not take it (auth, version,
                # malformed) and answered with an error instead of accept/reject.
                self._refused(msg.error)
            else:
                log.warning("prefill reported: %s: %s", msg.error.type, msg.error.message)

    def _refused(self, error: ErrorInfo) -> None:
        self.peer_state, self.peer_error = PeerState.REJECTED, error
        self.stats.handshakes["rejected"] += 1
        log.error("handshake refused: %s: %s", error.type, error.message)
        self._answered.set()

    def _on_handshake(self, msg) -> None:
        try:
            accept = self.handshake.receive(msg)
        except Exception as exc:  # any refusal: upstream RuntimeErrors, VersionMismatch, EngineError, ...
            self.peer_state, self.peer_error = PeerState.REJECTED, ErrorInfo.of(exc)
            self.stats.handshakes["rejected"] += 1
            log.error("handshake refused: %s: %s", type(exc).__name__, exc)
            if isinstance(msg, wire.Accept):  # we refuse the prefill: it records the same error
                self.client.send(wire.Reject(worker_id=self.worker_id, error=self.peer_error))
            self._answered.set()
            return
        self.peer_state, self.peer_error = PeerState.ACCEPTED, None
        self.prefill_incarnation = accept.incarnation
        self.handshake_s = now() - self._register_sent
        self.stats.handshakes["accepted"] += 1
        self._accepted.set()
        self._answered.set()
        log.info("accepted by prefill %s in %.2f ms", accept.worker_id, self.handshake_s * 1e3)

    def _on_done(self, msg: wire.TransferDone) -> None:
        if msg.room in self.quarantine:
            rq.free(self.pools, self.quarantine.pop(msg.room))
            self._admit()
            return
        req = self.requests.get(msg.room)
        if req is None:
            log.debug("late transfer_done for room %s ignored", msg.room)
            return
        if msg.status != "success":
            self._finish(
                req, "failed", error=msg.error or ErrorInfo(type="TransferFailed", message="prefill reported failure")
            )
            return
        req.state = advance(req.state, RequestState.TRANSFERRING)
        t0 = now()
        if req.verify == "sample":
            problem = synth.verify_sample(self.kv_args, req.room, req.alloc.lists, self._spans)
        else:
            problem = synth.verify_destination(self.kv_args, req.room, req.alloc.lists)
        if problem is None and msg.digest != synth.plan_digest(req.room, req.alloc.lists, self.kv_args):
            problem = "digest of the request's logical layout differs from the prefill's"
        t1 = now()
        if problem is not None:
            self._finish(
                req, "failed", error=ErrorInfo(type="TransferFailed", message=f"verification failed: {problem}")
            )
            return
        self._finish(
            req,
            "success",
            nbytes=msg.bytes,
            descriptors=msg.descriptors,
            verified=True,
            compute_s=msg.compute_s,
            copy_s=msg.copy_s,
            verify_s=t1 - t0,
            transfer_s=t1 - (req.sent_at if req.sent_at is not None else req.started),
        )

    def _finish(
        self,
        req: Request,
        status: str,
        error: ErrorInfo | None = None,
        nbytes: int = 0,
        descriptors: int = 0,
        verified: bool = False,
        quarantine: bool = False,
        compute_s: float = 0.0,
        copy_s: float = 0.0,
        verify_s: float = 0.0,
        transfer_s: float = 0.0,
    ) -> None:
        if req.state.terminal:
            return
        req.state = RequestState.SUCCESS if status == "success" else RequestState.FAILED
        self.requests.pop(req.room, None)
        seconds = now() - req.started
        res = TransferResult(
            req.room,
            status,
            req.seq_len,
            nbytes,
            descriptors,
            seconds,
            verified,
            error,
            compute_s,
            copy_s,
            transfer_s,
            verify_s,
        )
        if status == "success":
            self.stats.transfers["success"] += 1
            self.stats.bytes += nbytes
            self.stats.latencies_s.append(seconds)
        else:
            self.stats.fail(error.message if error else "failed")
        self.finished.pop(req.room, None)
        self.finished[req.room] = res
        while len(self.finished) > MAX_FINISHED:
            self.finished.pop(next(iter(self.finished)))
        if req.alloc is not None:
            if quarantine:
                self.quarantine[req.room] = req.alloc
            else:
                rq.free(self.pools, req.alloc)  # before settling: a caller sees its pages back
        settle(req.future, res)  # its caller may have cancelled it
        if req.alloc is not None and not quarantine:
            self._admit()

    def _timers(self, t: float) -> None:
        for req in list(self.requests.values()):
            if t > req.deadline:
                # sent, and not bounced with Busy: the prefill may be writing into its pages
                in_flight = req.state == RequestState.WAITING_FOR_INPUT and req.resend_at is None
                if in_flight:
                    self.client.send(wire.Abort(room=req.room, reason="deadline exceeded on decode"))
                self._finish(
                    req,
                    "failed",
                    error=ErrorInfo(type="TransferFailed", message="deadline exceeded"),
                    quarantine=in_flight,
                )
            elif req.resend_at is not None and t >= req.resend_at and req.message is not None:
                req.resend_at = None
                req.message = req.message.model_copy(update={"deadline_s": max(0.001, req.deadline - t)})
                self.client.send(req.message)
