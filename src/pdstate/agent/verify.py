"""Verification levels, the per-request sample, and digests bound to positions, on the host or on
the device where the memory lives.

Levels (``transfer.verify``): ``sampled`` (the default) digests a seeded sample of every
component (``SampleDigest``, sample rule ``SAMPLE_RULE`` = 3); ``full`` digests every byte
(``RequestDigest`` in host form, ``PositionDigest`` in device form); ``off`` digests nothing (the
handshake's checks alone). The decode names the level in its ``AgentRequest`` (``verify``; a
request without the field asks ``full`` when ``digest`` is true) and, at ``sampled``, the rule
(``sample_rule``); the prefill refuses a request that asks less than its own level, and a
``sampled`` one by another rule (``sample_rule_error``: absent is rule 1; rule 2 sampled 1 in 8
of each list), so what ran is what both sides agreed to and a mixed pair never fails as a digest mismatch.

What ``sampled`` reads. Channels are main KV (C4 KV, C4 indexer, C128 KV buffers), each state
component (the SWA one: SWA KV, C4 attention and indexer state rings; the C128 state; the draft's
SWA) and aux. Of channel ``c``'s list of ``n`` items (pages, rows, slots; aux: its one slot) the
sample holds positions ``0`` and ``n - 1`` and ``SAMPLE_OTHERS`` others, one in each of as many
equal strata of the positions between them, at splitmix64(``key`` xor stratum) mod the stratum's
length, ``key`` being the seed xor ``c << 56`` (``sample_positions``, the one rule: ``sample_mask``
and a chunk's pick read it off); as many items whatever the request's length, so the sample's
cost is flat in length. Of each such item every buffer of the channel (every layer); of each
buffer ``SAMPLE_BLOCKS`` blocks of ``SAMPLE_BLOCK`` bytes, one in each of the item's
``SAMPLE_BLOCKS`` equal parts, at an offset seeded per request, channel, buffer and block
(``block_offsets``; an item shorter than that: one block, or the whole item). For a
``dsv4-flash`` request that is about 85 KB on each side at 2k tokens as at 32k, gathered in one
numpy step, never fused into the copy: the prefill reads it on the thread that submitted the copy,
right after the submission when the copy is short (``inline``, under
``digest.INLINE_COPY_BYTES``: on the synchronous shm engine after the copy, on the others while
the engine copies; a longer copy hides it in the background), and the decode picks its sample on
its I/O thread once its request went out and reads it at ``TransferDone`` (no thread hop on
either side). It catches, in every one of 200 seeds
(``tests/agent/test_sampled_catches.py``): a one-page shift of the SWA window, a stale C128
state, a missing last chunk, two layers' state swapped — any fault that changes a sampled
item of every layer or the first or last item of a component. It misses a damaged byte outside
the blocks (or a page outside the sample): that is ``full``'s job.

The sample is a pure function of the request (``sample_seed``: its room and the decode's packed
page list, which both sides hold), so both sides read the same places. The digest is bound to
them: the sampled items' list positions go into a positions stream per channel, the blocks into
a data stream per channel in list order (item, buffer, block), so the prefill's chunks and the
decode's pieces give the same streams, and a shifted, stale, misplaced or missing write changes it.

Forms: ``host`` hashes bytes with xxh3 on the CPU. ``device`` reduces each item (``full``) or
block (``sampled``) where its memory lives to one 64-bit value (``lane_values``: the sum of its
words times fixed odd multipliers, modulo 2**64; a change of any one word changes it), with torch
on the memory's device, so only these values (8 bytes each) cross to the CPU; a host region in a
``device`` request is reduced by numpy (``lane_values_host``) to the same value. A request is
digested in ``device`` form when either side's memory is on a device (the decode asks with
``digest_form``; a prefill whose memory is on a device answers in that form and says so in
``TransferDone``). ``proto/PROTOCOL.md`` §3 (agent digests) gives every rule byte for byte.
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading
import time
from typing import Literal

import numpy as np
import xxhash

from pdstate.agent.digest import RequestDigest
from pdstate.errors import VerifyLevelRefused
from pdstate.pools.placement import memory_devices

__all__ = [
    "DEFAULT_LEVEL",
    "LEVELS",
    "PositionDigest",
    "SAMPLE_BLOCK",
    "SAMPLE_BLOCKS",
    "SAMPLE_OTHERS",
    "SAMPLE_RULE",
    "SampleDigest",
    "block_offsets",
    "check_level",
    "lane_values",
    "lane_values_host",
    "level_of",
    "memory_devices",
    "new_digest",
    "sample_mask",
    "sample_positions",
    "sample_rule_error",
    "sample_seed",
    "weaker",
]

Level = Literal["sampled", "full", "off"]
LEVELS: tuple[str, ...] = ("off", "sampled", "full")  # weakest first
DEFAULT_LEVEL = "sampled"
SAMPLE_OTHERS = 2  # items: seeded others of each channel's list, one per stratum (beside its first and last)
SAMPLE_BLOCK = 128  # bytes a block of the sample reads (an item shorter than that: all of it)
SAMPLE_BLOCKS = 2  # blocks of each sampled item, one in each half of it
SAMPLE_RULE = 3  # the sampling rule below (2: 1 in 8 of each list; 1: every state item, 1 in 8 main-KV pages whole)
_ROWS_PER_STEP = 256  # device form: items reduced at once (bounds the temporary)
_M64 = (1 << 64) - 1


def check_level(level: str) -> str:
    if level not in LEVELS:
        raise ValueError(f"verify: {level!r} is not one of 'sampled', 'full', 'off'")
    return level


def weaker(a: str, b: str) -> bool:
    """Whether level ``a`` checks less than level ``b``."""
    return LEVELS.index(a) < LEVELS.index(b)


def level_of(digest: bool, verify: str | None) -> str:
    """The level an ``AgentRequest`` asks: ``off`` without digests; ``full`` when it names none."""
    return "off" if not digest else (verify or "full")


def sample_rule_error(room: int, rule: int | None) -> VerifyLevelRefused | None:
    """Why a prefill refuses a ``sampled`` request naming sampling rule ``rule`` (``None``: rule 1,
    a decode from before ``sample_rule``): the two sides would digest different samples, and the
    request would fail as a digest mismatch that looks like corruption. ``None`` when it is ours."""
    rule = 1 if rule is None else rule
    if rule == SAMPLE_RULE:
        return None
    return VerifyLevelRefused(
        f"room {room}: the decode samples by rule {rule}, this prefill by rule {SAMPLE_RULE} "
        "(transfer.verify 'sampled' of another pdstate release): run the same release on both sides, "
        "or transfer.verify 'full' on the decode"
    )


def sample_seed(room: int, packed_pages: bytes) -> int:
    """The request's sample seed: both sides hold its room and the decode's packed page list."""
    return xxhash.xxh3_64_intdigest(b"pdstate-sample|%d|" % room + packed_pages)


_SPLITMIX = tuple(np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 30, 27, 31))


def _splitmix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser of each value, modulo 2**64 (array ufuncs in place: they wrap
    without a warning, and make no temporaries; ~4x faster than the same expression written out)."""
    c1, c2, c3, s30, s27, s31 = _SPLITMIX
    z = np.array(x, dtype=np.uint64)
    np.add(z, c1, out=z)
    np.bitwise_xor(z, np.right_shift(z, s30), out=z)
    np.multiply(z, c2, out=z)
    np.bitwise_xor(z, np.right_shift(z, s27), out=z)
    np.multiply(z, c3, out=z)
    np.bitwise_xor(z, np.right_shift(z, s31), out=z)
    return z


_C1, _C2, _C3 = (int(c) for c in _SPLITMIX[:3])


def _splitmix_int(x: int) -> int:
    """``_splitmix`` of one value, in Python integers (the same value: each step modulo 2**64)."""
    z = (x + _C1) & _M64
    z = ((z ^ (z >> 30)) * _C2) & _M64
    z = ((z ^ (z >> 27)) * _C3) & _M64
    return z ^ (z >> 31)


@functools.lru_cache(maxsize=1024)
def sample_positions(key: int, n: int) -> tuple[int, ...]:
    """The list positions the sample holds of a list of ``n`` items, ``key`` being the channel's
    seed (the request's seed xor ``c << 56``), ascending: the first, the last, and one of each of
    ``SAMPLE_OTHERS`` equal strata of the positions between them, at splitmix64(``key`` xor
    stratum) mod the stratum's length (every position when ``n`` is ``SAMPLE_OTHERS + 2`` or
    less). As many whatever ``n``: the sample's cost is flat in the request's length."""
    if n <= SAMPLE_OTHERS + 2:
        return tuple(range(n))
    inner, key = n - 2, key & _M64
    picks = []
    for s in range(SAMPLE_OTHERS):
        lo, hi = 1 + inner * s // SAMPLE_OTHERS, 1 + inner * (s + 1) // SAMPLE_OTHERS
        picks.append(lo + _splitmix_int(key ^ s) % (hi - lo))
    return (0, *picks, n - 1)


def _kept(key: int, start: int, k: int, n: int) -> list[int]:
    """``sample_positions`` of the ``k`` list positions from ``start`` (of a list of ``n``),
    ``key`` being the channel's seed: the offsets (from ``start``) of those the sample holds."""
    return [p - start for p in sample_positions(key, n) if start <= p < start + k]


def sample_mask(seed: int, positions: np.ndarray, n: int) -> np.ndarray:
    """Which list ``positions`` (of a list of ``n``) the sample holds (``sample_positions``, ``seed``
    being the channel's): a boolean per position."""
    return np.isin(np.asarray(positions, dtype=np.int64), np.array(sample_positions(seed & _M64, n), dtype=np.int64))


@functools.lru_cache(maxsize=64)
def _multipliers(words: int) -> np.ndarray:
    return _splitmix(np.arange(1, words + 1, dtype=np.uint64)) | np.uint64(1)


def _word(item_len: int) -> int:
    return 8 if item_len % 8 == 0 else 4 if item_len % 4 == 0 else 1


def lane_values_host(items: np.ndarray) -> np.ndarray:
    """``lane_values`` for host bytes (``items``: ``[k, item_len]`` uint8), by numpy: uint64."""
    k, n = items.shape
    w = _word(n)
    x = items.view({8: np.int64, 4: np.int32, 1: np.uint8}[w]).astype(np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        return (x * _multipliers(n // w)[None, :]).sum(axis=1, dtype=np.uint64) if k else np.empty(0, np.uint64)


def lane_values(items) -> np.ndarray:
    """Each item's 64-bit value, reduced on the tensor's own device (``items``: a ``[k, item_len]``
    uint8 torch tensor); only the ``k`` values come back to the CPU (as uint64)."""
    import torch

    k, n = items.shape
    w = _word(n)
    x = items.view({8: torch.int64, 4: torch.int32, 1: torch.uint8}[w])
    m = torch.from_numpy(_multipliers(n // w).view(np.int64)).to(items.device)
    out = [(x[i : i + _ROWS_PER_STEP].to(torch.int64) * m).sum(dim=1) for i in range(0, k, _ROWS_PER_STEP)]
    if not out:
        return np.empty(0, np.uint64)
    return torch.cat(out).cpu().numpy().view(np.uint64)  # k values, never the bytes


def _host_items(ptr: int, item_len: int, idx: np.ndarray) -> np.ndarray:
    """The items ``idx`` of a host buffer, gathered: ``[k, item_len]`` uint8 (a copy)."""
    lo, hi = int(idx.min()), int(idx.max())
    span = (ctypes.c_char * ((hi - lo + 1) * item_len)).from_address(ptr + lo * item_len)
    return np.frombuffer(span, dtype=np.uint8).reshape(-1, item_len)[idx - lo]


class _CudaSpan:
    """A device span as ``__cuda_array_interface__`` (torch wraps it without a copy)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def _device_items(ptr: int, item_len: int, idx: np.ndarray, device: str):
    """The items ``idx`` of a buffer as a ``[k, item_len]`` uint8 tensor on ``device`` (gathered
    there; a CPU "device" wraps the host bytes, which is how the device path runs without one)."""
    import torch

    lo, hi = int(idx.min()), int(idx.max())
    nbytes = (hi - lo + 1) * item_len
    if device == "cpu":
        span = (ctypes.c_char * nbytes).from_address(ptr + lo * item_len)
        base = torch.from_numpy(np.frombuffer(span, dtype=np.uint8))
    else:
        base = torch.as_tensor(_CudaSpan(ptr + lo * item_len, nbytes), device=device)
    return base.view(-1, item_len)[torch.from_numpy(idx - lo).to(base.device)]


class _BesideCopy(RequestDigest):
    """A digest hashed beside the copy, never fused into it: each update is read on the calling
    thread (``_rows`` picks, ``_run`` reads), and ``streams``/``fused_streams`` refuse with
    ``beside`` (the kind of digest, in the error's words)."""

    fusable = False
    beside = "a digest"  # what ``streams`` and ``fused_streams`` call this digest when they refuse

    def update_many(self, updates, threads: int | None = None) -> None:
        """``update`` for each ``(channel, indices)``, on this thread (what it reads is small, or
        only its values cross to the CPU)."""
        self.wait()
        with self._lock:
            self._run([r for c, idx in updates for r in self._rows(c, idx)])

    def streams(self, src, length):
        raise ValueError(f"{self.beside} is hashed beside the copy, not in it")

    def fused_streams(self, updates):
        raise ValueError(f"{self.beside} is hashed beside the copy, not in it")


class PositionDigest(_BesideCopy):
    """A request's digest at ``full`` in device form: per (channel, buffer) one xxh3_128 stream
    of ``(list position, lane value)`` records of every item in list order — see
    ``proto/PROTOCOL.md`` §3. ``devices``: per channel, per buffer, ``None`` (host memory) or a
    torch device; a host buffer is reduced by numpy unless ``torch_on_host`` (the device path on
    CPU tensors)."""

    beside = "a device-form digest"  # hashed beside the copy (only its values cross to the CPU)

    def __init__(
        self,
        layout,
        *,
        seed: int,
        n_pages: int,
        devices: list[list[str | None]] | None = None,
        torch_on_host: bool = False,
    ) -> None:
        super().__init__(layout)
        self.level, self.seed, self.n_pages, self.form = "full", seed, n_pages, "device"
        self._devices = devices or [[None] * len(p) for p, _ in layout]
        self._torch_on_host = torch_on_host
        self._next = [0] * len(layout)  # per channel: list positions taken so far

    def _rows(self, channel: int, indices) -> list:
        """``(channel, buffer, items, positions)`` per buffer of ``channel``; its count moved on."""
        idx = np.asarray(indices, dtype=np.int64)
        start = self._next[channel]
        self._next[channel] += idx.size
        pos = np.arange(start, start + idx.size, dtype=np.int64)
        if idx.size == 0:
            return []
        ptrs, items = self._layout[channel]
        self.bytes += int(idx.size * int(items.sum()))
        return [(channel, b, idx, pos) for b in range(len(ptrs))]

    def _run(self, rows: list) -> None:
        t0 = time.perf_counter()
        for channel, b, idx, pos in rows:
            ptrs, items = self._layout[channel]
            ptr, n, device = int(ptrs[b]), int(items[b]), self._devices[channel][b]
            if n == 0:
                continue
            if device is not None or self._torch_on_host:
                vals = lane_values(_device_items(ptr, n, idx, device or "cpu"))
            else:
                vals = lane_values_host(_host_items(ptr, n, idx))
            rec = np.stack([pos.astype(np.uint64), vals.astype(np.uint64)], axis=1).astype("<u8")
            self._hashers[channel][b].update(rec.tobytes())
        self.seconds += time.perf_counter() - t0

    def digest(self) -> bytes:
        self.wait()
        head = b"pdstate-verify|full|device|%d|%d|%s|" % (
            self.seed,
            self.n_pages,
            ",".join(map(str, self._next)).encode(),
        )
        empty = xxhash.xxh3_128().digest()  # the positions streams of the sampled rule 1, empty here
        head += empty * len(self._layout)
        return xxhash.xxh3_128(head + b"".join(h.digest() for hs in self._hashers for h in hs)).digest()


class _HostSpan:
    """Host bytes from ``lo`` as ``__array_interface__`` (numpy wraps them without a copy, and
    without a new ctypes type per length): ``nbytes`` bytes, or with ``row`` that many
    overlapping ``row``-byte elements, element ``i`` starting at ``lo + i`` (gathered with one
    copy each)."""

    def __init__(self, lo: int, nbytes: int, row: int = 0) -> None:
        shape, strides, typestr = ((nbytes,), (1,), f"|V{row}") if row else ((nbytes,), None, "|u1")
        self.__array_interface__ = {
            "shape": shape,
            "strides": strides,
            "typestr": typestr,
            "data": (lo, False),
            "version": 3,
        }


def _block_grid(item_lens) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per buffer (item lengths ``item_lens``): the block length, the stratum length (0: one
    stratum, the whole item), the alignment and the number of offsets a block can take."""
    return _grid_of(np.asarray(item_lens, dtype=np.int64).tobytes())


@functools.lru_cache(maxsize=64)
def _grid_of(item_lens: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    n = np.frombuffer(item_lens, dtype=np.int64)
    block = np.minimum(n, SAMPLE_BLOCK)
    align = np.where((n % 8 == 0) & (block % 8 == 0), 8, 1)
    stratum = np.where(n // SAMPLE_BLOCKS >= block, n // SAMPLE_BLOCKS, 0)
    slots = np.where(stratum > 0, stratum - block, n - block) // align + 1
    return block, stratum, align, slots


def block_offsets(seed: int, channel: int, item_lens) -> np.ndarray:
    """The byte offsets, inside each sampled item of ``channel``, of the blocks the sample reads
    there: one row per buffer (item lengths ``item_lens``), one column per block,
    ``[buffers, SAMPLE_BLOCKS]`` int64. Block ``j`` of buffer ``b`` lies in the item's stratum
    ``j`` (its ``SAMPLE_BLOCKS`` equal parts; an item too short for that has one, the whole item),
    at ``r mod slots`` times the alignment, ``r`` being
    splitmix64(``b << 8 | j``) xor splitmix64(seed xor ``channel << 56``)."""
    _, stratum, align, slots = _block_grid(item_lens)
    r = _block_mix(stratum.size) ^ np.uint64(_splitmix_int((seed ^ (channel << 56)) & _M64))
    j = np.arange(SAMPLE_BLOCKS, dtype=np.int64)[None, :]
    return j * stratum[:, None] + (r % slots.astype(np.uint64)[:, None]).astype(np.int64) * align[:, None]


@functools.lru_cache(maxsize=64)
def _block_mix(buffers: int) -> np.ndarray:
    """splitmix64(``b << 8 | j``) per buffer ``b`` and block ``j``: ``[buffers, SAMPLE_BLOCKS]``
    uint64 (what a block's offset mixes with the request's channel key)."""
    bj = (np.arange(buffers, dtype=np.uint64)[:, None] << np.uint64(8)) | np.arange(SAMPLE_BLOCKS, dtype=np.uint64)
    out = _splitmix(bj)
    out.flags.writeable = False
    return out


class _SampleShape:
    """What a sampled digest of one layout needs whatever the request, made once per layout
    (``_sample_shape``): per channel its addresses and item lengths (uint64, as ``RequestDigest``
    keeps them) and its span of the flat buffer list; per buffer (flat, channel by channel) its
    address, item length, block length, stratum, alignment, slots and ``b << 8 | j`` per block;
    per channel the blocks' lengths and buffers of one sampled item in read order (buffer, then
    block), their bytes, and whether every block is whole (``SAMPLE_BLOCK`` bytes: gathered
    together with the other such channels, host form)."""

    def __init__(self, layout) -> None:
        self.layout = [(np.asarray(p, dtype=np.uint64), np.asarray(i, dtype=np.uint64)) for p, i in layout]
        sizes = [len(p) for p, _ in self.layout]
        self.channels = len(sizes)
        flat = [np.asarray(x, dtype=np.uint64).astype(np.int64) for pair in self.layout for x in pair]
        self.ptrs = np.concatenate(flat[0::2]) if flat else np.empty(0, np.int64)
        self.items = np.concatenate(flat[1::2]) if flat else np.empty(0, np.int64)
        self.channel = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
        bounds = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64))).astype(np.int64)
        self.block, self.stratum, self.align, self.slots = _block_grid(self.items)
        self.slots_u64 = self.slots.astype(np.uint64)[:, None]
        self.strata = np.arange(SAMPLE_BLOCKS, dtype=np.int64)[None, :] * self.stratum[:, None]
        self.mix = np.concatenate([_block_mix(k) for k in sizes]) if sizes else np.empty((0, SAMPLE_BLOCKS), np.uint64)
        self.base = self.ptrs[:, None] + self.strata  # per buffer and block: its stratum's address in item 0
        self.spans = list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))
        self.item_lens, self.lens, self.bufs, self.item_bytes, self.whole, self.cols = [], [], [], [], [], []
        self.flat_lens = np.repeat(self.items, SAMPLE_BLOCKS)  # per buffer and block, flat: its item length
        for lo, hi in self.spans:
            blocks = self.block[lo:hi]
            one = hi > lo and int(blocks.min()) == int(blocks.max())
            self.cols.append(np.arange(lo * SAMPLE_BLOCKS, hi * SAMPLE_BLOCKS, dtype=np.int64))
            self.item_lens.append(self.flat_lens[lo * SAMPLE_BLOCKS : hi * SAMPLE_BLOCKS])  # a view, read order
            self.lens.append(int(blocks[0]) if one else np.repeat(blocks, SAMPLE_BLOCKS))
            self.bufs.append(np.repeat(np.arange(hi - lo), SAMPLE_BLOCKS))
            self.item_bytes.append(int(blocks.sum()) * SAMPLE_BLOCKS)
            self.whole.append(one and int(blocks[0]) == SAMPLE_BLOCK)
        self._columns: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def columns(self, blocks: tuple[tuple[int, int], ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For ``blocks``, ``(channel, blocks read)`` of whole-block channels in read order (each a
        whole number of the channel's sampled items): per block read, its column in the flat
        (buffer, block) table, its item length, and which sampled item (of all of them, in read
        order) it lies in. Made once per ``blocks`` (a request's counts repeat)."""
        got = self._columns.get(blocks)
        if got is None:
            at, slot, items = [], [], 0
            for c, k in blocks:
                cols = self.cols[c]
                for _ in range(k // cols.size):
                    at.append(cols)
                    slot.append(np.full(cols.size, items, dtype=np.int64))
                    items += 1
            at_ = np.concatenate(at)
            got = (at_, self.flat_lens[at_], np.concatenate(slot))
            if len(self._columns) >= 256:
                self._columns.clear()
            self._columns[blocks] = got
        return got

    def first(self, seed: int) -> np.ndarray:
        """Per buffer and block of a request of sample seed ``seed``: its address in item 0 (the
        buffer's address plus ``block_offsets``), ``[buffers, SAMPLE_BLOCKS]`` int64."""
        keys = np.array([_splitmix_int((seed ^ (c << 56)) & _M64) for c in range(self.channels)], dtype=np.uint64)
        r = self.mix ^ keys[self.channel][:, None]
        np.remainder(r, self.slots_u64, out=r)
        return self.base + r.view(np.int64) * self.align[:, None]


@functools.lru_cache(maxsize=32)
def _shape_of(key: tuple) -> _SampleShape:
    return _SampleShape(key)


_SEEN: dict[tuple, tuple[list, _SampleShape]] = {}  # the lists of a layout given before (by identity), and its shape


def _sample_shape(layout) -> _SampleShape:
    """The shape of ``layout`` (``[(ptrs, item_lens)]`` per channel), made once per layout: both
    agents digest every request over the same layout. A layout of the very lists given before
    (an agent's, sliced per request) is found by their identity, checked equal to what they held
    then, without building its key."""
    ids = tuple(id(x) for pair in layout for x in pair)
    seen = _SEEN.get(ids)
    if seen is not None and all(
        type(x) is list and x == y for x, y in zip((x for pair in layout for x in pair), seen[0])
    ):
        return seen[1]
    shape = _shape_of(
        tuple(
            (
                tuple(p) if type(p) is list else tuple(np.asarray(p).tolist()),
                tuple(i) if type(i) is list else tuple(np.asarray(i).tolist()),
            )
            for p, i in layout
        )
    )
    lists = [x for pair in layout for x in pair]
    if all(type(x) is list for x in lists):
        if len(_SEEN) >= 32:
            _SEEN.clear()
        _SEEN[ids] = ([list(x) for x in lists], shape)  # copies: a list changed since is not this layout
    return shape


class SampleDigest(_BesideCopy):
    """A request's digest at ``sampled`` (sample rule ``SAMPLE_RULE``), host or device form: per
    channel the items of the sample (``sample_positions`` of the channel's list, the channel in the
    seed), of each such item every buffer, of each buffer ``SAMPLE_BLOCKS`` blocks of
    ``SAMPLE_BLOCK`` bytes at the request's seeded offsets (``block_offsets``). Each channel has
    one data stream (the blocks' bytes, host form; ``u64le(lane value)`` per block, device form)
    and one positions stream (the sampled items' list positions, u64le), both in list order
    (item, then buffer, then block), so the prefill's chunks and the decode's pieces give the same
    streams. Small and flat in length (about 85 KB at any length of ``dsv4-flash``): gathered and hashed
    beside the copy, never fused into it (host form: on the submitting thread, ``inline``), and a last chunk's state not sent ahead of its pages
    (``split_state``). What does not depend on the request (the layout's table) is made once per
    layout (``_sample_shape``)."""

    beside = "a sampled digest"
    split_state = False

    @property
    def inline(self) -> bool:
        """Whether the prefill reads this digest's updates on the thread that submits the copy,
        right after submitting it, when the copy is short (``digest.submit_digested``,
        ``INLINE_COPY_BYTES``): the host form, a sample too small to be worth a thread hop (and a
        third thread beside a copy that has every core)."""
        return self.form == "host"

    def __init__(
        self,
        layout,
        *,
        seed: int,
        lengths: list[int],
        form: str = "host",
        devices: list[list[str | None]] | None = None,
        torch_on_host: bool = False,
    ) -> None:
        # ``RequestDigest``'s state, less its per-buffer hashers (this digest has one stream per channel)
        self._shape = _sample_shape(layout)
        self._layout = self._shape.layout
        self._hashers = []
        self.bytes, self.seconds, self.fused = 0, 0.0, False
        self._lock, self._qlock = threading.Lock(), threading.Lock()
        self._queue, self._pending, self._cancelled, self._flat = [], [], False, None
        self.level, self.seed, self.form = "sampled", seed, form
        self.lengths = list(lengths) + [1] * (len(layout) - len(lengths))  # per channel: its list's length
        self._devices = devices or [[None] * len(p) for p, _ in layout]
        self._torch_on_host = torch_on_host
        self._next = [0] * len(layout)
        self._data = [xxhash.xxh3_128() for _ in layout]
        self._pos_hashers = [xxhash.xxh3_128() for _ in layout]
        self._first = None  # per buffer and block: its address in the buffer's item 0 (made on first use)
        self._prepared = None  # ``prepare``'s rows and their plan

    def _rows(self, channel: int, indices) -> list:
        """One update: ``(channel, its items, the list position of the first)``; the channel's
        count moved on (the sample is picked and read by ``_run``)."""
        idx = np.asarray(indices, dtype=np.int64)
        start = self._next[channel]
        self._next[channel] += idx.size
        return [(channel, idx, start)] if idx.size else []

    def _plan(self, rows: list) -> tuple:
        """Pick the sample of ``rows``: per channel the sampled list positions (u64le bytes), the
        blocks' addresses, lengths and buffers (``parts``), and the addresses of the blocks of
        every channel whose blocks are whole, concatenated (host form: gathered at once)."""
        shape = self._shape
        if self._first is None:
            self._first = shape.first(self.seed)
        first, host = self._first, self.form == "host"
        positions, parts, nbytes = [], [], 0
        items: list[int] = []  # host form, channels of whole blocks: the sampled items, in read order,
        sizes: list[tuple[int, int]] = []  # and per channel its blocks (gathered at once)
        for channel, idx, start in rows:
            kept = _kept((self.seed ^ (channel << 56)) & _M64, start, idx.size, self.lengths[channel])
            if not kept:
                continue
            positions.append((channel, struct.pack(f"<{len(kept)}Q", *(p + start for p in kept))))
            lo, hi = shape.spans[channel]
            if hi == lo:
                continue
            nbytes += shape.item_bytes[channel] * len(kept)
            if host and shape.whole[channel]:
                items += idx[kept].tolist()
                sizes.append((channel, len(kept) * shape.cols[channel].size))
                continue
            # per sampled item, per buffer and block (read order): item 0's address + item * length
            addr = np.multiply.outer(idx[kept], shape.item_lens[channel])
            addr += first[lo:hi].reshape(1, -1)
            addr = addr.reshape(-1)
            lens = shape.lens[channel]
            if not isinstance(lens, int):
                lens = np.tile(lens, len(kept))
            parts.append((channel, addr, lens, None if host else np.tile(shape.bufs[channel], len(kept))))
        together = None
        if items:  # every whole block's address at once: item 0's address + item * item length
            at, lens_at, slot = shape.columns(tuple(sizes))
            together = (sizes, first.reshape(-1)[at] + np.array(items, dtype=np.int64)[slot] * lens_at)
        return positions, parts, together, nbytes

    def prepare(self, updates) -> None:
        """Pick the sample of ``updates`` now (the next updates this digest will be given), so that
        reading it later is only the gather and the hash: the decode prepares its whole request
        on its I/O thread once its request went out, while the prefill copies. Used by
        ``update_many`` when it is given these very updates (nothing is read here: touching
        the blocks ahead cost the prefill's copy CPU on two cores and saved nothing later)."""
        with self._lock:
            nxt, rows = list(self._next), []
            for c, idx in updates:
                idx = np.asarray(idx, dtype=np.int64)
                if idx.size:
                    rows.append((c, idx, nxt[c]))
                    nxt[c] += idx.size
            self._prepared = (_rows_key(rows), self._plan(rows))

    def _run(self, rows: list) -> None:
        """Pick (unless ``prepare`` did) and read the sample of ``rows``: the blocks of every
        channel gathered at once where they have one length (host form), each channel's streams
        fed in order."""
        t0 = time.perf_counter()
        prepared, self._prepared = self._prepared, None
        if prepared is not None and prepared[0] == _rows_key(rows):
            positions, parts, together, nbytes = prepared[1]
        else:
            positions, parts, together, nbytes = self._plan(rows)
        self.bytes += nbytes
        for channel, pos in positions:
            self._pos_hashers[channel].update(pos)
        if together is not None:  # one gather for every channel whose blocks are whole
            sizes, addr = together
            got, at = _gather_host(addr, SAMPLE_BLOCK), 0
            for channel, k in sizes:
                self._data[channel].update(got[at : at + k])
                at += k
        for channel, addr, lens, bufs in parts:
            if self.form == "host":
                self._data[channel].update(_read_host(addr, lens))
            else:
                self._data[channel].update(self._lane_values(channel, addr, lens, bufs).astype("<u8").tobytes())
        self.seconds += time.perf_counter() - t0

    def _lane_values(self, channel: int, addr: np.ndarray, lens: np.ndarray, bufs: np.ndarray) -> np.ndarray:
        """Each block's lane value, reduced where its memory lives (grouped by device and length)."""
        out = np.empty(addr.size, dtype=np.uint64)
        devices = self._devices[channel]
        lens = np.broadcast_to(lens, addr.shape)
        for device in set(devices):
            on = np.isin(bufs, [b for b, d in enumerate(devices) if d == device])
            for n in np.unique(lens[on]).tolist():
                sel = np.flatnonzero(on & (lens == n))
                if device is not None or self._torch_on_host:
                    out[sel] = lane_values(_gather_device(addr[sel], n, device or "cpu"))
                else:
                    out[sel] = lane_values_host(_gather_host(addr[sel], n))
        return out

    def digest(self) -> bytes:
        self.wait()
        head = b"pdstate-verify|sampled|rule%d|%s|%d|%s|%s|" % (
            SAMPLE_RULE,
            self.form.encode(),
            self.seed,
            ",".join(map(str, self.lengths)).encode(),
            ",".join(map(str, self._next)).encode(),
        )
        body = b"".join(p.digest() + d.digest() for p, d in zip(self._pos_hashers, self._data))
        return xxhash.xxh3_128(head + body).digest()


def _rows_key(rows: list) -> tuple:
    return tuple((c, start, idx.tobytes()) for c, idx, start in rows)


def _gather_host(addr: np.ndarray, lens: np.ndarray | int) -> np.ndarray:
    """The host bytes of the blocks at ``addr`` (each ``lens`` bytes, or ``lens[k]``), in order:
    ``[k, lens]`` uint8, or the concatenation (uint8) for blocks of several lengths. One gather
    over the span they lie in, which is never read outside the blocks."""
    lo = int(addr.min())
    rel = addr - lo
    if isinstance(lens, int):  # rows of n bytes starting at every byte of the span: row i is lo + i
        n = int(lens)
        rows = np.asarray(_HostSpan(lo, int(rel.max()) + 1, n))
        return rows[rel].view(np.uint8).reshape(-1, n)
    span = np.asarray(_HostSpan(lo, int((rel + lens).max())))
    starts = np.repeat(rel - np.concatenate(([0], np.cumsum(lens)[:-1])), lens)
    return span[starts + np.arange(int(lens.sum()))]


_FEW_BLOCKS = 8  # blocks read one by one (``ctypes.string_at``) rather than gathered by numpy


def _read_host(addr: np.ndarray, lens: np.ndarray | int) -> bytes | np.ndarray:
    """The bytes ``_gather_host`` gathers, concatenated: a few blocks (aux's slot) read one by one,
    without the numpy calls of a gather."""
    if addr.size > _FEW_BLOCKS:
        return _gather_host(addr, lens)
    sizes = [lens] * addr.size if isinstance(lens, int) else lens.tolist()
    return b"".join(map(ctypes.string_at, addr.tolist(), sizes))


def _gather_device(addr: np.ndarray, n: int, device: str):
    """The blocks at ``addr`` (each ``n`` bytes) as a ``[k, n]`` uint8 tensor on ``device``,
    gathered there (a CPU "device" wraps the host bytes)."""
    import torch

    lo, hi = int(addr.min()), int(addr.max()) + n
    if device == "cpu":
        base = torch.from_numpy(np.asarray(_HostSpan(lo, hi - lo)))
    else:
        base = torch.as_tensor(_CudaSpan(lo, hi - lo), device=device)
    rel = torch.from_numpy(addr - lo).to(base.device)
    return base[rel[:, None] + torch.arange(n, device=base.device)[None, :]]


def new_digest(
    layout,
    level: str,
    *,
    room: int,
    packed_pages: bytes,
    lengths: list[int],
    form: str = "host",
    devices=None,
) -> RequestDigest | None:
    """The digest one side keeps for a request at ``level`` (``None`` at ``off``): ``full`` in host
    form is ``RequestDigest`` (every byte, as before the levels), in device form a
    ``PositionDigest``; ``sampled`` a ``SampleDigest``. ``lengths``: per channel, the length of
    the request's list (main-KV pages, each state component's; aux: 1)."""
    if level == "off":
        return None
    seed = sample_seed(room, packed_pages)
    if level == "sampled":
        return SampleDigest(layout, seed=seed, lengths=lengths, form=form, devices=devices)
    if form == "host":
        return RequestDigest(layout)
    return PositionDigest(layout, seed=seed, n_pages=lengths[0], devices=devices)


def layout_devices(layout) -> list[list[str | None]]:
    """``memory_devices`` per channel of a digest layout (``common.channel_layout``)."""
    return [memory_devices([int(p) for p in ptrs]) for ptrs, _ in layout]


def on_device(devices) -> bool:
    return any(d is not None for ds in devices for d in ds)


def request_digest(layout, devices, req, n_channels: int, level: str, form: str | None = None):
    """One side's digest of the request ``req`` (a ``wire.AgentRequest``) at ``level``: its
    channels (aux only when the request names an aux slot), in ``form`` (default: ``device`` when
    the request asks it or this side's memory is on a device)."""
    if level == "off":
        return None
    k = len(layout) if req.dst_aux is not None else n_channels
    if form is None:
        form = "device" if req.digest_form == "device" or on_device(devices[:k]) else "host"
    return new_digest(
        layout[:k],
        level,
        room=req.room,
        packed_pages=req.dst_kv_pages.data,
        lengths=[len(req.dst_kv_pages), *(len(s) for s in req.dst_state_indices), 1][:k],
        form=form,
        devices=devices[:k],
    )


def wire_form(digest) -> str | None:
    """``TransferDone.digest_form`` for a digest: ``"device"``, or ``None`` for the host form."""
    return "device" if getattr(digest, "form", "host") == "device" else None
