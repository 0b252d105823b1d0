"""The decode worker: registers with prefills, then asks them for requests' state.

The control thread owns the DEALER sockets (one per prefill), the allocator and every request
record. Other threads call ``submit``/``transfer``, naming the prefill per request (by default
``opts.peer``); their commands reach the control thread through its mailbox
(``runtime.decode_link`` keeps the links to the prefills). A request is marked SUCCESS only after
``TransferDone`` arrived *and* the bytes that landed verified against the room's deterministic
content.

Pages of a request that failed while the prefill may still be writing into them (deadline, abort)
are quarantined until the prefill reports the room finished or is declared gone, so a late write
can never land in another request's pages. ("Gone" may be a frozen prefill that comes back: the
pages are reused only after a new handshake, and the prefill copies every request sent after that
handshake after every request sent before it; see ``runtime.prefill``.)
"""

from __future__ import annotations

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
)
from pdstate.protocol import wire
from pdstate.protocol.handshake import DecodeHandshake
from pdstate.protocol.lifecycle import PeerState, RequestState, move
from pdstate.protocol.report import ErrorInfo
from pdstate.runtime import requests as rq
from pdstate.runtime.commands import Reregister, Stop, Submit
from pdstate.runtime.decode_link import PrefillLinkMixin
from pdstate.runtime.decode_verify import VerifyMixin
from pdstate.runtime.hooks import WorkerHooks
from pdstate.runtime.mailbox import Mailbox
from pdstate.runtime.options import WorkerOptions
from pdstate.runtime.records import PrefillLink, Request, TransferResult
from pdstate.runtime.snapshot import PeerStatus, RequestStatus, WorkerSnapshot
from pdstate.runtime.worker import WorkerBase, local_side, log, now, settle

MAX_FINISHED = 10000  # results kept for ``/v1/transfers/{room}`` (oldest dropped first)
BUSY_BACKOFF_S = (0.002, 0.1)  # first and longest wait before re-sending a request answered Busy


class DecodeWorker(VerifyMixin, PrefillLinkMixin, WorkerBase):
    """A decode worker and its control thread.

    Control thread (``_control_loop``): owns the DEALER sockets, the handshakes, the allocator,
    its view of each prefill (``_links``; ``_link`` is ``opts.peer``'s) and every request: it
    admits, sends, verifies, ends and quarantines them. Callers' threads (``submit``,
    ``transfer``, ``reregister``) hand it ``Submit`` and ``Reregister`` through its mailbox and
    wait on a request's future.

    Written only by the control thread, under ``_lock``, and read under it by other threads
    (``status()``, ``lookup``, ``ready``, ``wait_ready`` and the views over them): ``_links``
    and each link's state, error, incarnation, fingerprint and handshake time, ``requests``,
    ``finished``, ``quarantine`` (pages by (prefill, room)), the waiting queue and the counter
    ``peak_in_flight``. A request's other fields (allocation, message, backoff) and a link's
    socket and timers are the control thread's alone.
    """

    role = "decode"

    def __init__(self, opts: WorkerOptions, hooks: WorkerHooks | None = None) -> None:
        super().__init__(opts, hooks)
        self.worker_id = opts.worker_id or f"decode-{secrets.token_hex(3)}"
        self.requests: dict[int, Request] = {}
        self.finished: dict[int, TransferResult] = {}
        self.quarantine: dict[tuple[str, int], rq.Allocation] = {}
        self.peak_in_flight = 0  # most requests entered and not finished at once
        self._link = PrefillLink(opts.peer)
        self._links: dict[str, PrefillLink] = {opts.peer: self._link}
        self._by_socket: dict = {}  # a link's DEALER socket -> the link (control thread)
        self._answered = threading.Event()  # the default prefill answered a register
        self._waiting: deque[Request] = deque()
        self._unprepared: deque[Request] = deque()  # sent, expectation not worked out (``_sent``)

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
            self.close_side()
            raise
        self.local = local_side(self.opts, self.worker_id, self.incarnation, self.report, self.kv_args, endpoint)
        self.handshake = DecodeHandshake(self.local)
        self._inbox = Mailbox(pollable=True)  # Submit and Reregister from callers' threads
        self._start_threads((self._control_loop, "pdstate-decode-control"))
        return self

    def stop(self) -> None:
        self._stop.set()
        inbox = getattr(self, "_inbox", None)
        if inbox is not None:
            inbox.put(Stop())  # wake the control loop
        for t in self._threads:
            t.join(timeout=10)
        if inbox is not None and not any(t.is_alive() for t in self._threads):
            inbox.close()
        self.close_side()

    # -- API for other threads ----------------------------------------------------------------
    def submit(
        self,
        seq_len: int,
        room: int | None = None,
        deadline_s: float | None = None,
        verify: str | None = None,
        prefill: str | None = None,
    ) -> Future:
        """Ask for one request's state; ``verify`` ("full" | "sample") overrides ``opts.verify``;
        ``prefill`` names the prefill's control address (default ``opts.peer``): a prefill used
        for the first time is dialled and registered with, and the request waits for its answer."""
        rq.check_submit(seq_len, verify, prefill)
        fut: Future = Future()
        room = room if room is not None else secrets.randbits(63)
        d = deadline_s or self.opts.request_deadline_s
        self._inbox.put(Submit(room, seq_len, d, fut, verify or self.opts.verify, prefill or self.opts.peer))
        return fut

    def transfer(
        self, seq_len: int, room: int | None = None, deadline_s: float | None = None, prefill: str | None = None
    ) -> TransferResult:
        d = deadline_s or self.opts.request_deadline_s
        return self.submit(seq_len, room, d, prefill=prefill).result(timeout=d + self.opts.peer_timeout_s + 5)

    def reregister(self) -> None:
        self._inbox.put(Reregister())

    # -- status (from any thread) -------------------------------------------------------------
    def status(self) -> WorkerSnapshot:
        with self._lock:
            return WorkerSnapshot(
                role=self.role,
                worker_id=self.worker_id,
                incarnation=self.incarnation,
                endpoint=self.opts.peer,
                peers=tuple(
                    PeerStatus(x.endpoint, x.state, x.error, x.incarnation, x.fingerprint) for x in self._links.values()
                ),
                requests=tuple(
                    RequestStatus(r.room, r.state, r.seq_len, r.started, r.prefill) for r in self.requests.values()
                ),
                dead_threads=self._dead_threads(),
                peak_in_flight=self.peak_in_flight,
                waiting=len(self._waiting),
                quarantined=len(self.quarantine),
                handshake_s=self._link.handshake_s,
            )

    def lookup(self, room: int) -> TransferResult | RequestStatus | None:
        """A finished request's result, an in-flight request's status, or ``None``."""
        with self._lock:
            res = self.finished.get(room)
            if res is not None:
                return res
            req = self.requests.get(room)
            return None if req is None else RequestStatus(req.room, req.state, req.seq_len, req.started)

    def snapshot(self) -> dict:
        """Peer state and request bookkeeping, for status commands."""
        s = self.status()
        return {
            "peer_state": s.peer.state.value,
            "prefill_incarnation": s.peer.incarnation,
            "in_flight": s.in_flight,
            "waiting": s.waiting,
            "quarantined": s.quarantined,
            "peak_in_flight": s.peak_in_flight,
        }

    # -- control thread -----------------------------------------------------------------------
    def _control_loop(self) -> None:
        self._poller = zmq.Poller()
        self._poller.register(self._inbox.socket, zmq.POLLIN)
        self._connect(self._link)
        next_hb = now() + self.opts.heartbeat_interval_s
        tick_ms = max(5, int(self.opts.heartbeat_interval_s * 1000 / 4))
        try:
            loop_t = now()
            while not self._stop.is_set():
                events = dict(self._poller.poll(tick_ms))
                if now() - loop_t > self.opts.peer_timeout_s / 2:  # this process did not run
                    self._resumed(now() - loop_t)
                loop_t = now()
                if self._inbox.socket in events:
                    for cmd in self._inbox.drain():
                        self._guarded(self._on_command, cmd)
                for sock, link in list(self._by_socket.items()):
                    if sock not in events:
                        continue
                    for _ in range(256):
                        try:
                            frame = sock.recv(flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._guarded(self._on_frame, (link, frame))
                self._guarded(self._prepare_checks, None)
                t = now()
                if t >= next_hb:
                    next_hb = t + self.opts.heartbeat_interval_s
                    self._guarded(self._heartbeat, t)
                self._guarded(self._timers, t)
        finally:
            for req in list(self.requests.values()):
                self._finish(req, "failed", error=ErrorInfo(type="TransferFailed", message="decode shutting down"))
            self._close_links()

    def _guarded(self, handler, arg) -> None:
        """Run one handler; a bug in it is logged and counted, and never ends the control loop
        (which would leave every request of this decode waiting forever)."""
        try:
            handler(arg)
        except Exception:
            self.stats.protocol_error()
            log.exception("decode control loop: %s failed", handler.__name__)

    def _on_command(self, cmd: Submit | Reregister | Stop) -> None:
        if isinstance(cmd, Reregister):
            for link in list(self._links.values()):
                self._reregister(link)
            return
        if not isinstance(cmd, Submit):
            return  # Stop: the loop ends on the stop flag
        if cmd.room in self.requests:
            settle(cmd.future, exc=ValueError(f"room {cmd.room} is already in flight"))
            return
        req = Request(cmd.room, cmd.seq_len, cmd.future, now() + cmd.deadline_s, verify=cmd.verify)
        req.prefill = cmd.prefill or self.opts.peer
        try:
            link = self._link_for(req.prefill)
        except ValueError as exc:  # a bad address, or too many prefills busy
            self._finish(req, "failed", error=ErrorInfo(type="PeerGone", message=str(exc)))
            return
        with self._lock:
            self.requests[req.room] = req
            self.peak_in_flight = max(self.peak_in_flight, len(self.requests))
        self._route(req, link)

    def _queue(self, req: Request) -> None:
        """An entered request whose prefill accepted this decode: wait for pages, then send."""
        capacity = rq.capacity_tokens(self.pools)
        if req.seq_len > capacity:
            err = AllocationError(f"seq_len {req.seq_len} exceeds the decode pool of {capacity} tokens")
            self._finish(req, "failed", error=ErrorInfo.of(err))
            return
        with self._lock:
            self._waiting.append(req)
        self._admit()

    def _admit(self) -> None:
        """Allocate waiting requests in arrival order while the pools have room, and send them."""
        while self._waiting:
            req = self._waiting[0]
            link = self._links[req.prefill]
            if req.state.terminal or link.state in (PeerState.GONE, PeerState.REJECTED):
                with self._lock:
                    self._waiting.popleft()
                self._enter(req, link)  # (a terminal request: nothing; else it fails with the link's reason)
                continue
            try:
                req.alloc = self._allocate(req.seq_len)
            except AllocationError:
                return  # wait for a finished request to free pages (or for the deadline)
            except PdStateError as exc:
                with self._lock:
                    self._waiting.popleft()
                self._finish(req, "failed", error=ErrorInfo.of(exc))
                continue
            with self._lock:
                self._waiting.popleft()
            req.message = wire.TransferRequest(
                room=req.room,
                seq_len=req.seq_len,
                dst_kv_pages=wire.PackedIndices.pack(req.alloc.lists[0]),
                dst_state_indices=[wire.PackedIndices.pack(x) for x in req.alloc.lists[1:]],
                deadline_s=max(0.001, req.deadline - now()),
            )
            with self._lock:
                move(req, RequestState.WAITING_FOR_INPUT)
            req.sent_at = now()
            self._links[req.prefill].client.send(req.message)
            self._sent(req)

    def _on_frame(self, arg) -> None:
        link, frame = arg
        try:
            msg = wire.decode(frame, self.opts.token)
        except (ProtocolError, AuthError) as exc:
            self.stats.protocol_error()
            log.warning("bad frame from prefill: %s", exc)
            if isinstance(exc, (AuthError, VersionMismatch)) and link.state == PeerState.PENDING:
                # The answer to our register cannot be authenticated (the tokens differ, or one
                # side has none) or is in another protocol version. Waiting longer cannot help;
                # refuse like a Reject would.
                self._refused(link, ErrorInfo.of(exc))
            return
        link.last_heard = now()
        if isinstance(msg, (wire.Accept, wire.Reject)):
            self._on_handshake(link, msg)
        elif isinstance(msg, wire.Heartbeat):
            incarnation = link.incarnation
            if incarnation is not None and msg.incarnation != incarnation:
                self._peer_gone(link, f"prefill restarted (incarnation {incarnation} -> {msg.incarnation})")
                self._send_register(link)
        elif isinstance(msg, wire.TransferDone):
            self._on_done(link, msg)
        elif isinstance(msg, wire.Goodbye):
            self._on_goodbye(link, msg)
        elif isinstance(msg, wire.Challenge):
            self._on_challenge(link, msg)
        elif isinstance(msg, wire.Busy):
            req = self._mine(link, msg.room)
            if req is not None and req.resend_at is None:
                # exponential backoff: a full prefill is not hammered by every waiting request
                self.stats.busy()
                first, longest = BUSY_BACKOFF_S
                req.resend_at = now() + min(longest, first * (2 ** min(req.busy_count, 16)))
                req.busy_count += 1
        elif isinstance(msg, wire.Error):
            if msg.room is not None and self._mine(link, msg.room) is not None:
                self._finish(self.requests[msg.room], "failed", error=msg.error)
            elif msg.error.type == NotRegistered.__name__:
                if link.state == PeerState.ACCEPTED:
                    self._peer_gone(link, "prefill forgot this decode (restarted or timed it out)")
                self._send_register(link)
            elif link.state == PeerState.PENDING:
                # Only a register is outstanding: the prefill could not take it (auth, version,
                # malformed) and answered with an error instead of accept/reject.
                self._refused(link, msg.error)
            else:
                log.warning("prefill reported: %s: %s", msg.error.type, msg.error.message)

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
            req.prefill,
        )
        if status == "success":
            self.stats.success(nbytes, seconds)
        else:
            self.stats.fail(error.message if error else "failed")
        with self._lock:  # one step for readers: no longer in flight, finished, pages quarantined
            move(req, RequestState.SUCCESS if status == "success" else RequestState.FAILED)
            self.requests.pop(req.room, None)
            self.finished.pop(req.room, None)
            self.finished[req.room] = res
            while len(self.finished) > MAX_FINISHED:
                self.finished.pop(next(iter(self.finished)))
            if req.alloc is not None and quarantine:
                self.quarantine[(req.prefill, req.room)] = req.alloc
        if req.alloc is not None and not quarantine:
            self._free(req.alloc)  # before settling: a caller sees its pages back
        settle(req.future, res)  # its caller may have cancelled it
        if req.alloc is not None and not quarantine:
            self._admit()
