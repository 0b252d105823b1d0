"""Per-request index lists, computed by each side from its own allocator (spec §5).

All functions take and return numpy int64 arrays (page ids, ring rows or state slots) so that the
planner never converts per-page Python objects.
"""

from __future__ import annotations

import numpy as np

from pdstate.errors import PaddingPageIndex
from pdstate.pools.interface import pool_view


def _np(a) -> np.ndarray:
    if hasattr(a, "numpy"):
        a = a.numpy()
    return np.asarray(a, dtype=np.int64)


def page_floor(x: int, page_size: int) -> int:
    return x // page_size * page_size


def main_kv_page_indices(req_locs, seq_len: int, page_size: int, start: int = 0) -> np.ndarray:
    """Full page ids of ``req_locs[start:seq_len]`` (one per page): ``locs[::ps] // ps``."""
    return _np(req_locs)[start:seq_len][::page_size] // page_size


def swa_window_start(seq_len: int, window: int, page_size: int) -> int:
    return page_floor(max(0, seq_len - window), page_size)


def swa_page_indices(req_locs, seq_len: int, window: int, page_size: int, mapping) -> np.ndarray:
    """SWA page ids of the sliding-window tail, through ``full_to_swa_index_mapping``.

    Raises ``PaddingPageIndex`` if a window slot is unmapped (0): upstream would silently copy the
    padding page there.
    """
    ws = swa_window_start(seq_len, window, page_size)
    locs = _np(req_locs)[ws:seq_len]
    swa = _np(mapping)[locs]
    if (swa <= 0).any():
        bad = int(np.flatnonzero(swa <= 0)[0])
        raise PaddingPageIndex(
            f"sliding-window slot for position {ws + bad} (full slot {int(locs[bad])}) maps to SWA "
            f"slot {int(swa[bad])}: the window is not allocated in the SWA pool and would copy the padding page"
        )
    return swa[::page_size] // page_size


def swa_ring_rows(req_pool_idx: int, seq_len: int, window: int, ring: int) -> np.ndarray:
    """Unified-mode ring rows ``req_pool_idx*ring + pos % ring`` for the last ``window`` positions."""
    pos = np.arange(max(0, seq_len - window), seq_len, dtype=np.int64)
    return req_pool_idx * ring + pos % ring


def c128_state_indices(req_pool_idx: int, seq_len: int, online: bool, ring: int | None) -> np.ndarray:
    """The request's C128 state slot holding the partial group, or empty when there is none."""
    if seq_len == 0 or seq_len % 128 == 0:
        return np.empty(0, dtype=np.int64)
    if online:
        return np.array([req_pool_idx], dtype=np.int64)
    pages_per_req = ring // 128
    return np.array([req_pool_idx * pages_per_req + ((seq_len - 1) % ring) // 128], dtype=np.int64)


def c4_state_slot_indices(req_pool_idx: int, seq_len: int) -> np.ndarray:
    """SGLang 0.5.23 unified mode: the C4 compress states are one ring per request slot (row
    ``req_pool_idx*ring + pos % ring``, one item = one slot's ring), so the request's item is its
    slot; empty for an empty request."""
    if seq_len <= 0:
        return np.empty(0, dtype=np.int64)
    return np.array([req_pool_idx], dtype=np.int64)


def swa_component_indices(pool, req_pool_idx: int, req_locs, seq_len: int, mapping) -> np.ndarray:
    """The target's ``SWA`` component index list for one request, by the pool's release.

    0.5.19 (both modes) and paged 0.5.23 address the component's items (SWA KV pages and the C4
    state rings of those pages) by the window's SWA pages (``swa_page_indices``); unified 0.5.23
    holds only the C4 states there, one ring per request slot (``c4_state_slot_indices``).
    ``pool`` is a DSV4 pool (pdstate's or SGLang's) or its ``PoolView``.
    """
    v = pool_view(pool)
    if v.c4_state_addressing == "request":
        return c4_state_slot_indices(req_pool_idx, seq_len)
    return swa_page_indices(req_locs, seq_len, v.sliding_window, v.page_size, mapping)


def request_state_indices(req_pool_idx: int, seq_len: int, online: bool, ring: int | None) -> np.ndarray:
    """The ``C128_STATE`` / ``DSV4_REQUEST_STATE`` index list: the same rule in 0.5.19
    (``get_dsv4_c128_state_indices``) and 0.5.23 (``request_state_transfer_indices`` for ratio 128)."""
    return c128_state_indices(req_pool_idx, seq_len, online, ring)
