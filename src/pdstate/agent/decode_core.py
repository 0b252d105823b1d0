"""The decode agent's sans-I/O core: its prefills by address, its requests, their fences.

After h11: inputs are method calls -- a decoded frame from a prefill (``on_frame``), a session
event of the connection to it (``on_session_up``/``on_session_closed``/``on_auth_failed``), a
timer tick (``on_tick``), the caller's commands (``add``, ``init``, ``abort``, ``connect``,
``forget``, ``reregister``, ``close``) -- each with the clock as ``now`` where it matters;
outputs are actions appended to an outbox the shell drains (``drain()``): ``Dial`` a fresh
connection, ``Send`` a message, ``Hangup``, ``Notify`` (a caller's fence callback, run by the
shell), ``Refused`` (an auth refusal to count) and ``PickSample`` (handed back to the core, once
the request's frame before it went out, as ``pick_sample``). No socket, thread or clock in here:
the shell (``agent.decode.DecodeAgent``) owns those and performs the actions in order. The engine is reached
through a narrow port (``DecodePort``): the proof of memory ownership a prefill asks and the
digest of the landed bytes (``agent.decode_frames``).

Fences (``agent.landing``): a request failed because its prefill went silent stays unfenced
until that prefill confirms (its ``TransferDone``, its goodbye), restarts, or -- with a
synchronous engine -- a control session it completed closes. Silence alone never releases one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from pdstate import logs
from pdstate.agent.decode_frames import DecodePort, LandedDigests
from pdstate.agent.landing import Landing
from pdstate.agent.receiver import PrefillPeer, Receiving
from pdstate.agent.verify import SAMPLE_RULE
from pdstate.errors import (
    AgentClosed,
    AuthError,
    PdStateError,
    PeerGone,
    ProtocolError,
    TransferAborted,
    error_from_wire,
)
from pdstate.protocol import wire
from pdstate.protocol.lifecycle import PeerState, RequestState, move
from pdstate.protocol.peers import PrefillSnapshot
from pdstate.protocol.report import ErrorInfo

__all__ = [
    "Action",
    "DecodeCore",
    "DecodePort",
    "DecodeTimers",
    "Dial",
    "Handshake",
    "Hangup",
    "Notify",
    "PickSample",
    "Refused",
    "RequestForm",
    "Send",
]

log = logging.getLogger("pdstate.agent")

_S = RequestState
_P = PeerState
NO_DETAIL_WINDOW_S = 2.0  # two handshakes cut short within this long: the prefill's key differs
RETRY_MAX_S = 30.0  # the longest wait between two registers with a prefill that refused this decode
# refusals that pass (another live incarnation holds the worker id, a challenge evicted or
# expired, a prefill busy): registered again with backoff (``_retry``); any other is final
PASSING_REFUSALS = frozenset({"WorkerIdInUse", "InvalidEndpoint", "PrefillBusy", "NotRegistered", "PeerGone"})


# --- actions: what the shell performs, in order -------------------------------------------------


@dataclass(frozen=True, slots=True)
class Dial:
    """Open a fresh connection to the prefill at ``peer`` (closing the one it had: nothing queued
    for a dead process goes out), watching its frames and session events."""

    peer: str


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``msg`` to the prefill at ``peer`` without blocking (a frame that cannot go is
    dropped: heartbeats and timeouts decide)."""

    peer: str
    msg: wire.Message


@dataclass(frozen=True, slots=True)
class Hangup:
    """Close the connection to the prefill at ``peer``."""

    peer: str


@dataclass(frozen=True, slots=True)
class Notify:
    """Run a caller's callback (a fence callback of request ``room``), outside the core; one that
    raises is logged."""

    callback: Callable[[], None]
    room: int


@dataclass(frozen=True, slots=True)
class Refused:
    """A prefill's answer refused for its auth (a token on one side only, a CURVE key that
    differs): count it and log it (``admission.Incidents``)."""

    peer: str
    error: AuthError


@dataclass(frozen=True, slots=True)
class PickSample:
    """Give the core ``DecodeCore.pick_sample(recv)`` once the actions before it are performed:
    a request just sent opens its digest and picks its sample after its frame went out, not
    before (the prefill's work starts a digest's opening earlier)."""

    recv: Receiving


Action = Dial | Send | Hangup | Notify | Refused | PickSample


@dataclass(frozen=True, slots=True)
class DecodeTimers:
    heartbeat_interval_s: float = 0.5
    peer_timeout_s: float = 3.0
    handshake_timeout_s: float = 10.0
    transfer_timeout_s: float = 600.0
    # a completed session's close -> its requests fenced (async engines; ``agent.landing``)
    dead_prefill_release_s: float = 300.0

    @property
    def redial_s(self) -> float:
        """A gone prefill's register is sent again at most this often (and a refusal that passes
        is first retried after it)."""
        return max(1.0, 2 * self.heartbeat_interval_s)


class Handshake(Protocol):
    """The decode's side of the handshake (``protocol.handshake.DecodeHandshake``)."""

    def register_message(self, proof: dict | None = None) -> wire.Register: ...

    def receive(self, msg: wire.Accept | wire.Reject) -> wire.Accept: ...


@dataclass(frozen=True, slots=True)
class RequestForm:
    """What every request of this decode asks: its verification, its aux buffers, its layout's
    state components (``KVArgs.state_types``' names)."""

    digest: bool
    verify: str
    aux: wire.AuxDest | None
    state_types: Sequence[str] = field(default_factory=tuple)


class DecodeCore:
    """The decode agent's state and decisions, driven by one thread (the shell's I/O thread).

    ``peers`` (address -> ``PrefillPeer``) and ``recvs`` ((address, room) -> ``Receiving``) are
    its state; ``handshakes`` counts the answers taken. ``register``: the ``Register`` this decode
    sends (the shell may keep its encoding)."""

    def __init__(
        self,
        *,
        worker_id: str,
        incarnation: str,
        handshake: Handshake,
        form: RequestForm,
        port: DecodePort,
        synchronous: bool,
        timers: DecodeTimers,
        now: float,
    ) -> None:
        self.worker_id, self.incarnation = worker_id, incarnation
        self.handshake, self.form, self.port, self.timers = handshake, form, port, timers
        self.synchronous = synchronous  # a copy ends within its submit (shm): a closed session proves
        self.register = handshake.register_message()
        self.peers: dict[str, PrefillPeer] = {}
        self.recvs: dict[tuple[str, int], Receiving] = {}
        self.handshakes = {"accepted": 0, "rejected": 0}
        self._out: list[Action] = []
        self.landing = Landing(lambda room, fn: self._out.append(Notify(fn, room)))
        self.digests = LandedDigests(port, form.digest)
        self._last_tick = now

    def drain(self) -> list[Action]:
        """The actions since the last drain, in order."""
        out, self._out = self._out, []
        return out

    def accepted(self, prefill: str) -> bool:
        """Whether the prefill at ``prefill`` has accepted this decode's handshake now (a request
        added for it would start at ``WAITING_FOR_INPUT``). One dictionary look and one attribute
        read: safe from another thread beside the I/O thread's writes."""
        p = self.peers.get(prefill)
        return p is not None and p.state is _P.ACCEPTED

    def pick_sample(self, recv: Receiving) -> None:
        """A request sent (``PickSample``): open its digest and pick its sample (``sampled``) in
        the background, unless it ended or is aborting meanwhile."""
        if recv.sent and recv.aborting is None and not recv.record.state.terminal:
            self.digests.prepare(recv)

    # --- the caller's commands ----------------------------------------------------------------

    def add(self, recv: Receiving, now: float, redial_gone: bool = True) -> Receiving:
        """A new request (its ``Receiving``) from ``recv.prefill``; that prefill is dialled if new
        or gone (or, ``redial_gone=False``, the request fails with the reason it went)."""
        key = (recv.prefill, recv.record.room)
        old = self.recvs.get(key)
        if old is not None and not old.record.state.terminal:
            raise ProtocolError(f"room {recv.record.room} from {recv.prefill} already has a live receiver")
        self.recvs[key] = recv
        recv.record.add_done_callback(lambda _record: self.landing.ended(recv))
        p = self.peers.get(recv.prefill)
        if p is not None and p.state is _P.GONE and not redial_gone:
            recv.record.fail(type(p.error)(str(p.error)) if p.error else PeerGone(f"prefill {p.address} is gone"))
            return recv
        if p is None or p.state is _P.GONE:
            p = self._reconnect(recv.prefill, p, now)
        elif p.state is _P.REJECTED:
            self._register(p, now)  # the prefill may have been fixed: ask again
        p.rooms.add(recv.record.room)
        if p.state is _P.ACCEPTED:
            recv.record.move(_S.WAITING_FOR_INPUT)
        return recv

    def init(
        self,
        recv: Receiving,
        pages: np.ndarray,
        state: list[np.ndarray],
        aux_index: int | None,
        seq_len: int | None,
        now: float,
    ) -> None:
        """Name ``recv``'s destination; it goes out once its prefill accepted this decode."""
        if recv.record.state.terminal:
            raise recv.record.error or ProtocolError(f"room {recv.record.room} is finished")
        if recv.request is not None:
            raise ProtocolError(f"room {recv.record.room}: init() called twice")
        form = self.form
        if len(state) != len(form.state_types):
            raise ValueError(
                f"state_indices: {len(state)} lists given, the layout has {len(form.state_types)} "
                f"components {list(form.state_types)}"
            )
        aux = None
        if aux_index is not None:
            if form.aux is None:
                raise ValueError("aux_index given, but this agent's KVArgs has no aux buffers")
            aux = form.aux.model_copy(update={"index": int(aux_index)})
        recv.request = wire.AgentRequest(
            room=recv.record.room,
            dst_kv_pages=wire.PackedIndices.pack(pages),
            dst_state_indices=[wire.PackedIndices.pack(s) for s in state],
            dst_aux=aux,
            digest=form.digest,
            verify="sampled" if form.verify == "sampled" else None,
            sample_rule=SAMPLE_RULE if form.verify == "sampled" else None,
            digest_form="device" if form.digest and self.port.on_device() else None,
            deadline_s=min(3600.0, self.timers.transfer_timeout_s),
            seq_len=seq_len,
        )
        self._maybe_send(recv, now)

    def abort(self, recv: Receiving, reason: str) -> None:
        """Abort ``recv``: at once if no prefill was told where to write, else once its prefill
        confirms (its ``TransferDone``)."""
        if recv.record.state.terminal or recv.aborting is not None:
            return
        recv.aborting = reason
        p = self.peers.get(recv.prefill)
        if not recv.sent or p is None or p.state is not _P.ACCEPTED:
            # the prefill never learned where to write: nothing of it can land
            recv.record.fail(TransferAborted(f"aborted by decode: {reason}"))
            return
        self._send(p, wire.Abort(room=recv.record.room, reason=reason[:1024]))

    def on_fence(self, recv: Receiving, fn: Callable[[], None]) -> None:
        """Notify ``fn`` once ``recv`` is terminal and fenced (at the next drain, if it is)."""
        self.landing.on_fence(recv, fn)

    def connect(self, address: str, now: float) -> None:
        """Dial a new prefill; register with a gone one again (it stays GONE until it answers)."""
        p = self.peers.get(address)
        if p is None:
            self._connect(address, now)
        elif p.state is _P.GONE:
            self._redial(p, now)

    def forget(self, address: str) -> bool:
        """Hang up on a prefill without live or unfenced requests (else False)."""
        p = self.peers.get(address)
        if p is not None:
            if any(True for _ in self._live(address)) or self.landing.holds(address):
                return False  # (an unconfirmed request is asked again at its next Accept)
            del self.peers[address]
            self._out.append(Hangup(address))
        return True

    def reregister(self, address: str, now: float) -> None:
        """Register with a prefill again, whatever its state (a gone one on a fresh connection)."""
        p = self.peers.get(address)
        if p is None or p.state is _P.GONE:
            self._reconnect(address, p, now)
        else:
            self._register(p, now)

    def close(self) -> None:
        """Fail every live request (``decode shutting down``) and stop hashing their pages."""
        for recv in self.recvs.values():
            recv.record.fail(AgentClosed("decode shutting down"))
            self.digests.drop(recv)  # after close returns no thread reads the caller's memory

    # --- what the caller reads ----------------------------------------------------------------

    def snapshot(self, now: float) -> dict[str, PrefillSnapshot]:
        """Every prefill this decode used, by address (``DecodeAgent.prefills``)."""
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
            for a, p in self.peers.items()
        }

    def unfenced(self) -> int:
        """Ended requests whose prefill may still write their pages."""
        return self.landing.count()

    def quarantined_pages(self) -> int:
        """The destination pages (main KV) of those requests."""
        return self.landing.pages()

    # --- the clock ----------------------------------------------------------------------------

    def on_tick(self, now: float) -> None:
        """Forget ended requests, time out transfers, handshakes and silent prefills, retry
        passing refusals, send heartbeats. A tick more than two heartbeat intervals late means
        this process did not run meanwhile (frozen, swapped out): the prefills are not blamed."""
        t = self.timers
        stalled = now - self._last_tick - 2 * t.heartbeat_interval_s
        self._last_tick = now
        if stalled > 0:
            for peer in self.peers.values():
                peer.last_seen += stalled
            self.landing.stalled(stalled)  # what waited in this process's own buffers lands after it
        for key, recv in list(self.recvs.items()):
            if recv.record.state.terminal:
                del self.recvs[key]  # the caller holds its KVReceiver; the core forgets it
                self.digests.drop(recv)
                continue
            sent_at = recv.sent_at
            if sent_at is not None and recv.aborting is None and now - sent_at > t.transfer_timeout_s:
                self.abort(recv, f"no TransferDone within transfer_timeout_s={t.transfer_timeout_s:g} s")
        for p in list(self.peers.values()):
            if p.state is _P.REJECTED and p.retry_s and now - p.registered_at >= p.retry_s:
                self._retry(p, now)
            elif p.state is _P.PENDING and now - p.registered_at > t.handshake_timeout_s:
                why = f"prefill {p.address} did not answer the handshake within {t.handshake_timeout_s:g} s"
                self._fail_prefill(p, PeerGone(why), _P.GONE)
            elif p.state is _P.ACCEPTED:
                if now - p.last_seen > t.peer_timeout_s:
                    why = f"prefill {p.address} missed heartbeats for {t.peer_timeout_s:g} s"
                    self._fail_prefill(p, PeerGone(why), _P.GONE)
                elif now - p.last_heartbeat >= t.heartbeat_interval_s:
                    p.last_heartbeat, p.seq = now, p.seq + 1
                    self._send(p, wire.Heartbeat(worker_id=self.worker_id, incarnation=self.incarnation, seq=p.seq))
        for address, incarnation in self.landing.past_horizon(now, t.dead_prefill_release_s):
            self._confirm(address, _sent_to(incarnation))  # its process is gone (``agent.landing``)

    # --- frames and session events ------------------------------------------------------------

    def on_frame(self, address: str, msg: wire.Message, now: float) -> None:
        """A frame from the prefill at ``address``, decoded (on its current connection)."""
        p = self.peers.get(address)
        if p is None:
            return
        p.last_seen = now
        if type(msg) is wire.TransferDone:  # a request's own frame first (a model's isinstance is ~0.6 us)
            self._on_done(p, msg, now)
        elif isinstance(msg, (wire.Accept, wire.Reject)):
            self._on_handshake(p, msg, now)
        elif isinstance(msg, wire.Challenge):
            if p.state is _P.PENDING or p.redial:  # prove the memory this decode named is its own
                # ... to the prefill at the address it dialled (``audience``): a proof relayed
                # through another address is worthless to the prefill (``agent.admission``)
                proof = self.port.prove(msg.nonce, f"{self.worker_id}/{self.incarnation}@{p.address}")
                self._send(p, self.handshake.register_message({**proof, "audience": p.address}))
        elif isinstance(msg, wire.Heartbeat):
            if p.state is _P.ACCEPTED and msg.incarnation != p.incarnation:
                self._register(p, now)  # a new process at that address: what the old one had fails at its Accept
        elif isinstance(msg, wire.TransferDone):
            self._on_done(p, msg, now)
        elif isinstance(msg, wire.Landed):
            recv = self.recvs.get((address, msg.room))
            if recv is not None and not recv.record.state.terminal and recv.sent and recv.aborting is None:
                self.digests.landed(recv, msg)
        elif isinstance(msg, wire.Goodbye):
            if p.state is _P.ACCEPTED and msg.incarnation == p.incarnation:
                # its requests have ended and nothing of them lands any more: fail them now
                self._fail_prefill(p, PeerGone(msg.reason), _P.GONE)
                self._confirm(address, _sent_to(msg.incarnation))
        elif isinstance(msg, wire.Error):
            self._on_error(p, msg, now)

    def on_bad_tag(self, address: str, exc: AuthError) -> None:
        """A frame from ``address`` refused for its auth tag: the answer to this register, from
        a prefill with a token on one side only, refuses it."""
        p = self.peers.get(address)
        if p is not None and (p.state is _P.PENDING or p.redial):
            self._auth_refused(p, AuthError(f"prefill {p.address} answered: {exc}"))

    def on_session_up(self, address: str) -> None:
        """The connection to ``address`` completed a session (its CURVE handshake)."""
        p = self.peers.get(address)
        if p is not None:
            p.session_up = True
            self.landing.session_up(address)

    def on_session_closed(self, address: str, now: float) -> None:
        """The connection to ``address`` closed. With a synchronous engine (shm: a copy ends
        within its submit, on the prefill's own thread), a session that completed its handshake
        and then closed means the prefill process exited (the kernel closes its sockets after its
        memory is gone) or closed its control socket (after its fences held): nothing it was
        told lands any more. A session that never completed (a frozen process) proves nothing.
        With an engine whose copies outlive the writer's I/O thread, the close starts a horizon
        (``timers.dead_prefill_release_s``, ``agent.landing``) at whose end, no session with that
        address completed since, its requests are fenced (``on_tick``)."""
        p = self.peers.get(address)
        if p is None or not (p.session_up and p.last_incarnation):
            return
        p.session_up = False
        if self.synchronous:
            self._confirm(address, _sent_to(p.last_incarnation))
        else:
            self.landing.session_closed(address, p.last_incarnation, now)

    def on_auth_failed(self, address: str, error: AuthError, no_detail: bool, now: float) -> None:
        """The CURVE handshake with ``address`` failed (``error``, ``agent.curve``): nothing of
        this decode's reached it. Its register waits in the connection, which is dialled again:
        the prefill is refused once, and its answer is still awaited (``redial``), so a handshake
        that succeeds later is taken as usual. ``no_detail``: a connection closed mid-handshake --
        a key that differs (again at each redial) or a prefill that died or froze during it
        (once): only the second within ``NO_DETAIL_WINDOW_S`` is taken for the key."""
        p = self.peers.get(address)
        if p is None or not (p.state is _P.PENDING or p.redial):
            return
        if no_detail:
            last, p.no_detail_at = p.no_detail_at, now
            if now - last > NO_DETAIL_WINDOW_S:
                return
        if not (p.state is _P.REJECTED and isinstance(p.error, AuthError)):  # told once per register
            self._auth_refused(p, error)
        p.redial = True

    # --- inside -------------------------------------------------------------------------------

    def _send(self, p: PrefillPeer, msg: wire.Message) -> None:
        self._out.append(Send(p.address, msg))

    def _connect(self, address: str, now: float, handshakes: int = 0) -> PrefillPeer:
        self._out.append(Dial(address))
        p = PrefillPeer(address, handshakes=handshakes, registered_at=now, last_seen=now)
        self.peers[address] = p
        self._register(p, now)
        return p

    def _reconnect(self, address: str, old: PrefillPeer | None, now: float) -> PrefillPeer:
        if old is None:
            return self._connect(address, now)
        p = self._connect(address, now, old.handshakes)  # a fresh connection: nothing queued for the dead process
        p.epoch = old.epoch  # registrations keep counting: what earlier ones asked is told apart
        p.last_incarnation = old.last_incarnation
        return p

    def _redial(self, p: PrefillPeer, now: float) -> None:
        """Register with a gone prefill again on a fresh connection, keeping it GONE (and its
        error) until it answers; sent afresh only after ``redial_s`` without an answer and without
        a frame from that prefill (so a challenge round under way is never cut)."""
        if p.redial and min(now - p.registered_at, now - p.last_seen) < self.timers.redial_s:
            return
        error = p.error
        q = self._reconnect(p.address, p, now)  # PENDING, then back to GONE meanwhile
        move(q, _P.GONE)
        q.error, q.redial = error, True

    def _register(self, p: PrefillPeer, now: float) -> None:
        if p.state is not _P.PENDING:
            move(p, _P.PENDING)
        p.error, p.registered_at, p.handshakes = None, now, p.handshakes + 1
        self._send(p, self.register)

    def _retry(self, p: PrefillPeer, now: float) -> None:
        """Register again with a prefill that refused this decode for a passing reason, keeping
        it REJECTED (and its error) until it answers; the next try waits twice as long."""
        p.retry_s = min(RETRY_MAX_S, 2 * p.retry_s)
        p.registered_at, p.handshakes, p.redial = now, p.handshakes + 1, True
        self._send(p, self.register)

    def _maybe_send(self, recv: Receiving, now: float) -> None:
        p = self.peers.get(recv.prefill)
        if recv.sent or recv.request is None or p is None or p.state is not _P.ACCEPTED:
            return
        if recv.record.state is _S.BOOTSTRAPPING:
            recv.record.move(_S.WAITING_FOR_INPUT)
        recv.sent_to = (p.incarnation, p.epoch)
        if recv.record.state is not _S.TRANSFERRING:  # else: sent again to a restarted prefill
            recv.record.move(_S.TRANSFERRING)
        recv.sent_at = now
        self.digests.restart(recv)  # sent again: everything lands again
        self._send(p, recv.request)
        if self.digests.wants_sample(recv):  # once the request is out: its sample, while the prefill copies
            self._out.append(PickSample(recv))

    def _live(self, address: str) -> Iterator[Receiving]:
        for (a, _), recv in self.recvs.items():
            if a == address and not recv.record.state.terminal:
                yield recv

    def _fail_prefill(self, p: PrefillPeer, error: PdStateError, state: PeerState) -> None:
        if p.state is not state:
            move(p, state)
        p.error = error
        for recv in list(self._live(p.address)):
            recv.record.fail(type(error)(str(error)))
            if state is _P.REJECTED:  # the prefill fails its sender of this room too
                self._send(p, wire.Abort(room=recv.record.room, reason=f"refused: {error}"[:1024]))

    def _confirm(self, address: str, which: Callable[[Receiving], bool], room: int | None = None) -> None:
        """Every request from ``address`` (of ``room`` only), live or ended unfenced, for which
        ``which(recv)`` holds is fenced (``agent.landing``)."""
        live = [r for (a, rm), r in self.recvs.items() if a == address and (room is None or rm == room)]
        self.landing.confirm(live, address, which, room)

    def _auth_refused(self, p: PrefillPeer, err: AuthError) -> None:
        p.redial = False
        self._out.append(Refused(p.address, err))
        self.handshakes["rejected"] += 1
        self._fail_prefill(p, err, _P.REJECTED)

    def _on_handshake(self, p: PrefillPeer, msg: wire.Accept | wire.Reject, now: float) -> None:
        if p.state is not _P.PENDING and not p.redial:
            return
        p.redial = False
        try:
            accept = self.handshake.receive(msg)
        except (PdStateError, RuntimeError, ValueError) as exc:
            err = exc if isinstance(exc, PdStateError) else error_from_wire(type(exc).__name__, str(exc))
            self.handshakes["rejected"] += 1
            logs.refusal(log, what="handshake", peer=p.address, error_type=type(err).__name__, message=str(err))
            self._fail_prefill(p, err, _P.REJECTED)
            p.retry_s = (p.retry_s or self.timers.redial_s) if type(err).__name__ in PASSING_REFUSALS else 0.0
            return
        self.handshakes["accepted"] += 1
        p.retry_s = 0.0
        if p.incarnation and accept.incarnation != p.incarnation:
            self._restarted(p, accept.incarnation)
        if p.state is not _P.ACCEPTED:
            move(p, _P.ACCEPTED)
        p.epoch += 1  # a registration of its own: a late TransferDone names the ones before
        p.incarnation, p.worker_id, p.error = accept.incarnation, accept.worker_id, None
        p.last_incarnation = accept.incarnation
        p.fingerprint = accept.report.fingerprint
        p.last_seen = now
        p.handshake_s = round(now - p.registered_at, 6)
        logs.handshake(log, peer=p.address, fingerprint=p.fingerprint, seconds=p.handshake_s)
        for recv in list(self._live(p.address)):
            if recv.record.state is _S.BOOTSTRAPPING:
                recv.record.move(_S.WAITING_FOR_INPUT)
            self._maybe_send(recv, now)
        # what an earlier registration with this process asked and has no confirmation of: ask
        # again here; the prefill answers each once nothing of it can land
        for recv in self.landing.earlier(p.address, p.epoch):
            self._send(p, wire.Abort(room=recv.record.room, reason="confirm the fence of an earlier registration"))

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
        self._confirm(p.address, _sent_to(p.incarnation))

    def _on_error(self, p: PrefillPeer, msg: wire.Error, now: float) -> None:
        if msg.error.type == "NotRegistered":
            # a new incarnation got this request, so the old one never did: send it again once
            # the new one accepted this decode
            recv = self.recvs.get((p.address, msg.room)) if msg.room is not None else None
            if recv is not None and not recv.record.state.terminal:
                recv.sent_to = None
            if p.state is _P.ACCEPTED:
                self._register(p, now)
        elif msg.room is not None:
            recv = self.recvs.get((p.address, msg.room))
            if recv is not None:
                recv.record.fail(error_from_wire(msg.error.type, msg.error.message))

    def _on_done(self, p: PrefillPeer, msg: wire.TransferDone, now: float) -> None:
        recv = self.recvs.get((p.address, msg.room))
        if recv is None or recv.record.state.terminal or not recv.sent:
            # the confirmation of a request that ended here first (an abort, a silent prefill)
            self._confirm(p.address, lambda r: r.record.state.terminal and r.sent_to is not None, msg.room)
            return
        recv.acked = True  # the prefill sends TransferDone once no copy of the room is in flight
        rec = recv.record
        rec.metrics.update(bytes=msg.bytes, descriptors=msg.descriptors, copy_s=msg.copy_s)
        if recv.sent_at is not None:
            rec.metrics["transfer_s"] = round(now - recv.sent_at, 6)
        if recv.aborting is not None:
            # the prefill sends TransferDone only once its writes of this room are finished
            rec.fail(TransferAborted(f"aborted by decode: {recv.aborting}"))
            return
        if msg.status == "failed":
            err = msg.error or ErrorInfo(type="TransferFailed", message="prefill reported failure")
            rec.fail(error_from_wire(err.type, err.message))
            return
        verdict_error = self.digests.verdict(recv, msg)
        if verdict_error is None:
            rec.move(_S.SUCCESS)  # the outcome is known here: the prefill is told after
            self._send(p, wire.AgentVerdict(room=msg.room, status="success"))
        else:
            rec.fail(verdict_error)
            self._send(p, wire.AgentVerdict(room=msg.room, status="failed", error=ErrorInfo.of(verdict_error)))


def _sent_to(incarnation: str) -> Callable[[Receiving], bool]:
    """Whether a request went to the prefill process ``incarnation``."""
    return lambda r: r.sent_to is not None and r.sent_to[0] == incarnation
