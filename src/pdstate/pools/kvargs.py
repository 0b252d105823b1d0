"""``setup_state_kv_args`` and friends: the state components read from live DSV4 pools.

Components are matched between prefill and decode **by position**, so their order is part of the
wire contract. For a DSV4 target the order is upstream's:

1. ``SWA``        = ``target.get_state_buf_infos()`` (always);
2. ``SWA_RING``   = ``target.get_unified_swa_ring_buf_infos()`` (unified mode);
3. ``C128_STATE`` (0.5.23: ``DSV4_REQUEST_STATE``, the same member and wire value) =
   ``target.get_request_state_buf_infos()`` (0.5.19: ``get_c128_state_buf_infos()``; any C128
   layer);
4. the draft's ``SWA`` (paged) or ``SWA_RING`` (unified) component, after the five checks of
   ``check_draft_pair`` — only when both pools are DSV4 pools (``pdstate.pools.interface``: the
   rule is upstream's, and SGLang's own pool objects are read the same way as pdstate's);
5. 0.5.23 only: the draft's ``REQUEST_ROW`` (``get_swa_valid_from_buf_infos``, a DSpark draft), last.

The checks and their texts follow the target's release (``PoolView.release``).

The data types and the five checks live in ``pdstate.protocol.facts`` (no torch).
"""

from __future__ import annotations

from pdstate.pools.interface import PoolView, is_dsv4_pool, pool_view
from pdstate.protocol.facts import (
    RELEASE_0_5_19,
    KVArgs,
    PoolFacts,
    StateType,
    append_state_component,
    check_draft_pair,
)

__all__ = [
    "KVArgs",
    "PoolFacts",
    "StateType",
    "append_state_component",
    "fill_kv_args",
    "pool_facts",
    "setup_state_kv_args",
    "state_components",
]


def pool_facts(pool: object) -> PoolFacts:
    """What the five target/draft checks read from one pool (pdstate's or SGLang's)."""
    return pool_view(pool).facts()


def _target_view(pool: object) -> PoolView:
    if not is_dsv4_pool(pool):
        raise TypeError(f"pdstate handles DSV4 pools; got {type(pool).__name__}")
    return pool_view(pool)


def state_components(
    target: object, draft: object | None, *, check: bool = True
) -> list[tuple[StateType, tuple[list[int], list[int], list[int]]]]:
    """The ordered state components of a target (+ draft), each ``(type, (ptrs, lens, items))``.

    With ``check`` (the upstream behaviour) the five draft checks run before the draft component
    is appended; without it, the components are only described (used to report a broken pair).
    Both pools are read through ``PoolView``: pdstate's pools and SGLang's real ones alike.
    """
    t = _target_view(target)
    comps = [(StateType.SWA, t.state_buf_infos())]
    if t.unified_kv:
        ring = t.unified_swa_ring_buf_infos()
        if ring[0]:
            comps.append((StateType.SWA_RING, ring))
    request_state = t.request_state_buf_infos()
    if request_state[0]:
        comps.append((StateType.DSV4_REQUEST_STATE, request_state))
    if draft is not None and is_dsv4_pool(draft):
        d = pool_view(draft)
        if check:
            check_draft_pair(t.facts(), d.facts(), lambda: t.mapping is d.mapping)
        if d.unified_kv:
            infos, state_type = d.unified_swa_ring_buf_infos(), StateType.SWA_RING
        else:
            infos, state_type = d.state_buf_infos(), StateType.SWA
        if infos[0]:
            comps.append((state_type, infos))
        if t.release != RELEASE_0_5_19:
            rows = d.swa_valid_from_buf_infos()
            if rows[0]:
                comps.append((StateType.REQUEST_ROW, rows))
    return comps


def setup_state_kv_args(
    kv_args: KVArgs,
    token_to_kv_pool: object,
    draft_token_to_kv_pool: object | None = None,
    total_kv_layers: int | None = None,
    req_to_token_pool: object | None = None,
) -> KVArgs:
    """Fill the state fields of ``kv_args`` from a DSV4 target (and draft) pool.

    Raises the upstream ``RuntimeError`` subclasses of ``pdstate.errors`` when the draft cannot be
    transferred alongside the target; ``kv_args`` is left untouched then. A draft that is ``None``
    or not a DSV4 pool is skipped silently; a target that is not a DSV4 pool is a ``TypeError``.
    """
    comps = state_components(token_to_kv_pool, draft_token_to_kv_pool)
    kv_args.state_types = []
    kv_args.state_data_ptrs, kv_args.state_data_lens, kv_args.state_item_lens = [], [], []
    kv_args.state_dim_per_tensor, kv_args.state_layer_ids = [], []
    kv_args.is_hybrid_mla_backend = False
    if total_kv_layers is not None:
        kv_args.total_kv_layers = total_kv_layers
    for state_type, infos in comps:
        append_state_component(kv_args, state_type, *infos)
    return kv_args


def fill_kv_args(
    token_to_kv_pool: object,
    draft_token_to_kv_pool: object | None = None,
    *,
    check: bool = True,
) -> KVArgs:
    """A complete ``KVArgs`` for a worker: main KV channel, page size, dtype, then state components.

    ``check=False`` describes the components without the five draft checks (a worker configured
    not to verify its own pair still registers its buffers, as upstream would have).
    """
    t = _target_view(token_to_kv_pool)
    kv_args = KVArgs()
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = t.contiguous_buf_infos()
    kv_args.page_size = t.page_size
    kv_args.kv_cache_dtype = str(t.dtype).replace("torch.", "")
    kv_args.mla_compression_ratios = list(t.compression_ratios)
    kv_args.prefill_start_layer, kv_args.prefill_end_layer = t.stage
    if check:
        return setup_state_kv_args(kv_args, token_to_kv_pool, draft_token_to_kv_pool)
    for state_type, infos in state_components(token_to_kv_pool, draft_token_to_kv_pool, check=False):
        append_state_component(kv_args, state_type, *infos)
    return kv_args
