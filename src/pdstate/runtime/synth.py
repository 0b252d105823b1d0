"""Deterministic stand-in for prefill compute, and the decode's independent verification.

The reference workers do not run a model. The prefill writes, into exactly the source slots a
request's plan will read, words derived only from ``(room, channel, buffer, position)``:
item ``k`` of buffer ``j`` of channel ``c`` holds the uint64 words ``base + w`` for
``w = 0..item_len/8-1`` with ``base = mix(room, c, j, k)``. The decode, knowing only the room and
its own destination indices, regenerates the expected words and compares them with what landed:
a wrong page, a shifted offset, a stale draft slot or a half-written item all fail verification.
"""

from __future__ import annotations

import ctypes
import hashlib

import numpy as np

from pdstate.planner import channels_of

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, vectorised (uint64 arithmetic wraps)."""
    x = x.astype(np.uint64, copy=True)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def item_bases(room: int, channel: int, buffer: int, count: int) -> np.ndarray:
    seed = np.uint64(((room * int(_GOLDEN)) ^ (channel << 48) ^ (buffer << 32)) & (2**64 - 1))
    return _mix(seed + np.arange(count, dtype=np.uint64) * _GOLDEN)


def words_view(ptr: int, nbytes: int) -> np.ndarray:
    """A writable uint64 numpy view of ``nbytes`` at ``ptr`` (memory owned elsewhere)."""
    buf = (ctypes.c_uint64 * (nbytes // 8)).from_address(ptr)
    return np.ctypeslib.as_array(buf)


def _item_matrix(ptr: int, data_len: int, item_len: int) -> np.ndarray:
    n_items = data_len // item_len
    return words_view(ptr, n_items * item_len).reshape(n_items, item_len // 8)


def fill_source(desc, room: int, lists: list[np.ndarray]) -> None:
    """Write the deterministic content of ``room`` into the items the lists address."""
    for c, (chan, idx) in enumerate(zip(channels_of(desc), lists)):
        if idx.size == 0:
            continue
        for j, (ptr, n, item) in enumerate(zip(chan.ptrs.tolist(), chan.lens.tolist(), chan.items.tolist())):
            m = _item_matrix(ptr, n, item)
            m[idx] = item_bases(room, c, j, idx.size)[:, None] + np.arange(item // 8, dtype=np.uint64)
    

def verify_destination(desc, room: int, lists: list[np.ndarray]) -> str | None:
    """``None`` when every addressed item holds the expected words; else what differs first."""
    for c, (chan, idx) in enumerate(zip(channels_of(desc), lists)):
        if idx.size == 0:
            continue
        for j, (ptr, n, item) in enumerate(zip(chan.ptrs.tolist(), chan.lens.tolist(), chan.items.tolist())):
            got = _item_matrix(ptr, n, item)[idx]
            base = item_bases(room, c, j, idx.size)
            expected_first = base
            if not np.array_equal(got[:, 0], expected_first):
                k = int(np.flatnonzero(got[:, 0] != expected_first)[0])
                return f"channel {c} ({chan.name}) buffer {j}: item {k} (index {int(idx[k])}) holds other content"
            if not np.array_equal(got - base[:, None], np.broadcast_to(np.arange(item // 8, dtype=np.uint64), got.shape)):
                return f"channel {c} ({chan.name}) buffer {j}: some item is partially written or shifted"
    return None


def plan_digest(room: int, lists: list[np.ndarray], desc) -> bytes:
    """Digest of the logical content of a request (room, per-channel item counts, buffer counts)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(room.to_bytes(8, "little"))
    for chan, idx in zip(channels_of(desc), lists):
        h.update(chan.name.encode() + len(chan.ptrs).to_bytes(4, "little") + idx.size.to_bytes(8, "little"))
        h.update(chan.items.tobytes())
    return h.digest()
