"""``build_report``: a side's ``LayoutReport`` read from its live target (and draft) pools."""

from __future__ import annotations

from pdstate.pools.dsv4 import DeepSeekV4TokenToKVPool, dtype_name
from pdstate.pools.kvargs import KVArgs, fill_kv_args, pool_facts, state_components
from pdstate.protocol.report import (
    FACTOR_NAMES,
    ErrorInfo,
    LayoutReport,
    LocalCheck,
    PoolFactsModel,
    fingerprint,
)


def _components(target: DeepSeekV4TokenToKVPool, draft: DeepSeekV4TokenToKVPool | None) -> list:
    """``[state_type, n_buffers, item_lens]`` per component, described without the pair checks."""
    return [[st.value, len(ptrs), list(items)] for st, (ptrs, _, items) in state_components(target, draft, check=False)]


def draft_descriptor(draft: DeepSeekV4TokenToKVPool | None) -> dict | None:
    if draft is None:
        return None
    return {
        "layers": len(draft.stage_ratios),
        "layout": "unified" if draft._unified_kv else "paged",
        "page_size": draft.page_size,
        "swa_page_size": draft.swa_page_size,
        "sliding_window": draft.sliding_window,
        "ring_size": draft.unified_swa_ring_size if draft._unified_kv else None,
    }


def build_report(
    target: DeepSeekV4TokenToKVPool,
    draft: DeepSeekV4TokenToKVPool | None,
    kv_args: KVArgs | None = None,
) -> tuple[LayoutReport, KVArgs | None]:
    """Report a side's layout. Runs ``setup_state_kv_args`` and records its outcome.

    Returns the report and the filled ``KVArgs`` (``None`` when the local check failed).
    """
    error: BaseException | None = None
    if kv_args is None:
        try:
            kv_args = fill_kv_args(target, draft)
        except RuntimeError as exc:  # the upstream refusals (AttributeError subclass included)
            error = exc
            kv_args = None
    factors = (
        ("layout", "unified" if target._unified_kv else "paged"),
        ("compression_ratios", list(target.stage_ratios)),
        ("stage", [target._stage_start, target._stage_end]),
        ("sliding_window", target.sliding_window),
        ("c4_ring", target.c4_ring_size),
        ("c128_ring", target.c128_ring_size),
        ("online_c128", target.online_c128),
        ("c4_state_dtype", dtype_name(target.c4_state_dtype)),
        ("c128_state_dtype", dtype_name(target.c128_state_dtype)),
        ("draft", draft_descriptor(draft)),
        ("main_kv_item_lens", list(target.get_contiguous_buf_infos()[2])),
        ("components", _components(target, draft)),
    )
    assert tuple(n for n, _ in factors) == FACTOR_NAMES
    kv_dtype = dtype_name(target.dtype)
    report = LayoutReport(
        page_size=target.page_size,
        kv_dtype=kv_dtype,
        factors=factors,
        fingerprint=fingerprint(target.page_size, kv_dtype, factors),
        target=PoolFactsModel.of(pool_facts(target)),
        draft=None if draft is None else PoolFactsModel.of(pool_facts(draft)),
        local_check=LocalCheck(ok=error is None, error=None if error is None else ErrorInfo.of(error)),
    )
    return report, kv_args
