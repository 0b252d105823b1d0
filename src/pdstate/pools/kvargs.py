"""``setup_state_kv_args`` and friends: the state components read from live DSV4 pools.

Components are matched between prefill and decode **by position**, so their order is part of the
wire contract. For a DSV4 target the order is upstream's:

1. ``SWA``        = ``target.get_state_buf_infos()`` (always);
2. ``SWA_RING``   = ``target.get_unified_swa_ring_buf_infos()`` (unified mode);
3. ``C128_STATE`` = ``target.get_c128_state_buf_infos()`` (any C128 layer);
4. the draft's ``SWA`` (paged) or ``SWA_RING`` (unified) component, last, after the five checks of
   ``check_draft_pair`` — only when both pools are DSV4 pools.

The data types and the five checks live in ``pdstate.protocol.facts`` (no torch).
"""

from __future__ import annotations

from pdstate.pools.dsv4 import DeepSeekV4TokenToKVPool
from pdstate.protocol.facts import (
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


def pool_facts(pool: DeepSeekV4TokenToKVPool) -> PoolFacts:
    """What the five target/draft checks read from one pool."""
    return PoolFacts(
        tuple(pool.compression_ratios),
        pool._unified_kv,
        pool.ring_geometry,
        pool.paged_geometry,
        pool.mapping_identity,
    )


def state_components(
    target: DeepSeekV4TokenToKVPool, draft: object | None, *, check: bool = True
) -> list[tuple[StateType, tuple[list[int], list[int], list[int]]]]:
    """The ordered state components of a target (+ draft), each ``(type, (ptrs, lens, items))``.

    With ``check`` (the upstream behaviour) the five draft checks run before the draft component
    is appended; without it, the components are only described (used to report a broken pair).
    """
    comps = [(StateType.SWA, target.get_state_buf_infos())]
    if target._unified_kv:
        ring = target.get_unified_swa_ring_buf_infos()
        if ring[0]:
            comps.append((StateType.SWA_RING, ring))
    if target.c128_states:
        comps.append((StateType.C128_STATE, target.get_c128_state_buf_infos()))
    if isinstance(draft, DeepSeekV4TokenToKVPool):
        if check:
            check_draft_pair(
                pool_facts(target),
                pool_facts(draft),
                lambda: target.full_to_swa_index_mapping is draft.full_to_swa_index_mapping,
            )
        if draft._unified_kv:
            infos, state_type = draft.get_unified_swa_ring_buf_infos(), StateType.SWA_RING
        else:
            infos, state_type = draft.get_state_buf_infos(), StateType.SWA
        if infos[0]:
            comps.append((state_type, infos))
    return comps


def setup_state_kv_args(
    kv_args: KVArgs,
    token_to_kv_pool: DeepSeekV4TokenToKVPool,
    draft_token_to_kv_pool: object | None = None,
    total_kv_layers: int | None = None,
    req_to_token_pool: object | None = None,
) -> KVArgs:
    """Fill the state fields of ``kv_args`` from a DSV4 target (and draft) pool.

    Raises the upstream ``RuntimeError`` subclasses of ``pdstate.errors`` when the draft cannot be
    transferred alongside the target; ``kv_args`` is left untouched then. A draft that is ``None``
    or not a DSV4 pool is skipped silently.
    """
    if not isinstance(token_to_kv_pool, DeepSeekV4TokenToKVPool):
        raise TypeError(f"pdstate handles DSV4 pools; got {type(token_to_kv_pool).__name__}")
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
    token_to_kv_pool: DeepSeekV4TokenToKVPool,
    draft_token_to_kv_pool: object | None = None,
    *,
    check: bool = True,
) -> KVArgs:
    """A complete ``KVArgs`` for a worker: main KV channel, page size, dtype, then state components.

    ``check=False`` describes the components without the five draft checks (a worker configured
    not to verify its own pair still registers its buffers, as upstream would have).
    """
    kv_args = KVArgs()
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = token_to_kv_pool.get_contiguous_buf_infos()
    kv_args.page_size = token_to_kv_pool.page_size
    kv_args.kv_cache_dtype = str(token_to_kv_pool.dtype).replace("torch.", "")
    kv_args.mla_compression_ratios = list(token_to_kv_pool.compression_ratios)
    kv_args.prefill_start_layer = token_to_kv_pool._stage_start
    kv_args.prefill_end_layer = token_to_kv_pool._stage_end
    if check:
        return setup_state_kv_args(kv_args, token_to_kv_pool, draft_token_to_kv_pool)
    for state_type, infos in state_components(token_to_kv_pool, draft_token_to_kv_pool, check=False):
        append_state_component(kv_args, state_type, *infos)
    return kv_args
