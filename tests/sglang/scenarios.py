"""The scenarios the harness builds twice, as real SGLang pools and as pdstate's pools.

Pure data (no torch, no SGLang): the parent test process and the child (``probe.py``) share it.
Each scenario names the constructor arguments of the target and the draft, the unified-KV mode,
whether the server is speculative, and how the draft gets its ``full_to_swa_index_mapping``:
``shared`` (upstream's wiring: the target allocator's tensor), ``own`` (an allocator of its own),
``clone``, ``view`` (``mapping[:]``), ``missing`` (none registered) or ``none`` (no draft).
``expect`` is ``"ok"`` or the pdstate error class both implementations must agree on, as SGLang
0.5.19 words it; ``expected`` gives it for another release (``EXPECT_BY_POOLS``).
"""

from __future__ import annotations

from copy import deepcopy

from tests.support.pools import SGLANG_KWARGS

SEED = "DSV4 target and draft pools must share the SWA index mapping"

# What a refusal is on pools that word it otherwise than 0.5.19's (by 0.5.19's class), by the
# release's pool rules (its row's ``pools``): 0.5.23's say "must share SWA geometry" with a
# three-element tuple, and a draft with no mapping at all gets the seed error (a RuntimeError)
# instead of a bare AttributeError.
EXPECT_BY_POOLS = {
    "0.5.23": {"PagedSWAGeometryMismatch": "SWAGeometryMismatch", "DraftMappingMissing": "SWAIndexMappingNotShared"},
}


def expected(s: dict, release: str) -> str:
    """``s["expect"]`` on ``release``."""
    from pdstate.integrations.sglang import releases

    return EXPECT_BY_POOLS.get(releases.row(release).pools, {}).get(s["expect"], s["expect"])


# Upstream's constructor keywords (dtypes by name), the conformance defaults.
UPSTREAM_TINY = SGLANG_KWARGS
NEXTN = dict(c4_size=0, c128_size=0, c4_state_pool_size=0, c128_state_pool_size=0, layer_num=1, compression_ratios=[0])
FLASH_43 = [0, 0] + [4, 128] * 20 + [4]  # DeepSeek-V4-Flash's 43 layers (2 SWA-only, 21 C4, 20 C128)


def scenario(
    name: str,
    *,
    speculative: bool = True,
    unified: bool = False,
    draft: str = "shared",
    pool: dict | None = None,
    draft_pool: dict | None = None,
    draft_unified: bool | None = None,
    expect: str = "ok",
) -> dict:
    p = deepcopy(UPSTREAM_TINY)
    p.update(pool or {})
    if not speculative:
        p["online_mtp_max_draft_tokens"] = 0
    d = deepcopy(NEXTN)
    d.update(draft_pool or {})
    return dict(
        name=name,
        speculative=speculative,
        draft_tokens=4,
        unified=unified,
        draft_unified=unified if draft_unified is None else draft_unified,
        draft=draft,
        pool=p,
        draft_pool=d,
        allocator=dict(size_full=1024, size_swa=512),
        expect=expect,
    )


FLASH = dict(
    compression_ratios=FLASH_43,
    layer_num=43,
    c4_state_pool_size=64,
    c128_state_pool_size=5 * 256,
)

# Offline C128 (SGLang's default process).
OFFLINE = [
    scenario("paged_spec_draft"),
    scenario("paged_spec_nodraft", draft="none"),
    scenario("paged_nospec_draft", speculative=False),
    scenario("paged_nospec_nodraft", speculative=False, draft="none"),
    scenario("unified_spec_draft", unified=True),
    scenario("unified_spec_nodraft", unified=True, draft="none"),
    scenario("unified_nospec_nodraft", unified=True, speculative=False, draft="none"),
    scenario("paged_two_layer_draft", draft_pool=dict(layer_num=2, compression_ratios=[0, 0])),
    scenario("paged_no_c128_layer", pool=dict(compression_ratios=[0, 4], layer_num=2)),
    scenario("flash_paged_draft", pool=FLASH),
    scenario("flash_unified_draft", unified=True, pool=FLASH),
    # a draft with its own mapping: the seed error (paged); unified mode never looks at it
    scenario("paged_draft_own_mapping", draft="own", expect="SWAIndexMappingNotShared"),
    scenario("paged_draft_clone_mapping", draft="clone", expect="SWAIndexMappingNotShared"),
    scenario("paged_draft_view_mapping", draft="view", expect="SWAIndexMappingNotShared"),
    scenario("flash_paged_draft_own_mapping", draft="own", pool=FLASH, expect="SWAIndexMappingNotShared"),
    scenario("unified_draft_own_mapping", unified=True, draft="own"),
    scenario("paged_draft_missing_mapping", draft="missing", expect="DraftMappingMissing"),
    # the other upstream refusals, same text from both implementations
    scenario("paged_draft_window", draft_pool=dict(sliding_window=64), expect="PagedSWAGeometryMismatch"),
    scenario("paged_draft_page", draft_pool=dict(page_size=512), expect="PagedSWAGeometryMismatch"),
    scenario(
        "unified_draft_window", unified=True, draft_pool=dict(sliding_window=64), expect="SWARingGeometryMismatch"
    ),
    scenario(
        "draft_not_swa_only",
        draft_pool=dict(compression_ratios=[0, 4], layer_num=2, c4_size=256, c4_state_pool_size=64),
        expect="DraftNotSWAOnly",
    ),
    scenario("paged_target_unified_draft", draft_unified=True, expect="UnifiedKVModeMismatch"),
]

# Known divergences of pdstate's own pool from SGLang 0.5.19's (``test_stage_rule``): the stage.
STAGE = [
    # start/end given: SGLang's DSV4 pool takes [start_layer, end_layer)
    scenario(
        "pp_stage_1_3",
        pool=dict(compression_ratios=[0, 4, 128, 4, 128], layer_num=2, start_layer=1, end_layer=3),
        draft="none",
    ),
    # start/end absent: SGLang's stage is the whole ratio list, whatever layer_num says (the
    # dsv4-flash preset's 44-entry list with its MTP placeholder, layer_num 43)
    scenario("ratio_list_longer_than_layer_num", pool=dict(compression_ratios=FLASH_43 + [0]), draft="none"),
]

ONLINE = [  # SGLANG_OPT_USE_ONLINE_COMPRESS=1: online C128 refuses speculation without the MTP option
    scenario("online_paged_nospec_draft", speculative=False),
    scenario("online_paged_nospec_nodraft", speculative=False, draft="none"),
    scenario("online_unified_nospec_nodraft", unified=True, speculative=False, draft="none"),
]

ONLINE_MTP = [  # ... plus SGLANG_EXPERIMENTAL_ONLINE_C128_MTP=1
    scenario("online_mtp_paged_spec_draft"),
    scenario("online_mtp_unified_spec_draft", unified=True),
    scenario("online_mtp_paged_draft_own_mapping", draft="own", expect="SWAIndexMappingNotShared"),
]

# One child process per variant: SGLang reads the online-C128 switches once, at import.
VARIANTS: dict[str, tuple[dict[str, str], list[dict]]] = {
    "offline": ({}, OFFLINE + STAGE),
    "online": ({"SGLANG_OPT_USE_ONLINE_COMPRESS": "1"}, ONLINE),
    "online_mtp": (
        {"SGLANG_OPT_USE_ONLINE_COMPRESS": "1", "SGLANG_EXPERIMENTAL_ONLINE_C128_MTP": "1"},
        ONLINE_MTP,
    ),
}
