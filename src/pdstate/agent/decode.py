"""The decode agent: receives from any number of prefill agents, one ``KVReceiver`` per request.

``DecodeAgent`` is the shell of the decode's sans-I/O core (``agent.decode_core``): it owns the
I/O thread, the sockets (one DEALER per prefill), the engine and the clock, feeds the core what
happens (frames, session events, ticks, the caller's commands) and performs the actions it
hands back, in order."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from pdstate.agent import curve
from pdstate.agent.admission import Incidents
from pdstate.agent.common import AgentLifetime, AgentLoop, RequestRecord, channel_layout, regions_of
from pdstate.agent.decode_core import (
    DecodeCore,
    DecodeTimers,
    Dial,
    Hangup,
    Notify,
    PickSample,
    Refused,
    RequestForm,
    Send,
)
from pdstate.agent.decode_frames import Digest, Updates
from pdstate.agent.posted import PostedAdds
from pdstate.agent.receiver import KVReceiver, Receiving
from pdstate.agent.verify import DEFAULT_LEVEL, check_level, layout_devices, on_device, request_digest
from pdstate.errors import AuthError, EngineError, PdStateError
from pdstate.protocol import wire
from pdstate.protocol.handshake import DecodeHandshake, LocalSide
from pdstate.protocol.peers import PrefillSnapshot
from pdstate.transfer.engines.base import TransferEngine, create_engine

__all__ = ["DecodeAgent", "KVReceiver"]

log = logging.getLogger("pdstate.agent")

# a DEALER's events the core hears of: its sessions, and failed CURVE handshakes
SESSION_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | curve.HANDSHAKE_EVENTS
_NOBLOCK = int(zmq.NOBLOCK)  # a plain int: the flag enum's conversions run in Python
CLOSE_REASON = "decode shutting down"  # the close's reason (``DecodeCore.close`` fails live requests with it)


@dataclass(slots=True)
class Link:
    """The shell's connection to one prefill: its DEALER."""

    sock: zmq.Socket


class EnginePort:
    """The decode core's port (``decode_frames.DecodePort``) over the engine and the caller's
    memory: proofs of ownership, digests of the landed bytes (``devices``: per buffer, host or
    device)."""

    def __init__(self, engine: TransferEngine, layout: list, devices: list) -> None:
        self.engine, self.layout, self.devices = engine, layout, devices

    def prove(self, nonce: bytes, audience: str) -> dict:
        return self.engine.prove(nonce, audience)

    def on_device(self) -> bool:
        return on_device(self.devices)

    def open_digest(self, request: wire.AgentRequest, level: str, form: str | None) -> Digest:
        return request_digest(self.layout, self.devices, request, 1 + len(request.dst_state_indices), level, form)

    def settle(self, digest: Any, updates: Updates) -> tuple[bytes, float]:
        t0 = time.perf_counter()
        digest.update_many(updates)  # waits for the background work first
        mine = digest.digest()
        return mine, time.perf_counter() - t0


class DecodeAgent(AgentLifetime):
    """Receives DSV4 state into the caller's memory from any number of prefill agents.

    ``kv_args``: the caller's filled ``KVArgs`` (``aux_data_*`` too when metadata moves);
    ``pools``: the caller's ``(target, draft)`` for the layout report (or ``report=``). The agent
    registers that memory with the engine; it never allocates, frees or writes it (the prefill's
    engine writes it). With the ``shm`` engine every buffer must lie in a shared file mapping
    under ``/dev/shm`` the prefill may map (e.g. tensors from ``pdstate.pools.memory.SharedMemory``:
    a ``pdstate-<pid>-...`` file, mode 0600, same user); private memory is refused here, in the
    constructor, with ``EngineError``. The ``loopback`` (same process), ``mooncake`` and ``nixl``
    engines register arbitrary memory.

    A prefill is named per request (``receiver(address, room)``); the first use of an address
    connects and shakes hands (cached), a refusal fails only that prefill's requests with the
    prefill's error (upstream's text), and a prefill that restarts (a new incarnation in its
    heartbeat answers) or stops answering for ``peer_timeout_s`` fails its requests with
    ``PeerGone`` and is shaken hands with again on next use.

    ``verify`` (``sampled`` by default, ``full``, ``off``; ``digest=False`` means ``off``) is the
    verification level every request asks (``pdstate.agent.verify``); each receiver's metrics
    name the level that ran (``verify``). ``devices``: where its digests read, per channel of
    the digest layout and per buffer, ``None`` (host) or a torch device name (default: where the
    memory lies, ``verify.layout_devices``).

    Threading contract:

    * One I/O thread per agent owns the sockets and every request's state; it starts in the
      constructor and ends in ``close()``.
    * ``receiver()``, ``KVReceiver.init/abort/poll/wait/failure_exception/metrics``,
      ``prefills()``, ``connect()``, ``reregister()``, ``forget()`` and ``close()`` are safe from
      any thread. ``init`` returns once the request
      is queued; ``abort`` blocks until the fence (see ``KVReceiver.abort``).
    * The caller must not reuse a request's destination pages until its receiver is ``fenced``
      (terminal, and nothing more of it can land): a SUCCESS is; a FAILED one is once the
      prefill confirmed (it fences before it confirms), was never told where to write, or is
      proven gone (restarted; or dead: a control session it had completed closed, shm at once,
      the other engines ``dead_prefill_release_s`` later, no session with its address completed
      meanwhile, ``agent.landing``). A prefill gone silent proves nothing (it, or this decode, may
      be frozen): its requests fail at once but stay unfenced until it confirms, after this decode
      registers with it again (``KVReceiver.add_fence_callback``).
    """

    def __init__(
        self,
        kv_args,
        pools=None,
        *,
        engine: str = "shm",
        engine_options: dict | None = None,
        worker_id: str | None = None,
        report=None,
        digest: bool = True,
        verify: str = DEFAULT_LEVEL,
        heartbeat_interval_s: float = 0.5,
        peer_timeout_s: float = 3.0,
        handshake_timeout_s: float = 10.0,
        transfer_timeout_s: float = 600.0,
        token: bytes | None = None,
        key_dir: str | None = None,
        devices: list | None = None,
        dead_prefill_release_s: float = 300.0,
    ) -> None:
        if not dead_prefill_release_s > 0:
            raise ValueError(f"dead_prefill_release_s must be > 0, got {dead_prefill_release_s!r}")
        self._keys = curve.control_keys(token, key_dir)  # first: a key file refused is a ConfigError
        if report is None:
            if pools is None:
                raise ValueError("DecodeAgent needs pools=(target, draft) or report= for the handshake")
            from pdstate.pools.reporting import build_report

            report, _ = build_report(*pools)
        self.kv_args, self.token = kv_args, token
        self.verify = check_level(verify) if digest else "off"  # ``digest=False``: off, as before the levels
        self.digest = self.verify != "off"
        self.worker_id = worker_id or f"decode-{secrets.token_hex(4)}"
        self.incarnation = secrets.token_hex(8)
        self.heartbeat_interval_s, self.peer_timeout_s = heartbeat_interval_s, peer_timeout_s
        self.handshake_timeout_s, self.transfer_timeout_s = handshake_timeout_s, transfer_timeout_s
        self._engine: TransferEngine = create_engine(engine, **(engine_options or {}))
        self._engine.start()
        try:
            self._engine.register(regions_of(kv_args))
            endpoint = self._engine.endpoint()
        except EngineError as exc:
            self._engine.close()
            raise type(exc)(f"DecodeAgent cannot publish its memory on the {engine} engine: {exc}") from exc
        except BaseException:
            self._engine.close()
            raise
        kv = wire.KVDesc.of(kv_args) if report.local_check.ok else None
        self._handshake = DecodeHandshake(
            LocalSide(
                worker_id=self.worker_id,
                incarnation=self.incarnation,
                report=report,
                kv=kv,
                engine=wire.EngineDesc(name=self._engine.name, endpoint=endpoint),
            )
        )
        aux = (
            wire.AuxDest(ptrs=list(kv_args.aux_data_ptrs), item_lens=list(kv_args.aux_item_lens), index=0)
            if kv_args.aux_data_ptrs
            else None
        )
        layout = channel_layout(kv_args, kv_args.aux_data_ptrs, kv_args.aux_item_lens)
        if devices is None:
            devices = layout_devices(layout)  # host (None) or device, per buffer
        elif [len(ds) for ds in devices] != [len(ptrs) for ptrs, _ in layout]:
            self._engine.close()
            raise ValueError(
                f"devices names {[len(ds) for ds in devices]} buffers per channel; "
                f"this decode's digests read {[len(ptrs) for ptrs, _ in layout]}"
            )
        self._port = EnginePort(self._engine, layout, devices)
        self._core = DecodeCore(
            worker_id=self.worker_id,
            incarnation=self.incarnation,
            handshake=self._handshake,
            form=RequestForm(
                digest=self.digest,
                verify=self.verify,
                aux=aux,
                state_types=[str(getattr(t, "value", t)) for t in kv_args.state_types],
            ),
            port=self._port,
            synchronous=self._engine.synchronous,
            timers=DecodeTimers(
                heartbeat_interval_s, peer_timeout_s, handshake_timeout_s, transfer_timeout_s, dead_prefill_release_s
            ),
            now=time.monotonic(),
        )
        self._register_frame = wire.encode(self._core.register, self.token)  # sent as it is
        self._prefills: dict[str, Link] = {}  # the sockets, by prefill address (the core has their state)
        self._recvs = self._core.recvs  # the live requests (the core's: read on the I/O thread only)
        self.handshakes = self._core.handshakes  # answers received, written by the I/O thread only
        self.auth_failures = Incidents()  # failed CURVE handshakes, answers refused for their tag
        self._unadded = PostedAdds("receiver")  # posted receivers the I/O thread has not added yet
        self._loop = AgentLoop(f"pdstate-decode-{self.worker_id}", min(0.05, heartbeat_interval_s / 2), self._tick)
        self._loop.start()

    # --- public ---------------------------------------------------------------------------------

    def receiver(self, prefill: str, room: int, *, redial_gone: bool = True, posted: bool = False) -> KVReceiver:
        """The receiver of request ``room`` from the prefill agent at ``prefill`` (its address).
        A gone prefill is dialled afresh for it; with ``redial_gone=False`` the receiver fails at
        once with the reason that prefill went instead (a caller that redials with ``connect``).

        ``posted=True``: returns without waiting for the I/O thread, which adds the receiver next
        (before any later call's work); what would have raised here (a live receiver of the room
        from that prefill) fails the returned receiver with that error instead."""
        recv = Receiving(RequestRecord(room), prefill)
        core = self._core
        if not posted:
            recv = self._in_loop(lambda now: core.add(recv, now, redial_gone))
        receiver = KVReceiver(
            recv,
            call=self._loop.call,
            post=self._loop.post,
            init=lambda r, pages, state, aux, seq_len: self._feed(
                lambda now: core.init(r, pages, state, aux, seq_len, now)
            ),
            abort=lambda r, reason: self._feed(lambda _now: core.abort(r, reason)),
            on_fence=lambda r, fn: self._feed(lambda _now: core.on_fence(r, fn)),
        )
        if posted:
            self._unadded.post(recv.record, self._loop.post, lambda: self._add_posted(receiver, recv, redial_gone))
        return receiver

    def _add_posted(self, receiver: KVReceiver, recv: Receiving, redial_gone: bool) -> None:
        if not self._unadded.take(recv.record):  # the agent closed first: failed for that
            return
        try:
            self._feed(lambda now: self._core.add(recv, now, redial_gone))
        except Exception as exc:  # the caller's next poll sees it: the receiver failed
            receiver.posted_error = exc
            if isinstance(exc, PdStateError):
                recv.record.fail(exc)

    def accepted(self, prefill: str) -> bool:
        """Whether the prefill agent at ``prefill`` (its address) has accepted this decode now,
        read without the I/O thread: a receiver made for it now starts ``WAITING_FOR_INPUT`` (a
        caller that posts its receivers can answer so before the I/O thread added them)."""
        return self._core.accepted(prefill)

    def prefills(self) -> dict[str, PrefillSnapshot]:
        """Every prefill this agent used, by address: a ``PrefillSnapshot`` each (``state``,
        ``worker_id``, ``incarnation``, ``handshakes``, ``error`` as an ``ErrorInfo`` or ``None``,
        ``fingerprint`` (its layout's, from its Accept), ``handshake_s`` (the latest accepted
        handshake's round trip) and ``registered_s_ago`` (seconds since the latest Register went
        out: how old a refusal is))."""
        return self._loop.call(lambda: self._core.snapshot(time.monotonic()))

    def register_message(self) -> wire.Register:
        """The ``Register`` this agent sends its prefills, without an ownership proof: its
        identity, layout, KVArgs and endpoint (a test or a probe that speaks for it)."""
        return self._handshake.register_message()

    def connect(self, prefill: str) -> None:
        """Shake hands with the prefill at ``prefill`` now, before any request names it (a
        service's readiness). A new address is dialled (PENDING until it answers). A gone prefill
        is dialled again but stays GONE, with its error, until it accepts: call this again to
        repeat the register (a service's watcher does, every heartbeat interval), while requests
        that name it meanwhile can still be refused with the reason it went. A prefill that is
        pending, accepted or refused is left as it is (``reregister`` asks a refusing one again).
        Returns at once; ``prefills()`` tells the outcome."""
        self._in_loop(lambda now: self._core.connect(prefill, now))

    def forget(self, prefill: str) -> bool:
        """Close the connection to the prefill at ``prefill`` unless it has live requests (then
        False); a later request or ``connect`` dials it afresh."""
        return self._in_loop(lambda _now: self._core.forget(prefill))

    def reregister(self, prefill: str) -> None:
        """Register with the prefill at ``prefill`` again, whatever its state (after it was fixed,
        or to measure a handshake); its live requests are kept and sent again if it restarted."""
        self._in_loop(lambda now: self._core.reregister(prefill, now))

    def unfenced(self) -> int:
        """Ended requests whose prefill may still write their pages (not fenced yet)."""
        return self._loop.call(self._core.unfenced)

    def close(self) -> None:
        """Fail live requests (``decode shutting down``), close sockets and the engine (the
        caller's memory is left as it is)."""
        if self._loop.closed:
            return

        def final() -> None:
            self._feed(lambda _now: self._core.close())
            self._unadded.close(CLOSE_REASON)  # posted receivers not added yet, and those behind this

        try:
            self._stop(final)
        finally:
            self._unadded.close(CLOSE_REASON)  # posted, never run: the thread ended first

    # --- I/O thread: feeding the core, performing its actions -----------------------------------

    def _in_loop(self, step: Callable[[float], Any]) -> Any:
        """Run ``step(now)`` on the I/O thread (its result, or its exception, back here)."""
        return self._loop.call(lambda: self._feed(step))

    def _feed(self, step: Callable[[float], Any]) -> Any:
        """Give the core one input (``step(now)``), then perform the actions it handed back,
        also when the input raised (the caller's mistake) after some were."""
        try:
            return step(time.monotonic())
        finally:
            self._perform()

    def _perform(self) -> None:
        for action in self._core.drain():
            if isinstance(action, Send):
                self._send(action.peer, action.msg)
            elif isinstance(action, Dial):
                self._dial(action.peer)
            elif isinstance(action, Hangup):
                link = self._prefills.pop(action.peer, None)
                if link is not None:
                    self._loop.unwatch(link.sock)
            elif isinstance(action, Notify):
                try:
                    action.callback()
                except Exception:  # a caller's callback must not break the I/O thread
                    log.exception("room %d: a fence callback failed", action.room)
            elif isinstance(action, Refused):
                self.auth_failures.note(action.error, action.peer)
            elif isinstance(action, PickSample):
                self._core.pick_sample(action.recv)  # after the request's frame went out

    def _send(self, address: str, msg: wire.Message) -> None:
        link = self._prefills.get(address)
        if link is None:
            return
        frame = self._register_frame if msg is self._core.register else wire.encode(msg, self.token)
        try:
            link.sock.send(frame, _NOBLOCK)
        except zmq.ZMQError:
            pass  # not connected yet or gone: heartbeats and timeouts decide

    def _dial(self, address: str) -> None:
        """A fresh DEALER to the prefill at ``address`` (the old one closed: nothing queued for
        the dead process): this incarnation's identity, the domain's CURVE keys
        (``agent.curve``), its frames and its session events watched (``unwatch`` ends both)."""
        old = self._prefills.pop(address, None)
        if old is not None:
            self._loop.unwatch(old.sock)
        sock = self._loop.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"{self.worker_id}/{self.incarnation}/{secrets.token_hex(4)}".encode())
        sock.setsockopt(zmq.SNDHWM, 10000)
        curve.dial(sock, self._keys)
        self._loop.watch(sock, lambda s, a=address: self._on_frame(a, s))
        self._loop.monitor(sock, SESSION_EVENTS, lambda event, a=address, s=sock: self._on_session(a, s, event))
        sock.connect(address)
        self._prefills[address] = Link(sock)

    def _current(self, address: str, sock: zmq.Socket) -> bool:
        link = self._prefills.get(address)
        return link is not None and link.sock is sock

    def _on_frame(self, address: str, sock: zmq.Socket) -> None:
        frame = sock.recv()
        if not self._current(address, sock):
            return
        try:
            msg = wire.decode(frame, self.token)
        except AuthError as exc:
            self._feed(lambda _now, e=exc: self._core.on_bad_tag(address, e))
            return
        except PdStateError:
            return
        self._feed(lambda now: self._core.on_frame(address, msg, now))

    def _on_session(self, address: str, sock: zmq.Socket, event: dict) -> None:
        if not self._current(address, sock):
            return
        kind, core = event["event"], self._core
        if kind & curve.HANDSHAKE_EVENTS:
            error = curve.handshake_error(event, address)
            no_detail = kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            self._feed(lambda now: core.on_auth_failed(address, error, no_detail, now))
        elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            core.on_session_up(address)
        else:
            self._feed(lambda now: core.on_session_closed(address, now))

    def _tick(self) -> None:
        self._feed(self._core.on_tick)

    # --- a view for tests and probes ----------------------------------------------------------------

    def receivers(self) -> dict[tuple[str, int], Receiving]:
        """The live requests by ``(prefill address, room)``: a copy of the I/O thread's map, taken
        on it (a request leaves the map once it ended, at a tick)."""
        return self._loop.call(lambda: dict(self._core.recvs))

    def quarantined_pages(self) -> int:
        """The destination pages (main KV) of the ``unfenced()`` requests: what a caller keeps out
        of its free pool until each is fenced."""
        return self._loop.call(self._core.quarantined_pages)
