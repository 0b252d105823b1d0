"""Byte images of destination memory: a sentinel fill, read-backs, and what a transfer must leave.

Before a transfer every destination byte is set to ``SENTINEL``; afterwards the memory must equal,
byte for byte, the sentinel everywhere except the items the request addressed.
"""

from __future__ import annotations

import ctypes

import numpy as np

from pdstate.pools.memory import Region
from pdstate.transfer.planner import channels_of
from pdstate.worker import synth

SENTINEL = 0xA5


def fill_regions(regions: list[Region], byte: int = SENTINEL) -> None:
    for r in regions:
        ctypes.memset(r.base_ptr, byte, r.nbytes)


def region_bytes(r: Region) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * r.nbytes).from_address(r.base_ptr)).copy()


def expected_images(regions: list[Region], desc, room: int, lists: list[np.ndarray]) -> list[np.ndarray]:
    """Every region as it must be after ``room`` landed on a sentinel-filled pool: the room's
    deterministic content in exactly the items its index lists address, the sentinel elsewhere."""
    images = [np.full(r.nbytes, SENTINEL, dtype=np.uint8) for r in regions]
    owner = [np.zeros(r.nbytes, dtype=bool) for r in regions]
    order = sorted(range(len(regions)), key=lambda i: regions[i].base_ptr)
    bases = np.array([regions[i].base_ptr for i in order], dtype=np.int64)
    for c, (chan, idx) in enumerate(zip(channels_of(desc), lists)):
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size == 0:
            continue
        for j, (ptr, n, item) in enumerate(zip(chan.ptrs.tolist(), chan.lens.tolist(), chan.items.tolist())):
            assert item % 8 == 0, (chan.name, item)
            assert int(idx.max()) * item + item <= n, f"{chan.name}[{j}]: index past the buffer"
            k = int(np.searchsorted(bases, ptr, side="right")) - 1
            r = order[max(k, 0)]
            assert k >= 0 and ptr + n <= regions[r].base_ptr + regions[r].nbytes, (
                f"{chan.name}[{j}] outside every region"
            )
            words = synth.item_bases(room, c, j, idx.size)[:, None] + np.arange(item // 8, dtype=np.uint64)
            offsets = (ptr - regions[r].base_ptr + idx * item)[:, None] + np.arange(item)
            assert not owner[r][offsets].any(), f"{chan.name}[{j}]: destination items overlap another's"
            owner[r][offsets] = True
            images[r][offsets] = words.astype("<u8").view(np.uint8).reshape(idx.size, item)
    return images


def compare_images(regions: list[Region], expected: list[np.ndarray]) -> str | None:
    """``None`` when every region equals its expected image; else where the first difference is."""
    for r, exp in zip(regions, expected):
        got = region_bytes(r)
        if not np.array_equal(got, exp):
            off = int(np.flatnonzero(got != exp)[0])
            where = "outside the request's destination" if exp[off] == SENTINEL else "inside the destination"
            return (
                f"region {r.name}: byte {off} is {got[off]:#04x}, expected {exp[off]:#04x} ({where}); "
                f"{int((got != exp).sum())} bytes differ"
            )
    return None
