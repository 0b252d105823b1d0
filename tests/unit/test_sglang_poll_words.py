"""The SGLang backend's poll on the scheduler thread: the status words it reads, and when it looks
further (the agent's ``arrivals``, one agent request's state, the agent check every
``AGENT_CHECK_POLLS``-th poll).

SGLang is not imported here: its base classes and ``KVPoll`` are stand-ins (``sglang.srt...`` in
``sys.modules`` for the test's length only), so the backend's own logic runs in this process."""

from __future__ import annotations

import sys
import types

import pytest

from pdstate.errors import AgentClosed, EngineError
from pdstate.integrations.sglang.manager import ONE_PREFILL_KEPT, one_prefill
from pdstate.protocol.lifecycle import RequestState
from tests.unit.test_prefill_core import Harness

S = RequestState


class KVPoll:
    Failed, Bootstrapping, WaitingForInput, Transferring, Success = 0, 1, 2, 3, 4


class CommonKVSender:
    def __init__(
        self, mgr, bootstrap_addr, bootstrap_room, dest_tp_ranks, pp_rank, req_has_disagg_prefill_dp_rank=False
    ):
        self.kv_mgr, self.bootstrap_room, self.conclude_state, self.curr_idx = mgr, bootstrap_room, None, 0
        self.timeouts = 0

    def init(self, num_kv_indices, aux_index=None):
        self.num_kv_indices, self.aux_index = num_kv_indices, aux_index

    def _check_bootstrap_timeout(self):
        self.timeouts += 1
        return None

    def _record_transfer_indices(self, pages, state_indices):
        pass

    def clear(self):
        pass


class CommonKVReceiver:
    def __init__(self, mgr, bootstrap_addr, bootstrap_room=None):
        self.kv_mgr, self.bootstrap_addr, self.bootstrap_room = mgr, bootstrap_addr, bootstrap_room
        self.conclude_state = self.init_time = None
        self.bootstrap_infos = [{"rank_ip": "127.0.0.1", "rank_port": 1}]

    def init(self, prefill_dp_rank):
        pass

    def _check_waiting_timeout(self):
        return None

    def clear(self):
        pass


class Record:
    """An agent sender or receiver: its ``record`` (itself here: its ``state``, the reads counted)
    and its ``poll()`` (counted)."""

    def __init__(self, room: int) -> None:
        self.room, self._state, self.polls, self.reads = room, S.BOOTSTRAPPING, 0, 0
        self.record = self
        self.posted_error = None
        self.fed: list = []  # chunks (a sender) or destinations (a receiver) handed to it, in order

    @property
    def state(self):
        self.reads += 1
        return self._state

    @state.setter
    def state(self, state) -> None:
        self._state = state

    def poll(self):
        self.polls += 1
        return self._state

    def post(self, pages, states):  # an agent sender's chunk
        self.fed.append((list(pages), states))

    def post_init(self, pages, states, aux):  # an agent receiver's destination
        self.fed.append((list(pages), aux))

    def failure_exception(self):
        return None


class Agent:
    """A prefill agent's reads (counted) over a real core's refusals (``Harness``)."""

    def __init__(self, refusals) -> None:
        self.refusals, self.looks, self.closed, self.alive = refusals, 0, False, True
        self.made: list[Record] = []
        self.queue: list | None = None  # ``None``: what is posted runs at once (the agent's thread was quick)

    def post(self, fn) -> None:
        if self.closed:
            raise AgentClosed("the agent is closed")
        if self.queue is None:
            fn()
        else:
            self.queue.append(fn)

    def accepted(self, prefill) -> bool:  # the decode agent's: its prefill accepted it (not here)
        return False

    def run_posted(self) -> None:
        """The agent's thread's turn: what was posted runs, in order."""
        while self.queue:
            self.queue.pop(0)()

    @property
    def arrivals(self) -> int:
        return self.refusals.arrivals

    def requested_any(self, rooms):
        self.looks += 1
        return self.refusals.requested_any(rooms)

    @property
    def waiting(self) -> int:  # a count, not a look for a room
        return self.refusals.waiting()

    @property
    def refusals_held(self) -> int:
        return len(self.refusals.rooms)

    def refused_any(self, rooms):
        self.looks += 1
        return self.refusals.refused_any(rooms)

    def requested(self, room):
        self.looks += 1
        return self.refusals.requested(room)

    def take_refusal(self, room):
        return self.refusals.take_refusal(room)

    def pending_pages(self, room):
        return self.refusals.pending_pages(room)

    def sender(self, room, pages, aux, posted=False):
        self.made.append(Record(room))
        return self.made[-1]

    def receiver(self, address, room, posted=False):
        self.made.append(Record(room))
        self.made[-1].room = room
        return self.made[-1]


def requested(room: int) -> tuple[Harness, Agent]:
    """A real core's harness, registered, with a decode's request for ``room``, and the counting
    agent over its refusals."""
    t = Harness()
    t.register()
    t.request(room)
    return t, Agent(t.core.refusals)


class Manager:
    def __init__(self, agent) -> None:
        self.agent, self.request_status, self.failure_records = agent, {}, {}
        self.counters = types.SimpleNamespace(watch=lambda *a: None, failed=lambda e: None)
        self.kv_args = types.SimpleNamespace(state_types=[], engine_rank=0)
        self.attn_tp_size, self.waiting_timeout, self.topology_errors = 1, 300.0, {}

    def agent_failure(self):
        return None if self.agent.alive else AgentClosed("the pdstate prefill agent's I/O thread has ended")

    def update_status(self, room, status):
        self.request_status[room] = status

    def record_failure(self, room, reason):
        self.failure_records[room] = reason

    def agent_address(self, info):
        return "tcp://127.0.0.1:1"

    def one_prefill(self, infos):
        return one_prefill(self.__dict__.setdefault("kept", {}), infos, self.agent_address)

    def agent_for(self, pp_rank, stages):
        return self.agent


@pytest.fixture
def classes(monkeypatch):
    """``(PdStateKVSender, PdStateKVReceiver)`` over the stand-ins."""
    from pdstate.integrations.sglang import receiver, sender, states

    base = types.ModuleType("sglang.srt.disaggregation.base.conn")
    base.KVPoll, base.KVTransferMetric = KVPoll, object
    common = types.ModuleType("sglang.srt.disaggregation.common.conn")
    common.CommonKVSender, common.CommonKVReceiver = CommonKVSender, CommonKVReceiver
    common.KVTransferError = RuntimeError
    for name in ("sglang", "sglang.srt", "sglang.srt.disaggregation", "sglang.srt.disaggregation.base"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, base.__name__, base)
    monkeypatch.setitem(sys.modules, common.__name__, common)
    states._table.cache_clear()
    yield sender.build_sender.__wrapped__(), receiver.build_receiver.__wrapped__()
    states._table.cache_clear()


def test_a_senders_poll_looks_at_the_agent_only_when_something_arrived(classes):
    sender_cls, _ = classes
    t = Harness()
    t.register()
    agent = Agent(t.core.refusals)
    mgr = Manager(agent)
    s = sender_cls(mgr, "127.0.0.1:1", 6, [0], 0)
    # the first look: its own room (one dictionary look); no request waits at all, so the replicas'
    # rooms are not looked for, and nothing was given up on the agent, so no refusal is either
    assert s.poll() == KVPoll.Bootstrapping and agent.looks == 1
    assert [s.poll() for _ in range(5)] == [KVPoll.Bootstrapping] * 5 and agent.looks == 1  # nothing arrived
    assert s.timeouts == 6  # SGLang's bootstrap timeout, asked on every poll all the same
    t.request(7)  # another room's request: its own room, then the replicas' rooms; still awaited
    assert s.poll() == KVPoll.Bootstrapping and agent.looks == 3 and t.core.refusals.arrivals == 1
    t.request(6)
    assert s.poll() == KVPoll.WaitingForInput and agent.looks == 4  # its own room found: one look
    assert s.poll() == KVPoll.WaitingForInput and agent.looks == 4
    s.init(2, 0)
    (record,) = agent.made
    # the agent sender not added yet (``init`` posted it): WaitingForInput, never Bootstrapping again
    assert record.room == 6 and s.poll() == KVPoll.WaitingForInput
    record.state = S.TRANSFERRING
    assert [s.poll() for _ in range(3)] == [
        KVPoll.Transferring
    ] * 3 and agent.looks == 5  # (one more: the making of its agent sender)
    mgr.request_status[6] = KVPoll.Failed  # SGLang's own verdict on the room comes first
    assert s.poll() == KVPoll.Failed and s.conclude_state == KVPoll.Failed


def test_a_senders_steady_poll_sees_its_agent_die_within_the_check_interval(classes):
    from pdstate.integrations.sglang.sender import AGENT_CHECK_POLLS

    sender_cls, _ = classes
    t, agent = requested(6)
    s = sender_cls(Manager(agent), "127.0.0.1:1", 6, [0], 0)
    s.init(2, 0)
    agent.made[0].state = S.TRANSFERRING
    # polls 1 .. AGENT_CHECK_POLLS - 2 of this sender (the agent is asked at every multiple)
    assert [s.poll() for _ in range(AGENT_CHECK_POLLS - 2)] == [KVPoll.Transferring] * (AGENT_CHECK_POLLS - 2)
    agent.alive = False
    assert s.poll() == KVPoll.Transferring  # the status word: the agent is asked on the next poll
    assert s.poll() == KVPoll.Failed
    with pytest.raises(AgentClosed, match="I/O thread has ended"):
        s.failure_exception()


class CountingManager(Manager):
    """The stand-in manager counting its ``agent_failure`` looks."""

    looks = 0

    def agent_failure(self):
        self.looks += 1
        return super().agent_failure()


@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_the_poll_that_ends_a_request_in_success_reads_one_status_word(classes, side):
    """The agent's verdict concludes the request (its room's status too) in the poll that reads it:
    nothing else is asked, neither the agent nor whether it lives."""
    sender_cls, receiver_cls = classes
    t, agent = requested(6)
    mgr = CountingManager(agent)
    if side == "sender":
        conn = sender_cls(mgr, "127.0.0.1:1", 6, [0], 0)
        assert conn.poll() == KVPoll.WaitingForInput
        conn.init(2, 0)
    else:
        conn = receiver_cls(mgr, "127.0.0.1:1", 6)
        conn.init(0)
    (record,) = agent.made
    record.state = S.TRANSFERRING
    reads, words = record.reads, record.polls
    assert conn.poll() == KVPoll.Transferring  # the record's state read once, as it is: no ``poll()`` call
    assert (record.reads, record.polls) == (reads + 1, words)
    looks, agent_looks = mgr.looks, agent.looks
    record.state = S.SUCCESS
    assert conn.poll() == KVPoll.Success and (record.reads, record.polls) == (reads + 2, words)
    assert (mgr.looks, agent.looks) == (looks, agent_looks)
    assert conn.conclude_state == KVPoll.Success and mgr.request_status[6] == KVPoll.Success


def test_a_refusal_that_arrives_fails_the_awaited_sender_at_the_next_poll(classes):
    sender_cls, _ = classes
    t = Harness()
    t.register()
    agent = Agent(t.core.refusals)
    s = sender_cls(Manager(agent), "127.0.0.1:1", 6, [0], 0)
    assert s.poll() == KVPoll.Bootstrapping
    t.core.refusals.give_up(6, EngineError("refused"))
    assert s.poll() == KVPoll.Failed and t.core.refusals.refusal(6) is None  # taken by this sender
    with pytest.raises(EngineError, match="refused"):
        s.failure_exception()


def test_a_receivers_poll_reads_its_agent_receivers_state(classes):
    _, receiver_cls = classes
    agent = Agent(None)
    r = receiver_cls(Manager(agent), "127.0.0.1:1", 9)
    r.init(0)
    (record,) = agent.made
    seen = []
    for state in (S.BOOTSTRAPPING, S.WAITING_FOR_INPUT, S.TRANSFERRING, S.SUCCESS):
        record.state = state
        seen.append(r.poll())
    assert seen == [KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success]
    assert r.conclude_state == KVPoll.Success and r.kv_mgr.request_status[9] == KVPoll.Success
    polls, reads = record.polls, record.reads
    assert r.poll() == KVPoll.Success and (record.polls, record.reads) == (polls, reads)  # concluded: not read again


def test_refusals_count_arrivals_and_answer_for_a_set_of_rooms():
    t = Harness()
    t.register()
    refusals = t.core.refusals
    assert refusals.arrivals == 0 and not refusals.requested_any(frozenset({6, 99}))
    t.request(6)
    assert refusals.arrivals == 1 and refusals.requested_any(frozenset({6, 99}))
    assert not refusals.requested_any(frozenset({7})) and not refusals.refused_any(frozenset({6}))
    refusals.give_up(8, EngineError("refused"))
    assert refusals.arrivals == 2 and refusals.refused_any(frozenset({1, 8}))
    assert type(refusals.take_refusal(8)) is EngineError and refusals.arrivals == 2
    assert not refusals.refused_any(frozenset({1, 8}))
    t.sender(6)  # the waiting request goes to its sender: nothing arrived
    assert refusals.arrivals == 2 and not refusals.requested_any(frozenset({6}))


def _queued_sender(sender_cls, sender=None):
    """A sender for room 6, its decode's request there, on an agent whose posted steps wait in
    ``agent.queue`` (``sender(agent)``: the agent's ``sender`` in place of the fake's): the
    harness, the agent and the sender, which says WaitingForInput."""
    t, agent = requested(6)
    agent.queue = []
    if sender is not None:
        agent.sender = sender(agent)
    s = sender_cls(Manager(agent), "127.0.0.1:1", 6, [0], 0)
    assert s.poll() == KVPoll.WaitingForInput
    return t, agent, s


def test_a_senders_init_makes_its_agent_sender_on_the_agents_thread(classes):
    """``init`` hands the agent sender's making to the agent's thread; the chunks sent meanwhile
    reach it after, in order; until then the poll says WaitingForInput without looking further."""
    sender_cls, _ = classes
    t, agent, s = _queued_sender(sender_cls)
    looks = agent.looks
    s.init(2, 0)
    assert [s.poll() for _ in range(3)] == [KVPoll.WaitingForInput] * 3  # its agent sender being made
    s.send([1])
    s.send([2], [])
    assert agent.made == [] and len(agent.queue) == 3
    # a chunk handed over: Transferring, as a posted chunk reads (``KVSender.post``)
    assert [s.poll() for _ in range(5)] == [KVPoll.Transferring] * 5 and agent.looks == looks
    agent.run_posted()
    (record,) = agent.made
    assert record.room == 6 and [pages for pages, _ in record.fed] == [[1], [2]]
    assert s.poll() == KVPoll.Transferring  # its record still BOOTSTRAPPING (the stand-in's post sets nothing)
    record.state = S.SUCCESS
    assert s.poll() == KVPoll.Success


def test_a_sender_whose_agent_closed_before_it_made_the_agent_sender_fails(classes):
    from pdstate.integrations.sglang.sender import AGENT_CHECK_POLLS

    sender_cls, _ = classes
    t, agent, s = _queued_sender(sender_cls)
    s.init(2, 0)
    agent.closed = True  # the thread ended with the step still queued
    polls = [s.poll() for _ in range(AGENT_CHECK_POLLS)]  # the agent is looked at every so often
    assert KVPoll.Failed in polls
    end = polls.index(KVPoll.Failed)
    assert polls[:end] == [KVPoll.WaitingForInput] * end and s.poll() == KVPoll.Failed
    with pytest.raises(AgentClosed, match="room 6: the agent closed before it made this request's sender"):
        s.failure_exception()
    agent.run_posted()  # the step, run after all: it makes nothing
    assert agent.made == []


def test_a_receivers_init_makes_its_agent_receiver_on_the_agents_thread(classes):
    """``init`` hands the agent receiver's making to the agent's thread and ``send_metadata`` goes
    after it; meanwhile the poll answers as the agent receiver would read (Bootstrapping, then
    Transferring once its pages were named)."""
    _, receiver_cls = classes
    agent = Agent(None)
    agent.queue = []
    r = receiver_cls(Manager(agent), "127.0.0.1:1", 9)
    r.init(0)
    assert agent.made == [] and [r.poll() for _ in range(3)] == [KVPoll.Bootstrapping] * 3
    r.send_metadata([5, 6], 3, [])
    assert agent.made == [] and r.poll() == KVPoll.Transferring
    agent.run_posted()
    (record,) = agent.made
    assert record.room == 9 and record.fed == [([5, 6], 3)]
    assert r.poll() == KVPoll.Transferring  # its record still BOOTSTRAPPING (the stand-in's post sets nothing)
    record.state = S.SUCCESS
    assert r.poll() == KVPoll.Success and r.agent_rooms == [9]


def test_a_receiver_whose_agent_closed_before_it_made_the_agent_receiver_fails(classes):
    from pdstate.integrations.sglang.receiver import AGENT_CHECK_POLLS

    _, receiver_cls = classes
    agent = Agent(None)
    agent.queue = []
    r = receiver_cls(Manager(agent), "127.0.0.1:1", 9)
    r.init(0)
    agent.closed = True
    polls = [r.poll() for _ in range(AGENT_CHECK_POLLS)]  # the agent is looked at every so often
    assert KVPoll.Failed in polls
    end = polls.index(KVPoll.Failed)
    assert polls[:end] == [KVPoll.Bootstrapping] * end and r.poll() == KVPoll.Failed
    with pytest.raises(AgentClosed, match="room 9: the agent closed before it made this request's receiver"):
        r.failure_exception()
    agent.run_posted()
    assert agent.made == []


def test_a_malformed_state_list_sent_while_the_agent_sender_is_made_concludes_at_once(classes):
    sender_cls, _ = classes
    t, agent, s = _queued_sender(sender_cls)
    s.init(2, 0)
    s.send([1])
    s.send([2], [[3]])  # one list, no state component: refused here, nothing posted for it
    assert s.conclude_state == KVPoll.Failed and len(agent.queue) == 2
    with pytest.raises(ValueError, match="1 lists for 0 state components"):
        s.failure_exception()


class _PostingRecord(Record):
    """An agent sender whose ``post`` goes through the agent's thread, as ``KVSender.post`` does."""

    def __init__(self, room: int, agent) -> None:
        super().__init__(room)
        self.agent = agent

    def post(self, pages, states):
        self.agent.post(lambda: self.fed.append((list(pages), states)))


def test_a_chunk_sent_after_the_agent_sender_was_made_follows_the_one_the_agents_thread_holds(classes):
    """``init``'s step ran, and the first chunk (sent while it was under way) still waits on the
    agent's thread: the second chunk goes there behind it, so the agent sender gets them in
    SGLang's order (the last, with the state, last)."""
    sender_cls, _ = classes
    t, agent, s = _queued_sender(
        sender_cls,
        lambda agent: (
            lambda room, pages, aux, posted=False: agent.made.append(_PostingRecord(room, agent)) or agent.made[-1]
        ),
    )
    s.init(2, 0)
    s.send([1])
    agent.queue.pop(0)()  # the agent's thread makes the agent sender; the first chunk still waits
    (record,) = agent.made
    s.send([2], [])
    agent.run_posted()
    assert [pages for pages, _ in record.fed] == [[1], [2]]


def test_a_receivers_one_prefill_is_made_once_per_rank_entry():
    """``init`` asks, per request, for the one prefill agent behind the ranks SGLang resolved:
    made once per rank entry (SGLang makes each request's list afresh from the same entries),
    never for a dummy or for several ranks; a new entry (even equal) is looked at afresh."""
    made = []

    def address_of(info):
        made.append(info["rank_port"])
        return f"tcp://{info['rank_ip']}:{info['rank_port']}"

    kept: dict = {}
    info = {"rank_ip": "10.0.0.1", "rank_port": 7001, "is_dummy": False}
    assert [one_prefill(kept, [info], address_of) for _ in range(3)] == ["tcp://10.0.0.1:7001"] * 3
    assert made == [7001]
    other = {"rank_ip": "10.0.0.2", "rank_port": 7002}
    assert one_prefill(kept, [other], address_of) == "tcp://10.0.0.2:7002" and made == [7001, 7002]
    assert one_prefill(kept, [dict(info)], address_of) == "tcp://10.0.0.1:7001" and made == [7001, 7002, 7001]
    assert one_prefill(kept, [{"rank_ip": "x", "rank_port": 1, "is_dummy": True}], address_of) is None
    assert one_prefill(kept, [info, other], address_of) is None and made == [7001, 7002, 7001]
    for _ in range(ONE_PREFILL_KEPT + 1):  # bounded: it starts over
        one_prefill(kept, [{"rank_ip": "x", "rank_port": 2}], address_of)
    assert len(kept) <= ONE_PREFILL_KEPT


@pytest.mark.parametrize("on", [False, True])
def test_a_receivers_success_asks_for_its_trace_only_when_tracing_was_on_where_it_was_made(classes, monkeypatch, on):
    """Whether a receiver's request is traced is read where its agent receiver is made (the
    agent's thread: ``trace.wanted``), once; the poll that reads Success then writes the trace
    only if it was on, and concludes the request (its room's status too) either way."""
    from pdstate.integrations.sglang import trace

    _, receiver_cls = classes
    t, agent = requested(6)
    mgr = Manager(agent)
    asked, finished = [], []
    monkeypatch.setattr(trace, "wanted", lambda side: asked.append(side.bootstrap_room) or on)
    monkeypatch.setattr(trace, "finish", lambda side, failed: finished.append((side.bootstrap_room, failed)))
    conn = receiver_cls(mgr, "127.0.0.1:1", 6)
    conn.init(0)
    assert asked == [6]
    (record,) = agent.made
    record.state = S.TRANSFERRING
    assert conn.poll() == KVPoll.Transferring and finished == []
    record.state = S.SUCCESS
    assert conn.poll() == KVPoll.Success and conn.poll() == KVPoll.Success
    assert finished == ([(6, False)] if on else []) and asked == [6]
    assert mgr.request_status[6] == KVPoll.Success
