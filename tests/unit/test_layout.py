"""Layout reports on real pools: the fingerprint, ``diff``, and what a report says about its pair."""

from __future__ import annotations

import json

import msgpack
import pytest

from pdstate.pools.dsv4 import DeepSeekV4TokenToKVPool
from pdstate.pools.presets import pool_kwargs
from pdstate.pools.reporting import build_report
from pdstate.protocol import report as layout
from pdstate.protocol.report import FACTOR_NAMES, LayoutReport, diff, fingerprint
from tests.support.paths import REPO
from tests.support.pools import TINY, TINY_DRAFT_FACTOR, keep, kept_pools, tiny
from tests.support.upstream import MAPPING_ERROR, MISSING_MAPPING_ERROR, UNIFIED_ERROR


def report_with_target_kwargs(**kw) -> LayoutReport:
    """A draftless report of a target built with upstream keywords changed (what presets cannot)."""
    target = DeepSeekV4TokenToKVPool(**{**pool_kwargs(TINY), **kw})
    keep(target)
    return build_report(target, None)[0]


def test_factor_names_are_the_protocol_order():
    # the normative vector (proto/vectors, exported from the codec) names them in this order too
    vector = json.loads((REPO / "proto" / "vectors" / "register.json").read_text())
    assert FACTOR_NAMES == tuple(name for name, _ in vector["body"]["report"]["factors"])
    assert FACTOR_NAMES[0] == "layout" and FACTOR_NAMES[-1] == "components" and len(FACTOR_NAMES) == 12


def test_tiny_report_values():
    r = tiny()
    assert (r.page_size, r.kv_dtype) == (256, "float8_e4m3fn")
    assert [n for n, _ in r.factors] == list(FACTOR_NAMES)
    assert r.factor("layout") == "paged"
    assert r.factor("compression_ratios") == [0, 4, 128]
    assert r.factor("stage") == [0, 3]
    assert (r.factor("c4_ring"), r.factor("c128_ring")) == (16, 256)
    assert r.factor("main_kv_item_lens") == [37440, 8448, 1728]
    assert r.factor("components") == [
        ["swa", 5, [149760, 149760, 149760, 131072, 32768]],
        ["c128_state", 1, [524288]],
        ["swa", 1, [149760]],
    ]
    assert r.factor("draft") == TINY_DRAFT_FACTOR
    assert r.local_check.ok and r.local_check.error is None
    assert r.target.mapping_identity is not None
    assert r.target.mapping_identity == r.draft.mapping_identity  # shared tensor


# --- fingerprint -------------------------------------------------------------------------------


def test_fingerprint_stable_for_equal_layouts_built_twice():
    a = build_report(*_pair(TINY))[0]
    b = build_report(*_pair(TINY))[0]
    assert a.target.mapping_identity != b.target.mapping_identity  # other process state ...
    assert a.fingerprint == b.fingerprint  # ... same layout
    assert diff(a, b) == []


def _pair(settings):
    pools = kept_pools(settings)
    return pools.target, pools.draft


def test_fingerprint_ignores_pool_sizes_and_slots():
    base = tiny()
    for changes in (
        dict(full_tokens=2048),
        dict(swa_tokens=1024),
        dict(max_num_reqs=8),
        dict(num_req_slots=12),
        dict(draft_mapping="clone"),  # the pair is broken, but the layout is the same
    ):
        other = tiny(**changes)
        assert other.fingerprint == base.fingerprint, changes
        assert diff(base, other) == [], changes


def test_fingerprint_is_the_digest_of_the_named_factors():
    r = tiny()
    payload = msgpack.packb(
        [["page_size", 256], ["kv_dtype", "float8_e4m3fn"]] + [[n, layout._canon(v)] for n, v in r.factors],
        use_bin_type=True,
    )
    import hashlib

    assert r.fingerprint == hashlib.blake2b(payload, digest_size=16).hexdigest()
    assert fingerprint(r.page_size, r.kv_dtype, r.factors) == r.fingerprint


def test_fingerprint_survives_a_wire_round_trip():
    r = tiny()
    back = LayoutReport.model_validate(msgpack.unpackb(msgpack.packb(layout._canon(r.model_dump()), use_bin_type=True)))
    assert fingerprint(back.page_size, back.kv_dtype, back.factors) == r.fingerprint
    assert diff(r, back) == []


# settings change -> (first differing name, every differing name)
VARIANTS = {
    "page_size": (dict(page_size=128, swa_page_size=128), ["page_size", "draft", "main_kv_item_lens", "components"]),
    "kv_dtype": (dict(kv_dtype="float8_e5m2"), ["kv_dtype"]),
    # 0.5.23 unified: the C4 states are indexed by request slot, so ``c4_ring`` says so
    "layout": (dict(unified_kv=True), ["layout", "c4_ring", "draft", "main_kv_item_lens", "components"]),
    "compression_ratios": (
        dict(compression_ratios=(0, 4, 4)),
        ["compression_ratios", "c128_ring", "c128_state_dtype", "main_kv_item_lens", "components"],
    ),
    "sliding_window": (dict(sliding_window=64), ["sliding_window", "draft"]),
    "c4_ring": (dict(speculative_num_draft_tokens=None), ["c4_ring", "c128_ring", "components"]),
    "c128_ring": (dict(online_c128=True, online_c128_mtp=True), ["c128_ring", "online_c128", "components"]),
    "c4_state_dtype": (dict(state_dtype="bfloat16"), ["c4_state_dtype", "c128_state_dtype", "components"]),
    "draft": (dict(draft_enabled=False), ["draft", "components"]),
    "draft_layers": (dict(draft_layers=2), ["draft", "components"]),
    "main_kv_item_lens": (dict(indexer_head_dim=64), ["main_kv_item_lens", "components"]),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_each_differing_factor_changes_the_fingerprint_and_is_named(name):
    changes, names = VARIANTS[name]
    base, other = tiny(), tiny(**changes)
    assert other.fingerprint != base.fingerprint
    d = diff(base, other)
    assert [n for n, _, _ in d] == names
    for n, ours, theirs in d:
        expected_ours = getattr(base, n) if n in ("page_size", "kv_dtype") else base.factor(n)
        expected_theirs = getattr(other, n) if n in ("page_size", "kv_dtype") else other.factor(n)
        assert (ours, theirs) == (expected_ours, expected_theirs)


def test_diff_is_in_protocol_order_and_names_both_values():
    d = diff(tiny(), tiny(speculative_num_draft_tokens=None))
    assert d[0] == ("c4_ring", 16, 8)
    assert d[1] == ("c128_ring", 256, 128)
    assert diff(tiny(), tiny(kv_dtype="float8_e5m2")) == [("kv_dtype", "float8_e4m3fn", "float8_e5m2")]
    assert diff(tiny(), tiny(page_size=128, swa_page_size=128))[0] == ("page_size", 256, 128)


def test_stage_alone_differs():
    a = tiny(compression_ratios=(4, 128, 4, 128), layer_num=2)
    b = tiny(compression_ratios=(4, 128, 4, 128), layer_num=2, start_layer=2)
    assert a.factor("compression_ratios") == b.factor("compression_ratios") == [4, 128]
    assert diff(a, b) == [("stage", [0, 2], [2, 4])]
    assert a.fingerprint != b.fingerprint


def test_c128_state_dtype_alone_differs():
    a = report_with_target_kwargs()
    b = report_with_target_kwargs(c128_state_dtype="bfloat16")
    assert [n for n, _, _ in diff(a, b)] == ["c128_state_dtype", "components"]
    assert diff(a, b)[0] == ("c128_state_dtype", "float32", "bfloat16")
    assert a.fingerprint != b.fingerprint


def test_components_alone_differ():
    r = tiny()
    factors = tuple((n, [["swa", 5, [1, 2, 3, 4, 5]]] if n == "components" else v) for n, v in r.factors)
    other = r.model_copy(update={"factors": factors, "fingerprint": fingerprint(r.page_size, r.kv_dtype, factors)})
    assert [n for n, _, _ in diff(r, other)] == ["components"]
    assert other.fingerprint != r.fingerprint


def test_a_missing_factor_is_a_difference():
    r = tiny()
    short = r.model_copy(update={"factors": tuple(f for f in r.factors if f[0] != "online_c128")})
    assert diff(r, short) == [("online_c128", False, None)]


# --- what a report says about its own pair --------------------------------------------------


@pytest.mark.parametrize(
    "changes,error_type,message",
    [
        (
            dict(draft_mapping="own"),
            "SWAIndexMappingNotShared",
            MAPPING_ERROR,
        ),
        (
            dict(draft_mapping="clone"),
            "SWAIndexMappingNotShared",
            MAPPING_ERROR,
        ),
        (
            dict(draft_mapping="view"),
            "SWAIndexMappingNotShared",
            MAPPING_ERROR,
        ),
        (
            dict(draft_mapping="none", upstream="0.5.19"),
            "DraftMappingMissing",
            MISSING_MAPPING_ERROR,
        ),
        (
            dict(draft_mapping="none"),  # 0.5.23 holds None: not the target's mapping
            "SWAIndexMappingNotShared",
            MAPPING_ERROR,
        ),
        (
            dict(draft_unified_kv=True),
            "UnifiedKVModeMismatch",
            UNIFIED_ERROR,
        ),
        (
            dict(unified_kv=True, draft_sliding_window=64),
            "SWARingGeometryMismatch",
            "DSV4 target and draft pools must share SWA ring geometry: target=(128, 131, 655), draft=(64, 67, 335)",
        ),
        (
            dict(draft_page_size=512, upstream="0.5.19"),
            "PagedSWAGeometryMismatch",
            "DSV4 target and draft pools must share paged SWA geometry: target=(256, 128), draft=(512, 128)",
        ),
        (
            dict(draft_page_size=512),
            "SWAGeometryMismatch",
            "DSV4 target and draft pools must share SWA geometry: target=(256, 128, None), draft=(512, 128, None)",
        ),
    ],
)
def test_local_check_records_the_upstream_refusal(changes, error_type, message):
    r = tiny(**changes)
    assert not r.local_check.ok
    assert (r.local_check.error.type, r.local_check.error.message) == (error_type, message)


def test_mapping_identities_tell_shared_from_copies():
    shared = tiny()
    assert shared.target.mapping_identity == shared.draft.mapping_identity
    for how in ("own", "clone", "view"):
        r = tiny(draft_mapping=how)
        assert r.target.mapping_identity != r.draft.mapping_identity, how
    view = tiny(draft_mapping="view")
    assert view.target.mapping_identity.data_ptr == view.draft.mapping_identity.data_ptr  # same storage
    assert view.target.mapping_identity.nonce != view.draft.mapping_identity.nonce  # another object
    assert tiny(draft_mapping="none").draft.mapping_identity is None


def test_to_facts_round_trip():
    r = tiny(unified_kv=True)
    facts = r.target.to_facts()
    assert facts.ring_geometry == (128, 131, 655)
    assert layout.PoolFactsModel.of(facts) == r.target


# --- across SGLang releases (a rolling upgrade: 0.5.19 prefill, 0.5.23 decode) --------------------


@pytest.mark.parametrize(
    "changes",
    [
        {},
        dict(speculative_num_draft_tokens=None),
        dict(online_c128=True, online_c128_mtp=True),
        dict(draft_enabled=False),
        dict(unified_kv=True, compression_ratios=(0, 128, 128)),  # no C4 layer: nothing indexed otherwise
    ],
)
def test_same_state_layout_same_fingerprint_across_releases(changes):
    """Capacities (rows, data lengths) differ between the releases; the fingerprint does not."""
    a, b = tiny(upstream="0.5.19", **changes), tiny(upstream="0.5.23", **changes)
    assert diff(a, b) == [] and a.fingerprint == b.fingerprint


def test_unified_c4_state_indexing_differs_across_releases():
    """Unified 0.5.19 indexes the C4 state items by SWA page, 0.5.23 by request slot: the same item
    lengths, other items; the ``c4_ring`` factor names the difference."""
    a, b = tiny(upstream="0.5.19", unified_kv=True), tiny(upstream="0.5.23", unified_kv=True)
    assert a.fingerprint != b.fingerprint
    assert diff(a, b) == [("c4_ring", 16, {"ring": 16, "items": "request"})]


def test_no_state_dtype_factor_for_a_ratio_the_model_lacks():
    r = tiny(compression_ratios=(0, 4, 4))
    assert r.factor("c4_state_dtype") == "float32" and r.factor("c128_state_dtype") is None
