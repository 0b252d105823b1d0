"""Posted adds: the senders and receivers handed to an agent's I/O thread (``posted=True``) that
its thread has not added yet, so that a close that comes first ends them ``FAILED`` instead of
leaving them ``BOOTSTRAPPING`` for ever.

The caller's thread puts a request's record here before it posts the add; the I/O thread takes it
out when it runs the add (``take``). The close's last step on that thread (``close``) fails what
is still here and every add that runs after it; what was posted and never ran (the thread ended
first) is failed by the closing thread once the thread has ended (``close`` again)."""

from __future__ import annotations

from collections.abc import Callable

from pdstate.agent.common import RequestRecord
from pdstate.errors import AgentClosed
from pdstate.protocol.lifecycle import RequestState

__all__ = ["AS_IS", "POSTED", "PostedAdds"]

_S = RequestState
# what a sender's or receiver's ``poll`` shows of its record's state: as it is, or, once work of it
# was posted (``KVSender.post``, ``KVReceiver.post_init``), Transferring for the states before it
# (the I/O thread has not taken that work yet)
AS_IS = {state: state for state in RequestState}
POSTED = {**AS_IS, _S.BOOTSTRAPPING: _S.TRANSFERRING, _S.WAITING_FOR_INPUT: _S.TRANSFERRING}


class PostedAdds:
    """The records of posted adds not yet run, by identity (written by the caller's thread and the
    I/O thread: single dictionary operations, atomic under the GIL)."""

    def __init__(self, what: str) -> None:
        self._what = what  # "sender" / "receiver": the messages' word
        self._records: dict[int, RequestRecord] = {}
        self.closed_for: str | None = None  # the close's reason, once it ran

    def post(self, record: RequestRecord, post: Callable[[Callable[[], None]], None], add: Callable[[], None]) -> None:
        """Keep ``record`` here and hand ``add`` to the I/O thread with ``post``; a post refused
        (``AgentClosed``: the agent closed) forgets it again, the caller getting the error itself."""
        self._records[id(record)] = record
        try:
            post(add)
        except AgentClosed:
            self._records.pop(id(record), None)
            raise

    def take(self, record: RequestRecord) -> bool:
        """On the I/O thread, as the add runs: whether to add it (``False``: the agent closed, and
        ``record`` failed for that)."""
        self._records.pop(id(record), None)
        if self.closed_for is None:
            return True
        record.fail(self.error(record.room))
        return False

    def error(self, room: int) -> AgentClosed:
        return AgentClosed(
            f"room {room}: the agent closed ({self.closed_for}) before its I/O thread added this posted {self._what}"
        )

    def close(self, reason: str) -> None:
        """Fail every posted add not run yet (and, from now on, each one as it runs)."""
        if self.closed_for is None:
            self.closed_for = reason
        for key in list(self._records):
            record = self._records.pop(key, None)
            if record is not None:
                record.fail(self.error(record.room))
