"""The prefill agent: serves any number of decode agents, one ``KVSender`` per request (room).

``PrefillAgent`` is the shell around ``agent.prefill_core.PrefillCore``: it owns the I/O thread
(``AgentLoop``), the ROUTER socket, the engine and the clock, feeds the core each frame, tick,
command and engine outcome, and performs the actions the core returns."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from pdstate.agent import curve
from pdstate.agent.admission import BACKLOG, HANDSHAKE_IVL_MS, Incidents
from pdstate.agent.common import AgentLifetime, AgentLoop, RequestRecord, channel_layout, regions_of
from pdstate.agent.fairness import VERDICT_TIMEOUT_S
from pdstate.agent.posted import PostedAdds
from pdstate.agent.prefill_core import ANSWERED as ANSWERED  # what an ended sender keeps of its request
from pdstate.agent.prefill_core import (
    KEEP_ENDED_S,
    MAX_ENDED,
    Again,
    AskCaller,
    PrefillCore,
    Release,
    Send,
    Watch,
)
from pdstate.agent.sender import EndedSender, KVSender, Sending
from pdstate.agent.verify import check_level, layout_devices
from pdstate.errors import AgentClosed, EngineError, PdStateError, error_from_wire
from pdstate.protocol import wire
from pdstate.protocol.handshake import LocalSide, PrefillHandshake
from pdstate.protocol.peers import DecodeSnapshot, PeerSnapshot
from pdstate.transfer.engines.base import TransferEngine, create_engine

__all__ = ["KVSender", "PrefillAgent"]

_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)  # plain ints: a flag enum's ``|`` runs in Python
_RCVMORE = int(zmq.RCVMORE)


def bind_router(loop: Any, bind: str, keys: curve.Keys, on_fail: Callable[[], None]) -> tuple[zmq.Socket, str]:
    """The prefill agent's ROUTER, the CURVE server of ``keys``' domain (``agent.curve``), bound
    to ``bind`` (``tcp://host:0``: a free port); returns it and its address. When that fails the
    socket is closed and ``on_fail()`` runs (the agent releases its loop and engine). A connection
    that does not complete ZeroMQ's handshake (ZMTP greeting and CURVE) within
    ``HANDSHAKE_IVL_MS`` is closed (libzmq's default: 30 s), so idle TCP connections to the control
    port hold their descriptors for seconds, not half a minute; ``BACKLOG`` lets a burst of them
    queue for accept rather than stall other connections' handshakes (``tests/security/test_exhaustion.py``)."""
    sock = loop.socket(zmq.ROUTER)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
    sock.setsockopt(zmq.BACKLOG, BACKLOG)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    try:
        loop.serve_curve(sock, keys)
        if bind.startswith("tcp://") and bind.endswith(":0"):
            port = sock.bind_to_random_port(bind[: -len(":0")])
            return sock, f"{bind[: -len(':0')]}:{port}"
        sock.bind(bind)
    except BaseException:
        sock.close(0)  # the loop's context can then end
        on_fail()
        raise
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


class _OnCore:
    """A public setting of ``PrefillAgent`` that its core keeps and reads (``path``: where on the
    core), read and written through the agent as an attribute."""

    def __init__(self, *path: str) -> None:
        self.path = path

    def _holder(self, agent: PrefillAgent) -> Any:
        holder = agent._core
        for name in self.path[:-1]:
            holder = getattr(holder, name)
        return holder

    def __get__(self, agent: PrefillAgent | None, owner: type | None = None) -> Any:
        return self if agent is None else getattr(self._holder(agent), self.path[-1])

    def __set__(self, agent: PrefillAgent, value: Any) -> None:
        setattr(self._holder(agent), self.path[-1], value)


class PrefillAgent(AgentLifetime):
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
        self._on_request = on_request
        if landed_piece_bytes < 0:
            raise ValueError(f"landed_piece_bytes must be >= 0 (0: whole chunks), got {landed_piece_bytes}")
        verify = check_level(verify) if verify is not None else None  # the least a decode may ask
        self._engine: TransferEngine = create_engine(engine, **(engine_options or {}))
        self._engine.start()
        try:
            self._engine.register(regions_of(kv_args))
        except BaseException:
            self._engine.close()
            raise
        handshake = PrefillHandshake(
            LocalSide(
                worker_id=worker_id,
                incarnation=self.incarnation,
                report=report,
                kv=wire.KVDesc.of(kv_args),
                engine=wire.EngineDesc(name=self._engine.name, endpoint={}),
                heartbeat_interval_s=heartbeat_interval_s,
                peer_timeout_s=peer_timeout_s,
            )
        )
        self._accept_frame: tuple | None = None  # (key, report, frame) of the last Accept sent (``_encode``)
        self._unadded = PostedAdds("sender")  # posted senders the I/O thread has not added yet
        self._loop = AgentLoop(f"pdstate-prefill-{worker_id}", min(0.05, heartbeat_interval_s / 2), self._tick)
        self._sock, self.address = bind_router(self._loop, bind, keys, on_fail=lambda: self._stop(lambda: None))
        layout = channel_layout(kv_args, kv_args.aux_data_ptrs, kv_args.aux_item_lens)
        self._core = PrefillCore(
            kv_args,
            handshake,
            self._engine,
            worker_id=worker_id,
            incarnation=self.incarnation,
            address=self.address,
            advertise=self.advertise,
            now=time.monotonic(),
            probe=self._probe,
            stopwatch=time.monotonic,
            wakes=getattr(self._engine, "on_done", None) is not None,
            ask_caller=on_request is not None,
            layout=layout,
            devices=layout_devices(layout),  # host (None) or device, per buffer
            heartbeat_interval_s=heartbeat_interval_s,
            peer_timeout_s=peer_timeout_s,
            bootstrap_timeout_s=bootstrap_timeout_s,
            verdict_timeout_s=verdict_timeout_s,
            landed_piece_bytes=landed_piece_bytes,
            verify=verify,
            keep_ended_s=KEEP_ENDED_S,
            max_ended=MAX_ENDED,
        )
        self._decodes, self._sends = self._core.decodes, self._core.sends  # the I/O thread's own maps
        self.handshakes = self._core.handshakes  # answers given, written by the I/O thread only
        self.auth_failures: Incidents = self._core.auth_failures  # refused CURVE handshakes and auth tags
        self.withheld: Incidents = self._core.withheld  # decodes dropped for withheld verdicts
        self._loop.watch(self._sock, self._on_frame)
        self._loop.monitor(self._sock, curve.REFUSED_EVENTS, self._on_refused_handshake)
        self._loop.start()

    # the settings the core reads (public, writable)
    landed_piece_bytes = _OnCore("copy", "landed_piece_bytes")
    verify = _OnCore("verify")  # the least verification level a decode may ask (``None``: any)
    verdict_timeout_s = _OnCore("verdict_timeout_s")
    bootstrap_timeout_s = _OnCore("bootstrap_timeout_s")

    # --- public ---------------------------------------------------------------------------------

    def sender(self, room: int, num_pages: int, aux_index: int | None = None, *, posted: bool = False) -> KVSender:
        """The sender of request ``room`` (``num_pages`` main-KV pages in all; ``aux_index``: the
        caller's aux slot, moved with the last chunk when both sides have aux buffers).

        ``posted=True``: returns without waiting for the I/O thread, which adds the sender next
        (before any later call's work); what would have raised here (a room with a live sender)
        fails the returned sender with that error instead (its ``failure_exception()``)."""
        if num_pages < 0:
            raise ValueError(f"num_pages must not be negative, got {num_pages}")
        send = Sending(RequestRecord(room), num_pages, aux_index)
        if not posted:
            send = self._loop.call(lambda: self._run(lambda now: self._core.add_sender(send, now)))
        sender = KVSender(
            send, call=self._loop.call, post=self._loop.post, queue_chunk=self._queue_chunk, abort=self._abort
        )
        if posted:
            self._unadded.post(send.record, self._loop.post, lambda: self._add_posted(sender, send))
        return sender

    def decodes(self) -> list[DecodeSnapshot]:
        """The accepted decode agents: worker id, incarnation, seconds since last heard."""
        now = time.monotonic()
        return self._loop.call(lambda: self._core.decode_list(now))

    @property
    def decode_count(self) -> int:
        """How many decode agents are accepted now (``len(decodes())``, read without the I/O
        thread: a caller's per-request look costs no round trip to it)."""
        return len(self._decodes)

    def refuse(self, room: int, error: PdStateError) -> bool:
        """Fail the decode's request for ``room`` that waits for its sender (``on_request``'s
        caller could not serve it after all): that decode's receiver fails with ``error``.
        Returns whether such a request was waiting."""
        return self._loop.call(lambda: self._run(lambda now: self._core.refuse(room, error, now)))

    def peers(self) -> list[PeerSnapshot]:
        """Every decode that registered (the latest, by worker id; bounded: ``refusals.PeerLog``):
        ``id``, ``state`` (``accepted``, ``rejected`` or ``gone``), ``incarnation``,
        ``fingerprint`` (its layout's, from its Register) and ``error`` (an ``ErrorInfo`` or
        ``None``)."""
        return self._loop.call(self._core.peer_log.records)

    def requested(self, room: int) -> bool:
        """Whether a decode's request for ``room`` arrived and waits for ``sender(room, ...)``
        (read without the I/O thread: ``agent.refusals``)."""
        return self._core.refusals.requested(room)

    @property
    def arrivals(self) -> int:
        """How many decode requests came to wait for their senders, and rooms were given up, so far
        (read without the I/O thread): a caller watching for its rooms (``requested``,
        ``take_refusal``) need look again only once this moved."""
        return self._core.refusals.arrivals

    @property
    def waiting(self) -> int:
        """How many decode requests wait for their senders (read without the I/O thread): none,
        and ``requested`` and ``requested_any`` are False for any room."""
        return self._core.refusals.waiting()

    def requested_any(self, rooms: frozenset[int]) -> bool:
        """``requested`` of any of ``rooms`` in one look (read without the I/O thread)."""
        return self._core.refusals.requested_any(rooms)

    @property
    def refusals_held(self) -> int:
        """How many rooms were given up before their senders were made and are still held
        (``refusal``; read without the I/O thread): none, and ``refused_any`` is False for any rooms."""
        return len(self._core.refusals.rooms)

    def refused_any(self, rooms: frozenset[int]) -> bool:
        """Whether any of ``rooms`` was given up before its sender was made (``refusal``)."""
        return self._core.refusals.refused_any(rooms)

    def pending_pages(self, room: int) -> int | None:
        """How many destination pages the waiting request for ``room`` names (``None``: none waits)."""
        return self._core.refusals.pending_pages(room)

    def pending_state_lengths(self, room: int) -> list[int] | None:
        """How many indices the waiting request for ``room`` names per state component
        (``agent.refusals.Refusals.pending_state_lengths``)."""
        return self._core.refusals.pending_state_lengths(room)

    def refusal(self, room: int) -> PdStateError | None:
        """The error a refused decode gave ``room`` up with before its sender was made."""
        return self._core.refusals.refusal(room)

    def take_refusal(self, room: int) -> PdStateError | None:
        """``refusal(room)``, forgotten as it is read (``agent.refusals``)."""
        return self._core.refusals.take_refusal(room)

    def close(self, reason: str = "prefill shutting down") -> None:
        """Fail live requests with ``reason`` (``AgentClosed``), say ``Goodbye`` with it to every
        accepted decode (which fails what it still has here at once and turns this prefill
        GONE), then close the socket and the engine."""
        if self._loop.closed:
            return

        def final() -> None:
            self._run(lambda now: self._core.close(reason, now))
            for send in self._core.fencing():  # the engine closes next: wait here, up to each deadline
                for h in send.handles:
                    try:
                        self._engine.wait(h, max(0.0, send.fence.deadline - time.monotonic()))
                    except EngineError:
                        pass  # failed or still in flight: the core tells which
            self._run(lambda now: self._core.end(reason, now))
            self._unadded.close(reason)  # posted senders not added yet, and those behind this

        try:
            self._stop(final)
        finally:
            self._unadded.close(reason)  # posted, never run: the thread ended first

    # --- I/O thread: inputs to the core, its actions performed ------------------------------------

    def _run(self, step: Callable[[float], object]) -> object:
        """Feed the core one input at the time now, then perform the actions it returned."""
        try:
            return step(time.monotonic())
        finally:
            self._perform(self._core.drain())

    def _perform(self, actions: list) -> None:
        for action in actions:
            if isinstance(action, Send):
                self._reply(action.peer, action.msg)
            elif isinstance(action, Release):
                self._engine.disconnect(action.peer_id)
            elif isinstance(action, Watch):
                for h in action.handles:
                    self._engine.on_done(h, self._waker(action.send))
            elif isinstance(action, Again):
                send = action.send
                self._loop.again(action.key, lambda: self._run(lambda now: self._core.landed(send, now)))
            elif isinstance(action, AskCaller):
                self._ask_caller(action)

    def _waker(self, send: Sending) -> Callable[[], None]:
        def wake() -> None:  # on the engine's thread: only hand over
            try:
                self._loop.post(lambda: self._run(lambda now: self._core.landed(send, now)))
            except AgentClosed:
                pass  # closing: the fence settles the request

        return wake

    def _ask_caller(self, ask: AskCaller) -> None:
        if self._on_request is None:
            return
        msg = ask.request
        try:
            self._on_request(msg.room, msg.seq_len, ask.worker_id)
        except PdStateError as exc:  # refused by the caller: the decode's receiver fails with it
            refused = exc
            self._run(lambda now: self._core.caller_refused(ask.peer, msg, refused, now))

    def _encode(self, msg: wire.Message) -> bytes:
        """``msg``'s frame. An ``Accept`` carries only this prefill's own constants (its identity,
        report and timings: ``PrefillHandshake``), so its frame is encoded once and sent as it is
        to every decode that registers (again): the report's encoding was most of a re-registration's
        answer on this side."""
        if type(msg) is not wire.Accept:
            return wire.encode(msg, self.token)
        key = (msg.worker_id, msg.incarnation, id(msg.report), msg.heartbeat_interval_s, msg.peer_timeout_s)
        cached = self._accept_frame
        if cached is None or cached[0] != key or cached[1] is not msg.report:
            cached = self._accept_frame = (key, msg.report, wire.encode(msg, self.token))
        return cached[2]

    def _reply(self, identity: bytes, msg: wire.Message) -> None:
        """Send ``msg`` to the decode ``identity``: every message to a decode but the probes leaves
        here, on the I/O thread (the one seam ``tests/support/tapped.py`` overrides)."""
        frame, sock = self._encode(msg), self._sock
        try:  # ``send_multipart``'s two sends, without its type checks and flag enums (Python, per part)
            sock.send(identity, _MORE)
            sock.send(frame, _NOBLOCK)
        except zmq.ZMQError:
            pass  # gone or full: its heartbeats stop and it fails its own requests

    def _probe(self, identity: bytes, msg: wire.Message) -> bool:
        """Queue ``msg`` to the connection ``identity`` now; False when none has it (ROUTER_MANDATORY) or it is full."""
        try:
            self._sock.send_multipart([identity, wire.encode(msg, self.token)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    def _on_frame(self, sock: zmq.Socket) -> None:
        parts = [sock.recv()]  # ``recv_multipart``, with a plain int for its option enum (Python)
        while sock.get(_RCVMORE):
            parts.append(sock.recv())
        if len(parts) != 2:
            self._run(lambda now: self._core.on_bad_parts(parts, now))
            return
        identity, frame = parts
        try:
            msg: wire.Message | PdStateError = wire.decode(frame, self.token)
        except PdStateError as exc:
            msg = exc
        if isinstance(msg, PdStateError):
            bad = msg
            self._run(lambda now: self._core.on_bad_frame(identity, frame, bad, now))
        else:
            good = msg
            self._run(lambda now: self._core.on_frame(identity, good, now))

    def _on_refused_handshake(self, event: dict) -> None:
        self._run(lambda now: self._core.on_refused_handshake(event, now))

    def _queue_chunk(self, send: Sending, pages: np.ndarray, state: list[np.ndarray] | None) -> None:
        self._run(lambda now: self._core.queue_chunk(send, pages, state, now))
        self._loop.post(lambda: self._run(lambda now: self._core.pump(send, now)))  # send() does not wait for the copy

    def _add_posted(self, sender: KVSender, send: Sending) -> None:
        if not self._unadded.take(send.record):  # the agent closed first: failed for that
            return
        try:
            self._run(lambda now: self._core.add_sender(send, now))
        except Exception as exc:  # the caller's next poll sees it: the sender failed
            sender.posted_error = exc
            if isinstance(exc, PdStateError):
                send.record.fail(exc)

    def _abort(self, send: Sending, reason: str) -> None:
        self._run(lambda now: self._core.abort(send, reason, now))

    def _tick(self) -> None:
        self._run(self._core.on_tick)

    # --- views for tests and probes --------------------------------------------------------------

    def senders(self) -> dict[int, Sending | EndedSender]:
        """The senders by room: a copy of the I/O thread's map, taken on it (live ones, and the
        newest ended ones kept as tombstones: ``EndedSender``)."""
        return self._loop.call(lambda: dict(self._core.sends))

    @property
    def waiting_refused(self) -> int:
        """Decodes' requests refused because ``refusals.MAX_WAITING_REQUESTS`` already waited for
        their senders (a hostile or buggy decode's flood of rooms; ``pdstate_waiting_refused_total``)."""
        return self._core.refusals.overflowed
