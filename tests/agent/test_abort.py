"""Abort from either side fences the destination: nothing lands after the receiver is FAILED."""

from __future__ import annotations

import numpy as np

from pdstate.agent import RequestState
from pdstate.errors import TransferAborted
from tests.agent.support import assert_images_equal, expected, snapshot
from tests.agent.test_transfer import PREFILL_SEED, decode, request_lists, source_image  # noqa: F401


def test_decode_abort_mid_way_fences_pages(decode, prefills, source_image):  # noqa: F811
    side, agent = decode
    kv = side.kv_args
    pf = prefills(PREFILL_SEED)
    src_pages, dst_pages, src_state, dst_state = request_lists(kv, np.random.default_rng(5), 8)
    before = snapshot(kv)
    recv = agent.receiver(pf.address, 21)
    pf.ask(op="sender", room=21, num_pages=8)
    recv.init(dst_pages, dst_state)
    assert "raised" not in pf.ask(op="send", room=21, pages=src_pages[:2])
    assert recv.wait(10, until=lambda s: s is RequestState.TRANSFERRING) is RequestState.TRANSFERRING
    recv.abort("client went away")
    assert recv.state is RequestState.FAILED
    exc = recv.failure_exception()
    assert type(exc) is TransferAborted and str(exc) == "aborted by decode: client went away"
    after_abort = snapshot(kv)
    # the first chunk had landed; nothing else did
    assert_images_equal(after_abort, expected(before, source_image, kv, [(0, src_pages[:2], dst_pages[:2])]))
    # the prefill keeps trying: every later chunk is refused and nothing lands
    for i in range(2, 8, 2):
        last = i == 6
        answer = pf.ask(op="send", room=21, pages=src_pages[i : i + 2], state=src_state if last else None)
        assert answer["raised"] == "TransferAborted: aborted by decode: client went away"
    assert pf.ask(op="wait", room=21, timeout=5)["error"] == "TransferAborted: aborted by decode: client went away"
    assert_images_equal(snapshot(kv), after_abort)


def test_prefill_abort_fails_receiver(decode, prefills):  # noqa: F811
    side, agent = decode
    kv = side.kv_args
    pf = prefills(PREFILL_SEED)
    src_pages, dst_pages, _, dst_state = request_lists(kv, np.random.default_rng(6), 4)
    recv = agent.receiver(pf.address, 22)
    pf.ask(op="sender", room=22, num_pages=4)
    recv.init(dst_pages, dst_state)
    pf.ask(op="send", room=22, pages=src_pages[:1])
    after = pf.ask(op="abort", room=22, reason="out of memory")
    assert after["state"] == "failed" and after["error"] == "TransferAborted: aborted by prefill: out of memory"
    assert recv.wait(10) is RequestState.FAILED
    assert str(recv.failure_exception()) == "aborted by prefill: out of memory"
    landed = snapshot(kv)
    assert pf.ask(op="send", room=22, pages=src_pages[1:])["raised"].startswith("TransferAborted")
    assert_images_equal(snapshot(kv), landed)


def test_abort_before_init_needs_no_prefill(decode, prefills):  # noqa: F811
    side, agent = decode
    pf = prefills(PREFILL_SEED)
    recv = agent.receiver(pf.address, 23)
    recv.abort("never mind")
    assert recv.state is RequestState.FAILED
    assert str(recv.failure_exception()) == "aborted by decode: never mind"
