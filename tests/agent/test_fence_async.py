"""The prefill's fence is pending work, not a wait on its I/O thread: while a failing request's
copy is still in flight (loopback engine, one scripted slow submit, longer than the peer
heartbeat timeout), the prefill keeps answering heartbeats and serving other requests; the
abort is confirmed, the request ended and a gone decode's mapping released only once that copy
has ended."""

from __future__ import annotations

import time
from contextlib import ExitStack

import pytest

from pdstate.agent import DecodeAgent, PrefillAgent, RequestState
from pdstate.errors import PeerGone, TransferAborted, TransferTimedOut
from pdstate.transfer.engines.loopback import ScriptedDelay
from tests.agent.support import assert_images_equal, expected, fill, make_side, snapshot
from tests.support.hooked import hooked
from tests.support.waiting import wait_until

SLOW_S = 4.0  # the first submit lands this long after it ...
HEARTBEAT_S, PEER_TIMEOUT_S = 0.2, 1.0  # ... well past the peer timeout of both agents
SHORT = {"heartbeat_interval_s": HEARTBEAT_S, "peer_timeout_s": PEER_TIMEOUT_S}
STATE = [[1], [0], [1]]  # one slot per state component (the tiny preset has three)


@pytest.fixture
def slow_pair():
    """A prefill whose first engine submit is slow, and a decode, both over the loopback engine."""
    p, d = make_side(False), make_side(False)
    fill(p.kv_args, 1)
    fill(d.kv_args, 2)
    stack = ExitStack()
    hooks = stack.enter_context(hooked("loopback"))
    slow = hooks.options(delays=[ScriptedDelay(nth_submit=1, delay_s=SLOW_S)])
    pa = PrefillAgent(p.kv_args, (p.pools.target, p.pools.draft), engine=hooks.engine, engine_options=slow, **SHORT)
    da = DecodeAgent(d.kv_args, (d.pools.target, d.pools.draft), engine="loopback", **SHORT)
    try:
        yield p, d, pa, da, hooks.engines[0]
    finally:
        da.close()
        pa.close()
        p.close()
        d.close()
        stack.close()


def _slow_request(pa, da, room: int):
    """Request ``room``'s first chunk (main-KV page 1 to page 1), submitted slow; returns the
    receiver, the sender and when the copy lands at the earliest."""
    recv, send = da.receiver(pa.address, room), pa.sender(room, 3)
    recv.init([1, 2, 3], STATE)
    due = time.monotonic() + SLOW_S
    send.send([1])
    assert send.wait(5, until=lambda s: s is RequestState.TRANSFERRING) is RequestState.TRANSFERRING
    return recv, send, due


def test_abort_of_a_slow_copy_keeps_the_prefill_serving(slow_pair):
    p, d, pa, da, _engine = slow_pair
    src, before = snapshot(p.kv_args), snapshot(d.kv_args)
    recv1, send1, due = _slow_request(pa, da, 41)
    acked: list[float] = []
    recv1.add_done_callback(lambda _r: acked.append(time.monotonic()))
    with pytest.raises(TransferTimedOut):  # sent; not confirmed yet (its copy is in flight)
        recv1.abort("stop", timeout_s=0)

    # another request on the same prefill completes, byte-exact, before the slow copy is due
    recv2, send2 = da.receiver(pa.address, 42), pa.sender(42, 2)
    recv2.init([4, 5], [[2], [1], [2]])
    send2.send([6, 7], [[3], [2], [3]])
    assert recv2.wait(SLOW_S) is RequestState.SUCCESS, recv2.failure_exception()
    assert send2.wait(SLOW_S) is RequestState.SUCCESS, send2.failure_exception()
    assert time.monotonic() < due and not acked, "served only after the slow copy"
    moved2 = [(0, [6, 7], [4, 5]), (1, [3], [2]), (2, [2], [1]), (3, [3], [2])]
    assert_images_equal(snapshot(d.kv_args), expected(before, src, d.kv_args, moved2))
    assert recv1.state is RequestState.TRANSFERRING and send1.state is RequestState.TRANSFERRING

    # the prefill answers heartbeats all along: the decode never finds it silent
    deadline = time.monotonic() + SLOW_S + 10
    while not acked:
        assert time.monotonic() < deadline, "the abort was never confirmed"
        view = da.prefills()[pa.address]
        assert view.state == "accepted" and view.handshakes == 1, view
        recv1.wait(HEARTBEAT_S)
    assert da.prefills()[pa.address].handshakes == 1
    assert [x.worker_id for x in pa.decodes()] == [da.worker_id]

    # the abort was confirmed only once the slow copy had landed, and nothing lands after it
    assert acked[0] >= due
    assert recv1.state is RequestState.FAILED and send1.state is RequestState.FAILED
    assert type(recv1.failure_exception()) is TransferAborted
    assert str(send1.failure_exception()) == "aborted by decode: stop"
    landed = expected(before, src, d.kv_args, [(0, [1], [1]), *moved2])
    assert_images_equal(snapshot(d.kv_args), landed)


def test_gone_decode_is_released_only_after_its_fence(slow_pair):
    p, d, pa, da, engine = slow_pair
    recv1, send1, due = _slow_request(pa, da, 43)
    ended: list[float] = []
    send1.add_done_callback(lambda _s: ended.append(time.monotonic()))
    assert engine.num_peers == 1  # the decode's mapping
    da.close()  # its heartbeats stop: the prefill drops it after PEER_TIMEOUT_S, the slow copy in flight
    deadline = time.monotonic() + PEER_TIMEOUT_S + 5
    while pa.decodes():
        assert time.monotonic() < deadline, "the prefill never dropped the silent decode"
        send1.wait(HEARTBEAT_S)
    assert time.monotonic() < due
    # dropped, but its request's copy is still in flight: not ended, the mapping kept
    assert not send1.state.terminal and engine.num_peers == 1
    assert pa.decode_count == 0
    assert send1.wait(SLOW_S + 10).terminal
    assert ended[0] >= due
    assert type(send1.failure_exception()) is PeerGone
    assert str(send1.failure_exception()).endswith(f"missed heartbeats for {PEER_TIMEOUT_S:g} s")
    wait_until("the gone decode's mapping released after the fence", lambda: engine.num_peers == 0, 5)


def test_prefill_abort_returns_once_its_fence_held(slow_pair):
    p, d, pa, da, _engine = slow_pair
    recv1, send1, due = _slow_request(pa, da, 44)
    with pytest.raises(TransferTimedOut, match=r"^room 44: the abort's fence did not hold within 0 s$"):
        send1.abort("stop", timeout_s=0)  # handed over; its copy still in flight
    assert not send1.state.terminal and not recv1.state.terminal
    send1.abort("again", timeout_s=SLOW_S + 10)  # returns once the fence held: the first reason stands
    assert time.monotonic() >= due and send1.state is RequestState.FAILED
    assert str(send1.failure_exception()) == "aborted by prefill: stop"
    assert recv1.wait(5) is RequestState.FAILED
    assert str(recv1.failure_exception()) == "aborted by prefill: stop"
    assert da.prefills()[pa.address].handshakes == 1
