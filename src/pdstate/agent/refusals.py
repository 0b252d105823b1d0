"""What a prefill (``Refusals``, owned by ``agent.prefill_core.PrefillCore``) does about the decodes it refused at the handshake, and its waiting rooms.

A refused decode fails its own receivers at once (the prefill's ``Reject`` carries the error), but
the prefill's senders for those rooms would wait for a request that never comes. So a refused
decode sends an ``Abort`` for each room it gives up, and the prefill fails that room with the very
error it refused the decode with (upstream's class and text): the live sender at once, or, when
the caller has not made it yet, the sender made later (``refusal(room)`` tells the caller before).
A request its decode aborts while it waits for its sender is given up the same way, and so is
one its decode reports an ``error`` for (``on_error``; the live sender fails, fenced, at once).

What is kept is bounded whatever decodes send: the refusal of each of the latest
``MAX_REFUSED_DECODES`` refused connections (an ``ErrorInfo``, its texts clipped where they
entered: ``pdstate.protocol.report``), and the error of each of the latest ``MAX_REFUSED_ROOMS``
rooms given up (built from such a refusal, or an abort's reason of at most 1024 characters).

``PeerLog``: every decode that registered, its latest record, bounded in count and error text.

``requested(room)`` says whether a decode's request for ``room`` is waiting for its sender: an
engine whose prefill learns the page count only after the decode asked (SGLang's scheduler) polls
it to leave its bootstrapping state. Both read without the I/O thread (a dict lookup).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pdstate.agent.fence import done_failed
from pdstate.errors import PdStateError, TransferFailed, error_from_wire
from pdstate.protocol import wire
from pdstate.protocol.lifecycle import PeerState, move
from pdstate.protocol.peers import PeerSnapshot
from pdstate.protocol.report import ErrorInfo

__all__ = ["PeerLog", "PeerRecord", "Refusals"]

MAX_REFUSED_ROOMS = 65536  # rooms given up before their sender existed, oldest forgotten first
MAX_REFUSED_DECODES = 1024  # refused connections whose refusal is kept, oldest forgotten first
MAX_PEER_LOG = 1024  # decodes ``PeerLog`` remembers ...
MAX_PEER_LOG_TEXT = 1 << 20  # ... and the characters of their errors' messages, all records together
# decodes' requests that wait for their sender (a room the caller has not made a sender for yet),
# all decodes together: one more, for a new room, is refused (``Refusals.over_limit``)
MAX_WAITING_REQUESTS = 65536


@dataclass(slots=True)
class PeerRecord:
    """What ``PeerLog`` keeps of one decode: its latest register and where it stands, moved by
    ``protocol.lifecycle``'s peer table (PENDING -> ACCEPTED or REJECTED; ACCEPTED -> GONE)."""

    worker_id: str
    incarnation: str
    fingerprint: str
    error: ErrorInfo | None = None
    state: PeerState = field(default=PeerState.PENDING, init=False)

    def snapshot(self) -> PeerSnapshot:
        return PeerSnapshot(self.worker_id, self.state, self.incarnation, self.fingerprint, self.error)


class PeerLog:
    """Every decode that registered with a prefill, by worker id: its latest record
    (``PrefillAgent.peers()``, hence ``/v1/compat`` and an SGLang rank's status snapshots). Past
    ``MAX_PEER_LOG`` records or ``MAX_PEER_LOG_TEXT`` characters of error messages, the least
    recently registered decode that is not accepted is forgotten first (an accepted one only when
    every record is one's): refused registers cannot push an accepted decode out, and what the
    list carries of them stays bounded. Run on the agent's I/O thread."""

    def __init__(self) -> None:
        self._log: OrderedDict[str, PeerRecord] = OrderedDict()

    def records(self) -> list[PeerSnapshot]:
        return [r.snapshot() for r in self._log.values()]

    def note(
        self, worker_id: str, state: PeerState, incarnation: str, fingerprint: str, error: ErrorInfo | None
    ) -> None:
        """The answer to a register of ``worker_id`` (``ACCEPTED`` or ``REJECTED``)."""
        self._log.pop(worker_id, None)
        record = PeerRecord(worker_id, incarnation, fingerprint, error)
        move(record, state)
        self._log[worker_id] = record
        text = sum(len(r.error.message) for r in self._log.values() if r.error is not None)
        while len(self._log) > MAX_PEER_LOG or text > MAX_PEER_LOG_TEXT:
            oldest = next((k for k, r in self._log.items() if r.state is not PeerState.ACCEPTED), None)
            entry = self._log.pop(oldest) if oldest is not None else self._log.popitem(last=False)[1]
            text -= len(entry.error.message) if entry.error is not None else 0

    def gone(self, worker_id: str, incarnation: str, why: str) -> None:
        """The accepted decode ``worker_id/incarnation`` is gone (``why``)."""
        record = self._log.get(worker_id)
        if record is not None and record.incarnation == incarnation and record.state is PeerState.ACCEPTED:
            move(record, PeerState.GONE)
            record.error = ErrorInfo(type="PeerGone", message=why)


class Refusals:
    """The refusals and waiting rooms of one prefill core, over what the core hands them: its
    senders (``room -> Sending | EndedSender``) and waiting requests (``room -> PendingRequest``),
    ``fail(send, err, tell_decode=)`` (its fences) and ``reply(identity, msg)``. The queries
    (``requested`` ...) are read from any thread (a dict lookup); the rest runs on the I/O thread."""

    def __init__(
        self,
        sends: Mapping[int, Any],
        pending: dict[int, Any],
        fail: Callable[..., None],
        reply: Callable[[bytes, wire.Message], None],
    ) -> None:
        self.sends, self.pending, self.fail, self.reply = sends, pending, fail, reply
        self.refused: dict[bytes, ErrorInfo] = {}  # decode identity -> the refusal it got
        self.rooms: OrderedDict[int, PdStateError] = OrderedDict()  # rooms given up, and why
        # requests that came to wait and rooms given up, so far: a reader watching for its rooms
        # (``requested``, ``take_refusal``) looks again only once this moved (``arrived``)
        self.arrivals = 0
        self.overflowed = 0  # requests refused: MAX_WAITING_REQUESTS already waited

    def arrived(self) -> None:
        """A request came to wait for its sender, or a room was given up (``arrivals``)."""
        self.arrivals += 1

    def over_limit(self, room: int) -> PdStateError | None:
        """The refusal of a decode's request for ``room`` that would wait for its sender beside
        ``MAX_WAITING_REQUESTS`` others (counted in ``overflowed``); None: it may wait. A room
        already waiting is asked again, not added."""
        if room in self.pending or len(self.pending) < MAX_WAITING_REQUESTS:
            return None
        self.overflowed += 1
        return TransferFailed(
            f"room {room}: refused: {MAX_WAITING_REQUESTS} requests already wait for their sender on this prefill"
        )

    def requested(self, room: int) -> bool:
        """Whether a decode's request for ``room`` arrived and waits for ``sender(room, ...)``."""
        return room in self.pending

    def waiting(self) -> int:
        """How many decode requests wait for their senders (none: ``requested`` and
        ``requested_any`` are False for any room)."""
        return len(self.pending)

    def requested_any(self, rooms: frozenset[int]) -> bool:
        """Whether a request for any of ``rooms`` waits (one pass in C over the smaller of the two:
        atomic under the GIL, so safe beside the I/O thread's writes)."""
        return not self.pending.keys().isdisjoint(rooms)

    def refused_any(self, rooms: frozenset[int]) -> bool:
        """Whether any of ``rooms`` was given up (``refusal``), as ``requested_any`` reads."""
        return not self.rooms.keys().isdisjoint(rooms)

    def pending_pages(self, room: int) -> int | None:
        """How many destination pages the waiting request for ``room`` names (``None``: none waits)."""
        pending = self.pending.get(room)
        return None if pending is None else len(pending.msg.dst_kv_pages)

    def pending_state_lengths(self, room: int) -> list[int] | None:
        """How many indices the waiting request for ``room`` names per state component, in
        ``KVArgs.state_types`` order (``None``: none waits): with ``pending_pages``, what a caller
        whose decode holds a prefix already (SGLang's ``decode_prefix_len``) sends of its lists."""
        pending = self.pending.get(room)
        return None if pending is None else [len(s) for s in pending.msg.dst_state_indices]

    def refusal(self, room: int) -> PdStateError | None:
        """The error a refused decode gave ``room`` up with before its sender was made."""
        return self.rooms.get(room)

    def take_refusal(self, room: int) -> PdStateError | None:
        """``refusal(room)``, forgotten as it is read: for the caller whose sender it fails, so the
        same room sent again later (a retracted request's next attempt) does not meet the refusal
        meant for the attempt before it. A new request for the room from a decode forgets it too."""
        return self.rooms.pop(room, None)

    def note_handshake(self, identity: bytes, answer: wire.Message) -> None:
        self.refused.pop(identity, None)
        if isinstance(answer, wire.Reject):
            self.refused[identity] = answer.error
            while len(self.refused) > MAX_REFUSED_DECODES:  # refused identities: the oldest forgotten
                del self.refused[next(iter(self.refused))]

    def on_refused_abort(self, identity: bytes, msg: wire.Abort) -> None:
        info = self.refused[identity]
        error = error_from_wire(info.type, info.message)
        send = self.sends.get(msg.room)
        if send is not None and send.request is None and not send.record.state.terminal:
            self.fail(send, error, tell_decode=False)
            return
        self.give_up(msg.room, error)

    def on_error(self, identity: bytes, msg: wire.Error) -> None:
        """A decode's ``error`` naming one of its rooms in flight fails that request (never answered)."""
        room = msg.room
        send = self.sends.get(room) if room is not None else None
        pending = self.pending.get(room) if room is not None else None
        err = TransferFailed(f"decode reported: {msg.error.type}: {msg.error.message}")
        if send is not None and send.identity == identity and not send.record.state.terminal:
            self.fail(send, err, tell_decode=True)
        elif pending is not None and pending.identity == identity:
            del self.pending[room]
            self.give_up(room, err)  # a sender made later for it fails with this
            self.reply(identity, done_failed(room, err))

    def give_up(self, room: int, error: PdStateError) -> None:
        """``room`` was given up before its sender was made (a refused decode's room, or a
        request its decode aborted while it waited): ``refusal(room)`` says so, with ``error``."""
        self.rooms[room] = error
        self.arrived()
        while len(self.rooms) > MAX_REFUSED_ROOMS:
            self.rooms.popitem(last=False)
