"""A decode the prefill refused gives its rooms up: the prefill's senders fail with the refusal."""

from __future__ import annotations

import pytest

from pdstate.agent import DecodeAgent, PrefillAgent, RequestState
from tests.agent.support import loopback_agents, make_side
from tests.support.waiting import wait_until

SEED = "DSV4 target and draft pools must share the SWA index mapping"


@pytest.fixture
def refused():
    """A prefill, and a decode whose draft holds a copy of the mapping (the seed error)."""
    p = make_side(False)
    d = make_side(False, check=False, draft_mapping="clone")
    with loopback_agents(p, d) as agents:
        yield agents


def test_the_live_sender_of_a_refused_room_fails_with_the_refusal(refused):
    pa, da = refused
    send = pa.sender(7, 2)
    recv = da.receiver(pa.address, 7)
    assert recv.wait(5) is RequestState.FAILED
    assert send.wait(5) is RequestState.FAILED
    assert type(send.failure_exception()) is type(recv.failure_exception())
    assert str(send.failure_exception()) == str(recv.failure_exception()) == SEED
    assert pa.refusal(7) is None  # the live sender took it


def test_a_room_given_up_before_its_sender_is_kept_for_the_caller(refused):
    pa, da = refused
    recv = da.receiver(pa.address, 8)
    assert recv.wait(5) is RequestState.FAILED
    wait_until("the prefill to learn room 8 was given up", lambda: pa.refusal(8) is not None, 5)
    assert str(pa.refusal(8)) == SEED and type(pa.refusal(8)).__name__ == "SWAIndexMappingNotShared"
    assert not pa.requested(8) and pa.pending_pages(8) is None


def test_an_accepted_decodes_request_waits_for_its_sender():
    p, d = make_side(False), make_side(False)
    pa = PrefillAgent(p.kv_args, (p.pools.target, p.pools.draft), engine="loopback")
    da = DecodeAgent(d.kv_args, (d.pools.target, d.pools.draft), engine="loopback")
    try:
        recv = da.receiver(pa.address, 9)
        assert recv.wait(5, lambda s: s is not RequestState.BOOTSTRAPPING) is RequestState.WAITING_FOR_INPUT
        assert not pa.requested(9)
        recv.init([3, 4], [[1], [0], [1]])
        wait_until("the decode's request to reach the prefill", lambda: pa.requested(9), 5)
        assert pa.pending_pages(9) == 2 and pa.refusal(9) is None
    finally:
        da.close()
        pa.close()
        p.close()
        d.close()


def test_a_decode_abort_before_the_sender_fails_that_attempt_only():
    """A decode rank aborts its waiting request (the prefill has made no sender yet): the prefill's
    next look at the room (SGLang's sender, ``refused_room``) fails with the abort and takes it, so
    the same room sent again (a retracted request's next attempt) does not meet it, even when the
    prefill looks before a decode rank's new request has come. With a decode attention TP twice
    the prefill's, each decode rank asks under a replica room; every replica's refusal goes."""
    from pdstate.integrations.sglang.replicas import refused_room, replica_room

    p, d = make_side(False), make_side(False)
    pa = PrefillAgent(p.kv_args, (p.pools.target, p.pools.draft), engine="loopback")
    da = DecodeAgent(d.kv_args, (d.pools.target, d.pools.draft), engine="loopback")
    room = 11
    rooms = [replica_room(room, i, 2) for i in range(2)]
    try:
        for r in rooms:
            recv = da.receiver(pa.address, r)
            assert recv.wait(5, lambda s: s is not RequestState.BOOTSTRAPPING) is RequestState.WAITING_FOR_INPUT
            recv.init([3, 4], [[1], [0], [1]])
            wait_until(f"the decode's request for room {r} to reach the prefill", lambda r=r: pa.requested(r), 5)
            recv.abort("Aborted by AbortReq.", timeout_s=5)
            wait_until(f"room {r} to be given up", lambda r=r: pa.refusal(r) is not None, 5)
        first = refused_room(pa, room)
        assert type(first).__name__ == "TransferAborted"
        assert str(first) == "aborted by decode: Aborted by AbortReq."
        assert refused_room(pa, room) is None  # the room's next attempt starts clean
        assert [pa.refusal(r) for r in rooms] == [None, None]
    finally:
        da.close()
        pa.close()
        p.close()
        d.close()
