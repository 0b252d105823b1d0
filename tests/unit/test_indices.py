"""Per-request index lists (spec §5): vectors, the worked example, and the SWA page-count rule."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdstate.errors import PaddingPageIndex
from pdstate.pools import ReqToTokenPool, SWATokenToKVPoolAllocator
from pdstate.pools.indices import (
    c128_state_indices,
    main_kv_page_indices,
    page_floor,
    swa_page_indices,
    swa_ring_rows,
    swa_window_start,
)

PS, W = 256, 128


# --- C128_STATE -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "req,seq_len,online,ring,want",
    [
        (7, 257, True, None, [7]),
        (7, 256, True, None, []),
        (7, 256, False, 128, []),
        (7, 129, False, 256, [15]),
        # worked example (§5.8): L = 1000
        (5, 1000, False, 128, [5]),
        (9, 1000, False, 128, [9]),
        (5, 1000, False, 256, [11]),
        (9, 1000, False, 256, [19]),
        (5, 1000, True, 1, [5]),
        (0, 0, False, 128, []),
        (0, 0, True, 1, []),
        (3, 1, False, 128, [3]),
        (3, 1, False, 256, [6]),
        (3, 128, False, 256, []),
        (3, 383, False, 256, [6]),  # (382 % 256) = 126 -> block 0
        (3, 385, False, 256, [7]),  # (384 % 256) = 128 -> block 1
        (3, 640, False, 256, []),
    ],
)
def test_c128_vectors(req, seq_len, online, ring, want):
    got = c128_state_indices(req, seq_len, online, ring)
    assert got.dtype == np.int64
    assert got.tolist() == want


@settings(max_examples=200, deadline=None)
@given(req=st.integers(0, 300), seq_len=st.integers(1, 100_000), spec=st.booleans())
def test_c128_offline_block_rule(req, seq_len, spec):
    ring = 256 if spec else 128
    got = c128_state_indices(req, seq_len, False, ring).tolist()
    if seq_len % 128 == 0:
        assert got == []
        return
    (idx,) = got
    ppr = ring // 128
    assert req * ppr <= idx < (req + 1) * ppr  # inside the request's own ring
    # the block holds the state row of the last position: req*ring + (L-1) % ring
    assert idx * 128 <= req * ring + (seq_len - 1) % ring < (idx + 1) * 128


# --- SWA_RING (unified) -------------------------------------------------------------------------


def test_worked_example_ring_rows():
    rows = swa_ring_rows(5, 1000, 128, 128)
    assert rows.dtype == np.int64
    assert rows.tolist() == [640 + r for r in list(range(104, 128)) + list(range(0, 104))]
    dec = swa_ring_rows(9, 1000, 128, 128)
    assert dec.tolist() == [1152 + r for r in list(range(104, 128)) + list(range(0, 104))]


def test_ring_rows_short_prompt_and_spec_ring():
    assert swa_ring_rows(2, 5, 128, 131).tolist() == [262, 263, 264, 265, 266]
    assert swa_ring_rows(0, 0, 128, 128).tolist() == []
    rows = swa_ring_rows(1, 300, 128, 131)  # positions 172..299 mod 131
    assert rows.tolist() == [131 + p % 131 for p in range(172, 300)]


@settings(max_examples=200, deadline=None)
@given(
    req=st.integers(0, 50),
    seq_len=st.integers(0, 5000),
    window=st.sampled_from([64, 128, 256]),
    extra=st.sampled_from([0, 1, 3]),
)
def test_ring_rows_rule(req, seq_len, window, extra):
    ring = window + extra
    rows = swa_ring_rows(req, seq_len, window, ring)
    assert len(rows) == min(seq_len, window)
    assert len(set(rows.tolist())) == len(rows)  # one row per token, no collisions
    assert all(req * ring <= r < (req + 1) * ring for r in rows.tolist())
    runs = 1 + int(np.count_nonzero(np.diff(rows) != 1)) if len(rows) else 0
    assert runs <= 2
    pos = np.arange(max(0, seq_len - window), seq_len)
    assert rows.tolist() == (req * ring + pos % ring).tolist()


# --- SWA (paged) and main KV, from real allocations ----------------------------------------------


def _request(alloc: SWATokenToKVPoolAllocator, req_pool: ReqToTokenPool, n: int, tail_window: int | None = None):
    slot = req_pool.alloc()
    locs = alloc.alloc(n) if tail_window is None else alloc.alloc_swa_tail(n, tail_window)
    req_pool.req_to_token[slot, :n] = locs
    return slot, locs


def test_worked_example_main_kv_and_swa():
    # prefill side: a 1000-token prompt fully allocated, after another request took page 1
    a = SWATokenToKVPoolAllocator(4096, 2048, PS)
    rp = ReqToTokenPool(10, 2048)
    _request(a, rp, 10)
    slot, locs = _request(a, rp, 1000)
    row = rp.req_to_token[slot]
    pages = main_kv_page_indices(row, 1000, PS)
    assert pages.dtype == np.int64
    assert pages.tolist() == [2, 3, 4, 5]  # 4 pages
    assert pages.tolist() == sorted(set((locs // PS).tolist()))
    assert swa_window_start(1000, W, PS) == 768
    swa = swa_page_indices(row, 1000, W, PS, a.full_to_swa_index_mapping)
    assert swa.dtype == np.int64
    assert swa.tolist() == [5]  # 1 SWA page: the one mapped to full page 5
    assert swa.tolist() == [int(a.translate(torch.tensor([5 * PS]))) // PS]

    # decode side: only the tail is allocated in the SWA pool
    b = SWATokenToKVPoolAllocator(4096, 2048, PS)
    rq = ReqToTokenPool(10, 2048)
    dslot, dlocs = _request(b, rq, 1000, tail_window=W)
    drow = rq.req_to_token[dslot]
    assert main_kv_page_indices(drow, 1000, PS).tolist() == [1, 2, 3, 4]
    assert swa_page_indices(drow, 1000, W, PS, b.full_to_swa_index_mapping).tolist() == [1]


def test_main_kv_from_a_start_offset():
    a = SWATokenToKVPoolAllocator(4096, 2048, PS)
    rp = ReqToTokenPool(4, 2048)
    slot, _ = _request(a, rp, 1000)
    assert main_kv_page_indices(rp.req_to_token[slot], 1000, PS, start=512).tolist() == [3, 4]
    assert main_kv_page_indices(rp.req_to_token[slot].numpy(), 1000, PS).tolist() == [1, 2, 3, 4]


def test_main_kv_pages_follow_a_scattered_allocation():
    a = SWATokenToKVPoolAllocator(4096, 4096, PS)
    x = a.alloc(3 * PS)  # pages 1..3
    y = a.alloc(PS)  # page 4
    a.free(x[PS : 2 * PS])  # page 2 back
    rp = ReqToTokenPool(2, 2048)
    slot, locs = _request(a, rp, 600)  # pages 2, 5, 6
    assert main_kv_page_indices(rp.req_to_token[slot], 600, PS).tolist() == [2, 5, 6]
    assert int(y[0]) // PS == 4


def test_unmapped_window_slot_is_refused_with_a_clear_message():
    a = SWATokenToKVPoolAllocator(4096, 2048, PS)
    rp = ReqToTokenPool(4, 2048)
    slot, _ = _request(a, rp, 1000, tail_window=W)  # full pages 1..4; only page 4 has an SWA page
    row = rp.req_to_token[slot]
    # a wider window reaches back into page 3, which is not in the SWA pool
    with pytest.raises(PaddingPageIndex) as info:
        swa_page_indices(row, 1000, 256, PS, a.full_to_swa_index_mapping)
    assert str(info.value) == (
        "sliding-window slot for position 512 (full slot 768) maps to SWA slot 0: the window is not "
        "allocated in the SWA pool and would copy the padding page"
    )
    # the matching window is fine
    assert swa_page_indices(row, 1000, W, PS, a.full_to_swa_index_mapping).tolist() == [1]


def test_freed_request_is_refused():
    a = SWATokenToKVPoolAllocator(4096, 2048, PS)
    rp = ReqToTokenPool(4, 2048)
    slot, locs = _request(a, rp, 300)
    row = rp.req_to_token[slot].clone()
    a.free(locs)
    with pytest.raises(
        PaddingPageIndex, match=r"^sliding-window slot for position 0 \(full slot 256\) maps to SWA slot 0"
    ):
        swa_page_indices(row, 300, W, PS, a.full_to_swa_index_mapping)


def test_unwritten_req_row_is_refused():
    a = SWATokenToKVPoolAllocator(4096, 2048, PS)
    row = torch.zeros(2048, dtype=torch.int64)  # req_to_token never filled: every slot is 0
    with pytest.raises(PaddingPageIndex):
        swa_page_indices(row, 100, W, PS, a.full_to_swa_index_mapping)


def _expected_swa_pages(seq_len: int) -> int:
    return 1 if seq_len <= 256 or seq_len % 256 == 0 or seq_len % 256 >= 128 else 2


@settings(max_examples=150, deadline=None)
@given(seq_len=st.integers(1, 4096), skew=st.integers(0, 3))
def test_swa_page_count_rule(seq_len, skew):
    """Window 128, page 256: 1 page when L <= 256, L % 256 == 0 or L % 256 >= 128; else 2.
    Prefill (fully allocated) and decode (tail-allocated) agree on the count, and every id is real."""
    a = SWATokenToKVPoolAllocator(8192, 8192, PS)
    rp = ReqToTokenPool(4, 4096)
    for _ in range(skew):  # other requests first, so ids are not trivially equal
        _request(a, rp, 100)
    slot, _ = _request(a, rp, seq_len)
    pre = swa_page_indices(rp.req_to_token[slot], seq_len, W, PS, a.full_to_swa_index_mapping)

    b = SWATokenToKVPoolAllocator(8192, 8192, PS)
    rq = ReqToTokenPool(4, 4096)
    dslot, _ = _request(b, rq, seq_len, tail_window=W)
    dec = swa_page_indices(rq.req_to_token[dslot], seq_len, W, PS, b.full_to_swa_index_mapping)

    n = _expected_swa_pages(seq_len)
    assert len(pre) == len(dec) == n
    assert all(p >= 1 for p in pre.tolist() + dec.tolist())
    assert len(set(pre.tolist())) == n
    # the pages are the ones the mapping gives for the window's full pages
    ws = page_floor(max(0, seq_len - W), PS)
    full_pages = main_kv_page_indices(rp.req_to_token[slot], seq_len, PS)[ws // PS :]
    m = a.full_to_swa_index_mapping
    assert pre.tolist() == [int(m[p * PS]) // PS for p in full_pages.tolist()]


@settings(max_examples=100, deadline=None)
@given(seq_len=st.integers(1, 3000), window=st.sampled_from([64, 128, 256, 300]), ps=st.sampled_from([128, 256, 512]))
def test_swa_page_count_general(seq_len, window, ps):
    a = SWATokenToKVPoolAllocator(4096, 4096, ps)
    locs = a.alloc_swa_tail(seq_len, window)
    got = swa_page_indices(locs, seq_len, window, ps, a.full_to_swa_index_mapping)
    start = (max(0, seq_len - window) // ps) * ps
    assert len(got) == -(-(seq_len - start) // ps) == a.swa_tail_pages(seq_len, window)
    assert swa_window_start(seq_len, window, ps) == start


def test_page_floor():
    assert [page_floor(x, 256) for x in (0, 1, 255, 256, 257, 872)] == [0, 0, 0, 256, 256, 768]


# --- the SWA component by release (0.5.23 unified: C4 states per request slot) -----------------


def _release_pools(upstream: str, unified: bool):
    from pdstate.pools.presets import build_worker_pools, preset

    return build_worker_pools(preset("tiny", upstream=upstream).with_(unified_kv=unified))


@pytest.mark.parametrize("upstream", ["0.5.19", "0.5.23"])
@pytest.mark.parametrize("unified", [False, True])
def test_swa_component_indices_follow_the_release(upstream, unified):
    from pdstate.pools.indices import c4_state_slot_indices, swa_component_indices

    w = _release_pools(upstream, unified)
    try:
        seq_len = 300
        locs = w.allocator.alloc(seq_len)
        got = swa_component_indices(w.target, 3, locs, seq_len, w.allocator.full_to_swa_index_mapping)
        if upstream == "0.5.23" and unified:
            assert got.tolist() == [3] == c4_state_slot_indices(3, seq_len).tolist()
            assert c4_state_slot_indices(3, 0).tolist() == []
        else:
            want = swa_page_indices(locs, seq_len, W, PS, w.allocator.full_to_swa_index_mapping)
            assert got.tolist() == want.tolist()
    finally:
        w.close()


def test_request_state_indices_are_the_same_rule_in_both_releases():
    from pdstate.pools.indices import request_state_indices

    for args in [(7, 257, True, None), (7, 129, False, 256), (5, 1000, False, 128), (0, 0, False, 128)]:
        assert request_state_indices(*args).tolist() == c128_state_indices(*args).tolist()
