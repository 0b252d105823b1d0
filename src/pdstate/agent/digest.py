"""Request digests over real bytes: xxh3_128 of what the prefill sent and what landed on the decode.

A request's digest is one xxh3_128 per (channel, buffer) — channels are main KV, each state
component in ``KVArgs.state_types`` order, then aux — streamed over that buffer's items in the
order of the side's own index list, and combined as ``xxh3_128(concat(per-buffer digests))``.
Each stream only depends on the bytes of the listed items in list order, so the prefill (which
sees main KV chunk by chunk, state and aux with the last chunk) and the decode (which sees its
whole destination lists at once) compute the same value exactly when the same bytes are in the
same places. Contiguous indices are hashed as one run: the Python loop is over (buffer, run),
never over items; addresses come from numpy.

Measured on the development VM (128 MiB random buffer, best of 3): xxh3_128 16.3 GB/s, xxh3_64
16.3, blake3 2.4, zlib.crc32 2.6, hashlib.blake2b 0.5.
"""

from __future__ import annotations

import ctypes

import numpy as np
import xxhash

__all__ = ["RequestDigest", "index_runs"]


def index_runs(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Maximal runs of +1 steps in ``idx``: ``(starts, lengths)`` as int64 arrays."""
    idx = np.asarray(idx, dtype=np.int64)
    if idx.size == 0:
        e = np.empty(0, dtype=np.int64)
        return e, e
    brk = np.flatnonzero(np.diff(idx) != 1) + 1
    first = np.concatenate(([0], brk))
    lengths = np.diff(np.concatenate((first, [idx.size])))
    return idx[first], lengths


class RequestDigest:
    """Streaming digest of one request; ``layout`` is ``[(ptrs, item_lens), ...]`` per channel."""

    def __init__(self, layout: list[tuple[list[int], list[int]]]) -> None:
        self._layout = [(np.asarray(p, dtype=np.uint64), np.asarray(i, dtype=np.uint64)) for p, i in layout]
        self._hashers = [[xxhash.xxh3_128() for _ in p] for p, _ in layout]
        self.bytes = 0

    def update(self, channel: int, indices) -> None:
        """Hash the items ``indices`` of every buffer of ``channel`` (after those hashed before)."""
        starts, lengths = index_runs(indices)
        if starts.size == 0:
            return
        ptrs, items = self._layout[channel]
        addr = ptrs[:, None] + starts.astype(np.uint64)[None, :] * items[:, None]
        size = lengths.astype(np.uint64)[None, :] * items[:, None]
        self.bytes += int(size.sum())
        char = ctypes.c_char
        for h, a_row, n_row in zip(self._hashers[channel], addr.tolist(), size.tolist()):
            update = h.update
            for a, n in zip(a_row, n_row):
                if n:
                    update((char * n).from_address(a))

    def digest(self) -> bytes:
        return xxhash.xxh3_128(b"".join(h.digest() for hs in self._hashers for h in hs)).digest()
