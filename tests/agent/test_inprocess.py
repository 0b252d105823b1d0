"""Both agents in this process over the loopback engine: digests, construction refusals."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from pdstate.agent import DecodeAgent, PrefillAgent, RequestState
from pdstate.agent.digest import RequestDigest, index_runs
from pdstate.errors import DigestMismatch, EngineError
from tests.agent.support import fill, loopback_agents, make_side
from tests.support.hooked import hooked


@pytest.fixture
def pair():
    p, d = make_side(False), make_side(False)
    fill(p.kv_args, 1)
    fill(d.kv_args, 2)
    with hooked("loopback") as hooks, loopback_agents(p, d, hooks) as (pa, da):
        yield pa, da, hooks


def test_corrupted_copy_fails_both_sides(pair):
    pa, da, hooks = pair

    def corrupting(plan):
        # every byte of the first descriptor's item flipped in what landed: the request's first
        # item of its channel, which every level's sample holds (a byte outside ``sampled``'s
        # blocks would pass it: tests/agent/test_verify_levels.py)
        n = int(min(plan.length[0], 4096))
        first = (ctypes.c_uint8 * n).from_address(int(plan.dst[0]))
        for k in range(n):
            first[k] ^= 0xFF

    hooks.after_submit = corrupting
    recv = da.receiver(pa.address, 5)
    send = pa.sender(5, 2)
    recv.init([3, 4], [[1], [0], [1]])
    send.send([1, 2], [[2], [1], [2]])
    assert recv.wait(10) is RequestState.FAILED
    assert send.wait(10) is RequestState.FAILED
    exc = recv.failure_exception()
    assert type(exc) is DigestMismatch and type(send.failure_exception()) is DigestMismatch
    assert str(send.failure_exception()) == str(exc)
    assert str(exc).startswith("room 5: digest of the ")
    assert "that landed" in str(exc) and "differs from the prefill's digest of the bytes it sent" in str(exc)


def test_success_metrics(pair):
    pa, da, _hooks = pair
    recv, send = da.receiver(pa.address, 6), pa.sender(6, 3, aux_index=0)
    recv.init([5, 6, 7], [[1], [0], [1]], aux_index=1)
    send.send([1])
    send.send([2, 3], [[2], [1], [2]])
    assert recv.wait(10) is RequestState.SUCCESS, recv.failure_exception()
    assert send.wait(10) is RequestState.SUCCESS
    assert send.landed and send.metrics["chunks"] == 2
    assert recv.metrics["bytes"] == send.metrics["bytes"] == send.metrics["bytes"] > 0
    assert [d.worker_id for d in pa.decodes()] == [da.worker_id]
    assert pa.decode_count == 1


def test_too_many_pages_refused(pair):
    pa, da, _hooks = pair
    send = pa.sender(8, 2)
    with pytest.raises(ValueError, match="chunk of 3 pages brings the request to 3 pages, more than the 2 declared"):
        send.send([1, 2, 3])


def test_shm_decode_over_private_memory_is_refused():
    d = make_side(False)
    try:
        with pytest.raises(
            EngineError,
            match="DecodeAgent cannot publish its memory on the shm engine: .* is not in a shared file mapping",
        ):
            DecodeAgent(d.kv_args, (d.pools.target, d.pools.draft))
    finally:
        d.close()


def test_digest_is_chunking_invariant_and_sees_every_byte():
    buf = np.random.default_rng(0).integers(0, 256, 64 * 10, dtype=np.uint8)
    ptr = buf.ctypes.data
    layout = [([ptr, ptr + 320], [32, 32])]
    whole = RequestDigest(layout)
    whole.update(0, [1, 2, 3, 7, 8])
    parts = RequestDigest(layout)
    parts.update(0, [1, 2])
    parts.update(0, [3, 7])
    parts.update(0, [8])
    assert whole.digest() == parts.digest() and whole.bytes == parts.bytes == 2 * 5 * 32
    buf[320 + 8 * 32 + 31] ^= 1  # last byte of item 8 in the second buffer
    again = RequestDigest(layout)
    again.update(0, [1, 2, 3, 7, 8])
    assert again.digest() != whole.digest()
    starts, lengths = index_runs(np.array([4, 5, 6, 9, 2, 3]))
    assert starts.tolist() == [4, 9, 2] and lengths.tolist() == [3, 1, 2]


def test_sender_nobody_asks_for_fails_after_bootstrap_timeout():
    p = make_side(False)
    pa = PrefillAgent(p.kv_args, (p.pools.target, p.pools.draft), engine="loopback", bootstrap_timeout_s=0.3)
    try:
        send = pa.sender(9, 1)
        assert send.wait(0.1) is RequestState.BOOTSTRAPPING
        assert send.wait(5) is RequestState.FAILED
        assert str(send.failure_exception()) == "room 9: no decode asked for it within 0.3 s"
    finally:
        pa.close()
        p.close()


def test_room_requested_twice_fails_the_second(pair):
    pa, da, _hooks = pair
    d2 = make_side(False)
    da2 = DecodeAgent(d2.kv_args, (d2.pools.target, d2.pools.draft), engine="loopback", worker_id="second")
    try:
        send = pa.sender(11, 1)
        first = da.receiver(pa.address, 11)
        first.init([2], [[1], [0], [1]])
        assert send.wait(5, until=lambda s: s is RequestState.WAITING_FOR_INPUT) is RequestState.WAITING_FOR_INPUT
        second = da2.receiver(pa.address, 11)
        second.init([3], [[1], [0], [1]])
        assert second.wait(5) is RequestState.FAILED
        assert str(second.failure_exception()) == f"room 11 was already requested by decode {da.worker_id}"
        send.send([1], [[1], [0], [1]])
        assert first.wait(5) is RequestState.SUCCESS, first.failure_exception()
    finally:
        da2.close()
        d2.close()


def test_abort_fences_a_write_still_in_flight():
    """An engine whose writes land later (loopback, delay_s): the prefill confirms the abort only
    after the in-flight handle finished, so nothing changes once ``abort()`` returned."""
    from tests.agent.support import snapshot

    p, d = make_side(False), make_side(False)
    fill(p.kv_args, 1)
    fill(d.kv_args, 2)
    pa = PrefillAgent(p.kv_args, (p.pools.target, p.pools.draft), engine="loopback", engine_options={"delay_s": 0.4})
    da = DecodeAgent(d.kv_args, (d.pools.target, d.pools.draft), engine="loopback")
    try:
        recv, send = da.receiver(pa.address, 12), pa.sender(12, 3)
        before = snapshot(d.kv_args)
        recv.init([1, 2, 3], [[1], [0], [1]])
        send.send([1])  # lands 0.4 s after its submit
        assert send.wait(5, until=lambda s: s is RequestState.TRANSFERRING) is RequestState.TRANSFERRING
        recv.abort("stop")
        assert recv.state is RequestState.FAILED and send.state is RequestState.FAILED
        fenced = snapshot(d.kv_args)
        # the in-flight chunk finished before the abort was confirmed (page 1 of main KV changed) ...
        item = d.kv_args.kv_item_lens[0]
        assert not np.array_equal(fenced[0][item : 2 * item], before[0][item : 2 * item])
        # ... and nothing lands afterwards, even past the engine's delay
        with pytest.raises(type(send.failure_exception()), match="aborted by decode: stop"):
            send.send([2, 3], [[1], [0], [1]])
        import time

        time.sleep(0.6)
        after = snapshot(d.kv_args)
        for j, (a, f) in enumerate(zip(after, fenced)):
            assert np.array_equal(a, f), f"buffer {j} changed after abort() returned"
    finally:
        da.close()
        pa.close()
        p.close()
        d.close()


def test_engine_failure_mid_request_fails_both_sides():
    from pdstate.transfer.engines.loopback import ScriptedFailure

    p, d = make_side(False), make_side(False)
    failure = ScriptedFailure(nth_submit=2, after_bytes=100, message="loopback link down")
    pa = PrefillAgent(
        p.kv_args, (p.pools.target, p.pools.draft), engine="loopback", engine_options={"failures": [failure]}
    )
    da = DecodeAgent(d.kv_args, (d.pools.target, d.pools.draft), engine="loopback")
    try:
        recv, send = da.receiver(pa.address, 13), pa.sender(13, 2)
        recv.init([1, 2], [[1], [0], [1]])
        send.send([1])
        send.send([2], [[1], [0], [1]])
        assert recv.wait(5) is RequestState.FAILED and send.wait(5) is RequestState.FAILED
        assert type(recv.failure_exception()) is EngineError
        assert str(recv.failure_exception()) == str(send.failure_exception()) == "loopback link down"
    finally:
        da.close()
        pa.close()
        p.close()
        d.close()


def test_digest_off():
    p, d = make_side(False), make_side(False)
    pa = PrefillAgent(p.kv_args, (p.pools.target, p.pools.draft), engine="loopback")
    da = DecodeAgent(d.kv_args, (d.pools.target, d.pools.draft), engine="loopback", digest=False)
    try:
        recv, send = da.receiver(pa.address, 14), pa.sender(14, 1)
        recv.init([4], [[1], [0], [1]])
        send.send([4], [[1], [0], [1]])
        assert recv.wait(5) is RequestState.SUCCESS and send.wait(5) is RequestState.SUCCESS
        assert "digest_s" not in recv.metrics and "digest_s" not in send.metrics
    finally:
        da.close()
        pa.close()
        p.close()
        d.close()


def test_an_empty_request_makes_no_engine_call(pair):
    """Zero pages and no state (the control path alone): Success on both sides, bytes 0, and the
    engine is never asked to move anything."""
    pa, da, hooks = pair
    recv, send = da.receiver(pa.address, 31), pa.sender(31, 0)
    recv.init([], [[], [], []])
    send.send([], [[], [], []])
    assert recv.wait(10) is RequestState.SUCCESS, recv.failure_exception()
    assert send.wait(10) is RequestState.SUCCESS, send.failure_exception()
    assert hooks.submits == [] and recv.metrics["bytes"] == send.metrics["bytes"] == 0


@pytest.mark.parametrize("digest", [False, True])
def test_an_empty_chunk_against_named_state_still_fails_as_the_planner_would(digest):
    """No pages on either side, but the decode names a state slot the prefill does not send:
    nothing to move for the prefill, yet the request fails with the planner's own count error
    (an empty chunk skips planning only where planning has nothing to refuse)."""
    p, d = make_side(False), make_side(False)
    pa = PrefillAgent(p.kv_args, (p.pools.target, p.pools.draft), engine="loopback")
    da = DecodeAgent(d.kv_args, (d.pools.target, d.pools.draft), engine="loopback", digest=digest)
    try:
        recv, send = da.receiver(pa.address, 32), pa.sender(32, 0)
        recv.init([], [[1], [], []])
        assert recv.wait(10, until=lambda s: s is RequestState.TRANSFERRING) is RequestState.TRANSFERRING
        send.send([], [[], [], []])
        assert send.wait(10) is RequestState.FAILED and recv.wait(10) is RequestState.FAILED
        assert type(send.failure_exception()).__name__ == "IndexCountMismatch"
        planners = "component 0 (swa): index count mismatch: prefill=0, decode=1"  # the planner's own words
        assert str(send.failure_exception()) == planners
        assert str(recv.failure_exception()) == str(send.failure_exception())
    finally:
        da.close()
        pa.close()
        p.close()
        d.close()


def test_an_empty_request_at_off_returns_before_planning():
    """An empty request at verification ``off`` (the bench's control path; at ``sampled``:
    ``test_an_empty_request_makes_no_engine_call``): the prefill plans
    nothing and asks its engine nothing, its ``TransferDone`` says nothing moved, and both sides
    end SUCCESS, the receiver's state stamps in order."""
    p, d = make_side(False), make_side(False)
    n_comp = len(p.kv_args.state_types)
    with hooked("loopback") as hooks:
        pa = PrefillAgent(
            p.kv_args, (p.pools.target, p.pools.draft), engine=hooks.engine, engine_options=hooks.options()
        )
        da = DecodeAgent(d.kv_args, (d.pools.target, d.pools.draft), engine="loopback", verify="off")
        try:
            recv, send = da.receiver(pa.address, 9), pa.sender(9, 0)
            recv.init([], [[]] * n_comp)
            send.send([], [[]] * n_comp)
            assert recv.wait(10) is RequestState.SUCCESS, recv.failure_exception()
            assert send.wait(10) is RequestState.SUCCESS, send.failure_exception()
            assert hooks.submits == []
            m, s = recv.metrics, send.metrics
            assert (m["bytes"], m["descriptors"], m["verify"]) == (0, 0, "off")
            assert (s["bytes"], s["descriptors"], s["chunks"], s["verify"]) == (0, 0, 1, "off")
            assert m["transferring_at_s"] <= m["success_at_s"]
        finally:
            da.close()
            pa.close()
            p.close()
            d.close()
