"""The prefill's sans-I/O core: every decision of a ``PrefillAgent``, with no socket, thread or clock.

After h11: the inputs are method calls (a decoded frame from a decode, ``on_frame(peer, msg,
now)``; a timer tick, ``on_tick(now)``; the caller's commands: a sender added, a chunk queued, an
abort, a close; an engine outcome: a request's handles may have landed, ``landed(send, now)``),
and the outputs are actions the core appends to its outbox, which the shell (``PrefillAgent``)
drains and performs (``drain()``):

* ``Send(peer, msg)``: one message to the decode on ROUTER identity ``peer``;
* ``Release(peer_id)``: the engine's mapping of a gone decode disconnected (its fences held);
* ``Watch(send, handles)``: call ``landed(send, now)`` when each of ``handles`` finishes (the
  engine's ``on_done``; asked only of an engine that has it, ``wakes=True``);
* ``Again(key, send)``: call ``landed(send, now)`` again in about a millisecond (an engine that
  cannot say when a copy lands; one per key, the last given);
* ``AskCaller(peer, worker_id, request)``: run the caller's ``on_request``; a ``PdStateError``
  it raises comes back as ``caller_refused(peer, request, error, now)``.

The engine is reached through a narrow port (``EnginePort``: the calls whose answer the core's
decisions need at once, such as polling a handle before a fence is said to hold), a test's
in-memory fake or the real engine. ``probe(identity, msg) -> bool`` queues a liveness probe to a
connection (``agent.admission``). The clock comes in as ``now`` on each input; ``stopwatch``
times only a copy's own duration for the request's metrics.

The rules live in objects the core owns and hands what they need: ``Gate`` (which registers
go further, ``agent.admission``), ``Verdicts`` (``agent.fairness``), ``Fences`` (``agent.fence``),
``CopyPipeline`` (``agent.prefill_copy``) and ``Refusals``/``PeerLog`` (``agent.refusals``). A
request's states move by ``protocol.lifecycle``'s table (``RequestRecord``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from pdstate import logs
from pdstate.agent.admission import Gate, Incidents
from pdstate.agent.fairness import VERDICT_TIMEOUT_S, Verdicts
from pdstate.agent.fence import Fences, done_failed
from pdstate.agent.prefill_copy import CopyPipeline
from pdstate.agent.refusals import PeerLog, Refusals
from pdstate.agent.sender import DecodePeer, EndedSender, PendingRequest, Sending
from pdstate.agent.verify import level_of, request_digest, sample_rule_error, weaker
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
from pdstate.protocol.handshake import PrefillHandshake
from pdstate.protocol.lifecycle import PeerState, RequestState
from pdstate.protocol.peers import DecodeSnapshot
from pdstate.protocol.report import ErrorInfo
from pdstate.transfer.engines.shm_owner import challenge_unknown, challenge_unknown_error
from pdstate.transfer.planner import PairPlanner

log = logging.getLogger("pdstate.agent")

__all__ = [
    "ANSWERED",
    "Action",
    "Again",
    "AskCaller",
    "EnginePort",
    "PrefillCore",
    "Release",
    "Send",
    "Watch",
]

KEEP_ENDED_S = 600.0  # an ended sender is kept this long (a late AgentRequest or Abort is answered) ...
MAX_ENDED = 8192  # ... but no more than this many, the oldest forgotten first
# an ended sender keeps only that it was requested: this stands for its request (index lists dropped)
ANSWERED = wire.AgentRequest(
    room=0, dst_kv_pages=wire.PackedIndices.pack([]), dst_state_indices=[], digest=False, deadline_s=1.0
)


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``msg`` to the decode on ROUTER identity ``peer`` (dropped if it is gone or full)."""

    peer: bytes
    msg: wire.Message


@dataclass(frozen=True, slots=True)
class Release:
    """Disconnect the engine's peer ``peer_id`` (a gone decode's mappings and claims)."""

    peer_id: str


@dataclass(frozen=True, slots=True, eq=False)
class Watch:
    """Call ``landed(send, now)`` as each of ``handles`` finishes (the engine's ``on_done``)."""

    send: Sending
    handles: tuple


@dataclass(frozen=True, slots=True, eq=False)
class Again:
    """Call ``landed(send, now)`` again in a moment (one pending call per ``key``, the last given)."""

    key: object
    send: Sending


@dataclass(frozen=True, slots=True)
class AskCaller:
    """Run the caller's ``on_request(room, seq_len, worker_id)`` for ``request`` from ``peer``."""

    peer: bytes
    worker_id: str
    request: wire.AgentRequest


Action = Send | Release | Watch | Again | AskCaller


class EnginePort(Protocol):
    """The engine calls the core makes (``TransferEngine`` has them; core tests pass a fake)."""

    name: str
    proves_ownership: bool

    def submit(self, peer_id: str, plan: Any, **kw: Any) -> Any: ...

    def poll(self, handle: Any) -> bool: ...

    def connect(self, endpoint: Any, owner: str | None = None) -> str: ...

    def disconnect(self, peer_id: str) -> bool: ...

    def peer_regions(self, peer_id: str) -> Any: ...

    def challenge(self, claimant: str, holder: str = "") -> bytes: ...


def _trim(send: Sending) -> None:
    """What an ended sender no longer needs: its handles, digest, queued chunks, index lists."""
    send.handles, send.digest, send.marks = [], None, []
    send.queued.clear()
    send.record.release()
    if send.request is not None:
        send.request = ANSWERED


class PrefillCore:
    """Every decision of one prefill serving decodes: handshakes, requests, chunks, aborts,
    verdicts, heartbeats, fences and timeouts, as inputs in and actions out (see the module).

    ``kv_args``: the caller's ``KVArgs``; ``handshake``: the ``PrefillHandshake`` of this side;
    ``engine``: the ``EnginePort``; ``wakes``: whether the shell can be told when a handle
    finishes (``Watch``), else it is asked to look again (``Again``); ``ask_caller``: whether a
    request for a room with no live sender is handed to the caller (``AskCaller``); ``layout`` and ``devices``:
    this side's buffers for digests (``agent.verify``). Not thread-safe: the shell calls it from
    its I/O thread only, except the queries ``requested``, ``pending_pages``,
    ``pending_state_lengths``, ``refusal`` and ``take_refusal`` (a dict lookup each)."""

    def __init__(
        self,
        kv_args: Any,
        handshake: PrefillHandshake,
        engine: EnginePort,
        *,
        worker_id: str,
        incarnation: str,
        address: str,
        now: float,
        probe: Callable[[bytes, wire.Message], bool],
        stopwatch: Callable[[], float],
        wakes: bool = False,
        ask_caller: bool = False,
        advertise: tuple[str, ...] = (),
        layout: list | None = None,
        devices: list | None = None,
        heartbeat_interval_s: float = 0.5,
        peer_timeout_s: float = 3.0,
        bootstrap_timeout_s: float = 300.0,
        verdict_timeout_s: float = VERDICT_TIMEOUT_S,
        landed_piece_bytes: int = 0,
        verify: str | None = None,
        keep_ended_s: float = KEEP_ENDED_S,
        max_ended: int = MAX_ENDED,
    ) -> None:
        self.kv_args, self.handshake, self.engine, self.wakes = kv_args, handshake, engine, wakes
        self.ask_caller = ask_caller  # whether the caller computes a request once a decode asks
        self.worker_id, self.incarnation, self.address, self.advertise = worker_id, incarnation, address, advertise
        self.layout, self.devices = layout or [], devices or []
        self.heartbeat_interval_s, self.peer_timeout_s = heartbeat_interval_s, peer_timeout_s
        self.bootstrap_timeout_s, self.verdict_timeout_s, self.verify = bootstrap_timeout_s, verdict_timeout_s, verify
        self.keep_ended_s, self.max_ended = keep_ended_s, max_ended
        self.now = self.last_tick = now  # the time of the input being handled
        self.out: list[Action] = []
        self.decodes: dict[bytes, DecodePeer] = {}
        self.sends: dict[int, Sending | EndedSender] = {}  # live senders, and ended ones as tombstones
        self.pending: dict[int, PendingRequest] = {}  # requests that wait for their sender
        self.handshakes = {"accepted": 0, "rejected": 0}  # answers given
        self.auth_failures = Incidents()  # refused CURVE handshakes and frames refused for their auth tag
        self.withheld = Incidents("verdict")  # decodes dropped for withheld verdicts (``agent.fairness``)
        self.peer_log = PeerLog()  # every decode that registered (``peers()``)
        clock = self._clock
        self.fences = Fences(engine, self.decodes, self._reply, self._watch, self._again, self._disconnect, clock)
        self.copy = CopyPipeline(
            kv_args,
            engine,
            self.decodes,
            self.fences,
            self._reply,
            self._watch,
            self._again,
            clock,
            stopwatch,
            landed_piece_bytes,
        )
        self.refusals = Refusals(self.sends, self.pending, self.fences.fail, self._reply)
        self.verdicts = Verdicts(self, self.decodes, self.fences.fail, self.decode_gone)
        self.gate = Gate(self, self.decodes, engine, handshake, probe, self._reply)

    # --- outbox -----------------------------------------------------------------------------------

    def drain(self) -> list[Action]:
        """The actions appended since the last drain, in order; the shell performs each."""
        out, self.out = self.out, []
        return out

    def _clock(self) -> float:
        return self.now

    def _reply(self, identity: bytes, msg: wire.Message) -> None:
        self.out.append(Send(identity, msg))

    def _disconnect(self, peer_id: str) -> None:
        self.out.append(Release(peer_id))

    def _watch(self, send: Sending) -> bool:
        """Ask to be told when the request's handles submitted since the last ask finish; False
        when the engine cannot say (the caller asks ``Again``)."""
        if not self.wakes:
            return False
        new = tuple(send.handles[send.watched :])
        send.watched = len(send.handles)
        if new:
            self.out.append(Watch(send, new))
        return True

    def _again(self, key: object, send: Sending) -> None:
        self.out.append(Again(key, send))

    # --- the caller's commands --------------------------------------------------------------------

    def add_sender(self, send: Sending, now: float) -> Sending:
        """A new sender; a request that waits for its room is attached to it."""
        self.now = now
        room = send.record.room
        old = self.sends.get(room)
        if old is not None and not old.record.state.terminal:
            raise ProtocolError(f"room {room} already has a live sender")
        self.sends[room] = send
        pending = self.pending.pop(room, None)
        if pending is not None:
            self._attach(send, pending.identity, pending.msg)
        return send

    def queue_chunk(self, send: Sending, pages: np.ndarray, state: list[np.ndarray] | None, now: float) -> None:
        """Queue one chunk of ``send`` (raises what the caller got wrong); ``pump`` submits it."""
        self.now = now
        self.copy.queue_chunk(send, pages, state)

    def pump(self, send: Sending, now: float) -> None:
        """Submit ``send``'s queued chunks once its decode's request is known."""
        self.now = now
        self.copy.pump(send)

    def abort(self, send: Sending, reason: str, now: float) -> None:
        """The caller aborts ``send``: it fails once its fence holds, the decode told."""
        self.now = now
        self.fences.abort(send, reason)

    def landed(self, send: Sending, now: float) -> None:
        """An engine outcome: a handle of ``send`` may have finished (``Watch``, ``Again``)."""
        self.now = now
        self.copy.finish_if_landed(send)

    def refuse(self, room: int, error: PdStateError, now: float) -> bool:
        """Fail the decode's request for ``room`` that waits for its sender with ``error``."""
        self.now = now
        pending = self.pending.pop(room, None)
        if pending is not None:
            self._reply(pending.identity, done_failed(room, error))
        return pending is not None

    def caller_refused(self, identity: bytes, msg: wire.AgentRequest, error: PdStateError, now: float) -> None:
        """The caller's ``on_request`` refused ``msg`` (``AskCaller``): its decode's receiver fails."""
        self.now = now
        waiting = self.pending.get(msg.room)
        if waiting is not None and waiting.msg is msg:
            del self.pending[msg.room]
        self._reply(identity, done_failed(msg.room, error))

    def close(self, reason: str, now: float) -> None:
        """Fail live requests with ``reason`` (``AgentClosed``, fenced). The shell then waits for
        the pending fences' handles (``fencing``) and calls ``end(reason, now)``."""
        self.now = now
        for send in list(self.sends.values()):
            if isinstance(send, Sending) and not send.record.state.terminal:
                self.fences.fail(send, AgentClosed(reason), tell_decode=True)

    def fencing(self) -> list[Sending]:
        """The failing requests whose fence is pending (their handles still in flight)."""
        return list(self.fences.fencing.values())

    def end(self, reason: str, now: float) -> None:
        """The last step of a close: every pending fence ends (confirmed to its decode where
        nothing is in flight), then each accepted decode is told ``Goodbye`` with ``reason``
        (after the confirmations: a decode fails what it still has here once it reads it)."""
        self.now = now
        self.fences.settle_all()
        bye = wire.Goodbye(worker_id=self.worker_id, incarnation=self.incarnation, reason=reason[:1024])
        for identity in list(self.decodes):
            self._reply(identity, bye)

    # --- queries ----------------------------------------------------------------------------------

    def decode_list(self, now: float) -> list[DecodeSnapshot]:
        """The accepted decodes: worker id, incarnation, seconds since last heard."""
        return [DecodeSnapshot(d.worker_id, d.incarnation, round(now - d.last_seen, 3)) for d in self.decodes.values()]

    # --- frames -----------------------------------------------------------------------------------

    def on_bad_frame(self, identity: bytes, frame: bytes, exc: PdStateError, now: float) -> None:
        """A frame from ``identity`` that did not decode (``exc``)."""
        self.now = now
        self.gate.refuse_frame(identity, frame, exc, now)

    def on_bad_parts(self, parts: list[bytes], now: float) -> None:
        """A message of other than one frame after the identity."""
        self.now = now
        self.gate.refuse_parts(parts)

    def on_refused_handshake(self, event: dict, now: float) -> None:
        """A connection that failed the CURVE handshake (the socket monitor's event)."""
        self.now = now
        self.gate.refuse_handshake(event, now)

    def on_frame(self, identity: bytes, msg: wire.Message, now: float) -> None:
        """One decoded frame from the decode on ROUTER identity ``identity``."""
        self.now = now
        decode = self.decodes.get(identity)
        if decode is not None:
            decode.last_seen = now
            kind = type(msg)  # a request's own frames first, by their exact kind (a model's isinstance is ~0.6 us)
            if kind is wire.AgentRequest:
                self._on_request(identity, decode, msg)
                return
            if kind is wire.AgentVerdict:
                self.verdicts.heard(identity)
                self._on_verdict(msg)
                return
        if isinstance(msg, wire.Register):
            self._on_register(identity, msg)
        elif isinstance(msg, wire.Heartbeat) and decode is not None:
            self._reply(identity, wire.Heartbeat(worker_id=self.worker_id, incarnation=self.incarnation, seq=msg.seq))
        elif isinstance(msg, wire.Error) and challenge_unknown(msg.error.message):  # an older decode: say why
            self._reply(identity, wire.Reject(worker_id=self.worker_id, error=ErrorInfo.of(challenge_unknown_error())))
        elif isinstance(msg, wire.Error):  # never answered (PROTOCOL §7); a room of this decode's fails
            self.refusals.on_error(identity, msg)
        elif decode is None and isinstance(msg, wire.Abort) and identity in self.refusals.refused:
            self.refusals.on_refused_abort(identity, msg)
        elif decode is None:
            self._reply(
                identity,
                wire.Error(
                    error=ErrorInfo(type="NotRegistered", message="decode is not registered with this prefill"),
                    room=getattr(msg, "room", None),
                ),
            )
        elif isinstance(msg, wire.AgentRequest):
            self._on_request(identity, decode, msg)
        elif isinstance(msg, wire.Abort):
            self._on_abort(identity, msg)
        elif isinstance(msg, wire.AgentVerdict):
            self.verdicts.heard(identity)
            self._on_verdict(msg)

    def _on_request(self, identity: bytes, decode: DecodePeer, msg: wire.AgentRequest) -> None:
        send = self.sends.get(msg.room)
        if send is None or send.record.state.terminal and send.request is not None:
            full = self.refusals.over_limit(msg.room)  # a hostile or buggy decode's flood of rooms
            if full is not None:
                self._reply(identity, done_failed(msg.room, full))
                return
            self.pending[msg.room] = PendingRequest(identity, msg)
            self.refusals.take_refusal(msg.room)  # asked for (again): not given up
            self.refusals.arrived()
            if self.ask_caller:
                self.out.append(AskCaller(identity, decode.worker_id, msg))
        else:
            self._attach(send, identity, msg)

    def _on_register(self, identity: bytes, msg: wire.Register) -> None:
        if self.gate.gatekeep(identity, msg, self.now):  # another live decode's worker_id, or memory not proven yet
            return
        answer = self.handshake.receive(msg)
        if isinstance(answer, wire.Accept):
            try:
                peer_id, endpoint = self.gate.connect(msg, identity)  # its buffers inside the regions it published
                replaced = self.decodes.get(identity)
                if replaced is not None and replaced.planner.dst_desc == msg.kv:
                    planner = replaced.planner  # registering again, the same buffers: the same plans
                else:
                    planner = PairPlanner(self.kv_args, msg.kv)
            except (PdStateError, ValueError) as exc:
                answer = wire.Reject(worker_id=self.worker_id, error=ErrorInfo.of(exc))
            else:
                olds = [k for k, d in self.decodes.items() if d.worker_id == msg.worker_id and k != identity]
                self.decodes[identity] = DecodePeer(
                    identity, msg.worker_id, msg.incarnation, peer_id, planner, self.now, endpoint=endpoint
                )
                for key in olds:  # after the new one is in: a peer id both share stays connected
                    self.decode_gone(key, f"decode {msg.worker_id} registered again (new incarnation)")
                if replaced is not None:
                    self.fences.release(replaced.peer_id)
        self.refusals.note_handshake(identity, answer)
        accepted = isinstance(answer, wire.Accept)
        self._log_peer(msg, PeerState.ACCEPTED if accepted else PeerState.REJECTED, getattr(answer, "error", None))
        self._reply(identity, answer)

    def _log_peer(self, msg: wire.Register, state: PeerState, error: ErrorInfo | None) -> None:
        self.handshakes[state.value] += 1
        if error is not None:  # an accepted one is logged by the decode, which times its round trip
            logs.refusal(log, what="handshake", peer=msg.worker_id, error_type=error.type, message=error.message)
        self.peer_log.note(msg.worker_id, state, msg.incarnation, msg.report.fingerprint, error)

    def decode_gone(self, identity: bytes, why: str) -> None:
        """Forget the decode on ``identity``: its live requests fail (fenced), its waiting ones
        are dropped, its mapping is released once no fence into it is pending."""
        gone = self.decodes.pop(identity, None)
        if gone is not None:
            self.peer_log.gone(gone.worker_id, gone.incarnation, why)
        for send in self.sends.values():
            if isinstance(send, Sending) and send.identity == identity and not send.record.state.terminal:
                self.fences.fail(send, PeerGone(why), tell_decode=False)
        for room, p in list(self.pending.items()):
            if p.identity == identity:
                del self.pending[room]
        if gone is not None:
            self.fences.release(gone.peer_id)

    def _attach(self, send: Sending, identity: bytes, msg: wire.AgentRequest) -> None:
        if send.request is not None:
            first = self.decodes.get(send.identity)
            by = f"decode {first.worker_id}" if first is not None else "another decode"
            err = ProtocolError(f"room {msg.room} was already requested by {by}")
            self._reply(identity, wire.Error(error=ErrorInfo.of(err), room=msg.room))
            return
        if send.record.state.terminal:
            # aborted on this side before the request came: tell the decode it will get nothing
            self._reply(identity, done_failed(msg.room, send.record.error))
            return
        send.identity, send.request = identity, msg
        send.decode_key = self._decode_key(identity)
        n_dst = len(msg.dst_kv_pages)
        if n_dst != send.num_pages:
            err = IndexCountMismatch(f"main KV: index count mismatch: prefill={send.num_pages}, decode={n_dst}")
            self.fences.fail(send, err, tell_decode=True)
            return
        has_aux = bool(self.kv_args.aux_data_ptrs)
        if msg.dst_aux is not None and (not has_aux or send.aux_index is None):
            err = IndexCountMismatch(
                "aux: the decode names an aux slot, but this prefill "
                + ("has no aux buffers" if not has_aux else "request has no aux_index")
            )
            self.fences.fail(send, err, tell_decode=True)
            return
        level = send.record.metrics["verify"] = level_of(msg.digest, msg.verify)
        if self.verify is not None and weaker(level, self.verify):
            err = VerifyLevelRefused(
                f"room {msg.room}: the decode asks verification {level!r}, below this prefill's transfer.verify {self.verify!r}"
            )
            self.fences.fail(send, err, tell_decode=True)
            return
        if level == "sampled" and (err := sample_rule_error(msg.room, msg.sample_rule)) is not None:
            self.fences.fail(send, err, tell_decode=True)  # a digest by another rule would only mismatch
            return
        n_channels = 1 + len(self.kv_args.state_types)
        send.digest = request_digest(self.layout, self.devices, msg, n_channels, level)
        send.record.move(RequestState.WAITING_FOR_INPUT)
        self.copy.pump(send)

    def _decode_key(self, identity: bytes) -> str | None:
        d = self.decodes.get(identity)
        return None if d is None else f"{d.worker_id}/{d.incarnation}"

    def _on_abort(self, identity: bytes, msg: wire.Abort) -> None:
        send = self.sends.get(msg.room)
        err = TransferAborted(f"aborted by decode: {msg.reason}")
        if isinstance(send, Sending) and not send.record.state.terminal and send.identity is not None:
            mine = self._decode_key(identity)
            if send.identity != identity and (mine is None or send.decode_key != mine):
                return  # another decode's room: nothing to confirm to this one
            send.identity = identity  # the same decode on a new connection: confirmed there
            self.fences.fail(send, err, tell_decode=True)  # confirmed once its fence holds
            return
        if self.pending.pop(msg.room, None) is not None:
            self.refusals.give_up(msg.room, err)  # a sender made later for it fails with this (``refusal``)
        self._reply(identity, done_failed(msg.room, err))  # nothing of it can land: confirm

    def _on_verdict(self, msg: wire.AgentVerdict) -> None:
        send = self.sends.get(msg.room)
        if not isinstance(send, Sending) or send.record.state.terminal or send.fence is not None:
            return  # a failing request ends with its fence
        if msg.status == "success":
            send.record.move(RequestState.SUCCESS)
        else:
            err = msg.error or ErrorInfo(type="TransferFailed", message="decode reported failure")
            send.record.fail(error_from_wire(err.type, err.message))

    # --- ticks ------------------------------------------------------------------------------------

    def on_tick(self, now: float) -> None:
        """Heartbeat loss, overdue verdicts, bootstrap timeouts, ended senders kept or forgotten,
        and landed copies looked at. A tick more than two heartbeat intervals late means this
        process did not run for a while (frozen, swapped out): the decodes are not blamed for it."""
        stalled = now - self.last_tick - 2 * self.heartbeat_interval_s
        self.now = self.last_tick = now
        if stalled > 0:
            for d in self.decodes.values():
                d.last_seen += stalled
        for identity, d in list(self.decodes.items()):
            if now - d.last_seen > self.peer_timeout_s:
                self.decode_gone(identity, f"decode {d.worker_id} missed heartbeats for {self.peer_timeout_s:g} s")
        self.verdicts.check(self.sends.values(), now)
        ended = 0
        for room, send in reversed(list(self.sends.items())):  # newest first
            if send.record.state.terminal:
                ended += 1
                if now - send.record.created > self.keep_ended_s or ended > self.max_ended:
                    del self.sends[room]  # kept a while so a late AgentRequest or Abort is answered
                elif isinstance(send, Sending):
                    _trim(send)  # the caller's KVSender may keep it a while: drop what it no longer needs
                    self.sends[room] = EndedSender.of(send, ANSWERED)
                continue
            if send.record.state is RequestState.BOOTSTRAPPING and now - send.record.created > self.bootstrap_timeout_s:
                self.fences.fail(
                    send,
                    TransferFailed(f"room {room}: no decode asked for it within {self.bootstrap_timeout_s:g} s"),
                    tell_decode=False,
                )
                continue
            self.copy.finish_if_landed(send)
