"""pdstate's request states as SGLang's ``KVPoll``, and a failure as the exception SGLang expects.

SGLang is imported when first needed (this module loads without it)."""

from __future__ import annotations

import contextlib
import functools

import numpy as np

from pdstate.integrations.sglang import trace
from pdstate.protocol.lifecycle import RequestState

__all__ = [
    "AGENT_CHECK_POLLS",
    "combine",
    "conclude",
    "conclude_failed",
    "failure_exception",
    "is_swa",
    "kv_poll",
    "posted_failure",
    "raise_failure",
    "state_lists",
    "succeed",
]

# SGLang polls every request in flight on its scheduler thread, every iteration: a sender's or
# receiver's poll that finds nothing new reads one status word (an agent request's state, or the
# prefill agent's ``arrivals`` while the decode's request is awaited); whether the rank's agent
# died is asked on every ``AGENT_CHECK_POLLS``-th poll, and on every poll that looks further
AGENT_CHECK_POLLS = 32


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


def posted_failure(handles) -> BaseException | None:
    """What a posted call (the agent's ``sender``/``receiver(..., posted=True)``, ``KVSender.post``,
    ``KVReceiver.post_init``) of the agent requests ``handles`` raised on the agent's thread: the
    first found, else ``None``. The backend's ``init``, ``send`` and ``send_metadata`` post their
    work and return; the next ``poll()`` fails the request with this (``failure_exception()``
    raises it: the class and text the call itself used to fail with)."""
    for handle in handles:
        error = handle.posted_error
        if error is not None:
            return error
    return None


def conclude(side, poll: int) -> int:
    """A Success ``poll`` concludes ``side`` (its room's status too); returns ``poll``."""
    return succeed(side) if poll == _table()[RequestState.SUCCESS] else poll


_SUCCESS: list = []  # ``KVPoll.Success`` (looked up once: ``succeed`` runs on SGLang's scheduler thread)


def succeed(side, traced: bool = True) -> int:
    """Conclude ``side`` Success (its room's status too, its trace written); returns
    ``KVPoll.Success``. A poll whose one agent request reads SUCCESS comes here straight from its
    status word: that word is the agent's verdict, nothing else is looked at. ``traced=False``:
    the caller knows its trace is off (a receiver that read the switch when its agent request was
    made, ``trace.wanted``), and ``trace.finish`` is not asked."""
    if not _SUCCESS:
        _SUCCESS.append(_table()[RequestState.SUCCESS])
    success = _SUCCESS[0]
    side.conclude_state = success
    side.kv_mgr.update_status(side.bootstrap_room, success)
    if traced:
        trace.finish(side, failed=False)
    return success


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


_SWA: dict = {}  # a state type (an enum member or its value) -> whether it names the SWA component


def is_swa(state_type) -> bool:
    """Whether ``state_type`` (``KVArgs.state_types``' entry) is the SWA component (looked up once)."""
    swa = _SWA.get(state_type)
    if swa is None:
        swa = _SWA[state_type] = str(getattr(state_type, "value", state_type)) == "swa"
    return swa


def state_lists(state_indices, state_types) -> list[np.ndarray]:
    """SGLang's request-state index lists, one int64 array per component (``None``: empty).

    An SWA list naming only the padding page (0) is emptied: on the unified KV layout (0.5.23, a
    per-request SWA ring) SGLang's allocator leaves its full-to-SWA mapping unwritten, so both
    sides name their SWA component (the C4 states) as page 0 only. SGLang's own backend copies
    padding to padding; pdstate moves nothing there (the window itself moves as the SWA ring).

    Called on SGLang's scheduler thread per request (``send_metadata``, the last chunk's ``send``):
    a list that is an int64 vector already is taken as it is, and only an SWA list is looked at."""
    n = len(state_types)
    if len(state_indices) != n:
        raise ValueError(f"state_indices: {len(state_indices)} lists for {n} state components")
    out = []
    for s, st in zip(state_indices, state_types):
        if s is None:
            lst = np.empty(0, dtype=np.int64)
        elif type(s) is np.ndarray and s.dtype == np.int64 and s.ndim == 1:
            lst = s
        else:
            lst = np.asarray(s, dtype=np.int64).reshape(-1)
        if lst.size and is_swa(st) and not np.count_nonzero(lst):
            lst = lst[:0]
        out.append(lst)
    return out
