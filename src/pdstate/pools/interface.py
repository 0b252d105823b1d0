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

Both SGLang releases are read: ``release`` is ``"0.5.19"`` or ``"0.5.23"`` (pdstate's pools state
it as ``upstream``; a real pool is 0.5.23 when it has ``get_request_state_buf_infos``). What
0.5.23 moved: the C128 state method (``get_request_state_buf_infos``, component
``DSV4_REQUEST_STATE``), the state dtypes (``compressed_pool_configs[ratio].state_dtype``), the
mapping (``None`` until registered, where 0.5.19 has no attribute), the paged geometry check's
third element (``request_window.capacity`` / ``swa_req_ring_size``), the DSpark draft's
``REQUEST_ROW`` component (``get_swa_valid_from_buf_infos``), and in unified mode the C4 states
are one ring per request slot (``c4_state_addressing``).
"""

from __future__ import annotations

import sys
from functools import cached_property
from typing import Any

from pdstate.errors import DraftMappingMissing
from pdstate.protocol.facts import RELEASE_0_5_19, RELEASE_0_5_23, MappingIdentity, PoolFacts

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

    @cached_property
    def release(self) -> str:
        """``"0.5.19"`` or ``"0.5.23"``: the SGLang release whose interface and rules the pool follows."""
        own = getattr(self.pool, "upstream", None)  # pdstate's pools state it
        if isinstance(own, str):
            return own
        return RELEASE_0_5_23 if hasattr(self.pool, "get_request_state_buf_infos") else RELEASE_0_5_19

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

    def _state_dtype(self, ratio: int) -> Any:
        own = getattr(self.pool, f"c{ratio}_state_dtype", None)  # 0.5.19 and pdstate's pools
        if own is not None:
            return own
        config = (getattr(self.pool, "compressed_pool_configs", None) or {}).get(ratio)  # 0.5.23
        return None if config is None else config.state_dtype

    @property
    def c4_state_dtype(self) -> Any:
        """The C4 compress-state dtype (``None`` when a 0.5.23 pool's model has no C4 layer)."""
        return self._state_dtype(4)

    @property
    def c128_state_dtype(self) -> Any:
        """The C128 compress-state dtype (``None`` when a 0.5.23 pool's model has no C128 layer)."""
        return self._state_dtype(128)

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
    def request_window_capacity(self) -> int | None:
        """0.5.23: rows per slot of the target's encoder-replay request window (``None`` without one)."""
        window = getattr(self.pool, "request_window", None)
        return None if window is None else window.capacity

    @property
    def swa_req_ring_size(self) -> int | None:
        """0.5.23: the per-request SWA ring (unified mode, or a DSpark draft's ring), else ``None``."""
        return getattr(self.pool, "swa_req_ring_size", None)

    @property
    def c4_state_addressing(self) -> str:
        """How the SWA component's C4 compress-state items are indexed: ``"swa_page"`` (0.5.19,
        and paged 0.5.23: the window's SWA pages, through the mapping) or ``"request"`` (unified
        0.5.23: one ring per request slot, item = ``req_pool_idx``)."""
        if self.unified_kv and self.release != RELEASE_0_5_19:
            return "request"
        return "swa_page"

    @property
    def mapping(self) -> Any:
        """``full_to_swa_index_mapping`` as upstream reads it. Never registered: 0.5.19 raises
        ``DraftMappingMissing`` (an ``AttributeError``, upstream's text), 0.5.23 gives ``None``."""
        try:
            return self.pool.full_to_swa_index_mapping
        except AttributeError:
            if self.release == RELEASE_0_5_19:
                raise DraftMappingMissing() from None
            return None

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
            self.compression_ratios,
            self.unified_kv,
            self.ring_geometry,
            self.paged_geometry,
            self.mapping_identity,
            self.release,
            self.request_window_capacity,
            self.swa_req_ring_size,
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

    def request_state_buf_infos(self) -> BufInfos:
        """The C128 (request-scoped) state component: 0.5.23's ``get_request_state_buf_infos``,
        0.5.19's ``get_c128_state_buf_infos``; empty when the pool has neither."""
        for name in ("get_request_state_buf_infos", "get_c128_state_buf_infos"):
            method = getattr(self.pool, name, None)
            if method is not None:
                return method()
        return [], [], []

    c128_state_buf_infos = request_state_buf_infos

    def swa_valid_from_buf_infos(self) -> BufInfos:
        """0.5.23's DSpark draft request row (``REQUEST_ROW``); empty when the pool has none."""
        method = getattr(self.pool, "get_swa_valid_from_buf_infos", None)
        return ([], [], []) if method is None else method()


def pool_view(pool: object) -> PoolView:
    return pool if isinstance(pool, PoolView) else PoolView(pool)
