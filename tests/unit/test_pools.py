"""Pool geometry rules over combinations beyond the recorded conformance cases, and shared memory.

The expected layout is computed here, independently, from the formulas of ``DSV4_STATE.md`` §3
and ``LAYOUT_NOTES.md``; the pool's own geometry helpers are not used to compute expectations.
"""

import math
import os
import stat
import struct
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pdstate.errors import OnlineC128MTPUnsupported, PoolConfigError
from pdstate.pools import BufferSpec, DeepSeekV4TokenToKVPool, PrivateMemory, SharedMemory, SWATokenToKVPoolAllocator
from pdstate.pools.kvargs import KVArgs, StateType, setup_state_kv_args
from pdstate.pools.memory import SEGMENT_HEADER_BYTES, sweep_stale_segments

NOPE, ROPE, IDX_HD = 448, 64, 128
HD = NOPE + ROPE  # 512
BYTES_PER_TOKEN = NOPE + 2 * ROPE + NOPE // 64 + 1  # 584
PAD = NOPE + 2 * ROPE  # rows padded to a multiple of 576
K = {0: 0, 4: 32, 128: 1}
ESIZE = {"float32": 4, "bfloat16": 2}


# --- configurations ---------------------------------------------------------------------------


def make_kwargs(
    *,
    ratios=(0, 4, 128),
    start_layer=None,
    layer_num=None,
    end_layer=None,
    page_size=256,
    swa_page_size=None,
    window=128,
    spec=None,
    online=False,
    mtp=False,
    unified=False,
    state_dtype="float32",
    kv_dtype="float8_e4m3fn",
    full_tokens=None,
    swa_tokens=None,
    slots=5,
    c4_state_pool_size=None,
    c128_state_pool_size=None,
    upstream="0.5.23",
):
    """Upstream constructor kwargs, sized with the configurator's formulas unless overridden."""
    full = full_tokens if full_tokens is not None else 4 * page_size
    swa = swa_tokens if swa_tokens is not None else 2 * page_size
    ring4 = 16 if spec else 8
    ring128 = 1 if online else (256 if spec else 128)
    if layer_num is None:
        layer_num = len(ratios) - (start_layer or 0)
    if start_layer is not None and end_layer is None:  # a stage's bounds, as the configurator passes them
        end_layer = start_layer + layer_num
    return dict(
        max_num_reqs=max(1, slots - 1),
        swa_size=swa,
        c4_size=full // 4,
        c128_size=full // 128,
        c4_state_pool_size=swa // window * ring4 if c4_state_pool_size is None else c4_state_pool_size,
        c128_state_pool_size=(slots if online else slots * ring128)
        if c128_state_pool_size is None
        else c128_state_pool_size,
        page_size=page_size,
        swa_page_size=swa_page_size or page_size,
        dtype=kv_dtype,
        c4_state_dtype=state_dtype,
        c128_state_dtype=state_dtype,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        indexer_head_dim=IDX_HD,
        layer_num=layer_num,
        device="cpu",
        enable_memory_saver=False,
        compression_ratios=list(ratios),
        sliding_window=window,
        start_layer=start_layer,
        end_layer=end_layer,
        enable_hisparse=False,
        online_mtp_max_draft_tokens=spec or 0,
        num_req_slots=slots,
        unified_kv=unified,
        speculative_num_draft_tokens=spec,
        online_c128=online,
        online_c128_mtp=mtp,
        upstream=upstream,
    )


def draft_kwargs(target_kw: dict, layers: int = 1) -> dict:
    kw = dict(target_kw)
    kw.update(
        c4_size=0,
        c128_size=0,
        c4_state_pool_size=0,
        c128_state_pool_size=0,
        layer_num=layers,
        compression_ratios=[0] * layers,
        start_layer=None,
        end_layer=None,
    )
    return kw


# --- the independent model ----------------------------------------------------------------------


def paged_row(page: int) -> int:
    return math.ceil(page * BYTES_PER_TOKEN / PAD) * PAD


def paged_rows(size: int, page: int, global_page: int | None = None) -> int:
    """Rows of a paged buffer: 0.5.19 ``(size + page + 1) // page`` (``global_page`` None);
    0.5.23 ``ceil((size + global_page) / page)``, ``global_page`` the model-wide page of the pool."""
    if global_page is None:
        return (size + page + 1) // page
    return math.ceil((size + global_page) / page)


def roundup(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class Model:
    """Expected buffers and buffer infos of one pool, from the documented formulas."""

    def __init__(self, kw: dict):
        ratios = kw["compression_ratios"]
        start, end = kw["start_layer"], kw["end_layer"]
        if start is None or end is None or len(ratios) < end:  # upstream: else the whole ratio list
            start, end = 0, len(ratios)
        self.start = start
        self.stage = ratios[start:end]
        self.c4 = [start + i for i, r in enumerate(self.stage) if r == 4]
        self.c128 = [start + i for i, r in enumerate(self.stage) if r == 128]
        spec = kw["speculative_num_draft_tokens"]
        online, mtp = kw["online_c128"], kw["online_c128_mtp"]
        self.unified = kw["unified_kv"]
        self.release = kw.get("upstream", "0.5.23")
        new = self.release != "0.5.19"
        ps, sps = kw["page_size"], kw["swa_page_size"]
        self.ps = ps
        slots = kw["num_req_slots"]
        es = ESIZE[kw["c4_state_dtype"]]
        self.ring4 = 16 if spec else 8
        self.ring128 = 1 if online else (256 if spec else 128)
        self.buffers: dict[str, tuple[tuple[int, int], torch.dtype]] = {}
        u8 = torch.uint8
        sdt = getattr(torch, kw["c4_state_dtype"])
        if self.unified:
            self.ring = kw["sliding_window"] + (spec - 1 if spec else 0)
            self.swa_pages = slots * self.ring
            for i, r in enumerate(self.stage):
                rows = self.swa_pages + kw["c128_size"] * K[r] + (ps // r if r else 0)
                self.buffers[f"unified_kv[local_layer={i}]"] = ((rows, HD), torch.bfloat16)
        else:
            for i in range(len(self.stage)):
                self.buffers[f"swa_kv[local_layer={i}]"] = (
                    (paged_rows(kw["swa_size"], sps, sps if new else None), paged_row(sps)),
                    u8,
                )
            for j in range(len(self.c4)):
                self.buffers[f"c4_kv[c4_idx={j}]"] = (
                    (paged_rows(kw["c4_size"], ps // 4, ps if new else None), paged_row(ps // 4)),
                    u8,
                )
            for j in range(len(self.c128)):
                self.buffers[f"c128_kv[c128_idx={j}]"] = (
                    (paged_rows(kw["c128_size"], ps // 128, ps if new else None), paged_row(ps // 128)),
                    u8,
                )
        for j in range(len(self.c4)):
            self.buffers[f"c4_indexer_k[c4_idx={j}]"] = (
                (paged_rows(kw["c128_size"] * 32, ps // 4, ps if new else None), (ps // 4) * (IDX_HD + 4)),
                u8,
            )
        # 0.5.23 unified: one C4 ring per request slot, whatever the caller's size
        c4_size = slots * self.ring4 if new and self.unified else kw["c4_state_pool_size"]
        c4_rows = roundup(c4_size + self.ring4 + 1, 4)
        for layer in self.c4:
            self.buffers[f"attn_state_c4[layer={layer}]"] = ((c4_rows, 2 * 2 * HD), sdt)
        for layer in self.c4:
            self.buffers[f"indexer_state_c4[layer={layer}]"] = ((c4_rows, 2 * 2 * IDX_HD), sdt)
        if online:
            banks = 1 + (kw["online_mtp_max_draft_tokens"] if mtp else 0)
            c128_shape = ((max(kw["c128_state_pool_size"], slots) + 2) * banks, 3 * HD)
        else:
            size = max(kw["c128_state_pool_size"], slots * self.ring128)
            c128_shape = (roundup(size + self.ring128 + 1, 128), 2 * HD)
        for layer in self.c128:
            self.buffers[f"attn_state_c128[layer={layer}]"] = (c128_shape, sdt)

        def nbytes(label):
            (r, c), dt = self.buffers[label]
            return r * c * (1 if dt == u8 else 2 if dt == torch.bfloat16 else 4)

        def row(label):
            return nbytes(label) // self.buffers[label][0][0]

        self.nbytes, self.row = nbytes, row
        # (label, byte offset, data_len, item_len)
        c4_local = [i for i, r in enumerate(self.stage) if r == 4]
        c128_local = [i for i, r in enumerate(self.stage) if r == 128]
        idx = [(f"c4_indexer_k[c4_idx={j}]", 0) for j in range(len(self.c4))]
        if self.unified:
            off = self.swa_pages * HD * 2
            unified = lambda i, r: (f"unified_kv[local_layer={i}]", off, None, (ps // r) * HD * 2)  # noqa: E731
            self.contiguous = [unified(i, 4) for i in c4_local]
            self.contiguous += [(lab, 0, None, row(lab)) for lab, _ in idx]
            self.contiguous += [unified(i, 128) for i in c128_local]
            self.contiguous = [(lab, o, nbytes(lab) - o, it) for lab, o, _, it in self.contiguous]
            self.state = []
            self.swa_ring = [
                (f"unified_kv[local_layer={i}]", 0, self.swa_pages * HD * 2, HD * 2) for i in range(len(self.stage))
            ]
        else:
            self.contiguous = [
                (lab, 0, nbytes(lab), row(lab))
                for lab in self.buffers
                if lab.startswith(("c4_kv[", "c4_indexer_k[", "c128_kv["))
            ]
            # order: C4 KV, C4 indexer, C128 KV
            order = {"c4_kv[": 0, "c4_indexer_k[": 1, "c128_kv[": 2}
            self.contiguous.sort(key=lambda e: next(v for k, v in order.items() if e[0].startswith(k)))
            self.state = [
                (f"swa_kv[local_layer={i}]", 0, nbytes(f"swa_kv[local_layer={i}]"), paged_row(sps))
                for i in range(len(self.stage))
            ]
            self.swa_ring = []
        self.state += [
            (f"attn_state_c4[layer={L}]", 0, nbytes(f"attn_state_c4[layer={L}]"), 2 * 2 * HD * es * self.ring4)
            for L in self.c4
        ]
        self.state += [
            (
                f"indexer_state_c4[layer={L}]",
                0,
                nbytes(f"indexer_state_c4[layer={L}]"),
                2 * 2 * IDX_HD * es * self.ring4,
            )
            for L in self.c4
        ]
        c128_item = 3 * HD * es if online else 2 * HD * es * 128
        self.c128_state = [
            (f"attn_state_c128[layer={L}]", 0, nbytes(f"attn_state_c128[layer={L}]"), c128_item) for L in self.c128
        ]


def resolve(pool: DeepSeekV4TokenToKVPool, expected: list) -> tuple[list, list, list]:
    return (
        [pool.buffers[lab].data_ptr() + off for lab, off, _, _ in expected],
        [n for _, _, n, _ in expected],
        [it for _, _, _, it in expected],
    )


# --- strategies ---------------------------------------------------------------------------------


@st.composite
def configs(draw):
    ratios = draw(st.lists(st.sampled_from([0, 4, 128]), min_size=1, max_size=5))
    start = draw(st.integers(0, len(ratios) - 1))
    layer_num = draw(st.integers(1, len(ratios) - start))
    page_size = draw(st.sampled_from([256, 512]))
    spec = draw(st.sampled_from([None, 2, 4]))
    online = draw(st.booleans())
    mtp = online and draw(st.booleans())
    state_dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    assume(not (online and state_dtype == "bfloat16"))  # upstream refuses bf16 state with online compression
    slots = draw(st.integers(1, 6))
    return make_kwargs(
        upstream=draw(st.sampled_from(["0.5.19", "0.5.23"])),
        ratios=ratios,
        start_layer=draw(st.sampled_from([None, start])) if start == 0 else start,
        layer_num=layer_num,
        page_size=page_size,
        swa_page_size=draw(st.sampled_from([page_size, 128, 256])),
        window=draw(st.sampled_from([64, 128, 256])),
        spec=spec,
        online=online,
        mtp=mtp,
        unified=draw(st.booleans()),
        state_dtype=state_dtype,
        full_tokens=page_size * draw(st.integers(1, 4)),
        swa_tokens=draw(st.one_of(st.integers(1, 3 * page_size), st.integers(1, 3).map(lambda k: k * page_size - 1))),
        slots=slots,
        c4_state_pool_size=draw(st.integers(0, 160)),
        c128_state_pool_size=draw(st.integers(0, 1500)),
    )


def _refused(kw: dict) -> bool:
    return (
        kw["online_c128"]
        and kw["speculative_num_draft_tokens"]
        and not kw["online_c128_mtp"]
        and 128 in Model(kw).stage
    )


# --- geometry over combinations -----------------------------------------------------------------


def check_pool_against_model(pool: DeepSeekV4TokenToKVPool, m: Model) -> None:
    assert pool.stage_ratios == m.stage
    got = {lab: (tuple(t.shape), t.dtype) for lab, t in pool.buffers.items()}
    assert got == m.buffers
    for lab, t in pool.buffers.items():
        assert t.nbytes == m.nbytes(lab), lab
        assert t.is_contiguous(), lab
    assert pool.get_contiguous_buf_infos() == resolve(pool, m.contiguous)
    assert pool.get_state_buf_infos() == resolve(pool, m.state)
    assert pool.get_unified_swa_ring_buf_infos() == resolve(pool, m.swa_ring)
    assert pool.get_c128_state_buf_infos() == resolve(pool, m.c128_state)
    assert pool.c4_ring_size == m.ring4
    if m.c128:
        assert pool.c128_ring_size == m.ring128
    if m.unified:
        assert pool.ring_geometry == (pool.sliding_window, m.ring, m.swa_pages)
        assert (pool.unified_swa_window, pool.unified_swa_ring_size, pool.unified_swa_pages) == pool.ring_geometry
    else:
        assert pool.ring_geometry is None
    assert pool.paged_geometry == (pool.page_size, pool.sliding_window)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(kw=configs())
def test_geometry_matches_documented_formulas(kw):
    if _refused(kw):
        with pytest.raises(OnlineC128MTPUnsupported, match=r"^online c128 does not support MTP$"):
            DeepSeekV4TokenToKVPool(**kw)
        return
    pool = DeepSeekV4TokenToKVPool(**kw)
    check_pool_against_model(pool, Model(kw))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(kw=configs(), draft_layers=st.integers(1, 2))
def test_setup_state_kv_args_component_order(kw, draft_layers):
    assume(not _refused(kw))
    m = Model(kw)
    target = DeepSeekV4TokenToKVPool(**kw)
    draft = DeepSeekV4TokenToKVPool(**draft_kwargs(kw, draft_layers))
    alloc = SWATokenToKVPoolAllocator(kw["page_size"] * 4, kw["page_size"] * 2, kw["page_size"], kvcache=target)
    draft.register_mapping(alloc.full_to_swa_index_mapping)
    kv = setup_state_kv_args(KVArgs(), target, draft)

    want_types = [StateType.SWA]
    want = [resolve(target, m.state)]
    if m.unified and m.stage:
        want_types.append(StateType.SWA_RING)
        want.append(resolve(target, m.swa_ring))
    if m.c128:
        want_types.append(StateType.C128_STATE)
        want.append(resolve(target, m.c128_state))
    dm = Model(draft_kwargs(kw, draft_layers))
    want_types.append(StateType.SWA_RING if m.unified else StateType.SWA)
    want.append(resolve(draft, dm.swa_ring if m.unified else dm.state))
    assert kv.state_types == want_types
    assert [list(c) for c in zip(kv.state_data_ptrs, kv.state_data_lens, kv.state_item_lens)] == [list(w) for w in want]
    assert kv.state_dim_per_tensor == [[] for _ in want_types]
    assert kv.is_hybrid_mla_backend is False
    # the draft component: one buffer per draft layer, each exactly the draft's SWA window storage
    assert len(kv.state_data_ptrs[-1]) == draft_layers
    # SWA-only draft: nothing on the main KV channel, in both modes
    assert draft.get_contiguous_buf_infos() == ([], [], [])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(kw=configs())
def test_main_kv_item_i_is_full_page_i(kw):
    """Item ``i`` of every main-KV buffer holds exactly the compressed rows of full page ``i``;
    every buffer has ``full_pages + 1`` items (page 0 is the padding page) in 0.5.19 and in
    unified mode; 0.5.23's paged buffers reserve one model-wide page in their own rows instead:
    ``full_pages + page_size // page`` items (C4 KV and indexer ``+4``, C128 KV ``+128``)."""
    assume(not _refused(kw))
    pool = DeepSeekV4TokenToKVPool(**kw)
    m = Model(kw)
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    full_pages = kw["c4_size"] * 4 // kw["page_size"]
    kinds = [4] * len(m.c4) + ["idx"] * len(m.c4) + [128] * len(m.c128)
    assert len(ptrs) == len(kinds)
    for (lab, off, _, _), ptr, n, item, kind in zip(m.contiguous, ptrs, lens, items, kinds):
        t = pool.buffers[lab]
        extra = 1
        if m.release != "0.5.19" and (kind == "idx" or not m.unified):
            extra = kw["page_size"] // (kw["page_size"] // (4 if kind == "idx" else kind))
        assert n % item == 0 and n // item == full_pages + extra, lab
        for i in range(n // item):
            if m.unified and kind != "idx":
                rpp = kw["page_size"] // kind
                rows = t[m.swa_pages + i * rpp : m.swa_pages + (i + 1) * rpp]
                assert off == m.swa_pages * t[0].nbytes  # unified: base + swa_pages*row_bytes
            else:
                rows = t[i]
            assert (rows.data_ptr(), rows.nbytes) == (ptr + i * item, item), (lab, i)


# --- explicit rules -------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [256, 512])
@pytest.mark.parametrize("unified", [False, True])
@pytest.mark.parametrize("spec", [None, 2, 4])
@pytest.mark.parametrize("window", [64, 128, 256])
def test_grid_page_window_spec_mode(page_size, unified, spec, window):
    kw = make_kwargs(ratios=(4, 0, 128, 4), page_size=page_size, unified=unified, spec=spec, window=window)
    pool = DeepSeekV4TokenToKVPool(**kw)
    check_pool_against_model(pool, Model(kw))


def test_hand_computed_rows_page_512():
    kw = make_kwargs(ratios=(0, 4, 128), page_size=512, full_tokens=2048, swa_tokens=1024, upstream="0.5.19")
    pool = DeepSeekV4TokenToKVPool(**kw)
    b = pool.buffers
    assert tuple(b["swa_kv[local_layer=0]"].shape) == (3, 299520)  # 512*584=299008 -> 520*576
    assert tuple(b["c4_kv[c4_idx=0]"].shape) == (5, 74880)  # 128 tok: 74752 -> 130*576
    assert tuple(b["c128_kv[c128_idx=0]"].shape) == (5, 2880)  # 4 tok: 2336 -> 5*576
    assert tuple(b["c4_indexer_k[c4_idx=0]"].shape) == (5, 16896)  # 128*(128+4)
    assert pool.get_contiguous_buf_infos()[2] == [74880, 16896, 2880]


def test_hand_computed_rows_page_512_0_5_23():
    """0.5.23: ``ceil((size + 512) / page)`` rows, the same row bytes (so the same item lengths)."""
    kw = make_kwargs(ratios=(0, 4, 128), page_size=512, full_tokens=2048, swa_tokens=1024, upstream="0.5.23")
    pool = DeepSeekV4TokenToKVPool(**kw)
    b = pool.buffers
    assert tuple(b["swa_kv[local_layer=0]"].shape) == (3, 299520)  # (1024 + 512) / 512
    assert tuple(b["c4_kv[c4_idx=0]"].shape) == (8, 74880)  # (512 + 512) / 128
    assert tuple(b["c128_kv[c128_idx=0]"].shape) == (132, 2880)  # (16 + 512) / 4
    assert tuple(b["c4_indexer_k[c4_idx=0]"].shape) == (8, 16896)  # (16*32 + 512) / 128
    assert pool.get_contiguous_buf_infos()[2] == [74880, 16896, 2880]


@pytest.mark.parametrize(
    "size,page,rows",
    [(512, 256, 3), (255, 256, 2), (511, 256, 3), (300, 256, 2), (8, 2, 5), (7, 2, 5), (8, 1, 10), (0, 64, 1)],
)
def test_paged_row_count_rule(size, page, rows):
    """0.5.19: ``(size + page + 1) // page`` rows: the +1 matters when ``size % page == page - 1`` or page is 1."""
    assert paged_rows(size, page) == rows
    kw = make_kwargs(swa_tokens=size, swa_page_size=page, upstream="0.5.19")
    pool = DeepSeekV4TokenToKVPool(**kw)
    assert pool.swa_kv_buffers[0].shape[0] == rows
    check_pool_against_model(pool, Model(kw))


@pytest.mark.parametrize(
    "size,page,rows",
    [(512, 256, 3), (255, 256, 2), (511, 256, 3), (300, 256, 3), (8, 2, 5), (7, 2, 5), (8, 1, 9), (0, 64, 1)],
)
def test_paged_row_count_rule_0_5_23(size, page, rows):
    """0.5.23: ``ceil((size + page) / page)`` rows for the SWA KV (its model-wide page is its own)."""
    assert paged_rows(size, page, page) == rows
    kw = make_kwargs(swa_tokens=size, swa_page_size=page, upstream="0.5.23")
    pool = DeepSeekV4TokenToKVPool(**kw)
    assert pool.swa_kv_buffers[0].shape[0] == rows
    check_pool_against_model(pool, Model(kw))


def test_page_size_128_gives_one_token_c128_pages():
    kw = make_kwargs(page_size=128, full_tokens=1024, upstream="0.5.19")  # C128 page = 1 compressed token
    pool = DeepSeekV4TokenToKVPool(**kw)
    assert tuple(pool.c128_kv_buffers[0].shape) == (8 + 2, 1152)  # 584 -> 2*576, (8 + 1 + 1) // 1 rows
    assert tuple(pool.c4_kv_buffers[0].shape) == ((256 + 33) // 32, 19008)  # 32 tok: 18688 B -> 33*576
    check_pool_against_model(pool, Model(kw))
    kw = dict(kw, upstream="0.5.23")
    pool = DeepSeekV4TokenToKVPool(**kw)
    assert tuple(pool.c128_kv_buffers[0].shape) == (8 + 128, 1152)  # (8 + 128) / 1 rows
    assert tuple(pool.c4_kv_buffers[0].shape) == ((256 + 128) // 32, 19008)
    check_pool_against_model(pool, Model(kw))


def test_hand_computed_unified_rows():
    # the recorded defaults: 5 slots, window 128, spec 4 -> ring 131, 655 ring rows
    for upstream, indexer_len, c4_state_rows in (("0.5.19", 42240, 84), ("0.5.23", 67584, 100)):
        kw = make_kwargs(unified=True, spec=4, upstream=upstream)
        pool = DeepSeekV4TokenToKVPool(**kw)
        assert [tuple(t.shape) for t in pool.unified_kv_buffers] == [(655, 512), (975, 512), (665, 512)]
        assert pool.ring_geometry == (128, 131, 655)
        ptrs, lens, items = pool.get_contiguous_buf_infos()
        assert ptrs[0] == pool.unified_kv_buffers[1].data_ptr() + 655 * 1024
        assert ptrs[2] == pool.unified_kv_buffers[2].data_ptr() + 655 * 1024
        # the indexer: 5 rows in 0.5.19, (256 + 256) / 64 = 8 in 0.5.23
        assert lens == [327680, indexer_len, 10240] and items == [65536, 8448, 2048]
        # C4 states: 0.5.19 from c4_state_pool_size=64; 0.5.23 one 16-row ring per slot, 5*16 = 80
        assert pool.c4_attn_states[0].shape[0] == pool.c4_indexer_states[0].shape[0] == c4_state_rows
        assert pool.swa_req_ring_size == (131 if upstream == "0.5.23" else None)
    # window 64, spec 4 -> (64, 67, 335): the spec's ring-geometry example
    assert DeepSeekV4TokenToKVPool(**make_kwargs(unified=True, spec=4, window=64)).ring_geometry == (64, 67, 335)
    assert DeepSeekV4TokenToKVPool(**make_kwargs(unified=True, spec=None)).ring_geometry == (128, 128, 640)


@pytest.mark.parametrize("state_dtype,item", [("float32", 524288), ("bfloat16", 262144)])
def test_c128_offline_spec_item_stays_128_rows(state_dtype, item):
    pool = DeepSeekV4TokenToKVPool(**make_kwargs(spec=4, state_dtype=state_dtype))
    assert pool.c128_ring_size == 256
    _, lens, items = pool.get_c128_state_buf_infos()
    assert items == [item]
    row = pool.c128_states[0][0].nbytes
    assert row * 256 == 2 * item  # the request's ring is two items
    assert lens == [1664 * row]


def test_c128_online_item_is_one_row_and_mtp_banks():
    pool = DeepSeekV4TokenToKVPool(**make_kwargs(online=True))
    assert tuple(pool.c128_states[0].shape) == (7, 1536)
    assert pool.get_c128_state_buf_infos()[2] == [6144]
    pool = DeepSeekV4TokenToKVPool(**make_kwargs(online=True, mtp=True, spec=4))
    assert tuple(pool.c128_states[0].shape) == (35, 1536)
    assert pool.c128_ring_size == 1 and pool.c4_ring_size == 16


@pytest.mark.parametrize("unified", [False, True])
def test_online_c128_with_speculation_needs_mtp_option(unified):
    with pytest.raises(OnlineC128MTPUnsupported) as info:
        DeepSeekV4TokenToKVPool(**make_kwargs(online=True, spec=4, unified=unified))
    assert str(info.value) == "online c128 does not support MTP"
    assert isinstance(info.value, AssertionError)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16", "float32", torch.bfloat16])
def test_paged_non_fp8_kv_dtype_refuses_to_build(kv_dtype):
    with pytest.raises(PoolConfigError):
        DeepSeekV4TokenToKVPool(**make_kwargs(kv_dtype=kv_dtype))


@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2", "uint8", torch.float8_e4m3fn])
def test_paged_fp8_kv_dtypes_build_uint8_storage(kv_dtype):
    pool = DeepSeekV4TokenToKVPool(**make_kwargs(kv_dtype=kv_dtype))
    assert all(t.dtype == torch.uint8 for t in pool.swa_kv_buffers + pool.c4_kv_buffers + pool.c128_kv_buffers)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float32", "float8_e4m3fn", "float16"])
def test_unified_ignores_kv_dtype(kv_dtype):
    kw = make_kwargs(unified=True, kv_dtype=kv_dtype)
    pool = DeepSeekV4TokenToKVPool(**kw)
    assert all(t.dtype == torch.bfloat16 for t in pool.unified_kv_buffers)
    check_pool_against_model(pool, Model(kw))


def test_unknown_dtype_and_ratio_refused():
    with pytest.raises(PoolConfigError):
        DeepSeekV4TokenToKVPool(**make_kwargs(kv_dtype="float9"))
    with pytest.raises(PoolConfigError):
        DeepSeekV4TokenToKVPool(**make_kwargs(ratios=(0, 8)))


@pytest.mark.parametrize("unified", [False, True])
def test_swa_only_draft_has_empty_main_kv(unified):
    kw = draft_kwargs(make_kwargs(unified=unified, spec=4))
    draft = DeepSeekV4TokenToKVPool(**kw)
    assert draft.get_contiguous_buf_infos() == ([], [], [])
    assert draft.get_c128_state_buf_infos() == ([], [], [])
    if unified:
        assert draft.get_state_buf_infos() == ([], [], [])
        assert [tuple(t.shape) for t in draft.unified_kv_buffers] == [(655, 512)]
    else:
        assert draft.get_state_buf_infos()[1:] == ([449280], [149760])
        assert draft.get_unified_swa_ring_buf_infos() == ([], [], [])


def test_pp_stage_uses_absolute_layer_ids_for_states():
    ratios = (0, 0, 4, 128, 4, 128, 4, 0)
    kw = make_kwargs(ratios=ratios, start_layer=3, layer_num=3)  # layers 3, 4, 5: 128, 4, 128
    pool = DeepSeekV4TokenToKVPool(**kw)
    assert pool.stage_ratios == [128, 4, 128]
    assert sorted(lab for lab in pool.buffers if "state" in lab) == [
        "attn_state_c128[layer=3]",
        "attn_state_c128[layer=5]",
        "attn_state_c4[layer=4]",
        "indexer_state_c4[layer=4]",
    ]
    assert len(pool.swa_kv_buffers) == 3 and len(pool.c4_kv_buffers) == 1 and len(pool.c128_kv_buffers) == 2
    check_pool_against_model(pool, Model(kw))


def test_stage_is_start_to_end_exclusive_as_upstreams_dsv4_pool():
    ratios = (0, 4, 128, 4, 128)
    pool = DeepSeekV4TokenToKVPool(**make_kwargs(ratios=ratios, start_layer=1, layer_num=2, end_layer=3))
    assert pool.stage_ratios == [4, 128] and (pool._stage_start, pool._stage_end) == (1, 3)
    assert sorted(lab for lab in pool.buffers if "state" in lab) == [
        "attn_state_c128[layer=2]",
        "attn_state_c4[layer=1]",
        "indexer_state_c4[layer=1]",
    ]


@pytest.mark.parametrize(
    "start,end",
    [(None, None), (1, None), (None, 3), (1, 6)],  # a bound missing, or past the list: upstream's else
    ids=["neither", "start only", "end only", "end past the list"],
)
def test_without_both_bounds_within_the_list_the_stage_is_the_whole_ratio_list(start, end):
    ratios = (0, 4, 128, 4, 128)
    kw = make_kwargs(ratios=ratios, layer_num=2)
    kw.update(start_layer=start, end_layer=end)  # as given, whatever layer_num says
    pool = DeepSeekV4TokenToKVPool(**kw)
    assert pool.stage_ratios == list(ratios) and (pool._stage_start, pool._stage_end) == (0, 5)
    assert len(pool.swa_kv_buffers) == 5


def test_a_trailing_placeholder_is_a_layer_unless_the_stage_ends_before_it():
    # 43 layers + MTP placeholder: given alone, upstream builds all 44 (its else branch); with the
    # stage's bounds, as SGLang's configurator passes them, exactly the 43 real layers
    ratios = [0, 0] + [4, 128] * 20 + [4] + [0]
    whole = Model(make_kwargs(ratios=ratios, layer_num=43))
    bounded = Model(make_kwargs(ratios=ratios, layer_num=43, start_layer=0, end_layer=43))
    assert len(whole.stage) == 44 and len(bounded.stage) == 43
    assert bounded.stage.count(4) == 21 and bounded.stage.count(128) == 20


def test_buffers_are_zeroed_and_disjoint():
    pool = DeepSeekV4TokenToKVPool(**make_kwargs(spec=4))
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in pool.buffers.values())
    for (_a0, a1), (b0, _) in zip(spans, spans[1:]):
        assert a1 <= b0
    (region,) = pool._memory.regions()
    for t in pool.buffers.values():
        assert (t.data_ptr() - region.base_ptr) % 4096 == 0  # each buffer on a 4 KiB offset of its arena
        assert region.base_ptr <= t.data_ptr() and t.data_ptr() + t.nbytes <= region.base_ptr + region.nbytes
        assert not t.view(torch.uint8).any()
    assert pool.total_bytes == sum(t.nbytes for t in pool.buffers.values())


@pytest.mark.parametrize("bad", [dict(device="cuda"), dict(enable_hisparse=True)])
def test_unsupported_options_refused(bad):
    kw = make_kwargs()
    kw.update(bad)
    with pytest.raises(PoolConfigError):
        DeepSeekV4TokenToKVPool(**kw)


# --- memory -----------------------------------------------------------------------------------------


def test_private_memory_layout():
    mem = PrivateMemory()
    specs = [
        BufferSpec("a", (3, 5), torch.uint8),
        BufferSpec("b", (2, 4), torch.float32),
        BufferSpec("c", (1,), torch.bfloat16),
    ]
    assert [s.nbytes for s in specs] == [15, 32, 2]
    ts = mem.allocate("x", specs)
    base = mem.regions()[0].base_ptr
    assert [t.data_ptr() - base for t in ts] == [0, 4096, 8192]
    assert mem.regions()[0].nbytes == 3 * 4096
    assert [tuple(t.shape) for t in ts] == [(3, 5), (2, 4), (1,)]
    assert [t.dtype for t in ts] == [torch.uint8, torch.float32, torch.bfloat16]


def test_shared_memory_segment_mode_alias_and_unlink(tmp_path):
    mem = SharedMemory(directory=tmp_path)
    specs = [BufferSpec("a", (3, 5), torch.uint8), BufferSpec("b", (2, 4), torch.float32)]
    a, b = mem.allocate("target", specs)
    (seg,) = mem.segments
    path = tmp_path / seg.name
    assert seg.path == str(path) and path.exists()
    assert seg.name.startswith(f"pdstate-{os.getpid()}-") and seg.name.endswith("-target")
    st_ = os.stat(path)
    assert stat.S_IMODE(st_.st_mode) == 0o600
    assert st_.st_uid == os.getuid()
    h = SEGMENT_HEADER_BYTES  # the file: the header (magic, ownership secret), then the buffers
    assert seg.nbytes == 2 * 4096 and st_.st_size == h + seg.nbytes
    assert a.data_ptr() == seg.base_ptr and b.data_ptr() == seg.base_ptr + 4096
    assert [(r.name, r.base_ptr, r.nbytes) for r in mem.regions()] == [(seg.name, seg.base_ptr, 8192)]
    # tensor -> file
    a[2, 4] = 0xAB
    b[1, 2] = 1.5
    data = path.read_bytes()
    assert data[:8] == b"PDSTSEG1" and len(set(data[8:40])) > 1  # a random secret
    assert data[h + 2 * 5 + 4] == 0xAB
    assert struct.unpack_from("<f", data, h + 4096 + (1 * 4 + 2) * 4)[0] == 1.5
    assert sum(1 for x in data[h:] if x) == 3  # 0xAB, and 1.5f = 00 00 c0 3f: nothing else written
    # file -> tensor
    with open(path, "r+b") as f:
        f.seek(h + 7)
        f.write(b"\x2a")
    assert a[1, 2].item() == 0x2A
    mem.close()
    assert not path.exists()
    assert mem.segments == []
    a[0, 0] = 1  # the mapping stays valid until collected
    assert a[0, 0].item() == 1


def test_shared_memory_context_manager_and_pool(tmp_path):
    with SharedMemory(directory=tmp_path) as mem:
        pool = DeepSeekV4TokenToKVPool(**make_kwargs(), memory=mem, name="target")
        (seg,) = mem.segments
        assert seg.name.endswith("-target")
        t = pool.buffers["c4_kv[c4_idx=0]"]
        assert seg.base_ptr <= t.data_ptr() and t.data_ptr() + t.nbytes <= seg.base_ptr + seg.nbytes
        t[1, 0] = 0x5C
        off = SEGMENT_HEADER_BYTES + t.data_ptr() - seg.base_ptr + t[0].nbytes
        with open(seg.path, "rb") as f:
            f.seek(off)
            assert f.read(1) == b"\x5c"
        path = seg.path
    assert not os.path.exists(path)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_sweep_removes_dead_owner_segments_only(tmp_path):
    live = SharedMemory(directory=tmp_path)
    live.allocate("target", [BufferSpec("a", (8,), torch.uint8)])
    (live_seg,) = live.segments
    dead_name = f"pdstate-{_dead_pid()}-deadbeef-target"
    (tmp_path / dead_name).write_bytes(b"\0" * 16)
    (tmp_path / "not-a-segment").write_bytes(b"x")
    (tmp_path / "pdstate-garbage").write_bytes(b"x")
    removed = sweep_stale_segments(tmp_path)
    assert removed == [dead_name]
    assert not (tmp_path / dead_name).exists()
    assert (tmp_path / live_seg.name).exists()
    assert (tmp_path / "not-a-segment").exists() and (tmp_path / "pdstate-garbage").exists()
    assert sweep_stale_segments(tmp_path) == []
    live.close()
    assert sweep_stale_segments(tmp_path / "missing") == []
