"""What a ``PrefillAgent`` does about the decodes it refused at the handshake, and its waiting rooms.

A refused decode fails its own receivers at once (the prefill's ``Reject`` carries the error), but
the prefill's senders for those rooms would wait for a request that never comes. So a refused
decode sends an ``Abort`` for each room it gives up, and the prefill fails that room with the very
error it refused the decode with (upstream's class and text): the live sender at once, or, when
the caller has not made it yet, the sender made later (``refusal(room)`` tells the caller before).
A request its decode aborts while it waits for its sender is given up the same way, and so is
one its decode reports an ``error`` for (``_on_error``; the live sender fails, fenced, at once).

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

from pdstate.errors import PdStateError, TransferFailed, error_from_wire
from pdstate.protocol import wire
from pdstate.protocol.lifecycle import PeerState
from pdstate.protocol.peers import PeerSnapshot
from pdstate.protocol.report import ErrorInfo

__all__ = ["PeerLog", "Refusals"]

MAX_REFUSED_ROOMS = 65536  # rooms given up before their sender existed, oldest forgotten first
MAX_REFUSED_DECODES = 1024  # refused connections whose refusal is kept, oldest forgotten first
MAX_PEER_LOG = 1024  # decodes ``PeerLog`` remembers ...
MAX_PEER_LOG_TEXT = 1 << 20  # ... and the characters of their errors' messages, all records together


class PeerLog:
    """Every decode that registered with a ``PrefillAgent``, by worker id: its latest record
    (``PrefillAgent.peers()``, hence ``/v1/compat`` and an SGLang rank's status snapshots). Past
    ``MAX_PEER_LOG`` records or ``MAX_PEER_LOG_TEXT`` characters of error messages, the least
    recently registered decode that is not accepted is forgotten first (an accepted one only when
    every record is one's): refused registers cannot push an accepted decode out, and what the
    list carries of them stays bounded. Run on the agent's I/O thread."""

    def __init__(self) -> None:
        self._log: OrderedDict[str, PeerSnapshot] = OrderedDict()

    def records(self) -> list[PeerSnapshot]:
        return list(self._log.values())

    def note(self, worker_id: str, state: str, incarnation: str, fingerprint: str, error: ErrorInfo | None) -> None:
        """The answer to a register of ``worker_id`` (``accepted`` or ``rejected``)."""
        self._log.pop(worker_id, None)
        self._log[worker_id] = PeerSnapshot(worker_id, PeerState(state), incarnation, fingerprint, error)
        text = sum(len(e.error.message) for e in self._log.values() if e.error is not None)
        while len(self._log) > MAX_PEER_LOG or text > MAX_PEER_LOG_TEXT:
            oldest = next((k for k, e in self._log.items() if e.state is not PeerState.ACCEPTED), None)
            entry = self._log.pop(oldest) if oldest is not None else self._log.popitem(last=False)[1]
            text -= len(entry.error.message) if entry.error is not None else 0

    def gone(self, worker_id: str, incarnation: str, why: str) -> None:
        """The accepted decode ``worker_id/incarnation`` is gone (``why``): its record is
        replaced, in its place."""
        e = self._log.get(worker_id)
        if e is not None and e.incarnation == incarnation and e.state is PeerState.ACCEPTED:
            why_info = ErrorInfo(type="PeerGone", message=why)
            self._log[worker_id] = PeerSnapshot(e.id, PeerState.GONE, e.incarnation, e.fingerprint, why_info)


class Refusals:
    """Mixed into ``PrefillAgent``; its I/O thread calls ``_note_handshake`` and ``_on_refused_abort``."""

    def _init_refusals(self) -> None:
        self._refused: dict[bytes, ErrorInfo] = {}  # decode identity -> the refusal it got
        self._refused_rooms: OrderedDict[int, PdStateError] = OrderedDict()

    def requested(self, room: int) -> bool:
        """Whether a decode's request for ``room`` arrived and waits for ``sender(room, ...)``."""
        return room in self._pending  # type: ignore[attr-defined]

    def pending_pages(self, room: int) -> int | None:
        """How many destination pages the waiting request for ``room`` names (``None``: none waits)."""
        pending = self._pending.get(room)  # type: ignore[attr-defined]
        return None if pending is None else len(pending.msg.dst_kv_pages)

    def pending_state_lengths(self, room: int) -> list[int] | None:
        """How many indices the waiting request for ``room`` names per state component, in
        ``KVArgs.state_types`` order (``None``: none waits): with ``pending_pages``, what a caller
        whose decode holds a prefix already (SGLang's ``decode_prefix_len``) sends of its lists."""
        pending = self._pending.get(room)  # type: ignore[attr-defined]
        return None if pending is None else [len(s) for s in pending.msg.dst_state_indices]

    def refusal(self, room: int) -> PdStateError | None:
        """The error a refused decode gave ``room`` up with before its sender was made."""
        return self._refused_rooms.get(room)

    def take_refusal(self, room: int) -> PdStateError | None:
        """``refusal(room)``, forgotten as it is read: for the caller whose sender it fails, so the
        same room sent again later (a retracted request's next attempt) does not meet the refusal
        meant for the attempt before it. A new request for the room from a decode forgets it too."""
        return self._refused_rooms.pop(room, None)

    def _note_handshake(self, identity: bytes, answer: wire.Message) -> None:
        self._refused.pop(identity, None)
        if isinstance(answer, wire.Reject):
            self._refused[identity] = answer.error
            while len(self._refused) > MAX_REFUSED_DECODES:  # refused identities: the oldest forgotten
                del self._refused[next(iter(self._refused))]

    def _on_refused_abort(self, identity: bytes, msg: wire.Abort) -> None:
        info = self._refused[identity]
        error = error_from_wire(info.type, info.message)
        send = self._sends.get(msg.room)  # type: ignore[attr-defined]
        if send is not None and send.request is None and not send.record.state.terminal:
            self._fail(send, error, tell_decode=False)  # type: ignore[attr-defined]
            return
        self._give_up(msg.room, error)

    def _on_error(self, identity: bytes, msg: wire.Error) -> None:
        """A decode's ``error`` naming one of its rooms in flight fails that request (never answered)."""
        room = msg.room
        send = self._sends.get(room) if room is not None else None  # type: ignore[attr-defined]
        pending = self._pending.get(room) if room is not None else None  # type: ignore[attr-defined]
        err = TransferFailed(f"decode reported: {msg.error.type}: {msg.error.message}")
        if send is not None and send.identity == identity and not send.record.state.terminal:
            self._fail(send, err, tell_decode=True)  # type: ignore[attr-defined]
        elif pending is not None and pending.identity == identity:
            del self._pending[room]  # type: ignore[attr-defined]
            self._give_up(room, err)  # a sender made later for it fails with this
            self._reply(identity, self._done_failed(room, err))  # type: ignore[attr-defined]

    def _give_up(self, room: int, error: PdStateError) -> None:
        """``room`` was given up before its sender was made (a refused decode's room, or a
        request its decode aborted while it waited): ``refusal(room)`` says so, with ``error``."""
        self._refused_rooms[room] = error
        while len(self._refused_rooms) > MAX_REFUSED_ROOMS:
            self._refused_rooms.popitem(last=False)
