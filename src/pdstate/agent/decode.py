"""The decode agent: receives from any number of prefill agents, one ``KVReceiver`` per request."""

from __future__ import annotations

import secrets
import time

import numpy as np
import zmq

from pdstate.agent import curve
from pdstate.agent.admission import Incidents
from pdstate.agent.common import AgentLifetime, AgentLoop, RequestRecord, channel_layout, regions_of
from pdstate.agent.decode_frames import RETRY_MAX_S, DecodeFrames
from pdstate.agent.landing import Landing
from pdstate.agent.receiver import KVReceiver, PrefillPeer, Receiving
from pdstate.agent.verify import DEFAULT_LEVEL, check_level, layout_devices, on_device
from pdstate.errors import (
    AgentClosed,
    EngineError,
    PdStateError,
    PeerGone,
    ProtocolError,
    TransferAborted,
)
from pdstate.protocol import wire
from pdstate.protocol.handshake import DecodeHandshake, LocalSide
from pdstate.protocol.lifecycle import PeerState, RequestState, move
from pdstate.protocol.peers import PrefillSnapshot
from pdstate.protocol.report import ErrorInfo
from pdstate.transfer.engines.base import TransferEngine, create_engine

__all__ = ["DecodeAgent", "KVReceiver"]

_S = RequestState


class DecodeAgent(AgentLifetime, DecodeFrames):
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
    name the level that ran (``verify``).

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
      proven gone (restarted). A prefill gone silent proves nothing (it, or this decode, may be
      frozen): its requests fail at once but stay unfenced until it confirms, after this decode
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
    ) -> None:
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
        self._aux = (
            wire.AuxDest(ptrs=list(kv_args.aux_data_ptrs), item_lens=list(kv_args.aux_item_lens), index=0)
            if kv_args.aux_data_ptrs
            else None
        )
        self._layout = channel_layout(kv_args, kv_args.aux_data_ptrs, kv_args.aux_item_lens)
        self._register_frame = wire.encode(self._handshake.register_message(), self.token)  # sent as it is
        self._devices = layout_devices(self._layout)  # host (None) or device, per buffer
        self._prefills: dict[str, PrefillPeer] = {}
        self.handshakes = {"accepted": 0, "rejected": 0}  # answers received, written by the I/O thread only
        self.auth_failures = Incidents()  # failed CURVE handshakes, answers refused for their tag
        self._redial_s = max(1.0, 2 * heartbeat_interval_s)  # a gone prefill's register, sent again at most this often
        self._recvs: dict[tuple[str, int], Receiving] = {}
        self._landing = Landing()  # ended requests a prefill may still write, until it confirms
        self._last_tick = time.monotonic()
        self._loop = AgentLoop(f"pdstate-decode-{self.worker_id}", min(0.05, heartbeat_interval_s / 2), self._tick)
        self._loop.start()

    # --- public ---------------------------------------------------------------------------------

    def receiver(self, prefill: str, room: int, *, redial_gone: bool = True) -> KVReceiver:
        """The receiver of request ``room`` from the prefill agent at ``prefill`` (its address).
        A gone prefill is dialled afresh for it; with ``redial_gone=False`` the receiver fails at
        once with the reason that prefill went instead (a caller that redials with ``connect``)."""
        recv = Receiving(RequestRecord(room), prefill)
        added = self._loop.call(lambda: self._add(recv, redial_gone))
        return KVReceiver(
            added, call=self._loop.call, init=self._init, abort=self._abort, on_fence=self._landing.on_fence
        )

    def prefills(self) -> dict[str, PrefillSnapshot]:
        """Every prefill this agent used, by address: a ``PrefillSnapshot`` each (``state``,
        ``worker_id``, ``incarnation``, ``handshakes``, ``error`` as an ``ErrorInfo`` or ``None``,
        ``fingerprint`` (its layout's, from its Accept), ``handshake_s`` (the latest accepted
        handshake's round trip) and ``registered_s_ago`` (seconds since the latest Register went
        out: how old a refusal is))."""

        def snap() -> dict[str, PrefillSnapshot]:
            now = time.monotonic()
            return {
                a: PrefillSnapshot(
                    a,
                    p.state,
                    p.worker_id,
                    p.incarnation,
                    p.handshakes,
                    None if p.error is None else ErrorInfo.of(p.error),
                    p.fingerprint,
                    p.handshake_s,
                    round(now - p.registered_at, 3),
                )
                for a, p in self._prefills.items()
            }

        return self._loop.call(snap)

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

        def run() -> None:
            p = self._prefills.get(prefill)
            if p is None:
                self._connect(prefill)
            elif p.state is PeerState.GONE:
                self._redial(p)

        self._loop.call(run)

    def forget(self, prefill: str) -> bool:
        """Close the connection to the prefill at ``prefill`` unless it has live requests (then
        False); a later request or ``connect`` dials it afresh."""

        def run() -> bool:
            p = self._prefills.get(prefill)
            if p is not None:
                if any(True for _ in self._live(prefill)) or self._landing.holds(prefill):
                    return False  # (an unconfirmed request is asked again at its next Accept)
                self._loop.unwatch(p.sock)
                del self._prefills[prefill]
            return True

        return self._loop.call(run)

    def reregister(self, prefill: str) -> None:
        """Register with the prefill at ``prefill`` again, whatever its state (after it was fixed,
        or to measure a handshake); its live requests are kept and sent again if it restarted."""

        def run() -> None:
            p = self._prefills.get(prefill)
            if p is None or p.state is PeerState.GONE:
                self._reconnect(prefill, p)
            else:
                self._register(p)

        self._loop.call(run)

    def close(self) -> None:
        """Fail live requests (``decode shutting down``), close sockets and the engine (the
        caller's memory is left as it is)."""
        if self._loop.closed:
            return

        def final() -> None:
            for recv in self._recvs.values():
                recv.record.fail(AgentClosed("decode shutting down"))
                self._drop_digest(recv)  # after close returns no thread reads the caller's memory

        self._stop(final)

    # --- I/O thread -------------------------------------------------------------------------------

    def _send(self, p: PrefillPeer, msg: wire.Message | bytes) -> None:
        try:
            p.sock.send(msg if isinstance(msg, bytes) else wire.encode(msg, self.token), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # not connected yet or gone: heartbeats and timeouts decide

    def _connect(self, address: str, handshakes: int = 0) -> PrefillPeer:
        sock = self._dealer(address)
        sock.connect(address)
        p = PrefillPeer(address, sock, handshakes=handshakes)
        self._prefills[address] = p
        self._register(p)
        return p

    def _reconnect(self, address: str, old: PrefillPeer | None) -> PrefillPeer:
        if old is None:
            return self._connect(address)
        self._loop.unwatch(old.sock)  # a fresh socket: nothing queued for the dead process
        p = self._connect(address, old.handshakes)
        p.epoch = old.epoch  # registrations keep counting: what earlier ones asked is told apart
        p.last_incarnation = old.last_incarnation
        return p

    def _redial(self, p: PrefillPeer) -> None:
        """Register with a gone prefill again on a fresh socket, keeping it GONE (and its error)
        until it answers. The register waits in the socket until a process listens there; it is
        sent afresh (new socket, nothing stale queued) only after ``_redial_s`` without an answer
        and without a frame from that prefill (so a challenge round under way is never cut)."""
        now = time.monotonic()
        if p.redial and min(now - p.registered_at, now - p.last_seen) < self._redial_s:
            return
        error = p.error
        q = self._reconnect(p.address, p)  # a fresh socket (PENDING), then back to GONE meanwhile
        move(q, PeerState.GONE)
        q.error, q.redial = error, True

    def _register(self, p: PrefillPeer) -> None:
        if p.state is not PeerState.PENDING:
            move(p, PeerState.PENDING)
        p.error, p.registered_at, p.handshakes = None, time.monotonic(), p.handshakes + 1
        self._send(p, self._register_frame)

    def _retry(self, p: PrefillPeer) -> None:
        """Register again with a prefill that refused this decode for a passing reason, keeping
        it REJECTED (and its error) until it answers; the next try waits twice as long."""
        p.retry_s = min(RETRY_MAX_S, 2 * p.retry_s)
        p.registered_at, p.handshakes, p.redial = time.monotonic(), p.handshakes + 1, True
        self._send(p, self._register_frame)

    def _add(self, recv: Receiving, redial_gone: bool = True) -> Receiving:
        key = (recv.prefill, recv.record.room)
        old = self._recvs.get(key)
        if old is not None and not old.record.state.terminal:
            raise ProtocolError(f"room {recv.record.room} from {recv.prefill} already has a live receiver")
        self._recvs[key] = recv
        recv.record.add_done_callback(lambda _record: self._landing.ended(recv))
        p = self._prefills.get(recv.prefill)
        if p is not None and p.state is PeerState.GONE and not redial_gone:
            recv.record.fail(type(p.error)(str(p.error)) if p.error else PeerGone(f"prefill {p.address} is gone"))
            return recv
        if p is None or p.state is PeerState.GONE:
            p = self._reconnect(recv.prefill, p)
        elif p.state is PeerState.REJECTED:
            self._register(p)  # the prefill may have been fixed: ask again
        p.rooms.add(recv.record.room)
        if p.state is PeerState.ACCEPTED:
            recv.record.move(_S.WAITING_FOR_INPUT)
        return recv

    def _init(
        self, recv: Receiving, pages: np.ndarray, state: list[np.ndarray], aux_index: int | None, seq_len: int | None
    ) -> None:
        if recv.record.state.terminal:
            raise recv.record.error or ProtocolError(f"room {recv.record.room} is finished")
        if recv.request is not None:
            raise ProtocolError(f"room {recv.record.room}: init() called twice")
        if len(state) != len(self.kv_args.state_types):
            raise ValueError(
                f"state_indices: {len(state)} lists given, the layout has {len(self.kv_args.state_types)} "
                f"components {[getattr(t, 'value', t) for t in self.kv_args.state_types]}"
            )
        aux = None
        if aux_index is not None:
            if self._aux is None:
                raise ValueError("aux_index given, but this agent's KVArgs has no aux buffers")
            aux = self._aux.model_copy(update={"index": int(aux_index)})
        recv.request = wire.AgentRequest(
            room=recv.record.room,
            dst_kv_pages=wire.PackedIndices.pack(pages),
            dst_state_indices=[wire.PackedIndices.pack(s) for s in state],
            dst_aux=aux,
            digest=self.digest,
            verify="sampled" if self.verify == "sampled" else None,
            digest_form="device" if self.digest and on_device(self._devices) else None,
            deadline_s=min(3600.0, self.transfer_timeout_s),
            seq_len=seq_len,
        )
        self._maybe_send(recv)

    def _maybe_send(self, recv: Receiving) -> None:
        p = self._prefills.get(recv.prefill)
        if recv.sent or recv.request is None or p is None or p.state is not PeerState.ACCEPTED:
            return
        if recv.record.state is _S.BOOTSTRAPPING:
            recv.record.move(_S.WAITING_FOR_INPUT)
        recv.sent_to = (p.incarnation, p.epoch)
        if recv.record.state is not _S.TRANSFERRING:  # else: sent again to a restarted prefill
            recv.record.move(_S.TRANSFERRING)
        recv.sent_at = time.monotonic()
        recv.digest, recv.hashed = None, (0, False)  # sent again: everything lands again
        self._send(p, recv.request)

    def _abort(self, recv: Receiving, reason: str) -> None:
        if recv.record.state.terminal or recv.aborting is not None:
            return
        recv.aborting = reason
        p = self._prefills.get(recv.prefill)
        if not recv.sent or p is None or p.state is not PeerState.ACCEPTED:
            # the prefill never learned where to write: nothing of it can land
            recv.record.fail(TransferAborted(f"aborted by decode: {reason}"))
            return
        self._send(p, wire.Abort(room=recv.record.room, reason=reason[:1024]))

    def _live(self, address: str):
        for (a, _), recv in self._recvs.items():
            if a == address and not recv.record.state.terminal:
                yield recv

    def _fail_prefill(self, p: PrefillPeer, error: PdStateError, state: PeerState) -> None:
        if p.state is not state:
            move(p, state)
        p.error = error
        for recv in list(self._live(p.address)):
            recv.record.fail(type(error)(str(error)))
            if state is PeerState.REJECTED:  # the prefill fails its sender of this room too
                self._send(p, wire.Abort(room=recv.record.room, reason=f"refused: {error}"[:1024]))

    def _restarted(self, p: PrefillPeer, incarnation: str) -> None:
        """The prefill at ``p.address`` is a new process: what the old one was sending is lost.

        Called at the new process's Accept. ZeroMQ delivers in order, so every request this
        decode sent before its new Register reached either the old process (still ``sent``:
        lost) or the new one, which answered ``NotRegistered`` before its Accept (``sent`` was
        cleared: it goes out again now)."""
        err = PeerGone(f"prefill {p.address} restarted (incarnation {p.incarnation} -> {incarnation})")
        for recv in list(self._live(p.address)):
            if recv.sent:
                recv.record.fail(PeerGone(str(err)))
        # a new process holds the address the old one listened on: the old one let its control
        # socket go, which it does once its fences held, or it is dead; nothing of it lands any more
        self._confirm(p.address, lambda r: r.sent_to is not None and r.sent_to[0] == p.incarnation)

    def _confirm(self, address: str, which, room: int | None = None) -> None:
        """Every request from ``address`` (of ``room`` only), live or ended unfenced, for which
        ``which(recv)`` holds is fenced (``agent.landing``)."""
        live = [r for (a, rm), r in self._recvs.items() if a == address and (room is None or rm == room)]
        self._landing.confirm(live, address, which, room)

    def unfenced(self) -> int:
        """Ended requests whose prefill may still write their pages (not fenced yet)."""
        return self._loop.call(self._landing.count)

    @staticmethod
    def _drop_digest(recv: Receiving) -> None:
        """Stop hashing an ended request's pages early (``wire.Landed``): the work not started is
        dropped and the running part waited for, so nothing reads pages the caller may free."""
        if recv.digest is not None:
            recv.digest.cancel()
            recv.digest = None

    def _tick(self) -> None:
        now = self._tick_time(self._prefills.values())
        for key, recv in list(self._recvs.items()):
            if recv.record.state.terminal:
                del self._recvs[key]  # the caller holds its KVReceiver; the agent forgets it
                self._drop_digest(recv)
                continue
            sent_at = recv.sent_at
            if sent_at is not None and recv.aborting is None and now - sent_at > self.transfer_timeout_s:
                self._abort(recv, f"no TransferDone within transfer_timeout_s={self.transfer_timeout_s:g} s")
        for p in list(self._prefills.values()):
            if p.state is PeerState.REJECTED and p.retry_s and now - p.registered_at >= p.retry_s:
                self._retry(p)
            elif p.state is PeerState.PENDING and now - p.registered_at > self.handshake_timeout_s:
                self._fail_prefill(
                    p,
                    PeerGone(f"prefill {p.address} did not answer the handshake within {self.handshake_timeout_s:g} s"),
                    PeerState.GONE,
                )
            elif p.state is PeerState.ACCEPTED:
                if now - p.last_seen > self.peer_timeout_s:
                    self._fail_prefill(
                        p,
                        PeerGone(f"prefill {p.address} missed heartbeats for {self.peer_timeout_s:g} s"),
                        PeerState.GONE,
                    )
                elif now - p.last_heartbeat >= self.heartbeat_interval_s:
                    p.last_heartbeat, p.seq = now, p.seq + 1
                    self._send(p, wire.Heartbeat(worker_id=self.worker_id, incarnation=self.incarnation, seq=p.seq))
