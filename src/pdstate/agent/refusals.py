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

``requested(room)`` says whether a decode's request for ``room`` is waiting for its sender: an
engine whose prefill learns the page count only after the decode asked (SGLang's scheduler) polls
it to leave its bootstrapping state. Both read without the I/O thread (a dict lookup).
"""

from __future__ import annotations

from collections import OrderedDict

from pdstate.errors import PdStateError, TransferFailed, error_from_wire
from pdstate.protocol import wire
from pdstate.protocol.report import ErrorInfo

__all__ = ["Refusals"]

MAX_REFUSED_ROOMS = 65536  # rooms given up before their sender existed, oldest forgotten first
MAX_REFUSED_DECODES = 1024  # refused connections whose refusal is kept, oldest forgotten first


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
