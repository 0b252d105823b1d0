"""The scheduler thread's share of a transfer backend: ``python -m pdstate.devtools.sglang_pair.sched``.

A child of ``bench_sched``'s pair (the same children as ``side``: every ``side`` command, plus two).
SGLang calls a backend's sender and receiver on its scheduler thread, the thread that runs the
model, and polls every request in flight on every iteration. Here each side runs ``n`` requests at
once the way its scheduler drives them, and times every call into the backend's classes with the
calling thread's CPU clock (``time.thread_time_ns``): what the backend costs the scheduler thread,
not what its own threads spend.

- ``sched_prefill``: each request's pages allocated and patterned (untimed); then, timed: the
  sender made (``new``), polled every iteration; at ``WaitingForInput`` (the decode said where it
  lands) ``init(num_pages, aux_index)`` and its two chunks sent (``send``, state on the last),
  then polled until ``Success`` or ``Failed``.
- ``sched_decode``: SGLang's parallel info fetched and each request's pages allocated (untimed);
  then, timed: the receiver made (``new``) and
  ``init``-ed, polled every iteration; at ``WaitingForInput`` ``send_metadata`` names its pages,
  then polled until ``Success`` or ``Failed``; after that every destination item of every request
  is checked (``_wrong_items``).

An iteration polls every live request once, then sleeps ``ITERATION_S``. Each answer holds every
request's CPU (ns, all its calls), the CPU by call, every ``poll()``'s CPU, the polls' CPU by what
they answered (the request's previous answer, or a new one) and each outcome.
"""

from __future__ import annotations

from pdstate.devtools.sglang_pair import side  # first: ``booted``, then SGLang

# isort: split

import collections
import time

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

from pdstate.devtools.sglang_pair import boot, pattern, pools
from pdstate.devtools.sglang_pair.child import error_text, serve

ITERATION_S = 0.001  # between two sweeps over the requests in flight (a scheduler iteration)
CALLS = ("new", "init", "send", "send_metadata", "poll")
READY = (KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success)
S = side.S


class _Request:
    """One request in flight: its pages, its sender or receiver, its CPU by call, where it is."""

    def __init__(self, req) -> None:
        self.req, self.conn, self.stage, self.outcome = req, None, "boot", None
        self.cpu = dict.fromkeys(CALLS, 0)
        self.last = None  # what its latest poll returned (``None``: not polled yet)

    def timed(self, call: str, fn, *args, polls: list | None = None, **kwargs):
        t0 = time.thread_time_ns()
        out = fn(*args, **kwargs)
        dt = time.thread_time_ns() - t0
        self.cpu[call] += dt
        if polls is not None:
            polls.append(dt)
        return out


def _allocate(rooms: list[int], tokens: int, first_slot: int) -> list[_Request]:
    return [_Request(pools.allocate(S.cur, S.args, room, tokens, first_slot + i)) for i, room in enumerate(rooms)]


def _drive(reqs: list[_Request], step, deadline: float, polls: list, kinds: dict) -> None:
    """Sweep every live request (``step(r, state)`` after its poll) until each ended or ``deadline``.
    ``kinds``: each poll's CPU by what it answered, ``"steady"`` (what the request's previous poll
    answered) or ``"to <state>"`` (its first poll, or a new state), ``[count, ns]`` each."""
    live = list(reqs)
    while live:
        for r in live:
            state = r.timed("poll", r.conn.poll, polls=polls)
            kind = kinds["steady" if state == r.last else f"to {side.STATES.get(state, state)}"]
            kind[0] += 1
            kind[1] += polls[-1]
            r.last = state
            if state == KVPoll.Failed:
                r.outcome = "Failed"
            elif state == KVPoll.Success and r.stage == "sent":
                r.outcome = "Success"
            else:
                step(r, state)
        live = [r for r in live if r.outcome is None]
        if live and time.perf_counter() >= deadline:
            for r in live:
                r.outcome = f"timeout ({side.STATES.get(r.conn.poll(), '?')})"
            return
        time.sleep(ITERATION_S)


def _failure(r: _Request) -> str | None:
    if r.outcome == "Success":
        return None
    try:
        if r.outcome == "Failed":
            r.conn.failure_exception()
        else:
            r.conn.abort()
    except Exception as exc:  # the failure's text is the point
        return error_text(exc)
    return None


def _kinds() -> dict:
    return collections.defaultdict(lambda: [0, 0])


def _answer(reqs: list[_Request], polls: list, kinds: dict) -> dict:
    outcomes: dict[str, int] = {}
    for r in reqs:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    failures = [f for f in (_failure(r) for r in reqs) if f]
    for r in reqs:
        pools.release(S.cur, r.req)
    return {
        "cpu_ns": [sum(r.cpu.values()) for r in reqs],
        "by_call_ns": {c: sum(r.cpu[c] for r in reqs) for c in CALLS},
        "poll_ns": polls,
        "poll_kinds": dict(kinds),
        "outcomes": outcomes,
        "failures": failures[:3],
    }


# -- prefill
def _new_sender(room: int):
    cls = get_kv_class(TransferBackend(S.backend), KVClassType.SENDER)
    if boot.row().keyword_api:  # the prefill's own call (0.5.23): keywords, no dest_tp_ranks / pp_rank
        return cls(mgr=S.mgr, bootstrap_addr=S.addr, bootstrap_room=room, req_has_disagg_prefill_dp_rank=False)
    return cls(S.mgr, S.addr, room, [0], 0)


def sched_prefill(rooms: list[int], tokens: int, deadline_s: float) -> dict:
    deadline = time.perf_counter() + deadline_s
    reqs = _allocate(rooms, tokens, 0)  # request slot (aux row) i: the decode's differ
    for i, r in enumerate(reqs):
        items = pools.request_items(S.cur, S.args, r.req, i)
        for (_, ptr, length, _), (_, item_len, keys) in zip(pools.buffers(S.args), items):
            pattern.write_items(pattern.memory(ptr, length), item_len, keys)
    for r in reqs:
        r.conn = r.timed("new", _new_sender, r.req.room)

    def step(r: _Request, state) -> None:
        if r.stage == "boot" and state in READY:  # SGLang's bootstrap queue: init, then the forward's chunks
            pages = r.req.pages
            first = max(1, len(pages) // 2)
            r.timed("init", r.conn.init, len(pages), r.req.slot)
            r.timed("send", r.conn.send, pages[:first], None)
            r.timed("send", r.conn.send, pages[first:], r.req.state_indices)
            r.stage = "sent"

    polls: list[int] = []
    kinds = _kinds()
    _drive(reqs, step, deadline, polls, kinds)
    return _answer(reqs, polls, kinds)


# -- decode
def sched_decode(rooms: list[int], tokens: int, deadline_s: float) -> dict:
    deadline = time.perf_counter() + deadline_s
    while not S.mgr.try_ensure_parallel_info(S.addr):  # once per prefill, not per request
        if time.perf_counter() >= deadline:
            raise RuntimeError("no parallel info from the prefill's bootstrap server")
        time.sleep(0.01)
    reqs = _allocate(rooms, tokens, 1)  # request slot (aux row) i + 1: the prefill's is i
    cls = get_kv_class(TransferBackend(S.backend), KVClassType.RECEIVER)
    for r in reqs:
        r.conn = r.timed("new", cls, S.mgr, S.addr, r.req.room)
        r.timed("init", r.conn.init, 0)

    def step(r: _Request, state) -> None:
        if r.stage == "boot" and state in READY:  # SGLang's prealloc queue: the destination named
            q = r.req
            r.timed("send_metadata", r.conn.send_metadata, q.pages, q.slot, q.state_indices, decode_prefix_len=0)
            r.stage = "sent"

    polls: list[int] = []
    kinds = _kinds()
    _drive(reqs, step, deadline, polls, kinds)
    return {**_answer(reqs, polls, kinds), "wrong_items": _wrong_items(reqs)}


def _wrong_items(reqs: list[_Request]) -> int:
    """Destination items of the requests that succeeded not holding their key's pattern. Each key
    names its room, so what an earlier request left in the same pages never passes; bytes outside
    the destinations are the pair suite's check (a whole-pool scan per batch would be most of the
    measurement's time)."""
    wrong = 0
    buffers = pools.buffers(S.args)
    for r in reqs:
        if r.outcome != "Success":
            continue
        for (_, ptr, length, _), (_, item_len, keys) in zip(
            buffers, pools.request_items(S.cur, S.args, r.req, r.req.slot)
        ):
            view = pattern.memory(ptr, length)
            for index, key in keys.items():
                got = view[index * item_len : (index + 1) * item_len]
                wrong += not (got == pattern.item_bytes(key, item_len)).all()
    return wrong


def main() -> None:
    ops = {"setup": side.setup, "use": side.use, "sched_prefill": sched_prefill, "sched_decode": sched_decode}
    serve(ops, side.REPLY, trace_chars=3000)


if __name__ == "__main__":
    main()
