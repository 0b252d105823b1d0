"""Per-request index lists, computed by each side from its own allocator (spec §5).

All functions take and return numpy int64 arrays (page ids, ring rows or state slots) so that the
planner never converts per-page Python objects.
"""

from __future__ import annotations

import numpy as np

from pdstate.errors import PaddingPageIndex


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
