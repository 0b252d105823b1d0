"""A rolling upgrade: a prefill on SGLang 0.5.19's pools, a decode on 0.5.23's, in two processes.

SGLang itself says "upgrade both servers together". pdstate accepts such a pair exactly when the
two state layouts agree (0.5.23's pools hold more rows of compressed KV and of unified C4 state,
which is capacity, not layout), and refuses it on both sides with the factor otherwise.
"""

from __future__ import annotations

import numpy as np
import pytest

from pdstate.agent import DecodeAgent, RequestState
from pdstate.pools.reporting import build_report
from tests.agent.support import (
    AUX_SLOTS,
    assert_images_equal,
    capacity,
    expected,
    fill,
    make_side,
    pick,
    snapshot,
)

PREFILL_SEED, DECODE_SEED = 23, 19
OLD, NEW = "0.5.19", "0.5.23"


@pytest.fixture
def new_decode():
    side = make_side(True, upstream=NEW)
    fill(side.kv_args, DECODE_SEED)
    agent = DecodeAgent(side.kv_args, (side.pools.target, side.pools.draft), peer_timeout_s=3.0)
    yield side, agent
    agent.close()
    side.close()


def test_the_releases_differ_in_capacity_only():
    old, new = make_side(False, upstream=OLD), make_side(False, upstream=NEW)
    try:
        a, b = old.kv_args, new.kv_args
        assert a.kv_item_lens == b.kv_item_lens and a.state_item_lens == b.state_item_lens
        assert [t.value for t in a.state_types] == [t.value for t in b.state_types]
        assert sum(a.kv_data_lens) < sum(b.kv_data_lens)  # 0.5.23 holds more compressed-KV rows
        assert old.pools.target.upstream == OLD and new.pools.target.upstream == NEW
    finally:
        old.close()
        new.close()


def test_an_old_prefill_feeds_a_new_decode_byte_exact(new_decode, prefills):
    side, agent = new_decode
    kv = side.kv_args
    old = make_side(False, upstream=OLD)
    fill(old.kv_args, PREFILL_SEED)
    source = snapshot(old.kv_args)
    src_kv = old.kv_args
    rng = np.random.default_rng(2319)
    src_pages, dst_pages = pick(rng, capacity(src_kv, 0), 6), pick(rng, capacity(kv, 0), 6)
    src_state, dst_state = [], []
    for c, st in enumerate(kv.state_types, start=1):
        k, lo = (1, 0) if st.value == "c128_state" else (2, 1)
        src_state.append(pick(rng, capacity(src_kv, c), k, lo))
        dst_state.append(pick(rng, capacity(kv, c), k, lo))
    old.close()
    pf = prefills(PREFILL_SEED, settings={"upstream": OLD})
    before = snapshot(kv)
    recv = agent.receiver(pf.address, 51)
    pf.ask(op="sender", room=51, num_pages=6, aux_index=2)
    recv.init(dst_pages, dst_state, aux_index=AUX_SLOTS - 2)
    assert "raised" not in pf.ask(op="send", room=51, pages=src_pages[:3])
    assert "raised" not in pf.ask(op="send", room=51, pages=src_pages[3:], state=src_state)
    assert recv.wait(30) is RequestState.SUCCESS, recv.failure_exception()
    assert pf.ask(op="wait", room=51, timeout=30)["state"] == "success"
    moves = [(0, src_pages, dst_pages)]
    moves += [(c + 1, s, d) for c, (s, d) in enumerate(zip(src_state, dst_state))]
    moves.append((len(kv.state_types) + 1, [2], [AUX_SLOTS - 2]))
    # main KV, SWA, C4 rings, C128 state, draft and aux: where 0.5.23 expects them, nothing else touched
    assert_images_equal(snapshot(kv), expected(before, source, kv, moves))
    peer = agent.prefills()[pf.address]
    assert (
        peer.state == "accepted"
        and peer.fingerprint == build_report(side.pools.target, side.pools.draft)[0].fingerprint
    )


def test_an_old_prefill_whose_layout_differs_is_refused_on_both_sides_with_the_factor(new_decode, prefills):
    side, agent = new_decode
    kv = side.kv_args
    # the old prefill is not speculative (C4 ring 8 per request) and has no draft; the new decode
    # is speculative with a NextN draft (C4 ring 16)
    pf = prefills(PREFILL_SEED, settings={"upstream": OLD, "speculative_num_draft_tokens": 0, "draft_enabled": False})
    before = snapshot(kv)
    pf.ask(op="sender", room=52, num_pages=2)  # first: the live sender fails with the refusal
    recv = agent.receiver(pf.address, 52)
    assert recv.wait(10) is RequestState.FAILED
    message = (
        "DSV4 layout mismatch on c4_ring: prefill server has c4_ring=8, but decode server has c4_ring=16. "
        "Both servers must build the same state layout."
    )
    assert type(recv.failure_exception()).__name__ == "LayoutMismatch"
    assert str(recv.failure_exception()) == message
    done = pf.ask(op="wait", room=52, timeout=10)
    assert done["state"] == "failed" and done["error"] == f"LayoutMismatch: {message}"
    assert_images_equal(snapshot(kv), before)  # nothing written
    assert agent.prefills()[pf.address].reason == f"LayoutMismatch: {message}"
