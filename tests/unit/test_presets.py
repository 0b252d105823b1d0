"""Named presets build quickly and wire the draft mapping as asked."""

import time

import pytest

from pdstate.errors import DraftMappingMissing, PoolConfigError, SWAIndexMappingNotShared
from pdstate.pools import PrivateMemory, SharedMemory
from pdstate.pools.kvargs import KVArgs, StateType, fill_kv_args, setup_state_kv_args
from pdstate.pools.presets import DSV4_FLASH_RATIOS, PRESETS, build_worker_pools, pool_kwargs, preset
from tests.support.bounds import within
from tests.support.upstream import MAPPING_ERROR, UNIFIED_ERROR

FLASH_BUILD_QUIET_S = 2.0  # building dsv4-flash's pools on a quiet machine (tests.support.bounds)


@pytest.fixture(scope="module")
def flash():
    t0 = time.perf_counter()
    w = build_worker_pools(preset("dsv4-flash"))
    elapsed = time.perf_counter() - t0
    yield w, elapsed
    w.close()


def test_flash_ratios():
    assert len(DSV4_FLASH_RATIOS) == 44
    assert DSV4_FLASH_RATIOS[:4] == [0, 0, 4, 128] and DSV4_FLASH_RATIOS[-2:] == [4, 0]
    real = DSV4_FLASH_RATIOS[:43]
    assert real.count(0) == 2 and real.count(4) == 21 and real.count(128) == 20
    assert all(r == (4 if i % 2 == 0 else 128) for i, r in enumerate(real[2:]))


def test_flash_builds_quickly_with_the_right_counts(flash):
    w, elapsed = flash
    within("dsv4-flash pools built", elapsed, 15.0, FLASH_BUILD_QUIET_S)
    t = w.target
    assert len(t.stage_ratios) == 43
    assert t.stage_ratios.count(0) == 2 and t.stage_ratios.count(4) == 21 and t.stage_ratios.count(128) == 20
    assert t.compression_ratios == DSV4_FLASH_RATIOS  # the full list, placeholder included
    ptrs, lens, items = t.get_contiguous_buf_infos()
    assert len(ptrs) == 62
    assert items == [37440] * 21 + [8448] * 21 + [1728] * 20
    kv = fill_kv_args(t, w.draft)
    assert kv.state_types == [StateType.SWA, StateType.C128_STATE, StateType.SWA]
    assert [len(p) for p in kv.state_data_ptrs] == [85, 20, 1]
    # speculative (4 draft tokens): C4 ring 16, C128 item still 128 rows of fp32
    assert kv.state_item_lens[0] == [149760] * 43 + [131072] * 21 + [32768] * 21
    assert kv.state_item_lens[1] == [524288] * 20
    assert kv.state_item_lens[2] == [149760]
    assert w.draft.get_contiguous_buf_infos() == ([], [], [])
    assert w.draft.full_to_swa_index_mapping is w.allocator.full_to_swa_index_mapping
    assert w.target.full_to_swa_index_mapping is w.allocator.full_to_swa_index_mapping
    # every main-KV buffer has one item per full page, then (0.5.23) the reserved model-wide page
    # in its own rows: 256 // 64 = 4 C4 KV and indexer items, 256 // 2 = 128 C128 KV items
    assert t.upstream == "0.5.23"
    full_pages = preset("dsv4-flash").full_tokens // 256
    assert [n // it - full_pages for n, it in zip(lens, items)] == [4] * 42 + [128] * 20


def test_flash_0_5_19_main_kv_has_one_padding_page():
    w = build_worker_pools(preset("dsv4-flash", upstream="0.5.19"))
    try:
        ptrs, lens, items = w.target.get_contiguous_buf_infos()
        assert items == [37440] * 21 + [8448] * 21 + [1728] * 20
        full_pages = preset("dsv4-flash").full_tokens // 256
        assert all(n // it == full_pages + 1 for n, it in zip(lens, items))
    finally:
        w.close()


def test_flash_unified_component_counts():
    w = build_worker_pools(preset("dsv4-flash").with_(unified_kv=True))
    try:
        kv = fill_kv_args(w.target, w.draft)
        assert kv.state_types == [StateType.SWA, StateType.SWA_RING, StateType.C128_STATE, StateType.SWA_RING]
        assert [len(p) for p in kv.state_data_ptrs] == [42, 43, 20, 1]
        # ring: window 128 + 4 - 1 = 131 rows per slot, 9 slots, 1 KiB rows
        assert w.target.ring_geometry == w.draft.ring_geometry == (128, 131, 9 * 131)
        assert kv.state_data_lens[1] == [9 * 131 * 1024] * 43 and kv.state_item_lens[1] == [1024] * 43
        assert kv.kv_item_lens == [64 * 1024] * 21 + [8448] * 21 + [2 * 1024] * 20
    finally:
        w.close()


@pytest.mark.parametrize("upstream,main_lens", [("0.5.19", [187200, 42240, 8640]), ("0.5.23", [299520, 67584, 228096])])
def test_tiny_matches_the_conformance_defaults(upstream, main_lens):
    w = build_worker_pools(preset("tiny", upstream=upstream))
    assert w.target.upstream == w.draft.upstream == upstream
    kv = fill_kv_args(w.target, w.draft)
    assert kv.kv_data_lens == main_lens and kv.kv_item_lens == [37440, 8448, 1728]
    assert kv.state_types == [StateType.SWA, StateType.C128_STATE, StateType.SWA]
    assert kv.state_data_lens == [[449280, 449280, 449280, 688128, 172032], [6815744], [449280]]
    assert kv.state_item_lens == [[149760, 149760, 149760, 131072, 32768], [524288], [149760]]
    assert w.req_to_token.req_to_token.shape == (5, 1024)
    assert w.extra_allocators == []


def test_tiny_kwargs_are_the_recorded_ctor_kwargs():
    kw = pool_kwargs(preset("tiny"))
    recorded = {
        "max_num_reqs": 4,
        "swa_size": 512,
        "c4_size": 256,
        "c128_size": 8,
        "c4_state_pool_size": 64,
        "c128_state_pool_size": 1280,
        "page_size": 256,
        "swa_page_size": 256,
        "dtype": "float8_e4m3fn",
        "c4_state_dtype": "float32",
        "c128_state_dtype": "float32",
        "qk_nope_head_dim": 448,
        "qk_rope_head_dim": 64,
        "indexer_head_dim": 128,
        "layer_num": 3,
        "device": "cpu",
        "enable_memory_saver": False,
        "compression_ratios": [0, 4, 128],
        "sliding_window": 128,
        "enable_hisparse": False,
        "online_mtp_max_draft_tokens": 4,
        "num_req_slots": 5,
    }
    assert {k: kw[k] for k in recorded} == recorded
    nospec = pool_kwargs(preset("tiny").with_(speculative_num_draft_tokens=None))
    assert nospec["c4_state_pool_size"] == 32 and nospec["c128_state_pool_size"] == 640
    assert nospec["online_mtp_max_draft_tokens"] == 0
    online = pool_kwargs(preset("tiny").with_(online_c128=True, online_c128_mtp=True))
    assert online["c128_state_pool_size"] == 5
    d = pool_kwargs(preset("tiny"), draft=True)
    assert (d["c4_size"], d["c128_size"], d["c4_state_pool_size"], d["c128_state_pool_size"]) == (0, 0, 0, 0)
    assert d["compression_ratios"] == [0] and d["layer_num"] == 1 and d["swa_size"] == 512


def test_unknown_preset_names_the_choices():
    with pytest.raises(KeyError) as info:
        preset("nope")
    assert "dsv4-flash" in str(info.value) and "tiny" in str(info.value)
    assert set(PRESETS) >= {"tiny", "dsv4-flash"}


@pytest.mark.parametrize(
    "wiring,error",
    [
        ("shared", None),
        ("own", SWAIndexMappingNotShared),
        ("clone", SWAIndexMappingNotShared),
        ("view", SWAIndexMappingNotShared),
        ("none", DraftMappingMissing),
    ],
)
@pytest.mark.parametrize("upstream", ["0.5.19", "0.5.23"])
def test_draft_mapping_wirings_paged(wiring, error, upstream):
    if upstream == "0.5.23" and error is DraftMappingMissing:
        error = SWAIndexMappingNotShared  # 0.5.23 holds None: not the target's mapping
    w = build_worker_pools(preset("tiny", upstream=upstream).with_(draft_mapping=wiring))
    assert len(w.extra_allocators) == (1 if wiring == "own" else 0)
    if error is None:
        kv = setup_state_kv_args(KVArgs(), w.target, w.draft)
        assert kv.state_types[-1] == StateType.SWA
        assert w.draft.mapping_identity == w.target.mapping_identity
        return
    with pytest.raises(error) as info:
        setup_state_kv_args(KVArgs(), w.target, w.draft)
    if error is SWAIndexMappingNotShared:
        assert str(info.value) == MAPPING_ERROR
        assert w.draft.mapping_identity != w.target.mapping_identity
    else:
        assert isinstance(info.value, AttributeError)
        assert w.draft.mapping_identity is None


@pytest.mark.parametrize("wiring", ["shared", "own", "clone", "view", "none"])
def test_draft_mapping_wirings_unified_all_pass(wiring):
    w = build_worker_pools(preset("tiny").with_(unified_kv=True, draft_mapping=wiring))
    kv = setup_state_kv_args(KVArgs(), w.target, w.draft)
    assert kv.state_types == [StateType.SWA, StateType.SWA_RING, StateType.C128_STATE, StateType.SWA_RING]


def test_bad_wiring_is_refused():
    with pytest.raises(ValueError):
        build_worker_pools(preset("tiny").with_(draft_mapping="copy"))


def test_draft_disabled():
    w = build_worker_pools(preset("tiny").with_(draft_enabled=False))
    assert w.draft is None
    assert fill_kv_args(w.target, w.draft).state_types == [StateType.SWA, StateType.C128_STATE]


def test_draft_overrides_reach_the_checks():
    w = build_worker_pools(preset("tiny").with_(draft_page_size=512))
    assert w.draft.page_size == 512
    with pytest.raises(RuntimeError) as info:
        setup_state_kv_args(KVArgs(), w.target, w.draft)
    assert str(info.value) == (
        "DSV4 target and draft pools must share SWA geometry: target=(256, 128, None), draft=(512, 128, None)"
    )
    w = build_worker_pools(preset("tiny", upstream="0.5.19").with_(draft_page_size=512))
    with pytest.raises(RuntimeError) as info:
        setup_state_kv_args(KVArgs(), w.target, w.draft)
    assert str(info.value) == (
        "DSV4 target and draft pools must share paged SWA geometry: target=(256, 128), draft=(512, 128)"
    )
    w = build_worker_pools(preset("tiny").with_(unified_kv=True, draft_sliding_window=64))
    with pytest.raises(RuntimeError) as info:
        setup_state_kv_args(KVArgs(), w.target, w.draft)
    assert str(info.value) == (
        "DSV4 target and draft pools must share SWA ring geometry: target=(128, 131, 655), draft=(64, 67, 335)"
    )
    w = build_worker_pools(preset("tiny").with_(draft_unified_kv=True))
    with pytest.raises(RuntimeError) as info:
        setup_state_kv_args(KVArgs(), w.target, w.draft)
    assert str(info.value) == UNIFIED_ERROR


def test_allocator_in_the_worker_pools_is_live_for_the_draft():
    w = build_worker_pools(preset("tiny"))
    locs = w.allocator.alloc(300)
    assert w.draft.translate_loc_from_full_to_swa(locs).tolist() == list(range(256, 556))


def test_worker_pools_on_shared_memory(tmp_path):
    mem = SharedMemory(directory=tmp_path)
    w = build_worker_pools(preset("tiny"), memory=mem)
    names = sorted(s.name.rsplit("-", 1)[1] for s in mem.segments)
    assert names == ["draft", "target"]
    w.close()
    assert list(tmp_path.iterdir()) == []


def test_private_memory_default():
    w = build_worker_pools(preset("tiny"))
    assert isinstance(w.memory, PrivateMemory)
    assert len(w.memory.regions()) == 2


@pytest.mark.parametrize("change", [dict(layer_num=4), dict(start_layer=1), dict(start_layer=-1)])
def test_a_stage_outside_the_ratio_list_is_refused_not_widened(change):
    """Upstream's pool takes the whole ratio list when the stage's end is past it; pdstate's
    settings name the stage, so such bounds are refused, naming them."""
    from dataclasses import replace

    from pdstate.errors import PoolConfigError

    s = replace(preset("tiny"), **change)  # 3 ratios
    start, end = s.start_layer, s.start_layer + s.layer_num
    with pytest.raises(PoolConfigError) as info:
        build_worker_pools(s)
    assert str(info.value) == (
        f"pool: the stage [start_layer, start_layer + layer_num) = [{start}, {end}) does not lie "
        "within the 3 compression ratios"
    )


def test_upstream_keyword_on_presets():
    assert PRESETS["tiny"].upstream == PRESETS["dsv4-flash"].upstream == "0.5.23"
    assert preset("tiny", upstream="0.5.19").upstream == "0.5.19"
    assert pool_kwargs(preset("tiny", upstream="0.5.19"))["upstream"] == "0.5.19"
    assert pool_kwargs(preset("tiny"), draft=True)["upstream"] == "0.5.23"
    with pytest.raises(PoolConfigError, match="upstream must be one of '0.5.19', '0.5.23'"):
        preset("tiny", upstream="0.5.20")
    with pytest.raises(PoolConfigError):
        preset("tiny").with_(upstream="0.5")
