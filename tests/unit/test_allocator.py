"""``full_to_swa_index_mapping``: shape, page coherence, free/reuse, swa-tail allocation, identity."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdstate.errors import AllocationError
from pdstate.pools import DeepSeekV4TokenToKVPool, MappingIdentity, ReqToTokenPool, SWATokenToKVPoolAllocator
from pdstate.pools.allocator import new_mapping
from tests.support.pools import draft_changes, upstream_kwargs
from tests.support.upstream import MISSING_MAPPING_ERROR

PS = 256


# the conformance target without speculative decoding (smaller state rings)
NO_SPEC = dict(
    c4_state_pool_size=32, c128_state_pool_size=640, online_mtp_max_draft_tokens=0, speculative_num_draft_tokens=None
)


def _pool(**over) -> DeepSeekV4TokenToKVPool:
    return DeepSeekV4TokenToKVPool(**upstream_kwargs(**{**NO_SPEC, "page_size": PS, "swa_page_size": PS, **over}))


def _draft() -> DeepSeekV4TokenToKVPool:
    return _pool(**draft_changes())


def _pages(locs: torch.Tensor, ps: int = PS) -> list[int]:
    return (locs[::ps] // ps).tolist()


# --- the tensor -----------------------------------------------------------------------------


@pytest.mark.parametrize("size_full,size_swa,ps", [(1024, 512, 256), (2048, 1024, 512), (64, 32, 16), (8, 8, 1)])
def test_fresh_mapping_shape_dtype_and_sentinel(size_full, size_swa, ps):
    a = SWATokenToKVPoolAllocator(size_full, size_swa, ps)
    m = a.full_to_swa_index_mapping
    assert m.dtype == torch.int64
    assert m.dim() == 1 and m.numel() == size_full + ps + 1
    assert m[-1].item() == -1
    assert torch.count_nonzero(m[:-1]).item() == 0
    assert a.translate(torch.tensor([-1])).tolist() == [-1]
    assert a.translate(torch.tensor([0, 5, -1])).tolist() == [0, 0, -1]
    assert a.full_available_size() == size_full and a.swa_available_size() == size_swa
    assert a.available_size() == min(size_full, size_swa)


def test_sizes_must_be_page_multiples():
    with pytest.raises(AllocationError):
        SWATokenToKVPoolAllocator(1000, 512, 256)
    with pytest.raises(AllocationError):
        SWATokenToKVPoolAllocator(1024, 500, 256)
    with pytest.raises(AllocationError):
        SWATokenToKVPoolAllocator(1024, 512, 0)


def test_new_mapping_helper():
    m = new_mapping(1024, 256)
    assert m.numel() == 1024 + 256 + 1 and m.dtype == torch.int64
    assert m[-1].item() == -1 and int(m[:-1].abs().sum()) == 0


def test_kvcache_gets_the_very_tensor_registered():
    pool = _pool()
    a = SWATokenToKVPoolAllocator(1024, 512, PS, kvcache=pool)
    assert pool.full_to_swa_index_mapping is a.full_to_swa_index_mapping
    assert pool.mapping_identity == MappingIdentity.of(a.full_to_swa_index_mapping)


# --- allocation -----------------------------------------------------------------------------


def test_alloc_is_page_coherent_and_starts_at_page_one():
    a = SWATokenToKVPoolAllocator(1024, 512, PS)
    locs = a.alloc(300)
    assert locs.dtype == torch.int64 and locs.tolist() == list(range(256, 556))
    m = a.full_to_swa_index_mapping
    # recorded upstream demo: both free lists start at page 1, so full 256..767 -> swa 256..767
    assert a.translate(locs).tolist() == list(range(256, 556))
    for full_page, swa_page in [(1, 1), (2, 2)]:
        for j in range(PS):
            assert m[full_page * PS + j].item() == swa_page * PS + j
    # the rest of the mapping stays unmapped (page 0 included) and the sentinel is intact
    assert torch.count_nonzero(m[:PS]).item() == 0
    assert torch.count_nonzero(m[3 * PS : -1]).item() == 0
    assert m[-1].item() == -1
    assert a.full_available_size() == 1024 - 512 and a.swa_available_size() == 0


def test_page_coherence_with_non_identity_pairing():
    a = SWATokenToKVPoolAllocator(2048, 1024, PS)  # 8 full pages, 4 swa pages
    r1 = a.alloc(PS)  # full 1 -> swa 1
    r2 = a.alloc(2 * PS)  # full 2,3 -> swa 2,3
    a.free(r1)
    a.alloc_swa_tail(2 * PS, 128)  # full 1,4; only the tail page (4) mapped -> swa 1
    r4 = a.alloc(PS)  # full 5 -> swa 4
    m = a.full_to_swa_index_mapping
    pairs = {}
    for P in range(1, 9):
        vals = m[P * PS : (P + 1) * PS]
        if int(vals[0]) == 0:
            assert torch.count_nonzero(vals).item() == 0, f"full page {P} partly mapped"
            continue
        Q = int(vals[0]) // PS
        assert vals.tolist() == [Q * PS + j for j in range(PS)], f"full page {P} not page-coherent"
        pairs[P] = Q
    assert pairs == {2: 2, 3: 3, 4: 1, 5: 4}
    assert _pages(r2) == [2, 3] and _pages(r4) == [5]


def test_page_zero_is_never_handed_out():
    a = SWATokenToKVPoolAllocator(1024, 1024, PS)
    seen = []
    while True:
        try:
            seen.append(a.alloc(PS))
        except AllocationError:
            break
    pages = sorted(p for locs in seen for p in _pages(locs))
    assert pages == [1, 2, 3, 4]
    swa_pages = sorted(int(a.translate(locs)[0]) // PS for locs in seen)
    assert swa_pages == [1, 2, 3, 4]
    assert a.full_available_size() == 0 and a.swa_available_size() == 0


def test_allocation_is_page_granular():
    a = SWATokenToKVPoolAllocator(1024, 1024, PS)
    locs = a.alloc(1)
    assert locs.tolist() == [256]
    assert a.full_available_size() == 768  # the whole page is taken
    # the whole page is mapped, not only the token
    assert a.translate(torch.arange(256, 512)).tolist() == list(range(256, 512))


def test_out_of_full_pages_raises_and_takes_nothing():
    a = SWATokenToKVPoolAllocator(512, 1024, PS)
    a.alloc(PS)
    with pytest.raises(AllocationError):
        a.alloc(2 * PS)
    assert a.full_available_size() == 256 and a.swa_available_size() == 768


def test_out_of_swa_pages_raises_and_takes_nothing():
    a = SWATokenToKVPoolAllocator(1024, 256, PS)
    with pytest.raises(AllocationError):
        a.alloc(2 * PS)
    assert a.full_available_size() == 1024 and a.swa_available_size() == 256
    assert torch.count_nonzero(a.full_to_swa_index_mapping[:-1]).item() == 0


def test_non_positive_request_raises():
    a = SWATokenToKVPoolAllocator(1024, 512, PS)
    with pytest.raises(AllocationError):
        a.alloc(0)
    with pytest.raises(AllocationError):
        a.alloc_swa_tail(0, 128)


# --- free -----------------------------------------------------------------------------------


def test_free_resets_entries_and_returns_pages():
    a = SWATokenToKVPoolAllocator(1024, 512, PS)
    r1 = a.alloc(300)
    r2 = a.alloc_swa_tail(PS, 128) if a.swa_available_size() else None
    assert r2 is None  # swa pool exhausted by r1 (2 pages)
    a.free(r1)
    m = a.full_to_swa_index_mapping
    assert torch.count_nonzero(m[:-1]).item() == 0 and m[-1].item() == -1
    assert a.full_available_size() == 1024 and a.swa_available_size() == 512
    # the pages come back and are handed out again, lowest first
    assert a.alloc(10).tolist() == list(range(256, 266))


def test_free_accepts_numpy_and_partial_page_locs():
    a = SWATokenToKVPoolAllocator(1024, 512, PS)
    locs = a.alloc(2 * PS)
    a.free(np.asarray(locs[::PS]))  # one loc per page frees the whole page
    assert a.full_available_size() == 1024 and a.swa_available_size() == 512
    a.free(torch.empty(0, dtype=torch.int64))  # nothing to do


def test_double_free_raises():
    a = SWATokenToKVPoolAllocator(1024, 512, PS)
    locs = a.alloc(PS)
    a.free(locs)
    with pytest.raises(AllocationError):
        a.free(locs)
    assert a.full_available_size() == 1024 and a.swa_available_size() == 512


def test_freeing_page_zero_or_never_allocated_raises():
    a = SWATokenToKVPoolAllocator(1024, 512, PS)
    with pytest.raises(AllocationError):
        a.free(torch.tensor([0]))
    with pytest.raises(AllocationError):
        a.free(torch.tensor([3 * PS]))


def test_failed_free_changes_nothing():
    a = SWATokenToKVPoolAllocator(1024, 512, PS)
    locs = a.alloc(PS)
    before = a.full_to_swa_index_mapping.clone()
    with pytest.raises(AllocationError):
        a.free(torch.cat([locs, torch.tensor([3 * PS])]))
    assert torch.equal(a.full_to_swa_index_mapping, before)
    assert a.full_available_size() == 768 and a.swa_available_size() == 256


# --- swa tail (decode pre-allocation) ---------------------------------------------------------


def test_alloc_swa_tail_maps_only_the_window_pages():
    a = SWATokenToKVPoolAllocator(2048, 1024, PS)
    locs = a.alloc_swa_tail(1000, 128)  # window [872, 1000) -> floor 768 -> 1 page
    assert _pages(locs) == [1, 2, 3, 4]
    m = a.full_to_swa_index_mapping
    assert torch.count_nonzero(m[locs[:768]]).item() == 0
    assert m[locs[768:]].tolist() == list(range(256, 256 + 232))
    # the unused tail of the last page is mapped too (page-coherent)
    assert m[4 * PS : 5 * PS].tolist() == list(range(256, 512))
    assert a.swa_available_size() == 1024 - 256 and a.full_available_size() == 2048 - 1024


@pytest.mark.parametrize(
    "n,window,tail",
    [
        (1000, 128, 1),
        (300, 128, 2),
        (200, 128, 1),
        (512, 128, 1),
        (513, 128, 2),
        (640, 128, 1),
        (100, 128, 1),
        (1000, 256, 2),
        (1000, 300, 2),
        (1280, 256, 1),
        (1024, 256, 1),
        (1025, 256, 2),
        (1000, 5000, 4),
        (256, 0, 0),
        (257, 0, 1),
    ],
)
def test_swa_tail_pages_rule(n, window, tail):
    a = SWATokenToKVPoolAllocator(2048, 2048, PS)
    assert a.swa_tail_pages(n, window) == tail
    start = max(0, n - window) // PS * PS
    assert tail == -(-(n - start) // PS)


def test_swa_tail_on_recycled_pages_leaves_head_unmapped():
    a = SWATokenToKVPoolAllocator(2048, 2048, PS)
    first = a.alloc(1000)  # full 1..4 -> swa 1..4, all mapped
    a.free(first)
    again = a.alloc_swa_tail(1000, 128)
    assert _pages(again) == _pages(first)  # the same full pages come back
    m = a.full_to_swa_index_mapping
    assert torch.count_nonzero(m[1 * PS : 4 * PS]).item() == 0
    assert int(m[4 * PS]) > 0


def test_swa_tail_resets_stale_head_entries():
    """PR #25805: a recycled page may still carry a stale mapping (e.g. written by a load-back);
    ``alloc_swa_tail`` must zero the head of the request itself, not rely on ``free``."""
    a = SWATokenToKVPoolAllocator(2048, 2048, PS)
    m = a.full_to_swa_index_mapping
    m[1 * PS : 5 * PS] = torch.arange(5 * PS, 9 * PS)  # stale garbage on free pages 1..4
    locs = a.alloc_swa_tail(1000, 128)
    assert _pages(locs) == [1, 2, 3, 4]
    assert torch.count_nonzero(m[1 * PS : 4 * PS]).item() == 0
    assert m[4 * PS : 5 * PS].tolist() == list(range(256, 512))


def test_swa_tail_needs_only_tail_pages_of_swa():
    a = SWATokenToKVPoolAllocator(2048, 256, PS)  # one SWA page only
    locs = a.alloc_swa_tail(1000, 128)
    assert _pages(locs) == [1, 2, 3, 4]
    with pytest.raises(AllocationError):
        a.alloc_swa_tail(100, 128)  # no SWA page left
    assert a.full_available_size() == 2048 - 1024  # nothing taken by the refused call
    a.free(locs)
    assert a.full_available_size() == 2048 and a.swa_available_size() == 256


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["alloc", "tail", "free"]), st.integers(1, 1100), st.sampled_from([64, 128, 256])),
        min_size=1,
        max_size=25,
    )
)
def test_random_alloc_free_keeps_invariants(ops):
    ps = 128
    a = SWATokenToKVPoolAllocator(2048, 1024, ps)
    m = a.full_to_swa_index_mapping
    live: list[tuple[torch.Tensor, int, int]] = []  # (locs, n, window or 0 for full)
    for op, n, window in ops:
        if op == "free":
            if live:
                locs, _, _ = live.pop(n % len(live))
                a.free(locs)
            continue
        try:
            locs = a.alloc(n) if op == "alloc" else a.alloc_swa_tail(n, window)
        except AllocationError:
            continue
        live.append((locs, n, 0 if op == "alloc" else window))
    # invariants: sentinel, page 0 unmapped, each full page either unmapped or page-coherent,
    # SWA pages in use are distinct and nonzero, accounting adds up
    assert m[-1].item() == -1
    assert torch.count_nonzero(m[:ps]).item() == 0
    used_full, used_swa = set(), []
    for locs, n, window in live:
        pages = _pages(locs, ps)
        assert 0 not in pages
        used_full.update(pages)
        tail = len(pages) if window == 0 else a.swa_tail_pages(n, window)
        for i, P in enumerate(pages):
            vals = m[P * ps : (P + 1) * ps]
            if i < len(pages) - tail:
                assert torch.count_nonzero(vals).item() == 0
            else:
                Q = int(vals[0]) // ps
                assert Q >= 1 and vals.tolist() == [Q * ps + j for j in range(ps)]
                used_swa.append(Q)
    assert len(used_swa) == len(set(used_swa))
    assert a.full_available_size() == 2048 - ps * len(used_full)
    assert a.swa_available_size() == 1024 - ps * len(used_swa)
    # nothing outside live pages is mapped
    mapped_pages = {int(i) // ps for i in torch.nonzero(m[:-1]).flatten()}
    assert mapped_pages <= used_full


# --- identity ---------------------------------------------------------------------------------


def test_identity_same_tensor_on_two_pools_is_equal():
    target, draft = _pool(), _draft()
    a = SWATokenToKVPoolAllocator(1024, 512, PS, kvcache=target)
    draft.register_mapping(a.full_to_swa_index_mapping)
    assert target.mapping_identity == draft.mapping_identity
    assert target.mapping_identity.data_ptr == a.full_to_swa_index_mapping.data_ptr()
    assert target.mapping_identity.numel == 1024 + 256 + 1
    assert target.mapping_identity.dtype == "int64"
    assert len(target.mapping_identity.nonce) >= 16
    d = target.mapping_identity.as_dict()
    assert d == {
        "nonce": target.mapping_identity.nonce,
        "data_ptr": a.full_to_swa_index_mapping.data_ptr(),
        "numel": 1281,
        "dtype": "int64",
    }


@pytest.mark.parametrize("wiring", ["clone", "view", "own_allocator", "own_identity"])
def test_identity_differs_for_anything_but_the_same_object(wiring):
    target, draft = _pool(), _draft()
    a = SWATokenToKVPoolAllocator(1024, 512, PS, kvcache=target)
    m = a.full_to_swa_index_mapping
    if wiring == "clone":
        draft.register_mapping(m.clone())
    elif wiring == "view":
        v = m[:]
        assert v.data_ptr() == m.data_ptr() and torch.equal(v, m)  # same storage, same contents
        draft.register_mapping(v)
    elif wiring == "own_allocator":
        SWATokenToKVPoolAllocator(1024, 512, PS, kvcache=draft)
    else:
        ident = torch.arange(1024 + PS + 1, dtype=torch.int64)
        ident[-1] = -1
        draft.register_mapping(ident)
    assert draft.mapping_identity is not None
    assert draft.mapping_identity != target.mapping_identity
    assert draft.full_to_swa_index_mapping is not target.full_to_swa_index_mapping


def test_view_identity_differs_even_though_pointer_numel_dtype_match():
    m = new_mapping(1024, PS)
    ia, iv = MappingIdentity.of(m), MappingIdentity.of(m[:])
    assert (ia.data_ptr, ia.numel, ia.dtype) == (iv.data_ptr, iv.numel, iv.dtype)
    assert ia.nonce != iv.nonce and ia != iv


def test_identity_is_stable_for_one_object():
    m = new_mapping(1024, PS)
    assert MappingIdentity.of(m) == MappingIdentity.of(m)
    t = torch.zeros(4, dtype=torch.int64)  # untagged: tagged on first use, then stable
    assert MappingIdentity.of(t) == MappingIdentity.of(t)


def test_two_allocators_have_different_nonces():
    a, b = SWATokenToKVPoolAllocator(1024, 512, PS), SWATokenToKVPoolAllocator(1024, 512, PS)
    assert (
        MappingIdentity.of(a.full_to_swa_index_mapping).nonce != MappingIdentity.of(b.full_to_swa_index_mapping).nonce
    )


def test_shared_draft_sees_later_allocations_clone_does_not():
    target, shared, cloned = _pool(), _draft(), _draft()
    a = SWATokenToKVPoolAllocator(1024, 512, PS, kvcache=target)
    shared.register_mapping(a.full_to_swa_index_mapping)
    cloned.register_mapping(a.full_to_swa_index_mapping.clone())
    locs = a.alloc(300)  # after registration
    expect = list(range(256, 556))
    assert target.translate_loc_from_full_to_swa(locs).tolist() == expect
    assert shared.translate_loc_from_full_to_swa(locs).tolist() == expect
    assert cloned.translate_loc_from_full_to_swa(locs).tolist() == [0] * 300  # stale copy
    a.free(locs)
    assert shared.translate_loc_from_full_to_swa(locs).tolist() == [0] * 300
    # the tensor is updated in place, never replaced
    assert shared.full_to_swa_index_mapping is a.full_to_swa_index_mapping
    assert target.mapping_identity == shared.mapping_identity


def test_pool_without_mapping():
    p = _draft()
    assert not p.has_mapping and p.mapping_identity is None
    with pytest.raises(AttributeError) as info:
        p.translate_loc_from_full_to_swa(torch.tensor([1]))
    assert str(info.value) == MISSING_MAPPING_ERROR


# --- request slots ------------------------------------------------------------------------------


def test_req_to_token_pool_slots():
    r = ReqToTokenPool(3, 16)
    assert r.req_to_token.shape == (3, 16) and r.req_to_token.dtype == torch.int64
    slots = [r.alloc(), r.alloc(), r.alloc()]
    assert sorted(slots) == [0, 1, 2] and r.available_size() == 0
    with pytest.raises(AllocationError):
        r.alloc()
    r.req_to_token[slots[1], :4] = torch.tensor([256, 257, 258, 259])
    r.free(slots[1])
    assert int(r.req_to_token[slots[1]].abs().sum()) == 0
    with pytest.raises(AllocationError):
        r.free(slots[1])
    with pytest.raises(AllocationError):
        r.free(7)
    assert r.alloc() == slots[1]


def test_req_to_token_write_then_free_leaves_the_row_zero():
    r = ReqToTokenPool(2, 1024)
    s = r.alloc()
    r.write(s, torch.arange(300, 600, dtype=torch.int64))
    assert r.req_to_token[s, :300].tolist() == list(range(300, 600)) and int(r.req_to_token[s, 300:].abs().sum()) == 0
    r.free(s)
    assert int(r.req_to_token.abs().sum()) == 0
    s2 = r.alloc()
    r.req_to_token[s2, 1000] = 7  # a direct write past anything write() set is cleared too
    r.free(s2)
    assert int(r.req_to_token.abs().sum()) == 0
