"""The prefill agent: serves any number of decode agents, one ``KVSender`` per request (room)."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable

import zmq

from pdstate import logs
from pdstate.agent import curve
from pdstate.agent.admission import Gate, Incidents, bind_router
from pdstate.agent.common import AgentLifetime, AgentLoop, RequestRecord, channel_layout, regions_of
from pdstate.agent.fairness import VERDICT_TIMEOUT_S, Verdicts
from pdstate.agent.fence import Fences
from pdstate.agent.prefill_copy import CopyPipeline
from pdstate.agent.refusals import PeerLog, Refusals
from pdstate.agent.sender import DecodePeer, EndedSender, KVSender, PendingRequest, Sending
from pdstate.agent.verify import check_level, layout_devices, level_of, request_digest, weaker
from pdstate.errors import (
    AgentClosed,
    IndexCountMismatch,
    PdStateError,
    PeerGone,
    ProtocolError,
    TransferAborted,
    TransferFailed,
    VerifyLevelRefused,
    error_from_wire,
)
from pdstate.protocol import wire
from pdstate.protocol.handshake import LocalSide, PrefillHandshake
from pdstate.protocol.lifecycle import RequestState
from pdstate.protocol.peers import DecodeSnapshot, PeerSnapshot
from pdstate.protocol.report import ErrorInfo
from pdstate.transfer.engines.base import TransferEngine, create_engine
from pdstate.transfer.engines.shm_owner import challenge_unknown, challenge_unknown_error
from pdstate.transfer.planner import PairPlanner

log = logging.getLogger("pdstate.agent")

__all__ = ["KVSender", "PrefillAgent"]

KEEP_ENDED_S = 600.0  # an ended sender is kept this long (a late AgentRequest or Abort is answered) ...
MAX_ENDED = 8192  # ... but no more than this many, the oldest forgotten first
# an ended sender keeps only that it was requested: this stands for its request (index lists dropped)
ANSWERED = wire.AgentRequest(
    room=0, dst_kv_pages=wire.PackedIndices.pack([]), dst_state_indices=[], digest=False, deadline_s=1.0
)


def _trim(send: Sending) -> None:
    """What an ended sender no longer needs: its handles, digest, queued chunks, index lists."""
    send.handles, send.digest, send.marks = [], None, []
    send.queued.clear()
    send.record.release()
    if send.request is not None:
        send.request = ANSWERED


class PrefillAgent(AgentLifetime, CopyPipeline, Fences, Refusals):
    """Serves decode agents over ZeroMQ (a ROUTER bound at ``bind``) and one transfer engine.

    ``kv_args``: the caller's filled ``KVArgs`` (``fill_kv_args`` / ``setup_state_kv_args``, plus
    ``aux_data_*`` when the caller moves metadata); ``pools``: the caller's ``(target, draft)``
    for the layout report (or pass ``report``). A sender no decode asks for within
    ``bootstrap_timeout_s`` fails (``TransferFailed``). ``check_local=False`` serves even when that
    pair fails ``setup_state_kv_args`` (every decode is then refused with the same error). The
    memory behind ``kv_args`` is the caller's: registered with the engine, never allocated, freed
    or written. A refused decode's rooms fail with the refusal (``pdstate.agent.refusals``); a
    verdict is awaited ``verdict_timeout_s`` (``pdstate.agent.fairness``); ``advertise``: other
    addresses decodes dial it at (a proof of ownership is bound to one, ``agent.admission``).

    ``on_request(room, seq_len, decode_worker_id)``: for a caller that computes a request only
    once a decode asks for it (``pdstate serve``'s synthetic prefill). Called on the I/O thread
    when a decode's request names a room without a live sender; it must return at once (hand the
    work to another thread, which then makes the sender), or raise a ``PdStateError`` to refuse
    the request: the decode's receiver fails with that error. ``seq_len`` is the decode's
    ``KVReceiver.init(seq_len=...)``, ``None`` when it gave none.

    Verification (``pdstate.agent.verify``): the decode's request names its level (``sampled``,
    ``full`` or ``off``); ``verify`` (``None``: any) is the least this prefill takes, a request
    asking less fails on both sides (``VerifyLevelRefused``).

    Digests: for a decode that asked for them, each chunk that lands before the last is told to
    the decode (``wire.Landed``), which hashes it while the rest copies. ``landed_piece_bytes``
    (0: off) cuts a chunk of over twice that into pieces of about that size, state and aux first,
    each told once landed: for hosts where the decode has cores the copy leaves idle. Measured on
    2 cores it costs: a 32k-token request over shm took 23.4 ms in 32 MiB pieces and 34.2 ms in
    8 MiB pieces against 21.9 ms whole (the decode's hashing takes a core from the copy), and over
    Mooncake SGLang's two chunks gained nothing from pieces.

    Threading (``pdstate.agent``): one I/O thread owns the socket, the engine's submissions and
    every request's state; every public method is safe from any thread. The caller keeps a chunk's
    source pages unchanged until its sender left TRANSFERRING (engines read them asynchronously;
    the digest reads them beside the copy).
    """

    def __init__(
        self,
        kv_args,
        pools=None,
        *,
        bind: str = "tcp://127.0.0.1:0",
        engine: str = "shm",
        engine_options: dict | None = None,
        worker_id: str = "prefill",
        report=None,
        heartbeat_interval_s: float = 0.5,
        peer_timeout_s: float = 3.0,
        token: bytes | None = None,
        check_local: bool = True,
        bootstrap_timeout_s: float = 300.0,
        on_request: Callable[[int, int | None, str], None] | None = None,
        landed_piece_bytes: int = 0,
        verdict_timeout_s: float = VERDICT_TIMEOUT_S,
        advertise: tuple[str, ...] = (),
        verify: str | None = None,
        key_dir: str | None = None,
    ) -> None:
        keys = curve.control_keys(token, key_dir)  # first: a key file refused is a ConfigError, nothing started
        if report is None:
            if pools is None:
                raise ValueError("PrefillAgent needs pools=(target, draft) or report= for the handshake")
            from pdstate.pools.reporting import build_report

            report, _ = build_report(*pools)
        if check_local and not report.local_check.ok and report.local_check.error is not None:
            raise error_from_wire(report.local_check.error.type, report.local_check.error.message)
        self.kv_args, self.worker_id, self.token, self.advertise = kv_args, worker_id, token, tuple(advertise)
        self.incarnation = secrets.token_hex(8)
        self.heartbeat_interval_s, self.peer_timeout_s = heartbeat_interval_s, peer_timeout_s
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self._on_request = on_request
        if landed_piece_bytes < 0:
            raise ValueError(f"landed_piece_bytes must be >= 0 (0: whole chunks), got {landed_piece_bytes}")
        self._engine: TransferEngine = create_engine(engine, **(engine_options or {}))
        self._engine.start()
        try:
            self._engine.register(regions_of(kv_args))
        except BaseException:
            self._engine.close()
            raise
        self.landed_piece_bytes = landed_piece_bytes
        self.verify = check_level(verify) if verify is not None else None  # the least a decode may ask
        kv = wire.KVDesc.of(kv_args)
        self._handshake = PrefillHandshake(
            LocalSide(
                worker_id=worker_id,
                incarnation=self.incarnation,
                report=report,
                kv=kv,
                engine=wire.EngineDesc(name=self._engine.name, endpoint={}),
                heartbeat_interval_s=heartbeat_interval_s,
                peer_timeout_s=peer_timeout_s,
            )
        )
        self._layout = channel_layout(kv_args, kv_args.aux_data_ptrs, kv_args.aux_item_lens)
        self._devices = layout_devices(self._layout)  # host (None) or device, per buffer
        self._decodes: dict[bytes, DecodePeer] = {}
        self._sends: dict[int, Sending | EndedSender] = {}  # live senders, and ended ones as tombstones
        self._pending: dict[int, PendingRequest] = {}
        self.handshakes = {"accepted": 0, "rejected": 0}  # answers given, written by the I/O thread only
        self.auth_failures = Incidents()  # refused CURVE handshakes and frames refused for their auth tag
        self.withheld, self.verdict_timeout_s = Incidents("verdict"), verdict_timeout_s  # ``agent.fairness``
        self._verdicts = Verdicts(self, self._decodes, self._fail, self._decode_gone)
        self._peer_log = PeerLog()  # every decode that registered (``peers()``)
        self._init_refusals()
        self._init_fences()
        self._last_tick = time.monotonic()
        self._loop = AgentLoop(f"pdstate-prefill-{worker_id}", min(0.05, heartbeat_interval_s / 2), self._tick)
        self._sock, self.address = bind_router(self._loop, bind, keys, on_fail=lambda: self._stop(lambda: None))
        self._gate = Gate(self, self._decodes, self._engine, self._handshake, self._sock, self._reply)
        self._loop.watch(self._sock, self._on_frame)
        self._loop.monitor(self._sock, curve.REFUSED_EVENTS, self._gate.refuse_handshake)
        self._loop.start()

    # --- public ---------------------------------------------------------------------------------

    def sender(self, room: int, num_pages: int, aux_index: int | None = None) -> KVSender:
        """The sender of request ``room`` (``num_pages`` main-KV pages in all; ``aux_index``: the
        caller's aux slot, moved with the last chunk when both sides have aux buffers)."""
        if num_pages < 0:
            raise ValueError(f"num_pages must not be negative, got {num_pages}")
        send = Sending(RequestRecord(room), num_pages, aux_index)
        added = self._loop.call(lambda: self._add_sender(send))
        return KVSender(added, call=self._loop.call, queue_chunk=self._queue_chunk, abort=self._abort)

    def decodes(self) -> list[DecodeSnapshot]:
        """The accepted decode agents: worker id, incarnation, seconds since last heard."""
        now = time.monotonic()
        return self._loop.call(
            lambda: [
                DecodeSnapshot(d.worker_id, d.incarnation, round(now - d.last_seen, 3)) for d in self._decodes.values()
            ]
        )

    def refuse(self, room: int, error: PdStateError) -> bool:
        """Fail the decode's request for ``room`` that waits for its sender (``on_request``'s
        caller could not serve it after all): that decode's receiver fails with ``error``.
        Returns whether such a request was waiting."""

        def run() -> bool:
            pending = self._pending.pop(room, None)
            if pending is not None:
                self._reply(pending.identity, self._done_failed(room, error))
            return pending is not None

        return self._loop.call(run)

    def peers(self) -> list[PeerSnapshot]:
        """Every decode that registered (the latest, by worker id; bounded: ``refusals.PeerLog``):
        ``id``, ``state`` (``accepted``, ``rejected`` or ``gone``), ``incarnation``,
        ``fingerprint`` (its layout's, from its Register) and ``error`` (an ``ErrorInfo`` or
        ``None``)."""
        return self._loop.call(self._peer_log.records)

    def close(self, reason: str = "prefill shutting down") -> None:
        """Fail live requests with ``reason`` (``AgentClosed``), say ``Goodbye`` with it to every
        accepted decode (which fails what it still has here at once and turns this prefill
        GONE), then close the socket and the engine."""
        if self._loop.closed:
            return

        def final() -> None:
            for send in list(self._sends.values()):
                if not send.record.state.terminal:
                    self._fail(send, AgentClosed(reason), tell_decode=True)
            self._hold_fences()  # the engine closes next
            bye = wire.Goodbye(worker_id=self.worker_id, incarnation=self.incarnation, reason=reason[:1024])
            for identity in list(self._decodes):
                self._reply(identity, bye)

        self._stop(final)

    # --- I/O thread -------------------------------------------------------------------------------

    def _reply(self, identity: bytes, msg: wire.Message) -> None:
        try:
            self._sock.send_multipart([identity, wire.encode(msg, self.token)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # gone or full: its heartbeats stop and it fails its own requests

    def _add_sender(self, send: Sending) -> Sending:
        room = send.record.room
        old = self._sends.get(room)
        if old is not None and not old.record.state.terminal:
            raise ProtocolError(f"room {room} already has a live sender")
        self._sends[room] = send
        pending = self._pending.pop(room, None)
        if pending is not None:
            self._attach(send, pending.identity, pending.msg)
        return send

    def _on_frame(self, sock: zmq.Socket) -> None:
        parts = sock.recv_multipart()
        if len(parts) != 2:
            self._gate.refuse_parts(parts)
            return
        identity, frame = parts
        try:
            msg = wire.decode(frame, self.token)
        except PdStateError as exc:
            self._gate.refuse_frame(identity, frame, exc)
            return
        decode = self._decodes.get(identity)
        if decode is not None:
            decode.last_seen = time.monotonic()
        if isinstance(msg, wire.Register):
            self._on_register(identity, msg)
        elif isinstance(msg, wire.Heartbeat) and decode is not None:
            self._reply(identity, wire.Heartbeat(worker_id=self.worker_id, incarnation=self.incarnation, seq=msg.seq))
        elif isinstance(msg, wire.Error) and challenge_unknown(msg.error.message):  # an older decode: say why
            self._reply(identity, wire.Reject(worker_id=self.worker_id, error=ErrorInfo.of(challenge_unknown_error())))
        elif isinstance(msg, wire.Error):  # never answered (PROTOCOL §7); a room of this decode's fails
            self._on_error(identity, msg)
        elif decode is None and isinstance(msg, wire.Abort) and identity in self._refused:
            self._on_refused_abort(identity, msg)
        elif decode is None:
            self._reply(
                identity,
                wire.Error(
                    error=ErrorInfo(type="NotRegistered", message="decode is not registered with this prefill"),
                    room=getattr(msg, "room", None),
                ),
            )
        elif isinstance(msg, wire.AgentRequest):
            send = self._sends.get(msg.room)
            if send is None or send.record.state.terminal and send.request is not None:
                self._pending[msg.room] = PendingRequest(identity, msg)
                self._refused_rooms.pop(msg.room, None)  # asked for (again): not given up
                if self._on_request is not None:
                    self._ask_caller(identity, decode.worker_id, msg)
            else:
                self._attach(send, identity, msg)
        elif isinstance(msg, wire.Abort):
            self._on_abort(identity, msg)
        elif isinstance(msg, wire.AgentVerdict):
            self._verdicts.heard(identity)
            self._on_verdict(msg)

    def _ask_caller(self, identity: bytes, worker_id: str, msg: wire.AgentRequest) -> None:
        try:
            self._on_request(msg.room, msg.seq_len, worker_id)
        except PdStateError as exc:  # refused by the caller: the decode's receiver fails with it
            if self._pending.get(msg.room) is not None and self._pending[msg.room].msg is msg:
                del self._pending[msg.room]
            self._reply(identity, self._done_failed(msg.room, exc))

    def _on_register(self, identity: bytes, msg: wire.Register) -> None:
        if self._gate.gatekeep(identity, msg):  # another live decode's worker_id, or memory not proven yet
            return
        answer = self._handshake.receive(msg)
        if isinstance(answer, wire.Accept):
            try:
                peer_id, endpoint = self._gate.connect(msg, identity)  # its buffers inside the regions it published
                planner = PairPlanner(self.kv_args, msg.kv)
            except (PdStateError, ValueError) as exc:
                answer = wire.Reject(worker_id=self.worker_id, error=ErrorInfo.of(exc))
            else:
                olds = [k for k, d in self._decodes.items() if d.worker_id == msg.worker_id and k != identity]
                replaced = self._decodes.get(identity)
                self._decodes[identity] = DecodePeer(
                    identity, msg.worker_id, msg.incarnation, peer_id, planner, time.monotonic(), endpoint=endpoint
                )
                for key in olds:  # after the new one is in: a peer id both share stays connected
                    self._decode_gone(key, f"decode {msg.worker_id} registered again (new incarnation)")
                if replaced is not None:
                    self._release(replaced.peer_id)
        self._note_handshake(identity, answer)
        self._log_peer(
            msg, "accepted" if isinstance(answer, wire.Accept) else "rejected", getattr(answer, "error", None)
        )
        self._reply(identity, answer)

    def _log_peer(self, msg: wire.Register, state: str, error: ErrorInfo | None) -> None:
        self.handshakes[state] += 1
        if error is not None:  # an accepted one is logged by the decode, which times its round trip
            logs.refusal(log, what="handshake", peer=msg.worker_id, error_type=error.type, message=error.message)
        self._peer_log.note(msg.worker_id, state, msg.incarnation, msg.report.fingerprint, error)

    def _decode_gone(self, identity: bytes, why: str) -> None:
        gone = self._decodes.pop(identity, None)
        if gone is not None:
            self._peer_log.gone(gone.worker_id, gone.incarnation, why)
        for send in self._sends.values():
            if send.identity == identity and not send.record.state.terminal:
                self._fail(send, PeerGone(why), tell_decode=False)
        for room, p in list(self._pending.items()):
            if p.identity == identity:
                del self._pending[room]
        if gone is not None:
            self._release(gone.peer_id)

    def _attach(self, send: Sending, identity: bytes, msg: wire.AgentRequest) -> None:
        if send.request is not None:
            first = self._decodes.get(send.identity)
            by = f"decode {first.worker_id}" if first is not None else "another decode"
            err = ProtocolError(f"room {msg.room} was already requested by {by}")
            self._reply(identity, wire.Error(error=ErrorInfo.of(err), room=msg.room))
            return
        if send.record.state.terminal:
            # aborted on this side before the request came: tell the decode it will get nothing
            self._reply(identity, self._done_failed(msg.room, send.record.error))
            return
        send.identity, send.request = identity, msg
        send.decode_key = self._decode_key(identity)
        n_dst = len(msg.dst_kv_pages)
        if n_dst != send.num_pages:
            err = IndexCountMismatch(f"main KV: index count mismatch: prefill={send.num_pages}, decode={n_dst}")
            self._fail(send, err, tell_decode=True)
            return
        if msg.dst_aux is not None and (not bool(self.kv_args.aux_data_ptrs) or send.aux_index is None):
            err = IndexCountMismatch(
                "aux: the decode names an aux slot, but this prefill "
                + ("has no aux buffers" if not bool(self.kv_args.aux_data_ptrs) else "request has no aux_index")
            )
            self._fail(send, err, tell_decode=True)
            return
        level = send.record.metrics["verify"] = level_of(msg.digest, msg.verify)
        if self.verify is not None and weaker(level, self.verify):
            err = VerifyLevelRefused(
                f"room {msg.room}: the decode asks verification {level!r}, below this prefill's transfer.verify {self.verify!r}"
            )
            self._fail(send, err, tell_decode=True)
            return
        send.digest = request_digest(self._layout, self._devices, msg, self._n_channels(), level)
        send.record.move(RequestState.WAITING_FOR_INPUT)
        self._pump(send)

    def _n_channels(self) -> int:
        return 1 + len(self.kv_args.state_types)

    def _decode_key(self, identity: bytes) -> str | None:
        d = self._decodes.get(identity)
        return None if d is None else f"{d.worker_id}/{d.incarnation}"

    def _on_abort(self, identity: bytes, msg: wire.Abort) -> None:
        send = self._sends.get(msg.room)
        err = TransferAborted(f"aborted by decode: {msg.reason}")
        if send is not None and not send.record.state.terminal and send.identity is not None:
            mine = self._decode_key(identity)
            if send.identity != identity and (mine is None or send.decode_key != mine):
                return  # another decode's room: nothing to confirm to this one
            send.identity = identity  # the same decode on a new connection: confirmed there
            self._fail(send, err, tell_decode=True)  # confirmed once its fence holds
            return
        if self._pending.pop(msg.room, None) is not None:
            self._give_up(msg.room, err)  # a sender made later for it fails with this (``refusal``)
        self._reply(identity, self._done_failed(msg.room, err))  # nothing of it can land: confirm

    def _on_verdict(self, msg: wire.AgentVerdict) -> None:
        send = self._sends.get(msg.room)
        if send is None or send.record.state.terminal or send.fence is not None:
            return  # a failing request ends with its fence
        if msg.status == "success":
            send.record.move(RequestState.SUCCESS)
        else:
            err = msg.error or ErrorInfo(type="TransferFailed", message="decode reported failure")
            send.record.fail(error_from_wire(err.type, err.message))

    def _tick(self) -> None:
        now = self._tick_time(self._decodes.values())
        for identity, d in list(self._decodes.items()):
            if now - d.last_seen > self.peer_timeout_s:
                self._decode_gone(identity, f"decode {d.worker_id} missed heartbeats for {self.peer_timeout_s:g} s")
        self._verdicts.check(self._sends.values(), now)
        ended = 0
        for room, send in reversed(list(self._sends.items())):  # newest first
            if send.record.state.terminal:
                ended += 1
                if now - send.record.created > KEEP_ENDED_S or ended > MAX_ENDED:
                    del self._sends[room]  # kept a while so a late AgentRequest or Abort is answered
                elif isinstance(send, Sending):
                    _trim(send)  # the caller's KVSender may keep it a while: drop what it no longer needs
                    self._sends[room] = EndedSender.of(send, ANSWERED)
                continue
            if send.record.state is RequestState.BOOTSTRAPPING and now - send.record.created > self.bootstrap_timeout_s:
                self._fail(
                    send,
                    TransferFailed(f"room {room}: no decode asked for it within {self.bootstrap_timeout_s:g} s"),
                    tell_decode=False,
                )
                continue
            self._finish_if_landed(send)
