"""pdstate's request states as SGLang's ``KVPoll``, and a failure as the exception SGLang expects.

SGLang is imported when first needed (this module loads without it)."""

from __future__ import annotations

import contextlib
import functools

import numpy as np

from pdstate.integrations.sglang import trace
from pdstate.protocol.lifecycle import RequestState

__all__ = ["combine", "conclude", "conclude_failed", "failure_exception", "kv_poll", "raise_failure", "state_lists"]


@functools.cache
def _table() -> dict:
    from sglang.srt.disaggregation.base.conn import KVPoll

    return {
        RequestState.BOOTSTRAPPING: KVPoll.Bootstrapping,
        RequestState.WAITING_FOR_INPUT: KVPoll.WaitingForInput,
        RequestState.TRANSFERRING: KVPoll.Transferring,
        RequestState.SUCCESS: KVPoll.Success,
        RequestState.FAILED: KVPoll.Failed,
    }


def kv_poll(state: RequestState) -> int:
    """The ``KVPoll`` value of an agent request's state (one to one)."""
    return _table()[state]


def combine(states: list[RequestState]) -> int:
    """The ``KVPoll`` of the agent requests behind one SGLang request (``states``): Failed if any
    failed, else the least advanced."""
    table = _table()
    polls = [table[s] for s in states]
    failed = table[RequestState.FAILED]
    return failed if failed in polls else min(polls)


def conclude(side, poll: int) -> int:
    """A Success ``poll`` concludes ``side`` (its room's status too); returns ``poll``."""
    if poll == _table()[RequestState.SUCCESS]:
        side.conclude_state = poll
        side.kv_mgr.update_status(side.bootstrap_room, poll)
        trace.finish(side, failed=False)
    return poll


def concluded(side) -> int | None:
    """What ``side.poll()`` returns before it looks at its requests: its conclusion, or Failed
    (through ``side.pdstate_fail``) when its rank's agent died; ``None`` when neither."""
    if side.conclude_state is not None:
        return side.conclude_state
    dead = side.kv_mgr.agent_failure()
    return None if dead is None else side.pdstate_fail(dead)


def conclude_failed(side, reason: str) -> int:
    """End ``side`` (an SGLang sender or receiver over a manager) Failed: the reason recorded for
    its room, the room's status and the side's own conclusion; returns ``KVPoll.Failed``."""
    failed = _table()[RequestState.FAILED]
    side.kv_mgr.record_failure(side.bootstrap_room, reason)
    side.kv_mgr.update_status(side.bootstrap_room, failed)
    side.conclude_state = failed
    trace.finish(side, failed=True)
    return failed


def raise_failure(room, error: BaseException | None, reason: str | None) -> None:
    """SGLang's ``failure_exception()``: raise the request's failure. pdstate's own error (its
    class and upstream's text) when there is one, else SGLang's ``KVTransferError``."""
    from sglang.srt.disaggregation.common.conn import KVTransferError

    if error is not None:
        raise error
    raise KVTransferError(room, reason or "Failed due to an unknown reason")


def failure_exception(side) -> None:
    """SGLang's ``failure_exception()`` of a sender or receiver: the room's status and failure
    record go with the request (SGLang's own ``clear``), so a later attempt over the same room
    (a retracted request's rebootstrap) starts clean; then the failure is raised (the same on
    every call: the reason is kept on ``side``)."""
    mgr = side.kv_mgr
    with getattr(mgr, "failure_lock", None) or contextlib.nullcontext():
        reason = mgr.failure_records.pop(side.bootstrap_room, None)
    if reason is not None:
        side._failure_reason = reason
    side.clear()
    trace.finish(side, failed=True)  # a failure of SGLang's own (its timeouts) ends the trace here
    raise_failure(side.bootstrap_room, side.pdstate_error, getattr(side, "_failure_reason", None))


def state_lists(state_indices, state_types) -> list[np.ndarray]:
    """SGLang's request-state index lists, one int64 array per component (``None``: empty).

    An SWA list naming only the padding page (0) is emptied: on the unified KV layout (0.5.23, a
    per-request SWA ring) SGLang's allocator leaves its full-to-SWA mapping unwritten, so both
    sides name their SWA component (the C4 states) as page 0 only. SGLang's own backend copies
    padding to padding; pdstate moves nothing there (the window itself moves as the SWA ring)."""
    n = len(state_types)
    if len(state_indices) != n:
        raise ValueError(f"state_indices: {len(state_indices)} lists for {n} state components")
    out = []
    for s, st in zip(state_indices, state_types):
        lst = np.empty(0, dtype=np.int64) if s is None else np.asarray(s, dtype=np.int64).reshape(-1)
        if str(getattr(st, "value", st)) == "swa" and lst.size and not lst.any():
            lst = lst[:0]
        out.append(lst)
    return out
