"""The synthetic prefill content and the decode's verification: exact when right, loud when not."""

import ctypes

import numpy as np
import pytest

from pdstate.pools.kvargs import fill_kv_args
from pdstate.pools.presets import build_worker_pools
from pdstate.transfer.planner import plan_request
from pdstate.worker import requests as rq
from pdstate.worker import synth
from tests.support.pools import TINY


@pytest.fixture(scope="module")
def pair():
    s = TINY
    src, dst = build_worker_pools(s), build_worker_pools(s)
    skv, dkv = fill_kv_args(src.target, src.draft), fill_kv_args(dst.target, dst.draft)
    yield src, dst, skv, dkv


def _transfer(pair, seq_len, room):
    src, dst, skv, dkv = pair
    a = rq.allocate(src, rq.channel_names(skv), seq_len)
    b = rq.allocate(dst, rq.channel_names(dkv), seq_len)
    synth.fill_source(skv, room, a.lists)
    plan = plan_request(skv, dkv, a.lists, b.lists)
    for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist()):
        ctypes.memmove(d, s, n)
    return a, b, plan


@pytest.mark.parametrize("seq_len", [1, 100, 255, 256, 257, 1000])
def test_exact_copy_verifies(pair, seq_len):
    src, dst, skv, dkv = pair
    a, b, _ = _transfer(pair, seq_len, room=42)
    try:
        assert synth.verify_destination(dkv, 42, b.lists) is None
        # another room's content is stale content: refused
        assert "holds other content" in synth.verify_destination(dkv, 43, b.lists)
    finally:
        rq.free(src, a), rq.free(dst, b)


@pytest.mark.parametrize("damage", ["one_word", "shift", "half_item"])
def test_damage_is_detected(pair, damage):
    src, dst, skv, dkv = pair
    a, b, plan = _transfer(pair, 1000, room=7)
    try:
        # damage the first descriptor's destination (main KV, buffer 0)
        d, n = int(plan.dst[0]), int(plan.length[0])
        item_words = dkv.kv_item_lens[0] // 8
        words = synth.words_view(d, n)[:item_words]  # the first item
        if damage == "one_word":
            words[item_words // 2] ^= 1
        elif damage == "shift":
            words[1:] = words[:-1].copy()
        else:
            words[: item_words // 2] = 0
        problem = synth.verify_destination(dkv, 7, b.lists)
        assert problem is not None and problem.startswith("channel 0 (main_kv) buffer 0: item 0")
    finally:
        rq.free(src, a), rq.free(dst, b)


def test_bases_differ_per_room_channel_buffer_position():
    a = synth.item_bases(1, 0, 0, 4)
    assert len(set(a.tolist())) == 4
    assert not np.array_equal(a, synth.item_bases(2, 0, 0, 4))
    assert not np.array_equal(a, synth.item_bases(1, 1, 0, 4))
    assert not np.array_equal(a, synth.item_bases(1, 0, 1, 4))


def test_channel_bases_match_the_per_buffer_definition():
    for room in (0, 1, 2**63 - 1, 123456789):
        m = synth.channel_bases(room, 3, 5, 7)
        assert m.shape == (5, 7)
        for j in range(5):
            assert np.array_equal(m[j], synth.item_bases(room, 3, j, 7)), (room, j)


def test_damage_deep_in_a_request_is_located():
    src, dst, skv, dkv = pair_ = _pair_tiny()
    a, b, _ = _transfer(pair_, 1000, room=9)
    try:
        idx = b.lists[0]
        assert idx.size >= 2 and len(dkv.kv_data_ptrs) >= 3
        item = dkv.kv_item_lens[2]
        words = synth.words_view(dkv.kv_data_ptrs[2] + int(idx[1]) * item, item)
        words[-1] += np.uint64(1)  # the last word of item 1 of buffer 2
        assert synth.verify_destination(dkv, 9, b.lists) == (
            f"channel 0 (main_kv) buffer 2: item 1 (index {int(idx[1])}) "
            "holds other content (stale, misplaced or partially written)"
        )
    finally:
        rq.free(src, a), rq.free(dst, b)


def _pair_tiny():
    s = TINY
    src, dst = build_worker_pools(s), build_worker_pools(s)
    return src, dst, fill_kv_args(src.target, src.draft), fill_kv_args(dst.target, dst.draft)


def _spans(pools):
    return [(r.base_ptr, r.nbytes) for r in pools.memory.regions()]


@pytest.mark.parametrize("seq_len", [1, 100, 256, 257, 1000])
def test_sampled_verification_passes_exact_copies_and_refuses_stale_rooms(pair, seq_len):
    src, dst, skv, dkv = pair
    a, b, _ = _transfer(pair, seq_len, room=11)
    try:
        assert synth.verify_sample(dkv, 11, b.lists, _spans(dst)) is None
        assert "holds other content" in synth.verify_sample(dkv, 12, b.lists, _spans(dst))
    finally:
        rq.free(src, a), rq.free(dst, b)


@pytest.mark.parametrize("where", ["first", "last_of_run", "last_inside_run", "middle"])
def test_sampled_verification_reads_every_first_word_and_the_end_of_every_run(where):
    src, dst, skv, dkv = pair_ = _pair_tiny()
    a, b, _ = _transfer(pair_, 1000, room=5)
    try:
        idx = b.lists[0]
        assert idx.size >= 3 and np.all(np.diff(idx) == 1), idx  # one run of pages
        k = idx.size - 1 if where == "last_of_run" else 1
        item = dkv.kv_item_lens[2]
        words = synth.words_view(dkv.kv_data_ptrs[2] + int(idx[k]) * item, item)
        pos = {"first": 0, "last_of_run": -1, "last_inside_run": -1, "middle": words.size // 2}[where]
        words[pos] += np.uint64(1)
        got = synth.verify_sample(dkv, 5, b.lists, _spans(dst))
        if where in ("middle", "last_inside_run"):  # what sampling gives up; the full pass sees it
            assert got is None
            assert synth.verify_destination(dkv, 5, b.lists) is not None
        else:
            assert got == (
                f"channel 0 (main_kv) buffer 2: item {k} (index {int(idx[k])}) "
                "holds other content (stale, misplaced or partially written)"
            )
    finally:
        rq.free(src, a), rq.free(dst, b)


def test_a_sampled_check_prepared_before_the_bytes_land_reads_them_when_run():
    """The decode prepares its check as soon as it sends the request: ``run()`` must read the
    pages as they are then, passing once the room's bytes landed and failing on what was there
    before (and the same message as ``verify_sample``)."""
    src, dst, skv, dkv = _pair_tiny()
    a = rq.allocate(src, rq.channel_names(skv), 300)
    b = rq.allocate(dst, rq.channel_names(dkv), 300)
    try:
        check = synth.sample_check(dkv, 9, b.lists, _spans(dst))  # before anything landed
        stale = check.run()
        assert stale is not None and "holds other content" in stale
        assert stale == synth.verify_sample(dkv, 9, b.lists, _spans(dst))
        synth.fill_source(skv, 9, a.lists)
        plan = plan_request(skv, dkv, a.lists, b.lists)
        for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist()):
            ctypes.memmove(d, s, n)
        assert check.run() is None
    finally:
        rq.free(src, a), rq.free(dst, b)
