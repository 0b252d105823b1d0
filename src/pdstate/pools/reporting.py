"""``build_report``: a side's ``LayoutReport`` read from its live target (and draft) pools.

The pools are read through ``pdstate.pools.interface.PoolView``: pdstate's own pools and SGLang's
real ``DeepSeekV4TokenToKVPool`` objects built from the same constructor arguments give the same
factors, hence the same fingerprint.
"""

from __future__ import annotations

from pdstate.pools.dsv4 import dtype_name
from pdstate.pools.interface import PoolView, is_dsv4_pool, pool_view
from pdstate.pools.kvargs import KVArgs, fill_kv_args, state_components
from pdstate.protocol.report import (
    DEFAULT_ALLOCATION_POLICY,
    FACTOR_NAMES,
    ErrorInfo,
    LayoutReport,
    LocalCheck,
    PoolFactsModel,
    default_kv_layout,
    fingerprint,
)


def _components(target: object, draft: object | None) -> list:
    """``[state_type, n_buffers, item_lens]`` per component, described without the pair checks."""
    return [[st.value, len(ptrs), list(items)] for st, (ptrs, _, items) in state_components(target, draft, check=False)]


def c4_ring_factor(t: PoolView) -> int | dict:
    """The C4 compress-state ring and, where it is not the SWA page, how its items are indexed.

    0.5.19 (both modes) and paged 0.5.23 index the SWA component's C4 state items by the window's
    SWA pages: the factor is the ring size alone, as it always was. Unified 0.5.23 keeps one ring
    per request slot and indexes those items by ``req_pool_idx``: the same item lengths, other
    items, so the factor says so (a 0.5.19 and a 0.5.23 unified pool then differ here, and only
    where the stage has C4 layers). The release itself is not a factor."""
    if t.c4_state_addressing == "swa_page" or 4 not in t.stage_ratios:
        return t.c4_ring_size
    return {"ring": t.c4_ring_size, "items": t.c4_state_addressing}


def _state_dtype_factor(t: PoolView, ratio: int) -> str | None:
    """A compress-state dtype, ``None`` when the model has no layer of ``ratio`` (SGLang 0.5.23
    keeps no state dtype for such a ratio)."""
    if ratio not in t.compression_ratios:
        return None
    return dtype_name(getattr(t, f"c{ratio}_state_dtype"))


def draft_descriptor(draft: object | None) -> dict | None:
    """The draft factor; ``None`` without a DSV4 draft (upstream skips any other draft)."""
    if draft is None or not is_dsv4_pool(draft):
        return None
    d = pool_view(draft)
    return {
        "layers": len(d.stage_ratios),
        "layout": "unified" if d.unified_kv else "paged",
        "page_size": d.page_size,
        "swa_page_size": d.swa_page_size,
        "sliding_window": d.sliding_window,
        "ring_size": d.unified_swa_ring_size,
    }


def upstream_factors(
    target: object, *, dspark: dict | None = None, allocation_policy: str = DEFAULT_ALLOCATION_POLICY
) -> tuple[tuple[str, object], ...]:
    """The optional factors (``report.OPTIONAL_FACTOR_NAMES``) that are not at their default.

    ``kv_layout`` and ``kv_fp8_two_pool`` are read from the pool (SGLang 0.5.23's ``pd_kv_layout()``
    and ``_unified_kv_fp8``; pdstate's pools and 0.5.19's have the default V4 layout, one pool per
    layer); ``dspark`` and ``allocation_policy`` are the server's (the SGLang backend passes them)."""
    out: list[tuple[str, object]] = []
    layout = target.pd_kv_layout() if callable(getattr(target, "pd_kv_layout", None)) else None
    if layout is not None and layout != default_kv_layout(pool_view(target).compression_ratios):
        out.append(("kv_layout", str(layout)))
    if getattr(target, "_unified_kv_fp8", False):
        out.append(("kv_fp8_two_pool", True))
    if dspark:
        out.append(("dspark", dict(dspark)))
    if allocation_policy != DEFAULT_ALLOCATION_POLICY:
        out.append(("allocation_policy", allocation_policy))
    return tuple(out)


def build_report(
    target: object,
    draft: object | None,
    kv_args: KVArgs | None = None,
    *,
    dspark: dict | None = None,
    allocation_policy: str = DEFAULT_ALLOCATION_POLICY,
) -> tuple[LayoutReport, KVArgs | None]:
    """Report a side's layout. Runs ``setup_state_kv_args`` and records its outcome.

    ``target`` is a DSV4 pool (pdstate's or SGLang's; anything else is a ``TypeError``); a draft
    that is not a DSV4 pool is reported as no draft, as upstream skips it. ``dspark`` (0.5.23's
    DSpark transfer layout) and ``allocation_policy`` are the server's settings SGLang 0.5.23
    compares across the pair (``upstream_factors``). Returns the report and the filled ``KVArgs``
    (``None`` when the local check failed).
    """
    t = pool_view(target)
    error: BaseException | None = None
    if kv_args is None:
        try:
            kv_args = fill_kv_args(target, draft)
        except RuntimeError as exc:  # the upstream refusals (AttributeError subclass included)
            error = exc
            kv_args = None
    start, end = t.stage
    factors = (
        ("layout", "unified" if t.unified_kv else "paged"),
        ("compression_ratios", t.stage_ratios),
        ("stage", [start, end]),
        ("sliding_window", t.sliding_window),
        ("c4_ring", c4_ring_factor(t)),
        ("c128_ring", t.c128_ring_size),
        ("online_c128", t.online_c128),
        ("c4_state_dtype", _state_dtype_factor(t, 4)),
        ("c128_state_dtype", _state_dtype_factor(t, 128)),
        ("draft", draft_descriptor(draft)),
        ("main_kv_item_lens", list(t.contiguous_buf_infos()[2])),
        ("components", _components(target, draft)),
    )
    assert tuple(n for n, _ in factors) == FACTOR_NAMES
    factors += upstream_factors(target, dspark=dspark, allocation_policy=allocation_policy)
    kv_dtype = dtype_name(t.dtype)
    report = LayoutReport(
        page_size=t.page_size,
        kv_dtype=kv_dtype,
        factors=factors,
        fingerprint=fingerprint(t.page_size, kv_dtype, factors),
        target=PoolFactsModel.of(t.facts()),
        draft=PoolFactsModel.of(pool_view(draft).facts()) if draft is not None and is_dsv4_pool(draft) else None,
        local_check=LocalCheck(ok=error is None, error=None if error is None else ErrorInfo.of(error)),
    )
    return report, kv_args
