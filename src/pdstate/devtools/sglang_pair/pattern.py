"""What every byte of a transferred item should hold, and the check of a whole side's memory.

Each item a request moves (a page of one main-KV buffer, a window page of one SWA-state entry, a
C128 state row, an aux slot) has a *key*: what the item is (the buffer's role and layer), which
part of the request it holds (the page of the sequence, the window page, the C128 block) and its
length. The prefill writes the key's pattern into its source items just before sending; the decode
expects its own key's pattern in each destination item and its sentinel byte everywhere else, so
data that lands in another layer, another page or another ring slot, or bytes written outside the
destination, are all seen. Pure numpy; both children import it.
"""

from __future__ import annotations

import ctypes
import hashlib

import numpy as np

SENTINEL = 0xA5  # the decode's bytes before any transfer (no prefill byte ever holds it)
FOREIGN = 0x5A  # the prefill's bytes outside the items of the request being sent


def memory(ptr: int, length: int) -> np.ndarray:
    """A writable uint8 view of ``length`` bytes at ``ptr`` (a pool buffer of this process)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(ptr))


def tag(key: tuple) -> int:
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")


def item_bytes(key: tuple, length: int) -> np.ndarray:
    """The pattern of one item: 64-bit words counting up from the key's tag (offset-sensitive),
    with no sentinel byte in it, so that every byte a prefill sends is seen where it lands."""
    words = (length + 7) // 8
    start = np.uint64(tag(key))
    seq = (np.arange(words, dtype=np.uint64) + start).view(np.uint8)[:length]
    seq[seq == SENTINEL] = SENTINEL - 1
    return seq


def write_items(view: np.ndarray, item_len: int, items: dict[int, tuple]) -> None:
    """Write the pattern of ``key`` into item ``index`` of ``view`` for every ``index: key``."""
    for index, key in items.items():
        view[index * item_len : (index + 1) * item_len] = item_bytes(key, item_len)


def check_buffer(view: np.ndarray, item_len: int, items: dict[int, tuple]) -> tuple[int, int, int]:
    """``(bytes checked, wrong destination items, bytes changed outside the destinations)``."""
    wrong = 0
    inside = np.zeros(len(view), dtype=bool)
    for index, key in items.items():
        lo, hi = index * item_len, (index + 1) * item_len
        inside[lo:hi] = True
        if not np.array_equal(view[lo:hi], item_bytes(key, item_len)):
            wrong += 1
    outside = int(np.count_nonzero(view[~inside] != SENTINEL))
    return len(view), wrong, outside


def changed_bytes(view: np.ndarray) -> int:
    """Bytes of ``view`` that no longer hold the sentinel."""
    return int(np.count_nonzero(view != SENTINEL))
