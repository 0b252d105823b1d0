"""Facts a side states about its pools, and the checks written once over them (no torch).

- ``StateType`` and ``KVArgs``: what a worker advertises about its memory (upstream names);
- ``MappingIdentity``: which ``full_to_swa_index_mapping`` object a pool registered;
- ``PoolFacts`` and ``check_draft_pair``: the five upstream target/draft checks over facts, so the
  handshake can re-run them on what a peer reports about its own pair and refuse with the very
  same error. ``pdstate.pools.kvargs`` reads these facts from live pools.
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdstate.errors import (
    DraftNotSWAOnly,
    PagedSWAGeometryMismatch,
    SWAGeometryMismatch,
    SWAIndexMappingNotShared,
    SWARingGeometryMismatch,
    UnifiedKVModeMismatch,
)

MAPPING_NONCE_ATTR = "_pdstate_mapping_nonce"


class StateType(str, enum.Enum):
    """Upstream's state component kinds, by wire value. SGLang 0.5.23 renamed ``C128_STATE`` to
    ``DSV4_REQUEST_STATE`` with the same wire value: both names are this one member (an alias;
    its canonical ``name`` stays ``C128_STATE``). ``REQUEST_ROW`` is 0.5.23's DSpark draft row."""

    MAMBA = "mamba"
    SWA = "swa"
    NSA = "nsa"
    SWA_RING = "swa_ring"
    C128_STATE = "c128_state"
    DSV4_REQUEST_STATE = "c128_state"
    REQUEST_ROW = "request_row"


RELEASE_0_5_19, RELEASE_0_5_23 = "0.5.19", "0.5.23"


@dataclass
class KVArgs:
    """Every field a worker advertises (upstream names). Pointers are host addresses."""

    engine_rank: int = 0
    kv_data_ptrs: list[int] = field(default_factory=list)
    kv_data_lens: list[int] = field(default_factory=list)
    kv_item_lens: list[int] = field(default_factory=list)
    aux_data_ptrs: list[int] = field(default_factory=list)
    aux_data_lens: list[int] = field(default_factory=list)
    aux_item_lens: list[int] = field(default_factory=list)
    state_types: list[StateType] = field(default_factory=list)
    state_data_ptrs: list[list[int]] = field(default_factory=list)
    state_data_lens: list[list[int]] = field(default_factory=list)
    state_item_lens: list[list[int]] = field(default_factory=list)
    state_dim_per_tensor: list[list[int]] = field(default_factory=list)
    state_layer_ids: list[list[int]] = field(default_factory=list)
    is_hybrid_mla_backend: bool = False
    page_size: int = 0
    kv_cache_dtype: str = ""
    ib_device: str | None = None
    gpu_id: int = 0
    pp_rank: int = 0
    prefill_start_layer: int = 0
    prefill_end_layer: int | None = None
    mla_compression_ratios: list[int] = field(default_factory=list)
    total_kv_layers: int | None = None

    @property
    def num_components(self) -> int:
        return len(self.state_types)


def append_state_component(
    kv_args: KVArgs,
    state_type: StateType,
    ptrs: list[int],
    lens: list[int],
    item_lens: list[int],
    dim_per_tensor: list[int] | None = None,
    layer_ids: list[int] | None = None,
) -> None:
    """Append one component; the four lists stay parallel."""
    if not (len(ptrs) == len(lens) == len(item_lens)):
        raise ValueError(
            f"state component {state_type.value}: {len(ptrs)} pointers, {len(lens)} lengths, "
            f"{len(item_lens)} item lengths"
        )
    kv_args.state_types.append(state_type)
    kv_args.state_data_ptrs.append(list(ptrs))
    kv_args.state_data_lens.append(list(lens))
    kv_args.state_item_lens.append(list(item_lens))
    kv_args.state_dim_per_tensor.append(list(dim_per_tensor or []))
    kv_args.state_layer_ids.append(list(layer_ids or []))


@dataclass(frozen=True)
class MappingIdentity:
    """Which mapping tensor object a pool registered: equal iff it is the very same object.

    The allocator tags its mapping with a random nonce; a clone has another pointer and no nonce, a
    ``[:]`` view shares the pointer but is another object without the nonce.
    """

    nonce: str
    data_ptr: int
    numel: int
    dtype: str

    @classmethod
    def of(cls, mapping: Any) -> MappingIdentity:
        """Identity of a tensor-like ``mapping``; tags an untagged object with a fresh nonce first."""
        nonce = getattr(mapping, MAPPING_NONCE_ATTR, None)
        if nonce is None:
            nonce = secrets.token_hex(8)
            setattr(mapping, MAPPING_NONCE_ATTR, nonce)
        return cls(nonce, mapping.data_ptr(), mapping.numel(), str(mapping.dtype).replace("torch.", ""))

    def as_dict(self) -> dict:
        return {"nonce": self.nonce, "data_ptr": self.data_ptr, "numel": self.numel, "dtype": self.dtype}


@dataclass(frozen=True)
class PoolFacts:
    """What the five target/draft checks read from one pool.

    ``release`` is the SGLang release whose checks and texts apply (the target's decides).
    0.5.23's paged geometry check adds a third element: the target's ``request_window_capacity``
    and the draft's ``swa_req_ring_size`` (``None`` without one).
    """

    compression_ratios: tuple[int, ...]
    unified_kv: bool
    ring_geometry: tuple[int, int, int] | None
    paged_geometry: tuple[int, int]
    mapping_identity: MappingIdentity | None
    release: str = RELEASE_0_5_19
    request_window_capacity: int | None = None
    swa_req_ring_size: int | None = None


def check_draft_pair(target: PoolFacts, draft: PoolFacts, mapping_shared: Callable[[], bool]) -> None:
    """The five upstream checks, in upstream order; raises the upstream error, else returns.

    ``mapping_shared`` is consulted only in paged mode, after the mode and ratio checks, exactly
    where upstream evaluates ``target.full_to_swa_index_mapping is draft.full_to_swa_index_mapping``.
    The target's ``release`` picks the paged geometry check: 0.5.19's ``(page_size, window)``
    (``PagedSWAGeometryMismatch``) or 0.5.23's three-element tuple (``SWAGeometryMismatch``).
    """
    if not draft.compression_ratios or any(r != 0 for r in draft.compression_ratios):
        raise DraftNotSWAOnly()
    if target.unified_kv != draft.unified_kv:
        raise UnifiedKVModeMismatch()
    if target.unified_kv:
        if target.ring_geometry != draft.ring_geometry:
            raise SWARingGeometryMismatch.build(target.ring_geometry, draft.ring_geometry)
        return
    if not mapping_shared():
        raise SWAIndexMappingNotShared()
    if target.release == RELEASE_0_5_19:
        if target.paged_geometry != draft.paged_geometry:
            raise PagedSWAGeometryMismatch.build(target.paged_geometry, draft.paged_geometry)
        return
    t_geometry = (*target.paged_geometry, target.request_window_capacity)
    d_geometry = (*draft.paged_geometry, draft.swa_req_ring_size)
    if t_geometry != d_geometry:
        raise SWAGeometryMismatch.build(t_geometry, d_geometry)


def identities_shared(target: PoolFacts, draft: PoolFacts) -> bool:
    """Cross-process form of the identity check: both pools recorded the same mapping identity.

    A draft that never registered a mapping reports ``None`` and is treated as not shared.
    """
    return target.mapping_identity is not None and target.mapping_identity == draft.mapping_identity
