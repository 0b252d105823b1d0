"""``build_report``: a side's ``LayoutReport`` read from its live target (and draft) pools.

The pools are read through ``pdstate.pools.interface.PoolView``: pdstate's own pools and SGLang's
real ``DeepSeekV4TokenToKVPool`` objects built from the same constructor arguments give the same
factors, hence the same fingerprint.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from pdstate.pools.dsv4 import dtype_name
from pdstate.pools.interface import PoolView, is_dsv4_pool, pool_view
from pdstate.pools.kvargs import KVArgs, fill_kv_args, state_components
from pdstate.protocol import factors as registry
from pdstate.protocol.factors import DEFAULT_ALLOCATION_POLICY, default_kv_layout
from pdstate.protocol.report import ErrorInfo, LayoutReport, LocalCheck, PoolFactsModel, fingerprint


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


def _kv_layout(t: PoolView, target: object, _draft: object | None) -> str | None:
    """SGLang 0.5.23's ``pd_kv_layout()`` where not the default V4 one (pdstate's pools and
    0.5.19's have the default)."""
    layout = target.pd_kv_layout() if callable(getattr(target, "pd_kv_layout", None)) else None
    if layout is None or layout == default_kv_layout(t.compression_ratios):
        return None
    return str(layout)


# How each factor read from live pools is read, by name (``pdstate.protocol.factors``): from the
# target's ``PoolView``, the target pool itself and the draft. A factor not here is a server setting
# (``build_report``'s ``settings``). An optional factor's reader gives ``None`` at its default.
Reader = Callable[[PoolView, object, object | None], object]
READERS: dict[str, Reader] = {
    "layout": lambda t, _target, _draft: "unified" if t.unified_kv else "paged",
    "compression_ratios": lambda t, _target, _draft: t.stage_ratios,
    "stage": lambda t, _target, _draft: list(t.stage),
    "sliding_window": lambda t, _target, _draft: t.sliding_window,
    "c4_ring": lambda t, _target, _draft: c4_ring_factor(t),
    "c128_ring": lambda t, _target, _draft: t.c128_ring_size,
    "online_c128": lambda t, _target, _draft: t.online_c128,
    "c4_state_dtype": lambda t, _target, _draft: _state_dtype_factor(t, 4),
    "c128_state_dtype": lambda t, _target, _draft: _state_dtype_factor(t, 128),
    "draft": lambda _t, _target, draft: draft_descriptor(draft),
    "main_kv_item_lens": lambda t, _target, _draft: list(t.contiguous_buf_infos()[2]),
    "components": lambda _t, target, draft: _components(target, draft),
    "kv_layout": _kv_layout,
    # SGLang 0.5.23's ``_unified_kv_fp8`` (upstream's own attribute of its pool)
    "kv_fp8_two_pool": lambda _t, target, _draft: True if getattr(target, "_unified_kv_fp8", False) else None,
}


def _carried(entry: registry.Factor, value: object) -> bool:
    """Whether a report carries an optional factor's value: not at its default."""
    return value is not None and (callable(entry.default) or value != entry.default)


def upstream_factors(
    target: object, draft: object | None = None, settings: Mapping[str, object] | None = None
) -> tuple[tuple[str, object], ...]:
    """The optional factors (``registry.names("optional")``) that are not at their default, in
    protocol order: each one's server setting where ``settings`` names it (the SGLang backend passes
    0.5.23's DSpark layout and allocation policy), else its reader (``READERS``)."""
    settings = settings or {}
    t = pool_view(target)
    out: list[tuple[str, object]] = []
    for entry in registry.FACTORS.values():
        if not entry.optional:
            continue
        if entry.name in settings:
            value = settings[entry.name]
        elif entry.name in READERS:
            value = READERS[entry.name](t, target, draft)
        else:
            value = None
        if _carried(entry, value):
            out.append((entry.name, value))
    return tuple(out)


def build_report(
    target: object,
    draft: object | None,
    kv_args: KVArgs | None = None,
    *,
    dspark: dict | None = None,
    allocation_policy: str = DEFAULT_ALLOCATION_POLICY,
    settings: Mapping[str, object] | None = None,
) -> tuple[LayoutReport, KVArgs | None]:
    """Report a side's layout. Runs ``setup_state_kv_args`` and records its outcome.

    ``target`` is a DSV4 pool (pdstate's or SGLang's; anything else is a ``TypeError``); a draft
    that is not a DSV4 pool is reported as no draft, as upstream skips it. Each factor is read
    from the pools (``READERS``) or, for a server setting, taken from ``settings`` (by factor name):
    ``dspark`` (0.5.23's DSpark transfer layout) and ``allocation_policy`` are the settings SGLang
    0.5.23 compares across the pair. Returns the report and the filled ``KVArgs`` (``None`` when
    the local check failed).
    """
    t = pool_view(target)
    error: BaseException | None = None
    if kv_args is None:
        try:
            kv_args = fill_kv_args(target, draft)
        except RuntimeError as exc:  # the upstream refusals (AttributeError subclass included)
            error = exc
            kv_args = None
    server = {"allocation_policy": allocation_policy, **({"dspark": dict(dspark)} if dspark else {})}
    server.update(settings or {})
    factors = tuple((name, READERS[name](t, target, draft)) for name in registry.names("state"))
    factors += upstream_factors(target, draft, server)
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
