"""``compat``: a peer's report checked against ours, with the errors the peer itself would raise.

Reports come from real pools (``presets.build_worker_pools`` + ``layout.build_report``).
"""

from __future__ import annotations

import functools

import pytest

from pdstate import errors as e
from pdstate.pools.dsv4 import DeepSeekV4TokenToKVPool
from pdstate.pools.presets import build_worker_pools, pool_kwargs
from pdstate.pools.reporting import build_report
from pdstate.protocol import compat
from pdstate.protocol.report import FACTOR_NAMES, LayoutReport, fingerprint
from tests.support.pools import TINY, keep, report_of, tiny
from tests.support.upstream import MAPPING_ERROR, MISSING_MAPPING_ERROR, SWA_ONLY_ERROR, UNIFIED_ERROR


@functools.cache
def report_with_compressed_draft() -> LayoutReport:
    """A draft with a C4 layer, wired to the target's mapping (presets only build SWA-only drafts)."""
    pools = build_worker_pools(TINY.with_(draft_enabled=False))
    kw = {**pool_kwargs(TINY, draft=True), "compression_ratios": [4], "c4_size": 256, "c4_state_pool_size": 64}
    draft = DeepSeekV4TokenToKVPool(**kw, name="draft")
    draft.register_mapping(pools.allocator.full_to_swa_index_mapping)
    keep((pools, draft))
    return build_report(pools.target, draft)[0]


def raises(exc_type, message, ours, theirs, role):
    with pytest.raises(exc_type) as info:
        compat.check_peer(ours, theirs, role)
    assert type(info.value) is exc_type
    assert str(info.value) == message
    return info.value


def raises_both(exc_type, message, prefill, decode):
    """The same sentence (prefill named first) whichever side checks."""
    raises(exc_type, message, prefill, decode, "prefill")
    raises(exc_type, message, decode, prefill, "decode")


def test_equal_layouts_pass_both_ways():
    a, b = tiny(), report_of(TINY.with_(full_tokens=2048, num_req_slots=9))
    compat.check_peer(a, b, "prefill")
    compat.check_peer(a, b, "decode")
    assert compat.compat_errors(a, b, "prefill") == []


# --- the peer's own target/draft pair: the five upstream checks on reported facts ---------------


@pytest.mark.parametrize("how", ["own", "clone", "view"])
def test_peer_draft_without_the_shared_mapping(how):
    peer = tiny(draft_mapping=how)
    for role in ("prefill", "decode"):
        raises(e.SWAIndexMappingNotShared, MAPPING_ERROR, tiny(), peer, role)
    # exactly what the peer raised locally
    assert (peer.local_check.error.type, peer.local_check.error.message) == ("SWAIndexMappingNotShared", MAPPING_ERROR)


def test_peer_draft_that_never_registered_a_mapping():
    # SGLang 0.5.19's pool has no attribute until a mapping is registered: its AttributeError
    peer = tiny(draft_mapping="none", upstream="0.5.19")
    err = raises(e.DraftMappingMissing, MISSING_MAPPING_ERROR, tiny(upstream="0.5.19"), peer, "prefill")
    assert isinstance(err, AttributeError) and isinstance(err, RuntimeError)
    assert (peer.local_check.error.type, peer.local_check.error.message) == (
        "DraftMappingMissing",
        MISSING_MAPPING_ERROR,
    )


def test_peer_draft_that_never_registered_a_mapping_on_0523_is_the_seed_error():
    # SGLang 0.5.23's pool holds None there, which is not the target's mapping
    peer = tiny(draft_mapping="none", upstream="0.5.23")
    raises(e.SWAIndexMappingNotShared, MAPPING_ERROR, tiny(), peer, "prefill")
    assert (peer.local_check.error.type, peer.local_check.error.message) == ("SWAIndexMappingNotShared", MAPPING_ERROR)


def test_peer_draft_with_compressed_layers():
    peer = report_with_compressed_draft()
    raises(e.DraftNotSWAOnly, SWA_ONLY_ERROR, tiny(), peer, "prefill")
    assert peer.local_check.error.message == SWA_ONLY_ERROR


def test_peer_draft_with_empty_ratios():
    r = tiny()
    peer = r.model_copy(update={"draft": r.draft.model_copy(update={"compression_ratios": ()})})
    raises(e.DraftNotSWAOnly, SWA_ONLY_ERROR, tiny(), peer, "prefill")


def test_peer_with_unified_mismatch_between_target_and_draft():
    peer = tiny(draft_unified_kv=True)
    raises(e.UnifiedKVModeMismatch, UNIFIED_ERROR, tiny(), peer, "prefill")


def test_peer_with_ring_geometry_mismatch():
    peer = tiny(unified_kv=True, draft_sliding_window=64)
    raises(
        e.SWARingGeometryMismatch,
        "DSV4 target and draft pools must share SWA ring geometry: target=(128, 131, 655), draft=(64, 67, 335)",
        tiny(unified_kv=True),
        peer,
        "prefill",
    )


def test_unified_branch_does_not_consult_the_mapping():
    # a unified pair with an unshared mapping but equal ring geometry is fine, as upstream
    peer = tiny(unified_kv=True, draft_mapping="clone")
    compat.check_peer(tiny(unified_kv=True), peer, "prefill")


PAGED = (e.PagedSWAGeometryMismatch, "DSV4 target and draft pools must share paged SWA geometry: ", "0.5.19")
SWA = (e.SWAGeometryMismatch, "DSV4 target and draft pools must share SWA geometry: ", "0.5.23")


@pytest.mark.parametrize(
    "check,ours,changes,tuples",
    [
        # in the peer's release's words: SGLang 0.5.19's paged check, whichever release we run
        (PAGED, "0.5.23", dict(draft_page_size=512), "target=(256, 128), draft=(512, 128)"),
        (PAGED, "0.5.23", dict(draft_sliding_window=64), "target=(256, 128), draft=(256, 64)"),
        # SGLang 0.5.23's check adds the request window (none here) to the tuple
        (SWA, "0.5.19", dict(draft_page_size=512), "target=(256, 128, None), draft=(512, 128, None)"),
        (SWA, "0.5.19", dict(draft_sliding_window=64), "target=(256, 128, None), draft=(256, 64, None)"),
    ],
)
def test_peer_with_swa_geometry_mismatch_in_its_release_words(check, ours, changes, tuples):
    error, message, theirs = check
    raises(error, message + tuples, tiny(upstream=ours), tiny(upstream=theirs, **changes), "decode")


def test_own_pair_checks_come_before_cross_side_checks():
    # the peer's broken pair wins over a page-size difference
    peer = tiny(draft_mapping="clone", page_size=128, swa_page_size=128)
    raises(e.SWAIndexMappingNotShared, MAPPING_ERROR, tiny(), peer, "prefill")


def test_our_own_pair_is_not_rechecked_by_check_peer():
    compat.check_peer(tiny(draft_mapping="clone"), tiny(), "prefill")


def test_draftless_peer_skips_the_pair_checks():
    compat.check_own_pair(tiny(draft_enabled=False))


# --- cross-side sentences ------------------------------------------------------------------------


PAGE = (
    "Page size mismatch: prefill server has page_size=256, but decode server has page_size=128. "
    "Both servers must use the same --page-size value."
)


def test_page_size_sentence_names_prefill_first_whichever_side_checks():
    p, d = tiny(), tiny(page_size=128, swa_page_size=128)
    raises_both(e.PageSizeMismatch, PAGE, p, d)


def test_kv_dtype_sentence():
    p, d = tiny(), tiny(kv_dtype="float8_e5m2")
    message = (
        "KV cache dtype mismatch: prefill server has kv_cache_dtype=float8_e4m3fn, but decode server has "
        "kv_cache_dtype=float8_e5m2. Both servers must use the same --kv-cache-dtype value."
    )
    raises_both(e.KVCacheDtypeMismatch, message, p, d)


def test_page_size_before_kv_dtype():
    p, d = tiny(), tiny(page_size=128, swa_page_size=128, kv_dtype="float8_e5m2")
    raises(e.PageSizeMismatch, PAGE, p, d, "prefill")


def layout_sentence(factor, p, d):
    return (
        f"DSV4 layout mismatch on {factor}: prefill server has {factor}={p!r}, but decode server has "
        f"{factor}={d!r}. Both servers must build the same state layout."
    )


def test_speculative_on_one_side_names_c4_ring():
    message = layout_sentence(
        "c4_ring", 16, 8
    )  # "... prefill server has c4_ring=16, but decode server has c4_ring=8. ..."
    raises_both(e.LayoutMismatch, message, tiny(), tiny(speculative_num_draft_tokens=None))


def test_unified_on_one_side_names_layout():
    raises(e.LayoutMismatch, layout_sentence("layout", "paged", "unified"), tiny(), tiny(unified_kv=True), "prefill")
    raises(e.LayoutMismatch, layout_sentence("layout", "unified", "paged"), tiny(), tiny(unified_kv=True), "decode")


def test_window_mismatch():
    raises(e.LayoutMismatch, layout_sentence("sliding_window", 128, 64), tiny(), tiny(sliding_window=64), "prefill")


def test_state_dtype_mismatch():
    raises(
        e.LayoutMismatch,
        layout_sentence("c4_state_dtype", "float32", "bfloat16"),
        tiny(),
        tiny(state_dtype="bfloat16"),
        "prefill",
    )


def test_draft_on_one_side_names_draft():
    p, d = tiny(), tiny(draft_enabled=False)
    err = raises(e.LayoutMismatch, layout_sentence("draft", p.factor("draft"), None), p, d, "prefill")
    assert "decode server has draft=None" in str(err)
    raises(e.LayoutMismatch, layout_sentence("draft", None, p.factor("draft")), d, p, "prefill")


def test_online_c128_names_c128_ring():
    raises(
        e.LayoutMismatch,
        layout_sentence("c128_ring", 256, 1),
        tiny(),
        tiny(online_c128=True, online_c128_mtp=True),
        "prefill",
    )


def test_layout_mismatch_is_a_runtime_error():
    assert issubclass(e.LayoutMismatch, RuntimeError)
    assert issubclass(e.PageSizeMismatch, e.CrossSideMismatch)


# --- compat_errors lists every reason ----------------------------------------------------------


def test_compat_errors_lists_all_in_order():
    ours = tiny(draft_mapping="own")
    theirs = tiny(
        draft_mapping="clone",
        page_size=128,
        swa_page_size=128,
        kv_dtype="float8_e5m2",
        speculative_num_draft_tokens=None,
    )
    errs = compat.compat_errors(ours, theirs, "decode")  # we are the decode; they are the prefill
    assert [x.type for x in errs[:4]] == [
        "SWAIndexMappingNotShared",  # theirs
        "SWAIndexMappingNotShared",  # ours
        "PageSizeMismatch",
        "KVCacheDtypeMismatch",
    ]
    assert errs[2].message == (
        "Page size mismatch: prefill server has page_size=128, but decode server has page_size=256. "
        "Both servers must use the same --page-size value."
    )
    layout_names = [x.message.split(":")[0].removeprefix("DSV4 layout mismatch on ") for x in errs[4:]]
    assert layout_names == ["c4_ring", "c128_ring", "draft", "main_kv_item_lens", "components"]
    assert all(x.type == "LayoutMismatch" for x in errs[4:])
    # the first one is what the handshake raises
    with pytest.raises(e.SWAIndexMappingNotShared):
        compat.check_peer(ours, theirs, "decode")


# --- descriptor sanity -------------------------------------------------------------------------


def test_check_ranges_refuses_implausible_ranges():
    compat.check_ranges("main KV", [4096], [8192], [4096])
    cases = [
        ([0], [10], [1], "main KV[0]: implausible range ptr=0x0 len=10 item_len=1"),
        ([4096], [0], [1], "main KV[0]: implausible range ptr=0x1000 len=0 item_len=1"),
        ([4096], [10], [0], "main KV[0]: implausible range ptr=0x1000 len=10 item_len=0"),
        ([4096], [10], [11], "main KV[0]: implausible range ptr=0x1000 len=10 item_len=11"),
        ([4096], [(1 << 44) + 1], [1], f"main KV[0]: implausible range ptr=0x1000 len={(1 << 44) + 1} item_len=1"),
        ([(1 << 64) - 16], [16], [1], "main KV[0]: implausible range ptr=0xfffffffffffffff0 len=16 item_len=1"),
        ([4096, 1], [1, 2], [1], "main KV: 2 pointers, 2 lengths, 1 item lengths"),
    ]
    for ptrs, lens, items, message in cases:
        with pytest.raises(e.DescriptorMismatch) as info:
            compat.check_ranges("main KV", ptrs, lens, items)
        assert str(info.value) == message


def test_check_no_overlap():
    compat.check_no_overlap([(0x1000, 0x100, "a"), (0x1100, 0x100, "b")])  # touching is fine
    with pytest.raises(e.DescriptorMismatch) as info:
        compat.check_no_overlap([(0x1100, 0x100, "b"), (0x1000, 0x101, "a")])
    assert str(info.value) == "registered ranges overlap: a [0x1000, +257) and b [0x1100, +256)"


# --- what SGLang 0.5.23 compares beyond the state layout, in its own words ---------------------


def with_factors(report: LayoutReport, **extra) -> LayoutReport:
    """``report`` carrying the optional factors ``extra`` (fingerprint recomputed)."""
    factors = tuple(report.factors) + tuple(extra.items())
    return report.model_copy(
        update={"factors": factors, "fingerprint": fingerprint(report.page_size, report.kv_dtype, factors)}
    )


def test_optional_factors_at_their_default_are_left_out_of_the_report_and_its_fingerprint():
    r = tiny()
    assert [n for n, _ in r.factors] == list(FACTOR_NAMES)
    assert r.factor("kv_layout") is None and r.kv_layout() == "v4,c4:v4,c128:v4"
    assert r.factor("allocation_policy") is None and r.allocation_policy() == "early"
    assert build_report(*_tiny_pools(), allocation_policy="early")[0].fingerprint == r.fingerprint
    policy = build_report(*_tiny_pools(), allocation_policy="prefill_complete")[0]
    assert policy.factor("allocation_policy") == "prefill_complete" and policy.fingerprint != r.fingerprint


def _tiny_pools():
    pools = build_worker_pools(TINY)
    keep(pools)
    return pools.target, pools.draft


def test_kv_layouts_that_differ_are_refused_with_sglangs_sentence_on_both_sides():
    v41 = with_factors(tiny(), kv_layout="v41,c4:v41,c128:v4")
    message = (
        "KV layout mismatch: prefill server has kv_layout=v4,c4:v4,c128:v4, but decode server has "
        "kv_layout=v41,c4:v41,c128:v4. Both servers must use the same --dsv4-attn-backend and SGLANG_DSV4_KV_LAYOUT."
    )
    raises(e.KVLayoutMismatch, message, tiny(), v41, "prefill")
    raises(e.KVLayoutMismatch, message, v41, tiny(), "decode")
    assert compat.compat_errors(tiny(), v41, "prefill")[0].message == message


def test_one_pool_against_the_fp8_two_pool_is_refused_with_sglangs_sentence():
    two = with_factors(tiny(), kv_fp8_two_pool=True)
    message = (  # [0, 4, 128]: one C4 and one C128 layer
        "PD peers disagree on the compressed-MLA KV layout: prefill registered 5 regions, decode 3 "
        "(3 is one pool per layer, 5 is the fp8 two-pool). SGLANG_DSV4_UNIFIED_KV_FP8 must be set the same on both sides."
    )
    err = raises(e.CompressedMLAPoolMismatch, message, two, tiny(), "prefill")
    assert isinstance(err, ValueError) and isinstance(err, e.CrossSideMismatch)


def test_dspark_layouts_name_the_fields_that_differ():
    a = with_factors(tiny(), dspark={"num_draft_tokens": 4, "compression_ratios": [0, 2]})
    b = with_factors(tiny(), dspark={"num_draft_tokens": 8, "compression_ratios": [0, 2]})
    raises(
        e.DSparkLayoutMismatch,
        "DeepSeek-V4.1 DSpark PD layout mismatch (num_draft_tokens): both servers must enable DSpark with the same "
        "block size and target/draft KV layout. Upgrade both servers together.",
        a,
        b,
        "prefill",
    )
    raises(
        e.DSparkLayoutMismatch,
        "DeepSeek-V4.1 DSpark PD layout mismatch (compression_ratios, num_draft_tokens): both servers must enable "
        "DSpark with the same block size and target/draft KV layout. Upgrade both servers together.",
        a,
        tiny(),
        "prefill",
    )


def test_allocation_policies_that_differ_are_refused_with_sglangs_sentence():
    complete = with_factors(tiny(), allocation_policy="prefill_complete")
    raises(
        e.AllocationPolicyMismatch,
        "Disaggregation decode allocation policy mismatch: prefill=early, decode=prefill_complete. "
        "Set --disaggregation-decode-allocation-policy identically on both roles.",
        tiny(),
        complete,
        "prefill",
    )
    compat.check_peer(complete, complete, "decode")


def test_sglangs_sentences_come_before_the_state_factors_they_explain():
    v41 = with_factors(report_of(TINY.with_(sliding_window=256)), kv_layout="v41,c4:v41,c128:v4")
    errors = compat.compat_errors(tiny(), v41, "prefill")
    assert [x.type for x in errors][:2] == ["KVLayoutMismatch", "LayoutMismatch"]
