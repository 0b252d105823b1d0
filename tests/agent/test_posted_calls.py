"""Posted calls: the agents' handles that hand their work to the I/O thread and return
(``sender``/``receiver(..., posted=True)``, ``KVSender.post``, ``KVReceiver.post_init``), and the
SGLang backend over them, whose ``init``, ``send`` and ``send_metadata`` post and whose next
``poll()`` reports what the call used to fail with (``Failed``, ``failure_exception()`` raising the
same class and text).

Both agents run in this process over the loopback engine; SGLang's base classes are the stand-ins
of ``tests/unit/test_sglang_poll_words.py`` (the backend's own code runs, SGLang is not imported)."""

from __future__ import annotations

import threading
import time
import types

import numpy as np
import pytest

from pdstate.agent import DecodeAgent, PrefillAgent, RequestState
from pdstate.agent.common import AgentLoop
from pdstate.agent.prefill_core import PrefillCore
from pdstate.errors import AgentClosed, ProtocolError, TransferAborted
from tests.agent.support import assert_images_equal, expected, fill, make_side, snapshot
from tests.support.hooked import hooked
from tests.support.waiting import wait_until
from tests.unit.test_sglang_poll_words import CommonKVSender, KVPoll, Manager, classes  # noqa: F401

S = RequestState
DST_STATE = [[1], [0], [1]]  # the tiny layout's three state components
SRC_STATE = [[2], [1], [2]]
COPY_DELAY_S = 0.3  # the prefill engine's copies land this long after their submit


@pytest.fixture
def bare_sides():
    """Two private-memory sides of the tiny layout without aux buffers (prefill 1, decode 2)."""
    p, d = make_side(False, aux=False), make_side(False, aux=False)
    fill(p.kv_args, 1)
    fill(d.kv_args, 2)
    yield p, d
    p.close()
    d.close()


@pytest.fixture
def copies():
    """The prefill's loopback engine under hooks (``tests.support.hooked``): the plans it was given."""
    with hooked("loopback") as hooks:
        yield hooks


@pytest.fixture
def agents(bare_sides, copies):
    p, d = bare_sides
    pa = PrefillAgent(
        p.kv_args,
        (p.pools.target, p.pools.draft),
        engine=copies.engine,
        engine_options=copies.options(delay_s=COPY_DELAY_S),
    )
    da = DecodeAgent(d.kv_args, (d.pools.target, d.pools.draft), engine="loopback")
    yield pa, da
    da.close()
    pa.close()


class AgentManager(Manager):
    """The stand-in manager over a real agent (``prefill``: the address its receivers dial)."""

    def __init__(self, agent, kv_args, prefill: str = "") -> None:
        super().__init__(agent)
        self.kv_args = types.SimpleNamespace(state_types=list(kv_args.state_types), engine_rank=0)
        self.prefill = prefill

    def agent_address(self, info):
        return self.prefill


@pytest.fixture
def sglang(classes, monkeypatch):  # noqa: F811
    """``(PdStateKVSender, PdStateKVReceiver)`` over the stand-ins, the sender's base with SGLang's
    ``_record_transfer_indices`` and ``abort`` (the conclusion SGLang's own abort records)."""
    monkeypatch.setattr(CommonKVSender, "_record_transfer_indices", lambda self, *a: None, raising=False)

    def abort(self):
        self.conclude_state = KVPoll.Failed

    monkeypatch.setattr(CommonKVSender, "abort", abort, raising=False)
    return classes


def _poll_until(side, want: int, what: str) -> int:
    return wait_until(what, lambda: side.poll() == want, 10) and side.poll()


def _asked_sender(sender_cls, pa, bare_sides, room: int, da) -> tuple:
    """A decode's receiver of ``room`` that named its two destination pages, and the backend's
    sender of the room at ``WaitingForInput`` (the decode's request arrived)."""
    recv = da.receiver(pa.address, room)
    recv.init([3, 4], DST_STATE)
    wait_until("the decode's request at the prefill", lambda: pa.requested(room), 10)
    s = sender_cls(AgentManager(pa, bare_sides[0].kv_args), "127.0.0.1:1", room, [0], 0)
    _poll_until(s, KVPoll.WaitingForInput, "the sender at WaitingForInput")
    return recv, s


def test_a_posted_sender_of_a_room_with_a_live_one_fails_with_the_error_sender_raises(agents):
    pa, _ = agents
    live = pa.sender(7, 2)
    with pytest.raises(ProtocolError) as raised:
        pa.sender(7, 2)
    posted = pa.sender(7, 2, posted=True)  # returns at once: the same error fails it
    assert posted.wait(10) is S.FAILED and live.state is S.BOOTSTRAPPING
    exc = posted.failure_exception()
    assert type(exc) is ProtocolError and str(exc) == str(raised.value) == "room 7 already has a live sender"
    assert posted.posted_error is exc


def test_a_posted_chunk_the_agent_refuses_fails_the_backends_next_poll_with_its_error(agents, bare_sides, sglang):
    pa, da = agents
    sender_cls, _ = sglang
    recv, s = _asked_sender(sender_cls, pa, bare_sides, 8, da)
    s.init(2, None)
    one = pa.sender(99, 2)
    with pytest.raises(ValueError) as raised:  # what the blocking call raises for the same chunk
        one.send([1, 2, 3])
    assert s.send(np.array([1, 2, 3])) is None  # posted: nothing raised here
    assert _poll_until(s, KVPoll.Failed, "the sender Failed") == KVPoll.Failed
    want = "room 8: chunk of 3 pages brings the request to 3 pages, more than the 2 declared"
    assert s.kv_mgr.failure_records[8] == f"ValueError: {want}"  # the room's reason, as SGLang records it
    with pytest.raises(ValueError) as failed:
        s.failure_exception()
    assert str(failed.value) == str(raised.value).replace("room 99", "room 8") == want
    assert recv.state is S.WAITING_FOR_INPUT or recv.state is S.TRANSFERRING  # the agent's request: as before


def test_a_posted_send_metadata_the_agent_refuses_fails_the_backends_next_poll(agents, bare_sides, sglang):
    pa, da = agents
    _, receiver_cls = sglang
    r = receiver_cls(AgentManager(da, bare_sides[1].kv_args, pa.address), "127.0.0.1:1", 9)
    r.init(0)
    _poll_until(r, KVPoll.WaitingForInput, "the receiver at WaitingForInput")
    assert r.send_metadata([3, 4], aux_index=1, state_indices=DST_STATE) is None  # posted
    assert _poll_until(r, KVPoll.Failed, "the receiver Failed") == KVPoll.Failed
    with pytest.raises(ValueError, match=r"^aux_index given, but this agent's KVArgs has no aux buffers$"):
        r.failure_exception()
    assert not pa.requested(9)  # no request went out: nothing may land


@pytest.mark.parametrize("copying", [False, True], ids=["at-once", "copying"])
def test_an_abort_right_after_posted_sends_lands_no_byte_after_its_fence(agents, bare_sides, sglang, copies, copying):
    """``copying``: the abort comes once both chunks' copies are in the engine (each landing
    ``COPY_DELAY_S`` after its submit): its fence waits for them."""
    pa, da = agents
    sender_cls, _ = sglang
    kv = bare_sides[1].kv_args
    before, source = snapshot(kv), snapshot(bare_sides[0].kv_args)
    recv, s = _asked_sender(sender_cls, pa, bare_sides, 10, da)
    s.init(2, None)
    s.send(np.array([1]))
    s.send(np.array([2]), SRC_STATE)  # the last chunk, with the request's state
    assert s.poll() == KVPoll.Transferring  # a chunk was handed over: transferring, to SGLang
    if copying:
        wait_until("both chunks' copies in the engine", lambda: len(copies.submits) >= 2, 10)
    s.abort()  # returns once nothing of the request can land any more (each copy takes COPY_DELAY_S)
    fenced = snapshot(kv)
    assert s.poll() == KVPoll.Failed
    assert recv.wait(10) is S.FAILED
    exc = recv.failure_exception()
    assert type(exc) is TransferAborted and str(exc) == "aborted by prefill: Aborted by AbortReq."
    assert recv.fenced
    # what landed before the fence is a prefix of the request's chunks, byte for byte
    state = [(c, src, dst) for c, (src, dst) in enumerate(zip(SRC_STATE, DST_STATE), 1)]
    moves = [(0, [1], [3]), (0, [2], [4]), *state]
    landed = [
        k for k in (0, 1, len(moves)) if all(map(np.array_equal, fenced, expected(before, source, kv, moves[:k])))
    ]
    assert landed == [len(moves)] if copying else len(landed) == 1
    # a request sent after it through the same engine (its copies as slow) lands, and only it does
    later = da.receiver(pa.address, 11)
    later.init([5, 6], [[2], [1], [2]])
    send = pa.sender(11, 2)
    send.send([1, 2], SRC_STATE)
    assert later.wait(10) is S.SUCCESS and send.wait(10) is S.SUCCESS
    more = [(0, [1, 2], [5, 6])] + [(c, src, [2 - (c == 2)]) for c, src in enumerate(SRC_STATE, 1)]
    assert_images_equal(snapshot(kv), expected(fenced, source, kv, more))


def test_posts_from_two_threads_never_wait_for_the_loops_tick():
    """One wake-up per burst of posts (``AgentLoop.post``): a post that skips its write because
    one is pending must still be run without the next tick (here 60 s away)."""
    loop = AgentLoop("posts", 60.0, lambda: None)
    loop.start()
    stop = threading.Event()

    def other() -> None:  # another thread posting all along (the engine's wake-ups, a second caller)
        while not stop.is_set():
            loop.post(lambda: None)
            time.sleep(0)

    t = threading.Thread(target=other, daemon=True)
    t.start()
    try:
        for i in range(3000):
            ran = threading.Event()
            loop.post(ran.set)
            assert ran.wait(10), f"post {i} still waits for the loop"
    finally:
        stop.set()
        t.join(10)
        loop.stop(lambda: None)


@pytest.fixture
def dropped_posts(monkeypatch):
    """``hold()``: from now on the agents' posts are taken and never run (their I/O thread ends
    before it reaches them); ``release()``: posts run again."""
    dropping = threading.Event()
    post = AgentLoop.post

    def dropping_post(loop, fn):
        if dropping.is_set():
            if loop.closed:
                post(loop, fn)  # refused as it would be (AgentClosed)
            return
        post(loop, fn)

    monkeypatch.setattr(AgentLoop, "post", dropping_post)
    return types.SimpleNamespace(hold=dropping.set, release=dropping.clear)


def test_a_posted_sender_reads_transferring_from_its_first_posted_chunk_and_fails_at_a_close_before_its_add(
    agents, dropped_posts
):
    pa, _ = agents
    dropped_posts.hold()
    s = pa.sender(60, 2, posted=True)
    assert s.poll() is S.BOOTSTRAPPING and s.state is S.BOOTSTRAPPING  # its add is on its way
    s.post([1])
    assert s.poll() is S.TRANSFERRING and s.state is S.TRANSFERRING  # the agent's word, not the thread's yet
    assert s.wait(0) is S.BOOTSTRAPPING and s.record.state is S.BOOTSTRAPPING  # the thread never took it
    dropped_posts.release()
    pa.close()
    assert s.wait(10) is S.FAILED and s.poll() is S.FAILED
    exc = s.failure_exception()
    assert type(exc) is AgentClosed
    assert (
        str(exc) == "room 60: the agent closed (prefill shutting down) before its I/O thread added this posted sender"
    )
    with pytest.raises(AgentClosed, match=r"^the agent is closed$"):
        pa.sender(61, 2, posted=True)


def test_a_posted_receiver_reads_transferring_from_post_init_and_fails_at_a_close_before_its_add(agents, dropped_posts):
    pa, da = agents
    dropped_posts.hold()
    r = da.receiver(pa.address, 62, posted=True)
    assert r.poll() is S.BOOTSTRAPPING
    r.post_init([3, 4], DST_STATE)
    assert r.poll() is S.TRANSFERRING and r.state is S.TRANSFERRING
    assert r.record.state is S.BOOTSTRAPPING  # the thread's own state: it took nothing yet
    dropped_posts.release()
    da.close()
    assert r.wait(10) is S.FAILED and r.poll() is S.FAILED and r.record.state is S.FAILED
    exc = r.failure_exception()
    assert type(exc) is AgentClosed
    assert (
        str(exc) == "room 62: the agent closed (decode shutting down) before its I/O thread added this posted receiver"
    )
    assert not pa.requested(62)  # nothing went out


def test_a_posted_sender_behind_the_closes_last_step_fails_and_is_never_added(agents, monkeypatch):
    """A sender posted while the agent closes runs after the close's last step on the I/O thread:
    it fails there, and the closed core never holds it."""
    pa, _ = agents
    late: list = []
    end = PrefillCore.end

    def end_then_post(core, reason, now):
        end(core, reason, now)
        late.append(pa.sender(63, 2, posted=True))  # queued behind the close's last step

    monkeypatch.setattr(PrefillCore, "end", end_then_post)
    pa.close()
    (s,) = late
    assert s.wait(10) is S.FAILED and s.posted_error is None
    exc = s.failure_exception()
    assert type(exc) is AgentClosed
    assert (
        str(exc) == "room 63: the agent closed (prefill shutting down) before its I/O thread added this posted sender"
    )
