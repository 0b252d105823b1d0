"""``setup_state_kv_args``: the five target/draft checks, their order, and what each branch ignores."""

import pytest

from pdstate.errors import (
    DraftMappingMissing,
    DraftNotSWAOnly,
    PagedSWAGeometryMismatch,
    SWAGeometryMismatch,
    SWAIndexMappingNotShared,
    SWARingGeometryMismatch,
    UnifiedKVModeMismatch,
)
from pdstate.pools import DeepSeekV4TokenToKVPool, SWATokenToKVPoolAllocator
from pdstate.pools.kvargs import (
    KVArgs,
    StateType,
    append_state_component,
    fill_kv_args,
    pool_facts,
    setup_state_kv_args,
)
from pdstate.protocol.facts import check_draft_pair, identities_shared
from tests.support.pools import draft_changes, upstream_kwargs, wire_draft
from tests.support.upstream import MAPPING_ERROR, MISSING_MAPPING_ERROR, SWA_ONLY_ERROR, UNIFIED_ERROR


def target(**over) -> DeepSeekV4TokenToKVPool:
    return DeepSeekV4TokenToKVPool(**upstream_kwargs(**over))


def draft(ratios=(0,), **over) -> DeepSeekV4TokenToKVPool:
    return DeepSeekV4TokenToKVPool(**upstream_kwargs(**{**draft_changes(ratios), **over}))


def wire(t, d, how: str) -> SWATokenToKVPoolAllocator:
    """Give ``t`` an allocator and wire ``d``'s mapping as ``how`` says."""
    a = SWATokenToKVPoolAllocator(1024, 512, t.page_size, kvcache=t)
    a.alloc(2 * t.page_size)
    wire_draft(a, d, how)
    return a


def run(t, d):
    return setup_state_kv_args(KVArgs(), t, d)


def raises(t, d, cls, msg):
    with pytest.raises(cls) as info:
        run(t, d)
    assert type(info.value) is cls
    assert str(info.value) == msg
    assert isinstance(info.value, RuntimeError)
    return info.value


# --- 1. ratio check comes first ---------------------------------------------------------------


@pytest.mark.parametrize("ratios", [(), (4,), (128,), (0, 4), (0, 0, 128)])
@pytest.mark.parametrize("how", ["shared", "own", "none", "clone"])
def test_ratio_check_first_in_paged(ratios, how):
    t = target()
    d = draft(ratios)
    wire(t, d, how)
    raises(t, d, DraftNotSWAOnly, SWA_ONLY_ERROR)


@pytest.mark.parametrize("ratios", [(), (4,), (0, 128)])
def test_ratio_check_before_mode_check(ratios):
    t = target(unified_kv=True)
    d = draft(ratios, unified_kv=False)  # also a mode mismatch, and no mapping at all
    raises(t, d, DraftNotSWAOnly, SWA_ONLY_ERROR)
    t = target(unified_kv=False)
    d = draft(ratios, unified_kv=True, sliding_window=64)
    raises(t, d, DraftNotSWAOnly, SWA_ONLY_ERROR)


def test_ratio_check_reads_the_full_ratio_list_not_the_stage():
    # the draft's stage holds only a 0 layer, but its ratio list has a 4: upstream refuses
    t = target()
    d = draft((0, 4), layer_num=1, start_layer=0, end_layer=1)
    assert d.stage_ratios == [0]
    wire(t, d, "shared")
    raises(t, d, DraftNotSWAOnly, SWA_ONLY_ERROR)


# --- 2. mode check before mapping / geometry ----------------------------------------------------


@pytest.mark.parametrize("how", ["shared", "own", "none", "clone"])
@pytest.mark.parametrize("target_unified", [False, True])
def test_mode_check_before_mapping_and_geometry(how, target_unified):
    t = target(unified_kv=target_unified)
    d = draft(unified_kv=not target_unified, page_size=512, sliding_window=64)
    wire(t, d, how)
    raises(t, d, UnifiedKVModeMismatch, UNIFIED_ERROR)


# --- 3. unified: ring geometry only, the mapping is never looked at -------------------------------


@pytest.mark.parametrize("how", ["shared", "own", "identity", "none", "clone", "view"])
def test_unified_ignores_the_mapping(how):
    t = target(unified_kv=True)
    d = draft(unified_kv=True)
    wire(t, d, how)
    kv = run(t, d)
    assert kv.state_types == [StateType.SWA, StateType.SWA_RING, StateType.C128_STATE, StateType.SWA_RING]
    ptrs, lens, items = kv.state_data_ptrs[-1], kv.state_data_lens[-1], kv.state_item_lens[-1]
    assert ptrs == [d.unified_kv_buffers[0].data_ptr()] and lens == [670720] and items == [1024]


def test_unified_ignores_a_missing_target_mapping_too():
    t, d = target(unified_kv=True), draft(unified_kv=True)
    assert run(t, d).num_components == 4


def test_unified_ignores_page_size_and_swa_sizes():
    t = target(unified_kv=True)
    d = draft(unified_kv=True, page_size=512, swa_page_size=128, swa_size=4096)
    assert run(t, d).state_types[-1] == StateType.SWA_RING


@pytest.mark.parametrize(
    "over,draft_geom",
    [
        (dict(sliding_window=64), "(64, 67, 335)"),
        (dict(speculative_num_draft_tokens=2), "(128, 129, 645)"),
        (dict(speculative_num_draft_tokens=None), "(128, 128, 640)"),
        (dict(num_req_slots=4), "(128, 131, 524)"),
    ],
)
@pytest.mark.parametrize("how", ["shared", "none", "own"])
def test_unified_ring_geometry_mismatch(over, draft_geom, how):
    t = target(unified_kv=True)
    d = draft(unified_kv=True, **over)
    wire(t, d, how)
    raises(
        t,
        d,
        SWARingGeometryMismatch,
        f"DSV4 target and draft pools must share SWA ring geometry: target=(128, 131, 655), draft={draft_geom}",
    )


# --- 4/5. paged: mapping identity, then geometry -------------------------------------------------


@pytest.mark.parametrize("how", ["own", "identity", "clone", "view"])
def test_paged_mapping_not_shared(how):
    t, d = target(), draft()
    wire(t, d, how)
    raises(t, d, SWAIndexMappingNotShared, MAPPING_ERROR)


def test_paged_missing_draft_mapping_is_an_attribute_error():
    """0.5.19: the draft has no mapping attribute at all."""
    t, d = target(upstream="0.5.19"), draft(upstream="0.5.19")
    wire(t, d, "none")
    with pytest.raises(AttributeError) as info:
        run(t, d)
    assert isinstance(info.value, DraftMappingMissing)
    assert str(info.value) == MISSING_MAPPING_ERROR


@pytest.mark.parametrize("how", ["own", "clone", "view", "identity"])
@pytest.mark.parametrize(
    "over", [dict(page_size=512), dict(sliding_window=64), dict(page_size=128, sliding_window=256)]
)
def test_paged_mapping_check_before_geometry_check(how, over):
    t = target()
    d = draft(**over)
    wire(t, d, how)
    raises(t, d, SWAIndexMappingNotShared, MAPPING_ERROR)


def test_paged_missing_mapping_before_geometry_check():
    t, d = target(upstream="0.5.19"), draft(page_size=512, upstream="0.5.19")
    wire(t, d, "none")
    with pytest.raises(DraftMappingMissing):
        run(t, d)


@pytest.mark.parametrize("over", [{}, dict(page_size=512)])
def test_paged_missing_draft_mapping_0_5_23_is_not_shared(over):
    """0.5.23 holds ``None`` until a mapping is registered: the identity check refuses it, with
    its RuntimeError, before the geometry check."""
    t, d = target(), draft(**over)
    assert t.upstream == d.upstream == "0.5.23"
    wire(t, d, "none")
    assert d.full_to_swa_index_mapping is None
    raises(t, d, SWAIndexMappingNotShared, MAPPING_ERROR)


@pytest.mark.parametrize(
    "over,draft_geom",
    [
        (dict(page_size=512), "(512, 128)"),
        (dict(sliding_window=64), "(256, 64)"),
        (dict(page_size=128, sliding_window=256), "(128, 256)"),
    ],
)
def test_paged_geometry_mismatch_with_shared_mapping(over, draft_geom):
    t, d = target(upstream="0.5.19"), draft(**over, upstream="0.5.19")
    wire(t, d, "shared")
    raises(
        t,
        d,
        PagedSWAGeometryMismatch,
        f"DSV4 target and draft pools must share paged SWA geometry: target=(256, 128), draft={draft_geom}",
    )


@pytest.mark.parametrize(
    "over",
    [dict(swa_page_size=128), dict(num_req_slots=9), dict(swa_size=1024), dict(speculative_num_draft_tokens=None)],
)
def test_paged_ignores_what_upstream_does_not_compare(over):
    t, d = target(), draft(**over)
    wire(t, d, "shared")
    kv = run(t, d)
    assert kv.state_types == [StateType.SWA, StateType.C128_STATE, StateType.SWA]
    assert kv.state_data_ptrs[-1] == [d.swa_kv_buffers[0].data_ptr()]
    assert kv.state_item_lens[-1] == [d.swa_kv_buffers[0][0].nbytes]


def test_paged_happy_components_exact():
    t, d = target(), draft()
    wire(t, d, "shared")
    kv = run(t, d)
    assert kv.state_types == [StateType.SWA, StateType.C128_STATE, StateType.SWA]
    assert kv.state_data_lens == [[449280, 449280, 449280, 688128, 172032], [6815744], [449280]]
    assert kv.state_item_lens == [[149760, 149760, 149760, 131072, 32768], [524288], [149760]]
    swa = t.swa_kv_buffers + t.c4_attn_states + t.c4_indexer_states
    assert kv.state_data_ptrs == [
        [x.data_ptr() for x in swa],
        [t.c128_states[0].data_ptr()],
        [d.swa_kv_buffers[0].data_ptr()],
    ]


def test_draft_with_two_layers_sends_both():
    t, d = target(), draft((0, 0))
    wire(t, d, "shared")
    kv = run(t, d)
    assert kv.state_data_ptrs[-1] == [x.data_ptr() for x in d.swa_kv_buffers]
    assert len(kv.state_data_ptrs[-1]) == 2


# --- skipped drafts -------------------------------------------------------------------------------


class _NotAPool:
    compression_ratios = [4]  # would fail every check if it were looked at
    _unified_kv = True


@pytest.mark.parametrize("d", [None, object(), _NotAPool(), "draft"])
@pytest.mark.parametrize("unified", [False, True])
def test_non_dsv4_or_missing_draft_is_skipped(d, unified):
    t = target(unified_kv=unified)
    kv = run(t, d)
    want = [StateType.SWA] + ([StateType.SWA_RING] if unified else []) + [StateType.C128_STATE]
    assert kv.state_types == want


def test_target_must_be_a_dsv4_pool():
    with pytest.raises(TypeError):
        setup_state_kv_args(KVArgs(), object())


# --- field reset ----------------------------------------------------------------------------------


def test_fields_are_reset_not_appended():
    t, d = target(), draft()
    wire(t, d, "shared")
    kv = KVArgs()
    kv.state_types = [StateType.MAMBA]
    kv.state_data_ptrs, kv.state_data_lens, kv.state_item_lens = [[1]], [[2]], [[3]]
    kv.state_dim_per_tensor, kv.state_layer_ids = [[9]], [[9]]
    kv.is_hybrid_mla_backend = True
    out = setup_state_kv_args(kv, t, d, total_kv_layers=3)
    assert out is kv
    assert kv.state_types == [StateType.SWA, StateType.C128_STATE, StateType.SWA]
    assert kv.state_dim_per_tensor == [[], [], []] and kv.state_layer_ids == [[], [], []]
    assert kv.is_hybrid_mla_backend is False
    assert kv.total_kv_layers == 3
    # running twice gives the same result
    again = setup_state_kv_args(KVArgs(), t, d)
    assert again.state_data_ptrs == kv.state_data_ptrs and again.state_item_lens == kv.state_item_lens


@pytest.mark.parametrize(
    "over,draft_geom",
    [
        (dict(page_size=512), "(512, 128, None)"),
        (dict(sliding_window=64), "(256, 64, None)"),
        (dict(page_size=128, sliding_window=256), "(128, 256, None)"),
    ],
)
def test_paged_geometry_mismatch_0_5_23(over, draft_geom):
    """0.5.23's wording and three-element tuple; still a ``PagedSWAGeometryMismatch`` subclass."""
    t, d = target(), draft(**over)
    wire(t, d, "shared")
    exc = raises(
        t,
        d,
        SWAGeometryMismatch,
        f"DSV4 target and draft pools must share SWA geometry: target=(256, 128, None), draft={draft_geom}",
    )
    assert isinstance(exc, PagedSWAGeometryMismatch)


def test_state_type_values():
    assert [s.value for s in StateType] == ["mamba", "swa", "nsa", "swa_ring", "c128_state", "request_row"]
    assert StateType.SWA == "swa"
    # 0.5.23's name for the C128 state component: the same member, the same wire value
    assert StateType.DSV4_REQUEST_STATE is StateType.C128_STATE
    assert StateType["DSV4_REQUEST_STATE"] is StateType("c128_state") is StateType["C128_STATE"]
    assert StateType.REQUEST_ROW.value == "request_row"


@pytest.mark.parametrize("upstream", ["0.5.19", "0.5.23"])
def test_request_state_component_under_both_names(upstream):
    t, d = target(upstream=upstream), draft(upstream=upstream)
    wire(t, d, "shared")
    kv = run(t, d)
    assert kv.state_types == [StateType.SWA, StateType.DSV4_REQUEST_STATE, StateType.SWA]
    assert t.get_request_state_buf_infos() == t.get_c128_state_buf_infos()


class _DSparkDraft(DeepSeekV4TokenToKVPool):
    """A draft stating a DSpark request row (0.5.23's ``swa_valid_from``), by interface."""

    def get_swa_valid_from_buf_infos(self):
        return [1234], [8 * self.num_req_slots], [8]


@pytest.mark.parametrize("unified", [False, True])
def test_request_row_component_last_for_a_0_5_23_dspark_draft(unified):
    t = target(upstream="0.5.23", unified_kv=unified)
    d = _DSparkDraft(**upstream_kwargs(**draft_changes((0,)), upstream="0.5.23", unified_kv=unified))
    wire(t, d, "shared")
    kv = run(t, d)
    assert kv.state_types[-1] is StateType.REQUEST_ROW
    assert kv.state_data_ptrs[-1] == [1234] and kv.state_item_lens[-1] == [8]
    # a 0.5.19 target has no such component
    t19 = target(upstream="0.5.19", unified_kv=unified)
    d19 = _DSparkDraft(**upstream_kwargs(**draft_changes((0,)), upstream="0.5.19", unified_kv=unified))
    wire(t19, d19, "shared")
    assert StateType.REQUEST_ROW not in run(t19, d19).state_types


def test_append_component_keeps_lists_parallel():
    kv = KVArgs()
    with pytest.raises(ValueError):
        append_state_component(kv, StateType.SWA, [1, 2], [3], [4, 5])
    assert kv.state_types == []


def test_no_c128_layer_no_c128_component():
    t = target(compression_ratios=[0, 4], layer_num=2)
    d = draft()
    wire(t, d, "shared")
    assert run(t, d).state_types == [StateType.SWA, StateType.SWA]
    # a PP stage without C128 layers, even though the model has some
    t = target(compression_ratios=[0, 4, 128], layer_num=2, start_layer=0, end_layer=2)
    assert run(t, None).state_types == [StateType.SWA]


def test_unified_without_c4_layers_still_sends_an_empty_swa_component_first():
    t = target(unified_kv=True, compression_ratios=[0, 128], layer_num=2)
    kv = run(t, None)
    assert kv.state_types == [StateType.SWA, StateType.SWA_RING, StateType.C128_STATE]
    assert kv.state_data_ptrs[0] == [] and kv.state_item_lens[0] == []


# --- the checks over reported facts (cross-process form) ------------------------------------------


def _facts(pool):
    return pool_facts(pool)


def test_mapping_predicate_consulted_only_where_upstream_evaluates_it():
    calls = []

    def shared():
        calls.append(1)
        return True

    t_p, t_u = target(), target(unified_kv=True)
    # ratio refusal: not consulted
    with pytest.raises(DraftNotSWAOnly):
        check_draft_pair(_facts(t_p), _facts(draft((4,))), shared)
    # mode refusal: not consulted
    with pytest.raises(UnifiedKVModeMismatch):
        check_draft_pair(_facts(t_p), _facts(draft(unified_kv=True)), shared)
    # unified branch: never consulted, pass or fail
    check_draft_pair(_facts(t_u), _facts(draft(unified_kv=True)), shared)
    with pytest.raises(SWARingGeometryMismatch):
        check_draft_pair(_facts(t_u), _facts(draft(unified_kv=True, sliding_window=64)), shared)
    assert calls == []
    # paged: consulted exactly once, before the geometry comparison
    with pytest.raises(SWAIndexMappingNotShared):
        check_draft_pair(_facts(t_p), _facts(draft(page_size=512)), lambda: calls.append(2) or False)
    with pytest.raises(PagedSWAGeometryMismatch):
        check_draft_pair(_facts(t_p), _facts(draft(page_size=512)), shared)
    assert calls == [2, 1]


def test_identities_shared_over_reported_facts():
    t, d_shared, d_clone, d_none = target(), draft(), draft(), draft()
    a = wire(t, d_shared, "shared")
    d_clone.register_mapping(a.full_to_swa_index_mapping.clone())
    assert identities_shared(_facts(t), _facts(d_shared))
    assert not identities_shared(_facts(t), _facts(d_clone))
    assert not identities_shared(_facts(t), _facts(d_none))
    assert not identities_shared(_facts(draft()), _facts(d_none))  # both None: not shared
    check_draft_pair(_facts(t), _facts(d_shared), lambda: identities_shared(_facts(t), _facts(d_shared)))
    with pytest.raises(SWAIndexMappingNotShared):
        check_draft_pair(_facts(t), _facts(d_clone), lambda: identities_shared(_facts(t), _facts(d_clone)))


def test_pool_facts_fields():
    t = target(unified_kv=True)
    f = pool_facts(t)
    assert f.compression_ratios == (0, 4, 128)
    assert f.unified_kv is True
    assert f.ring_geometry == (128, 131, 655)
    assert f.paged_geometry == (256, 128)
    assert f.mapping_identity is None


@pytest.mark.parametrize("upstream,lens", [("0.5.19", [187200, 42240, 8640]), ("0.5.23", [299520, 67584, 228096])])
def test_fill_kv_args_main_channel_then_states(upstream, lens):
    t, d = target(upstream=upstream), draft(upstream=upstream)
    wire(t, d, "shared")
    kv = fill_kv_args(t, d)
    assert kv.kv_data_lens == lens and kv.kv_item_lens == [37440, 8448, 1728]
    assert kv.kv_data_ptrs == [
        t.c4_kv_buffers[0].data_ptr(),
        t.c4_indexer_buffers[0].data_ptr(),
        t.c128_kv_buffers[0].data_ptr(),
    ]
    assert kv.page_size == 256 and kv.kv_cache_dtype == "float8_e4m3fn"
    assert kv.mla_compression_ratios == [0, 4, 128]
    assert kv.state_types == [StateType.SWA, StateType.C128_STATE, StateType.SWA]
