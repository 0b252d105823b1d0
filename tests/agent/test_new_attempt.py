"""A room sent again after its first attempt ended (an engine's retraction and rebootstrap): the
second attempt gets fresh pages, nothing of the first lands after its end, and every byte of the
second is right."""

from __future__ import annotations

import numpy as np

from pdstate.agent import RequestState
from tests.agent.support import assert_images_equal, capacity, expected, snapshot
from tests.agent.test_transfer import PREFILL_SEED, decode, request_lists, source_image  # noqa: F401


def _moves(kv, src_pages, dst_pages, src_state, dst_state) -> list:
    moves = [(0, src_pages, dst_pages)]
    return moves + [(c + 1, s, d) for c, (s, d) in enumerate(zip(src_state, dst_state))]


def _send_all(pf, room: int, src_pages, src_state) -> None:
    for i in range(0, len(src_pages), 2):
        last = i + 2 >= len(src_pages)
        answer = pf.ask(op="send", room=room, pages=src_pages[i : i + 2], state=src_state if last else None)
        assert "raised" not in answer, answer


def test_room_sent_again_after_an_abort(decode, prefills, source_image):  # noqa: F811
    side, agent = decode
    kv = side.kv_args
    pf = prefills(PREFILL_SEED)
    room = 41
    src_pages, first_pages, src_state, first_state = request_lists(kv, np.random.default_rng(41), 6)
    first = agent.receiver(pf.address, room)
    pf.ask(op="sender", room=room, num_pages=6)
    first.init(first_pages, first_state)
    assert "raised" not in pf.ask(op="send", room=room, pages=src_pages[:2])
    assert first.wait(10, until=lambda s: s is RequestState.TRANSFERRING) is RequestState.TRANSFERRING
    first.abort("retracted")
    assert first.state is RequestState.FAILED
    fenced = snapshot(kv)
    # the first attempt's sender keeps sending: refused, nothing lands
    assert pf.ask(op="send", room=room, pages=src_pages[2:4])["raised"].startswith("TransferAborted")
    assert_images_equal(snapshot(kv), fenced)

    # the second attempt: the same room, fresh pages, a new sender on the prefill
    rng = np.random.default_rng(42)
    _, second_pages, _, second_state = request_lists(kv, rng, 6)
    second = agent.receiver(pf.address, room)
    assert pf.ask(op="sender", room=room, num_pages=6)["state"] == "bootstrapping"
    second.init(second_pages, second_state)
    _send_all(pf, room, src_pages, src_state)
    assert second.wait(30) is RequestState.SUCCESS, second.failure_exception()
    assert pf.ask(op="wait", room=room, timeout=30)["state"] == "success"
    assert first.state is RequestState.FAILED  # the first attempt's end stands
    want = expected(fenced, source_image, kv, _moves(kv, src_pages, second_pages, src_state, second_state))
    assert_images_equal(snapshot(kv), want)


def test_room_sent_again_after_success_decode_asks_first(decode, prefills, source_image):  # noqa: F811
    """The rebootstrap order: the decode names the new destination before the prefill recomputed
    (its request waits for the new sender); the first attempt's pages are left as they were."""
    side, agent = decode
    kv = side.kv_args
    pf = prefills(PREFILL_SEED)
    room = 43
    src_pages, first_pages, src_state, first_state = request_lists(kv, np.random.default_rng(43), 4)
    before = snapshot(kv)
    first = agent.receiver(pf.address, room)
    pf.ask(op="sender", room=room, num_pages=4)
    first.init(first_pages, first_state)
    _send_all(pf, room, src_pages, src_state)
    assert first.wait(30) is RequestState.SUCCESS
    assert pf.ask(op="wait", room=room, timeout=30)["state"] == "success"
    after_first = snapshot(kv)
    assert_images_equal(
        after_first, expected(before, source_image, kv, _moves(kv, src_pages, first_pages, src_state, first_state))
    )

    second_pages = [p for p in range(1, capacity(kv, 0)) if p not in first_pages][-4:]
    second = agent.receiver(pf.address, room)
    assert second.wait(10, until=lambda s: s is RequestState.WAITING_FOR_INPUT) is RequestState.WAITING_FOR_INPUT
    second.init(second_pages, first_state)
    assert second.wait(1, until=lambda s: s.terminal) is RequestState.TRANSFERRING  # waits for the new sender
    pf.ask(op="sender", room=room, num_pages=4)
    _send_all(pf, room, src_pages, src_state)
    assert second.wait(30) is RequestState.SUCCESS, second.failure_exception()
    want = expected(after_first, source_image, kv, _moves(kv, src_pages, second_pages, src_state, first_state))
    assert_images_equal(snapshot(kv), want)
