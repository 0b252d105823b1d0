"""What one decode may hold on a ``PrefillAgent``: its verdicts come within a deadline, and a
decode that keeps withholding them is dropped.

A sender whose ``TransferDone`` went out waits for the decode's ``AgentVerdict`` and keeps its
pages until then (the caller frees them once the sender is terminal). A decode that never sends
its verdict used to hold those pages for the whole request deadline (30 s), starving every other
decode of the prefill. Now, run on the prefill agent's I/O thread (``Verdicts``, from its tick):

* a request waiting more than ``verdict_timeout_s`` (default 5 s) for its verdict fails with
  ``TransferFailed: room R: decode W sent no verdict within T s (verdict_timeout_s)``, told to the
  decode, so the caller frees its pages;
* ``MAX_WITHHELD`` such requests in a row from one decode (a verdict in between resets the count)
  drop that decode: its live requests fail with ``PeerGone: decode W withheld its verdict on N
  requests in a row (verdict_timeout_s T s): dropped``, its mappings are released, the drop is
  counted and logged (``Incidents``, ``PrefillAgent.withheld``); its next frame is answered
  ``NotRegistered`` and it may register again.

The share of the caller's pages one decode may hold is the caller's to bound (``pdstate serve``:
``control.decode_share``, ``worker.base.PagePool``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pdstate.agent.sender import Sending
from pdstate.errors import PeerGone, TransferFailed

MAX_WITHHELD = 3  # verdicts missed in a row before the decode is dropped
VERDICT_TIMEOUT_S = 5.0


class Verdicts:
    """The verdict rules of one prefill, over what its core hands them at start: its decodes
    (``identity -> DecodePeer``, the I/O thread's own map), ``fail(send, err, tell_decode=)`` and
    ``drop(identity, why)``; the core's public ``verdict_timeout_s`` and ``withheld`` (the drops'
    ``Incidents``) are read from ``agent``. Run on the agent's I/O thread."""

    def __init__(
        self,
        agent: Any,
        decodes: Mapping[bytes, Any],
        fail: Callable[..., None],
        drop: Callable[[bytes, str], None],
    ) -> None:
        self.agent, self.decodes, self.fail, self.drop = agent, decodes, fail, drop

    def check(self, sends: Iterable[Any], now: float) -> None:
        """Fail each request whose verdict is overdue, and drop a decode that withholds them."""
        t = self.agent.verdict_timeout_s
        overdue = [
            s
            for s in sends
            if isinstance(s, Sending) and s.done_sent and not s.record.state.terminal and s.fence is None
            if now - s.done_at > t
        ]
        for send in overdue:
            decode = self.decodes.get(send.identity)
            who = decode.worker_id if decode is not None else "(gone)"
            err = TransferFailed(
                f"room {send.record.room}: decode {who} sent no verdict within {t:g} s (verdict_timeout_s)"
            )
            self.fail(send, err, tell_decode=True)
            if decode is None:
                continue
            decode.withheld += 1
            if decode.withheld >= MAX_WITHHELD:
                why = PeerGone(
                    f"decode {who} withheld its verdict on {decode.withheld} requests in a row "
                    f"(verdict_timeout_s {t:g} s): dropped"
                )
                self.agent.withheld.note(why, who, now)
                self.drop(send.identity, str(why))

    def heard(self, identity: bytes) -> None:
        """A verdict from the decode on ``identity``: its count of withheld ones starts again."""
        decode = self.decodes.get(identity)
        if decode is not None:
            decode.withheld = 0
