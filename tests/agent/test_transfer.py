"""One decode agent (this process, shm pools) and prefill agents in child processes."""

from __future__ import annotations

import numpy as np
import pytest

from pdstate.agent import DecodeAgent, RequestState
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

PREFILL_SEED, DECODE_SEED = 11, 99


@pytest.fixture
def decode():
    side = make_side(True)
    fill(side.kv_args, DECODE_SEED)  # sentinels: every byte not written must stay as it is
    agent = DecodeAgent(side.kv_args, (side.pools.target, side.pools.draft), peer_timeout_s=3.0)
    yield side, agent
    agent.close()
    side.close()


@pytest.fixture(scope="module")
def source_image():
    side = make_side(False)
    fill(side.kv_args, PREFILL_SEED)
    img = snapshot(side.kv_args)
    side.close()
    return img


def request_lists(kv, rng, num_pages: int):
    n_comp = len(kv.state_types)
    src_pages, dst_pages = pick(rng, capacity(kv, 0), num_pages), pick(rng, capacity(kv, 0), num_pages)
    rng.shuffle(dst_pages)
    src_state, dst_state = [], []
    for c in range(1, n_comp + 1):
        k = 1 if kv.state_types[c - 1].value == "c128_state" else 2
        lo = 0 if kv.state_types[c - 1].value == "c128_state" else 1
        src_state.append(pick(rng, capacity(kv, c), k, lo))
        dst_state.append(pick(rng, capacity(kv, c), k, lo))
    return src_pages, dst_pages, src_state, dst_state


@pytest.mark.parametrize("num_chunks", [1, 2, 3, 5, 8])
def test_chunked_every_byte(decode, prefills, source_image, num_chunks):
    side, agent = decode
    kv = side.kv_args
    rng = np.random.default_rng(num_chunks)
    pf = prefills(PREFILL_SEED)
    src_pages, dst_pages, src_state, dst_state = request_lists(kv, rng, 8)
    room = 100 + num_chunks
    before = snapshot(kv)
    recv = agent.receiver(pf.address, room)
    assert pf.ask(op="sender", room=room, num_pages=8, aux_index=3)["state"] == "bootstrapping"
    recv.init(dst_pages, dst_state, aux_index=AUX_SLOTS - 1)
    bounds = np.linspace(0, 8, num_chunks + 1).astype(int)
    for i in range(num_chunks):
        last = i == num_chunks - 1
        answer = pf.ask(
            op="send", room=room, pages=src_pages[bounds[i] : bounds[i + 1]], state=src_state if last else None
        )
        assert "raised" not in answer, answer
        if not last:
            # state components only with the last chunk: nothing of them has landed yet
            mid = snapshot(kv)
            for j in range(len(kv.kv_data_ptrs), len(mid)):
                assert np.array_equal(mid[j], before[j]), f"state/aux buffer {j} written before the last chunk"
    assert recv.wait(30) is RequestState.SUCCESS, recv.failure_exception()
    done = pf.ask(op="wait", room=room, timeout=30)
    assert done["state"] == "success", done
    assert done["metrics"]["chunks"] == num_chunks
    moves = [(0, src_pages, dst_pages)]
    moves += [(c + 1, s, d) for c, (s, d) in enumerate(zip(src_state, dst_state))]
    moves.append((len(kv.state_types) + 1, [3], [AUX_SLOTS - 1]))
    assert_images_equal(snapshot(kv), expected(before, source_image, kv, moves))
    assert recv.metrics["bytes"] == done["metrics"]["bytes"] > 0
    assert recv.metrics["digest_s"] >= 0


def test_state_only_on_last_chunk_is_enforced(decode, prefills):
    side, agent = decode
    pf = prefills(PREFILL_SEED)
    pf.ask(op="sender", room=7, num_pages=4)
    answer = pf.ask(op="send", room=7, pages=[1, 2], state=[[1], [0], [1]])
    assert answer["raised"] == "ValueError: room 7: state indices go with the last chunk only"


@pytest.mark.parametrize("num_chunks", [1, 4])
def test_unified_mode_every_byte(prefills, num_chunks):
    """The same over unified-KV pools (state components swa, swa_ring, c128_state, draft swa_ring)."""
    src = make_side(False, unified_kv=True)
    fill(src.kv_args, PREFILL_SEED)
    source = snapshot(src.kv_args)
    src.close()
    side = make_side(True, unified_kv=True)
    fill(side.kv_args, DECODE_SEED)
    agent = DecodeAgent(side.kv_args, (side.pools.target, side.pools.draft))
    try:
        kv = side.kv_args
        assert [t.value for t in kv.state_types] == ["swa", "swa_ring", "c128_state", "swa_ring"]
        pf = prefills(PREFILL_SEED, settings={"unified_kv": True})
        src_pages, dst_pages, src_state, dst_state = request_lists(kv, np.random.default_rng(70 + num_chunks), 8)
        before = snapshot(kv)
        recv = agent.receiver(pf.address, 70)
        pf.ask(op="sender", room=70, num_pages=8, aux_index=0)
        recv.init(dst_pages, dst_state, aux_index=1)
        bounds = np.linspace(0, 8, num_chunks + 1).astype(int)
        for i in range(num_chunks):
            last = i == num_chunks - 1
            pf.ask(op="send", room=70, pages=src_pages[bounds[i] : bounds[i + 1]], state=src_state if last else None)
        assert recv.wait(30) is RequestState.SUCCESS, recv.failure_exception()
        moves = [(0, src_pages, dst_pages)]
        moves += [(c + 1, s, d) for c, (s, d) in enumerate(zip(src_state, dst_state))]
        moves.append((len(kv.state_types) + 1, [0], [1]))
        assert_images_equal(snapshot(kv), expected(before, source, kv, moves))
    finally:
        agent.close()
        side.close()
