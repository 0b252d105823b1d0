"""DSV4 pools by interface: pdstate's own pools and SGLang's real ones, read the same way.

Which objects count as DSV4 pools follows upstream's own rule (SGLang 0.5.19,
``disaggregation/utils.py`` ``setup_state_kv_args``), written here without importing SGLang:

- a **target** gets state components from the generic branch, ``hasattr(pool,
  "get_state_buf_infos")`` and an instance of ``BaseSWAKVPool`` (upstream's
  ``DeepSeekV4TokenToKVPool`` subclasses it): ``SWA`` always, ``SWA_RING`` when
  ``getattr(pool, "_unified_kv", False)`` and the pool has ``get_unified_swa_ring_buf_infos`` that
  returns pointers, ``C128_STATE`` when the pool has ``get_c128_state_buf_infos`` that returns
  pointers. pdstate reports DSV4 layouts only, so its target must also be a DSV4 pool;
- the **draft** block (the five checks, then the draft's component) runs only when the target
  *and* the draft are ``isinstance(..., DeepSeekV4TokenToKVPool)``; any other draft (``None``, a
  non-DSV4 pool, an unrelated object) is skipped silently.

``is_dsv4_pool`` is that ``isinstance`` test by class name over the MRO: upstream's class, its
subclasses (e.g. the NPU pool) and pdstate's own class count, whatever module they come from.

``PoolView`` reads what pdstate's checks and reports need through upstream's attributes only, and
derives the facts pdstate's own pools state directly (``stage_ratios``, ``ring_geometry``,
``paged_geometry``, ``mapping_identity``, ``c4_ring_size``, ``c128_ring_size``, ``online_c128``).
"""

from __future__ import annotations

import sys
from functools import cached_property
from typing import Any

from pdstate.errors import DraftMappingMissing
from pdstate.protocol.facts import MappingIdentity, PoolFacts

BufInfos = tuple[list[int], list[int], list[int]]

DSV4_POOL_CLASS = "DeepSeekV4TokenToKVPool"

__all__ = ["DSV4_POOL_CLASS", "PoolView", "is_dsv4_pool", "pool_view"]


def is_dsv4_pool(obj: object) -> bool:
    """Upstream's ``isinstance(obj, DeepSeekV4TokenToKVPool)``, by class name over the MRO."""
    return any(c.__name__ == DSV4_POOL_CLASS for c in type(obj).__mro__)


def _first_state_pool(pool: object, ratio: int) -> Any | None:
    """Upstream's first per-layer compress-state pool of ``ratio`` (``compress_state_pools``)."""
    for p in getattr(pool, "compress_state_pools", None) or ():
        if p is not None and getattr(p, "ratio", None) == ratio:
            return p
    return None


_MISSING = object()


class PoolView:
    """A DSV4 pool (pdstate's or upstream's) seen through upstream's interface."""

    def __init__(self, pool: object) -> None:
        self.pool = pool

    # -- upstream attributes, as they are ------------------------------------------------------
    @property
    def compression_ratios(self) -> tuple[int, ...]:
        return tuple(self.pool.compression_ratios)

    @property
    def unified_kv(self) -> bool:
        return bool(getattr(self.pool, "_unified_kv", False))

    @property
    def stage(self) -> tuple[int, int]:
        """``[start, end)`` absolute layers of this PP stage (upstream's ``_stage_start/_end``)."""
        return self.pool._stage_start, self.pool._stage_end

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def swa_page_size(self) -> int:
        return self.pool.swa_page_size

    @property
    def sliding_window(self) -> int:
        return self.pool.sliding_window

    @property
    def dtype(self) -> Any:
        return self.pool.dtype

    @property
    def c4_state_dtype(self) -> Any:
        return self.pool.c4_state_dtype

    @property
    def c128_state_dtype(self) -> Any:
        return self.pool.c128_state_dtype

    @property
    def unified_swa_ring_size(self) -> int | None:
        return self.pool.unified_swa_ring_size if self.unified_kv else None

    # -- derived facts ---------------------------------------------------------------------------
    @property
    def stage_ratios(self) -> list[int]:
        start, end = self.stage
        return list(self.pool.compression_ratios[start:end])

    @property
    def ring_geometry(self) -> tuple[int, int, int] | None:
        """Upstream's unified check tuple ``(unified_swa_window, unified_swa_ring_size, unified_swa_pages)``."""
        if not self.unified_kv:
            return None
        p = self.pool
        return (p.unified_swa_window, p.unified_swa_ring_size, p.unified_swa_pages)

    @property
    def paged_geometry(self) -> tuple[int, int]:
        """Upstream's paged check tuple ``(page_size, sliding_window)``."""
        return (self.pool.page_size, self.pool.sliding_window)

    @property
    def mapping(self) -> Any:
        """``full_to_swa_index_mapping`` as upstream reads it: ``DraftMappingMissing`` (an
        ``AttributeError``, upstream's text) when the pool never registered one."""
        try:
            return self.pool.full_to_swa_index_mapping
        except AttributeError:
            raise DraftMappingMissing() from None

    @property
    def mapping_identity(self) -> MappingIdentity | None:
        """Identity of the very mapping object the pool holds (``None`` if it holds none)."""
        try:
            mapping = self.mapping
        except AttributeError:
            return None
        return None if mapping is None else MappingIdentity.of(mapping)

    @cached_property
    def c4_ring_size(self) -> int:
        own = getattr(self.pool, "c4_ring_size", None)  # pdstate's pools state it
        if own is not None:
            return own
        state = _first_state_pool(self.pool, 4)
        return state.ring_size if state is not None else self.pool.get_ring_size(4)

    @cached_property
    def c128_ring_size(self) -> int | None:
        """The C128 compress-state ring, ``None`` when the stage has no C128 layer."""
        own = getattr(self.pool, "c128_ring_size", _MISSING)
        if own is not _MISSING:
            return own
        state = _first_state_pool(self.pool, 128)
        return None if state is None else state.ring_size

    @cached_property
    def online_c128(self) -> bool:
        own = getattr(self.pool, "online_c128", None)
        if own is not None:
            return bool(own)
        state = _first_state_pool(self.pool, 128)
        if state is not None:
            return bool(getattr(state, "online", False))
        # no C128 layer in this stage: upstream's process-wide switch, read at its import
        module = sys.modules.get(type(self.pool).__module__)
        return bool(getattr(module, "ONLINE_C128", False))

    def facts(self) -> PoolFacts:
        """What the five target/draft checks read from one pool."""
        return PoolFacts(
            self.compression_ratios, self.unified_kv, self.ring_geometry, self.paged_geometry, self.mapping_identity
        )

    # -- buffer infos (upstream's methods; optional ones as upstream probes them) ----------------
    def contiguous_buf_infos(self) -> BufInfos:
        return self.pool.get_contiguous_buf_infos()

    def state_buf_infos(self) -> BufInfos:
        return self.pool.get_state_buf_infos()

    def unified_swa_ring_buf_infos(self) -> BufInfos:
        if not hasattr(self.pool, "get_unified_swa_ring_buf_infos"):
            return [], [], []
        return self.pool.get_unified_swa_ring_buf_infos()

    def c128_state_buf_infos(self) -> BufInfos:
        if not hasattr(self.pool, "get_c128_state_buf_infos"):
            return [], [], []
        return self.pool.get_c128_state_buf_infos()


def pool_view(pool: object) -> PoolView:
    return pool if isinstance(pool, PoolView) else PoolView(pool)
