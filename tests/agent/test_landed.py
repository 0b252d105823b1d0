"""``wire.Landed``: the prefill tells a digest request's decode what has landed before
``TransferDone``, and the decode hashes it while the rest copies (both agents in this process,
over shm, pieces made small so that a ``tiny`` request is cut)."""

from __future__ import annotations

import ctypes
import time
from contextlib import ExitStack

import pytest

from pdstate.agent import DecodeAgent, PrefillAgent, RequestState
from pdstate.errors import DigestMismatch
from pdstate.protocol import wire
from tests.agent.support import SHM_DIR, assert_images_equal, expected, fill, make_side, snapshot
from tests.support.hooked import hooked
from tests.support.tapped import TappedPrefillAgent

pytestmark = pytest.mark.timeout(60)

PAGES = [1, 2, 3, 4, 5, 6, 7, 8]
DST = [9, 10, 11, 12, 13, 14, 15, 3]
STATE_SRC, STATE_DST = [[2], [1], [2]], [[1], [0], [1]]
MOVES = [(0, PAGES, DST), (1, [2], [1]), (2, [1], [0]), (3, [2], [1]), (4, [0], [5])]


@pytest.fixture
def shm_pair():
    """An shm pair whose prefill cuts a digest request into pieces of two main-KV pages."""
    p, d = make_side(False), make_side(True)
    fill(p.kv_args, 1)
    fill(d.kv_args, 2)
    stack = ExitStack()
    hooks = stack.enter_context(hooked("shm"))
    pa = TappedPrefillAgent(
        p.kv_args,
        (p.pools.target, p.pools.draft),
        engine=hooks.engine,
        engine_options=hooks.options(segment_dir=str(SHM_DIR)),
        landed_piece_bytes=2 * sum(p.kv_args.kv_item_lens),
    )
    sent: list[wire.Message] = []
    pa.tap = lambda identity, msg, send: (sent.append(msg), send(identity, msg))

    def decode(digest: bool = True) -> DecodeAgent:
        da = DecodeAgent(
            d.kv_args,
            (d.pools.target, d.pools.draft),
            engine="shm",
            engine_options={"segment_dir": str(SHM_DIR)},
            digest=digest,
            verify="full",  # every byte: early hashing of each piece is what is tested
        )
        decodes.append(da)
        return da

    decodes: list[DecodeAgent] = []
    yield pa, decode, sent, p, d, hooks
    for da in decodes:
        da.close()
    pa.close()
    p.close()
    d.close()
    stack.close()


def _landed(sent, room: int) -> list[tuple[int, bool]]:
    return [(m.pages, m.state_landed) for m in sent if isinstance(m, wire.Landed) and m.room == room]


def test_a_large_chunk_is_told_piece_by_piece_and_every_byte_lands(shm_pair):
    pa, decode, sent, p, d, _hooks = shm_pair
    da = decode()
    src, before = snapshot(p.kv_args), snapshot(d.kv_args)
    recv, send = da.receiver(pa.address, 21), pa.sender(21, len(PAGES), aux_index=0)
    recv.init(DST, STATE_DST, aux_index=5)
    send.send(PAGES, STATE_SRC)
    assert recv.wait(20) is RequestState.SUCCESS, recv.failure_exception()
    assert send.wait(20) is RequestState.SUCCESS, send.failure_exception()
    # state and aux first, then 4 pieces of 2 pages; the last piece is told by TransferDone
    assert _landed(sent, 21) == [(0, True), (2, True), (4, True), (6, True)]
    assert recv.metrics["landed"] == 4 and send.metrics["chunks"] == 1
    assert recv.metrics["bytes"] == send.metrics["bytes"]
    assert_images_equal(snapshot(d.kv_args), expected(before, src, d.kv_args, MOVES))


def test_digest_off_no_pieces_and_no_notices(shm_pair):
    pa, decode, sent, p, d, _hooks = shm_pair
    da = decode(digest=False)
    src, before = snapshot(p.kv_args), snapshot(d.kv_args)
    recv, send = da.receiver(pa.address, 22), pa.sender(22, len(PAGES), aux_index=0)
    recv.init(DST, STATE_DST, aux_index=5)
    send.send(PAGES, STATE_SRC)
    assert recv.wait(20) is RequestState.SUCCESS, recv.failure_exception()
    assert _landed(sent, 22) == [] and "landed" not in recv.metrics
    assert_images_equal(snapshot(d.kv_args), expected(before, src, d.kv_args, MOVES))


def test_a_byte_wrong_in_an_early_piece_fails_the_verdict(shm_pair):
    """What the decode hashed early is what landed: one byte flipped in the first main-KV piece
    (right after it was copied, before it was told landed) fails both sides."""
    pa, decode, sent, p, d, hooks = shm_pair
    da = decode()
    calls = []

    def corrupting(plan):
        calls.append(plan)
        if len(calls) == 2:  # the first main-KV piece (the first is state and aux)
            ctypes.c_uint8.from_address(int(plan.dst[0])).value ^= 0xFF

    hooks.after_submit = corrupting
    recv, send = da.receiver(pa.address, 23), pa.sender(23, len(PAGES), aux_index=0)
    recv.init(DST, STATE_DST, aux_index=5)
    send.send(PAGES, STATE_SRC)
    assert recv.wait(20) is RequestState.FAILED and send.wait(20) is RequestState.FAILED
    assert type(recv.failure_exception()) is DigestMismatch
    assert str(send.failure_exception()) == str(recv.failure_exception())
    assert _landed(sent, 23)[:2] == [(0, True), (2, True)]


def test_notices_past_the_request_or_repeated_change_nothing(shm_pair):
    """A notice naming more pages than the request has is cut to the request; repeated or
    backward ones hash nothing twice: the verdict is still exact."""
    pa, decode, sent, p, d, _hooks = shm_pair
    da = decode()

    def noisy(identity, msg, send):
        if isinstance(msg, wire.TransferDone):  # everything has landed by now
            send(identity, wire.Landed(room=msg.room, pages=10**6, state_landed=True))  # past the end
        send(identity, msg)
        if isinstance(msg, wire.Landed):
            send(identity, wire.Landed(room=msg.room, pages=0, state_landed=False))  # backward, after it

    pa.tap = noisy
    recv, send = da.receiver(pa.address, 24), pa.sender(24, len(PAGES), aux_index=0)
    recv.init(DST, STATE_DST, aux_index=5)
    send.send(PAGES, STATE_SRC)
    assert recv.wait(20) is RequestState.SUCCESS, recv.failure_exception()
    assert send.wait(20) is RequestState.SUCCESS, send.failure_exception()
    assert recv.metrics["landed"] == 9


def test_pieces_of_a_request_small_enough_stay_whole(shm_pair):
    pa, decode, sent, p, d, _hooks = shm_pair
    pa.landed_piece_bytes = 1 << 40
    da = decode()
    recv, send = da.receiver(pa.address, 25), pa.sender(25, len(PAGES), aux_index=0)
    recv.init(DST, STATE_DST, aux_index=5)
    send.send(PAGES, STATE_SRC)
    assert recv.wait(20) is RequestState.SUCCESS, recv.failure_exception()
    assert _landed(sent, 25) == [] and "landed" not in recv.metrics


def test_pieces_are_off_by_default_and_never_negative():
    p = make_side(False)
    try:
        pa = PrefillAgent(p.kv_args, (p.pools.target, p.pools.draft), engine="loopback")
        assert pa.landed_piece_bytes == 0
        pa.close()
        with pytest.raises(ValueError, match=r"^landed_piece_bytes must be >= 0 \(0: whole chunks\), got -1$"):
            PrefillAgent(p.kv_args, (p.pools.target, p.pools.draft), engine="loopback", landed_piece_bytes=-1)
    finally:
        p.close()


def test_an_ended_request_stops_its_early_hashing(shm_pair):
    """A request that fails after some of it was told landed: once the decode forgets it (its
    next tick), its digest's background work is cancelled and dropped, so no thread reads the
    pages after the caller frees them."""
    pa, decode, sent, p, d, _hooks = shm_pair
    da = decode()
    recv, send = da.receiver(pa.address, 26), pa.sender(26, len(PAGES), aux_index=0)
    recv.init(DST, STATE_DST, aux_index=5)
    send.send(PAGES[:4])  # a first chunk, in two pieces: each told landed (not the last chunk)
    deadline = time.monotonic() + 10
    while recv.metrics.get("landed") != 2:
        assert time.monotonic() < deadline, recv.metrics
        time.sleep(0.005)
    inner = da.receivers()[(pa.address, 26)]
    assert inner.digest is not None and inner.hashed == (4, False)
    send.abort("the prefill gave up")
    assert recv.wait(10) is RequestState.FAILED
    while (pa.address, 26) in da.receivers():  # forgotten at a tick
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert inner.digest is None
