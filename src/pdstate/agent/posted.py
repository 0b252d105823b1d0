"""Posted adds: the senders and receivers handed to an agent's I/O thread (``posted=True``) that
its thread has not added yet, so that a close that comes first ends them ``FAILED`` instead of
leaving them ``BOOTSTRAPPING`` for ever.

The caller's thread puts a request's record here before it posts the add; the I/O thread takes it
out when it runs the add (``take``). The close's last step on that thread (``close``) fails what
is still here and every add that runs after it; what was posted and never ran (the thread ended
first) is failed by the closing thread once the thread has ended (``close`` again)."""

from __future__ import annotations

from pdstate.agent.common import RequestRecord
from pdstate.errors import AgentClosed

__all__ = ["PostedAdds"]


class PostedAdds:
    """The records of posted adds not yet run, by identity (written by the caller's thread and the
    I/O thread: single dictionary operations, atomic under the GIL)."""

    def __init__(self, what: str) -> None:
        self._what = what  # "sender" / "receiver": the messages' word
        self._records: dict[int, RequestRecord] = {}
        self.closed_for: str | None = None  # the close's reason, once it ran

    def put(self, record: RequestRecord) -> None:
        self._records[id(record)] = record

    def drop(self, record: RequestRecord) -> None:
        """``record``'s post was refused (the agent closed): the caller got the error itself."""
        self._records.pop(id(record), None)

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
