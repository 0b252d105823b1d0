"""What one decode may hold on a ``PrefillAgent``: its verdicts come within a deadline, and a
decode that keeps withholding them is dropped.

A sender whose ``TransferDone`` went out waits for the decode's ``AgentVerdict`` and keeps its
pages until then (the caller frees them once the sender is terminal). A decode that never sends
its verdict used to hold those pages for the whole request deadline (30 s), starving every other
decode of the prefill. Now, run on the prefill agent's I/O thread (``PrefillAgent._tick``):

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

from typing import Any

from pdstate.agent.sender import Sending
from pdstate.errors import PeerGone, TransferFailed

MAX_WITHHELD = 3  # verdicts missed in a row before the decode is dropped
VERDICT_TIMEOUT_S = 5.0


def check_verdicts(agent: Any, now: float) -> None:
    """Fail each request whose verdict is overdue, and drop a decode that withholds them."""
    overdue = [
        s
        for s in agent._sends.values()
        if isinstance(s, Sending) and s.done_sent and not s.record.state.terminal
        if now - s.done_at > agent.verdict_timeout_s
    ]
    for send in overdue:
        decode = agent._decodes.get(send.identity)
        who = decode.worker_id if decode is not None else "(gone)"
        t = agent.verdict_timeout_s
        err = TransferFailed(
            f"room {send.record.room}: decode {who} sent no verdict within {t:g} s (verdict_timeout_s)"
        )
        agent._fail(send, err, tell_decode=True)
        if decode is None:
            continue
        decode.withheld += 1
        if decode.withheld >= MAX_WITHHELD:
            why = PeerGone(
                f"decode {who} withheld its verdict on {decode.withheld} requests in a row "
                f"(verdict_timeout_s {t:g} s): dropped"
            )
            agent.withheld.note(why, who)
            agent._decode_gone(send.identity, str(why))


def verdict_heard(agent: Any, identity: bytes) -> None:
    """A verdict from the decode on ``identity``: its count of withheld ones starts again."""
    decode = agent._decodes.get(identity)
    if decode is not None:
        decode.withheld = 0
