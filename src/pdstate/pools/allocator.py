"""The SWA allocator, owner of ``full_to_swa_index_mapping``, and the request-slot pool.

``full_to_swa_index_mapping`` is an int64 tensor of ``size_full + page_size + 1`` entries: entry
``i`` is the SWA slot of full slot ``i``, ``0`` means unmapped, and the last entry is the constant
``-1`` so that looking up ``-1`` yields ``-1``. Allocation is page-coherent (full page ``P`` maps to
SWA page ``Q`` with equal in-page offsets), page 0 is the padding page and is never handed out, and
the tensor is only ever updated in place.

The allocator tags its mapping with a random nonce. A pool records a ``MappingIdentity`` (nonce,
data pointer, numel, dtype) when a mapping is registered, so two pools report equal identities iff
they registered the very same tensor object: a clone has another pointer and no nonce; a ``[:]``
view shares the pointer but is another object without the nonce.
"""

from __future__ import annotations

import secrets

import numpy as np
import torch

from pdstate.errors import AllocationError
from pdstate.protocol.facts import MAPPING_NONCE_ATTR, MappingIdentity

__all__ = ["MappingIdentity", "ReqToTokenPool", "SWATokenToKVPoolAllocator", "new_mapping"]

_NONCE_ATTR = MAPPING_NONCE_ATTR


def new_mapping(size_full: int, page_size: int, device: str = "cpu") -> torch.Tensor:
    """A fresh, tagged, all-unmapped mapping with the ``-1`` sentinel."""
    mapping = torch.cat(
        [
            torch.zeros(size_full + page_size, dtype=torch.int64, device=device),
            torch.tensor([-1], dtype=torch.int64, device=device),
        ]
    )
    setattr(mapping, _NONCE_ATTR, secrets.token_hex(8))
    return mapping


class _PagePool:
    """Free list of page ids ``1..num_pages`` (page 0 reserved), lowest ids handed out first."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = list(range(num_pages, 0, -1))  # a stack: pop() yields the lowest id
        self._used: set[int] = set()

    def available(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise AllocationError(f"out of pages: asked for {n}, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        bad = [p for p in pages if p not in self._used]
        if bad:
            raise AllocationError(f"freeing pages that are not allocated: {bad[:8]}")
        self._used.difference_update(pages)
        self._free.extend(pages)
        self._free.sort(reverse=True)


class SWATokenToKVPoolAllocator:
    """Full-pool and SWA-pool page allocators sharing one ``full_to_swa_index_mapping``.

    ``alloc(n)`` maps every page of the request; ``alloc_swa_tail(n, window)`` (decode side) maps
    only the pages of the last ``window`` tokens and leaves the rest of the request unmapped.
    ``free(locs)`` returns full pages and their SWA pages and resets their mapping entries to 0.
    """

    def __init__(
        self,
        size_full: int,
        size_swa: int,
        page_size: int,
        device: str = "cpu",
        kvcache: object | None = None,
    ) -> None:
        if page_size <= 0 or size_full % page_size or size_swa % page_size:
            raise AllocationError(
                f"size_full={size_full} and size_swa={size_swa} must be multiples of page_size={page_size}"
            )
        self.size_full = size_full
        self.size_swa = size_swa
        self.page_size = page_size
        self.device = device
        self._full = _PagePool(size_full // page_size)
        self._swa = _PagePool(size_swa // page_size)
        self.full_to_swa_index_mapping = new_mapping(size_full, page_size, device)
        # Page-row view of the mapping (host memory): row p holds the entries of full page p, so
        # mapping or clearing a request's pages is one row-indexed numpy assignment.
        self._rows = self.full_to_swa_index_mapping.numpy()[: size_full + page_size].reshape(-1, page_size)
        self._ramp = np.arange(page_size, dtype=np.int64)
        self._swa_page_of: dict[int, int] = {}
        if kvcache is not None:
            kvcache.register_mapping(self.full_to_swa_index_mapping)

    # -- sizes --------------------------------------------------------------------------------
    def full_available_size(self) -> int:
        return self._full.available() * self.page_size

    def swa_available_size(self) -> int:
        return self._swa.available() * self.page_size

    def available_size(self) -> int:
        return min(self.full_available_size(), self.swa_available_size())

    # -- allocation ---------------------------------------------------------------------------
    def _pages_for(self, num_tokens: int) -> int:
        if num_tokens <= 0:
            raise AllocationError(f"num_tokens must be positive, got {num_tokens}")
        return -(-num_tokens // self.page_size)

    def _locs(self, pages: list[int], num_tokens: int) -> torch.Tensor:
        p = np.array(pages, dtype=np.int64)
        return torch.from_numpy((p[:, None] * self.page_size + self._ramp).reshape(-1)[:num_tokens])

    def _map(self, full_pages: list[int], swa_pages: list[int]) -> None:
        if full_pages:
            sp = np.array(swa_pages, dtype=np.int64)
            self._rows[full_pages] = sp[:, None] * self.page_size + self._ramp
        self._swa_page_of.update(zip(full_pages, swa_pages))

    def alloc(self, num_tokens: int) -> torch.Tensor:
        """Full slots for ``num_tokens``, every page mapped to a fresh SWA page."""
        n = self._pages_for(num_tokens)
        if n > self._swa.available():
            raise AllocationError(f"out of SWA pages: asked for {n}, {self._swa.available()} free")
        full = self._full.alloc(n)
        self._map(full, self._swa.alloc(n))
        return self._locs(full, num_tokens)

    def swa_tail_pages(self, num_tokens: int, window: int) -> int:
        """Pages covering ``[page_floor(max(0, n - window)), n)``: the SWA tail of a request."""
        start = max(0, num_tokens - window) // self.page_size * self.page_size
        return -(-(num_tokens - start) // self.page_size)

    def alloc_swa_tail(self, num_tokens: int, window: int) -> torch.Tensor:
        """Full slots for ``num_tokens``; SWA pages only for the last-``window`` tail pages."""
        n = self._pages_for(num_tokens)
        tail = self.swa_tail_pages(num_tokens, window)
        if tail > self._swa.available():
            raise AllocationError(f"out of SWA pages: asked for {tail}, {self._swa.available()} free")
        full = self._full.alloc(n)
        if n > tail:
            self._rows[full[: n - tail]] = 0
        self._map(full[n - tail :], self._swa.alloc(tail))
        return self._locs(full, num_tokens)

    def free(self, locs: torch.Tensor | np.ndarray) -> None:
        """Free the pages holding ``locs`` (and their SWA pages); mapping entries back to 0."""
        arr = locs.numpy() if isinstance(locs, torch.Tensor) else np.asarray(locs, dtype=np.int64)
        if arr.size == 0:
            return
        # the distinct pages, cheaply: a request's slots come page by page, so dropping repeats of
        # the previous page leaves one entry per page before the (now small) sort
        p = arr // self.page_size
        pages = np.unique(p[np.concatenate(([True], p[1:] != p[:-1]))]).tolist()
        self._full.free(pages)
        swa = [self._swa_page_of.pop(p) for p in pages if p in self._swa_page_of]
        if swa:
            self._swa.free(swa)
        self._rows[pages] = 0

    def translate(self, locs: torch.Tensor) -> torch.Tensor:
        return self.full_to_swa_index_mapping[locs]


class ReqToTokenPool:
    """Request slots (``req_pool_idx``) and each slot's row of full-slot locations."""

    def __init__(self, num_req_slots: int, max_context_len: int) -> None:
        self.num_req_slots = num_req_slots
        self.req_to_token = torch.zeros((num_req_slots, max_context_len), dtype=torch.int64)
        self._rows = self.req_to_token.numpy()  # the same memory, for cheap row writes and clears
        self._free = list(range(num_req_slots - 1, -1, -1))
        # per slot, how many leading entries may be non-zero: the whole row once handed out (a
        # caller may write it directly), only what ``write`` set when it wrote the row
        self._written = [0] * num_req_slots

    def write(self, slot: int, locs: torch.Tensor) -> None:
        """``req_to_token[slot, :len(locs)] = locs`` on a row fresh from ``alloc`` (zero beyond
        ``locs``), so that ``free`` clears only those entries."""
        n = int(locs.shape[0])
        self._rows[slot, :n] = locs.numpy() if isinstance(locs, torch.Tensor) else locs
        self._written[slot] = n

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise AllocationError("out of request slots")
        slot = self._free.pop()
        self._written[slot] = self.req_to_token.shape[1]
        return slot

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_req_slots:
            raise AllocationError(f"request slot {slot} is not allocated")
        self._rows[slot, : self._written[slot]] = 0
        self._written[slot] = 0
        self._free.append(slot)
        self._free.sort(reverse=True)
