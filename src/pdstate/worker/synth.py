"""Deterministic stand-in for prefill compute, and the decode's independent verification.

The reference workers do not run a model. The prefill writes, into exactly the source items a
request's plan will read, words derived only from ``(room, channel, buffer, position)``: item ``k``
of buffer ``j`` of channel ``c`` holds the uint64 words ``base + w`` for ``w = 0..item_len/8-1``,
``base = mix(room, c, j, k)``. The decode, knowing only the room and its own destination indices,
checks what landed: per item, the first word must equal ``base`` and the 64-bit wrapping sum of
the item's words must equal ``W*base + W*(W-1)/2``. A wrong page, a shifted offset, a stale draft
slot or a half-written item fails (a collision needs a 2^-64 coincidence of random bases).

Both passes run per contiguous run of indices on numpy views of the buffers: one pass over the
bytes each (torch's threaded kernels measured 10-100x slower here for item-sized broadcasts).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib

import numpy as np

from pdstate.transfer.planner import channels_of

_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


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
    """The base words of items ``0..count-1`` of one buffer (the per-buffer definition)."""
    seed = np.uint64(((room * _GOLDEN) ^ (channel << 48) ^ (buffer << 32)) & _MASK)
    return _mix(seed + np.arange(count, dtype=np.uint64) * np.uint64(_GOLDEN))


def channel_bases(room: int, channel: int, buffers: int, count: int) -> np.ndarray:
    """``[buffers, count]`` base words of one channel, in one vectorised pass (a per-buffer call
    cost ~20 us of numpy overhead, 3 ms over a ``dsv4-flash`` request's 148 buffers)."""
    j = np.arange(buffers, dtype=np.uint64)
    seeds = (np.uint64((room * _GOLDEN) & _MASK) ^ np.uint64(channel << 48)) ^ (j << np.uint64(32))
    return _mix(seeds[:, None] + np.arange(count, dtype=np.uint64)[None, :] * np.uint64(_GOLDEN))


def words_view(ptr: int, nbytes: int) -> np.ndarray:
    """A writable uint64 numpy view of ``nbytes`` at ``ptr`` (memory owned elsewhere)."""
    buf = (ctypes.c_uint64 * (nbytes // 8)).from_address(ptr)
    return np.ctypeslib.as_array(buf)


def item_matrix(ptr: int, data_len: int, item_len: int) -> np.ndarray:
    n_items = data_len // item_len
    return words_view(ptr, n_items * item_len).reshape(n_items, item_len // 8)


@functools.lru_cache(maxsize=8192)
def _items(ptr: int, data_len: int, item_len: int) -> np.ndarray:
    """The buffer as a uint64 array ``[n_items, item_len/8]`` (a view, no copy).

    Cached: registered buffers live as long as their worker, and building a view through ctypes
    costs ~100 us, which would dominate a small request's 150 buffers.
    """
    return item_matrix(ptr, data_len, item_len)


@functools.lru_cache(maxsize=64)
def _ramp(words: int) -> np.ndarray:
    return np.arange(words, dtype=np.uint64)


_CHANNELS: dict[int, tuple[object, list, dict]] = {}


def _cached(desc) -> tuple[object, list, dict]:
    """``(desc, channels_of(desc), per-spans sample layouts)``, kept per descriptor object (a
    worker's own ``KVArgs`` lives as long as the worker; the reference held here keeps its id
    from being reused while the entry exists)."""
    hit = _CHANNELS.get(id(desc))
    if hit is not None and hit[0] is desc:
        return hit
    if len(_CHANNELS) >= 64:
        _CHANNELS.pop(next(iter(_CHANNELS)))
    hit = _CHANNELS[id(desc)] = (desc, channels_of(desc), {})
    return hit


def _channels_of(desc) -> list:
    return _cached(desc)[1]


def _runs(idx: np.ndarray) -> list[tuple[int, int, int]]:
    """``(position in list, first index, length)`` of each run of consecutive indices."""
    brk = np.flatnonzero(np.diff(idx) != 1) + 1
    pos = np.concatenate(([0], brk))
    lengths = np.diff(np.concatenate((pos, [idx.size])))
    return list(zip(pos.tolist(), idx[pos].tolist(), lengths.tolist()))


def _channels(desc, room: int, lists):
    """Per channel with indices: ``(channel no., name, idx, runs, bases [buffers, items],
    item matrices)``."""
    for c, (chan, idx) in enumerate(zip(_channels_of(desc), lists)):
        if idx.size == 0:
            continue
        mats = [
            _items(ptr, n, item) for ptr, n, item in zip(chan.ptrs.tolist(), chan.lens.tolist(), chan.items.tolist())
        ]
        yield c, chan.name, idx, _runs(idx), channel_bases(room, c, len(mats), idx.size), mats


def _first_mismatch(c: int, name: str, idx: np.ndarray, bad: np.ndarray) -> str:
    """What ``bad`` (``[buffers, items]``) says first, as the verification's message."""
    j, k = (int(x[0]) for x in np.nonzero(bad))
    return (
        f"channel {c} ({name}) buffer {j}: item {k} (index {int(idx[k])}) "
        "holds other content (stale, misplaced or partially written)"
    )


def fill_source(desc, room: int, lists: list[np.ndarray]) -> None:
    """Write the deterministic content of ``room`` into the items the lists address."""
    for _, _, _idx, runs, bases, mats in _channels(desc, room, lists):
        for j, m in enumerate(mats):
            base = bases[j, :, None]
            ramp = _ramp(m.shape[1])
            for p, s, n in runs:
                np.add(base[p : p + n], ramp, out=m[s : s + n])


def verify_destination(desc, room: int, lists: list[np.ndarray]) -> str | None:
    """``None`` when every addressed item holds the room's content; else what differs first.

    One read pass: per buffer and run of indices, the first words and the row sums go into
    per-channel arrays that are compared with the expected values at once."""
    for c, name, idx, runs, bases, mats in _channels(desc, room, lists):
        firsts = np.empty_like(bases)
        sums = np.empty_like(bases)
        widths = np.empty(len(mats), dtype=np.uint64)
        for j, m in enumerate(mats):
            widths[j] = m.shape[1]
            f, sm, col0 = firsts[j], sums[j], m[:, 0]
            for p, s, n in runs:
                f[p : p + n] = col0[s : s + n]
                np.add.reduce(m[s : s + n], axis=1, out=sm[p : p + n])
        w = widths[:, None]
        expected = bases * w + ((w * (w - np.uint64(1))) // np.uint64(2))
        bad = (firsts != bases) | (sums != expected)
        if bad.any():
            return _first_mismatch(c, name, idx, bad)
    return None


@functools.lru_cache(maxsize=64)
def _span_words(base: int, nbytes: int) -> np.ndarray:
    return words_view(base, nbytes - nbytes % 8)


def _sample_layout(desc, spans: tuple[tuple[int, int], ...]) -> list:
    """Per channel: the word view of the span holding all its buffers, each buffer's first word
    in that view, and its item length in words (``None`` for a channel outside every span)."""
    _, chans, layouts = _cached(desc)
    if spans in layouts:
        return layouts[spans]
    out = []
    for chan in chans:
        ends = chan.ptrs + chan.lens
        home = [(b, n) for b, n in spans if chan.ptrs.size and int(chan.ptrs.min()) >= b and int(ends.max()) <= b + n]
        if not home or np.any(chan.ptrs % np.uint64(8)) or np.any(chan.items % np.uint64(8)):
            out.append(None)
            continue
        base, nbytes = home[0]
        out.append(
            (
                _span_words(base, nbytes),
                (chan.ptrs - np.uint64(base)) // np.uint64(8),
                (chan.items // np.uint64(8))[:, None],
            )
        )
    layouts[spans] = out
    return out


def verify_sample(desc, room: int, lists: list[np.ndarray], spans: list[tuple[int, int]]) -> str | None:
    """Like ``verify_destination``, reading only the first word of every addressed item and the
    last word of every run of consecutive items (the end of each copy that wrote them): a wrong,
    shifted or stale item, or a copy cut short, still fails; damage strictly inside an item does
    not. Two gathers per channel: O(items) reads, not O(bytes) (on 4 KiB pages each read is a
    TLB and cache miss, so fewer reads is what makes it cheap).

    ``spans``: the ``(base_ptr, nbytes)`` of the memory regions the buffers live in.
    """
    return sample_check(desc, room, lists, spans).run()


class SampleCheck:
    """``verify_sample`` in two steps: everything that needs only the room and the indices (the
    expected words and where to read them), worked out by ``sample_check`` while the bytes are
    still on their way, then ``run()``: the two gathers and the comparison, once they landed."""

    __slots__ = ("_parts",)

    def __init__(self, parts: list) -> None:
        self._parts = parts

    def run(self) -> str | None:
        """``None`` when every sampled word holds the room's content; else what differs first."""
        for c, name, idx, words, pos, bases, ends, end_pos, end_want in self._parts:
            bad = words[pos] != bases
            bad[:, ends] |= words[end_pos] != end_want
            if bad.any():
                return _first_mismatch(c, name, idx, bad)
        return None


def verify(desc, room: int, lists: list[np.ndarray], how: str, memory) -> str | None:
    """What landed in ``lists`` against the room's content: ``full`` (every byte) or ``sample``
    (over ``memory``'s regions); ``None`` when it matches, else the first mismatch."""
    if how == "sample":
        return verify_sample(desc, room, lists, [(r.base_ptr, r.nbytes) for r in memory.regions()])
    return verify_destination(desc, room, lists)


def sample_check(desc, room: int, lists: list[np.ndarray], spans: list[tuple[int, int]]) -> SampleCheck:
    """The prepared ``verify_sample`` of ``room`` (see ``SampleCheck``); raises ``ValueError``
    for a channel whose buffers lie outside ``spans``."""
    chans = _channels_of(desc)
    layout = _sample_layout(desc, tuple(sorted(spans)))
    parts = []
    for c, (chan, idx, lay) in enumerate(zip(chans, lists, layout)):
        if idx.size == 0 or chan.ptrs.size == 0:
            continue
        if lay is None:
            raise ValueError(f"channel {c} ({chan.name}): buffers outside the given spans")
        words, off, iw = lay
        bases = channel_bases(room, c, chan.ptrs.size, idx.size)
        pos = off[:, None] + idx.astype(np.uint64)[None, :] * iw  # first word of every item
        if idx.size <= 64:
            il = idx.tolist()
            ends = [k for k in range(len(il) - 1) if il[k + 1] != il[k] + 1] + [len(il) - 1]
        else:
            ends = np.append(np.flatnonzero(np.diff(idx) != 1), idx.size - 1)
        last = iw - np.uint64(1)  # the last word of the item ending each run
        parts.append((c, chan.name, idx, words, pos, bases, ends, pos[:, ends] + last, bases[:, ends] + last))
    return SampleCheck(parts)


# -- a running request's decode steps ---------------------------------------------------------
#
# ``pdstate serve``'s decode can keep a request running after it landed (``hold``); each synthetic
# decode step rewrites what a real decode step rewrites of a DSV4 request: its last main-KV page
# (the token appended), its SWA window, the compressors' rings and its request state (every state
# component). Step ``s`` writes the content of key ``step_key(room, s)`` there, so the state at
# step ``s`` is a function of ``(room, s)`` alone and any decode can check it.


def step_key(room: int, step: int) -> int:
    """The content key of a running request's stepped items at ``step`` (``room`` at step 0)."""
    if step == 0:
        return room
    seed = np.array([(room ^ (step * _GOLDEN)) & _MASK], dtype=np.uint64)
    return int(_mix(seed)[0]) & ((1 << 63) - 1)


_NO_INDICES = np.empty(0, dtype=np.int64)


def _split(lists: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``(unstepped, stepped)`` index lists: every main-KV page but the last; the last one and
    every state component."""
    main = lists[0]
    return [main[:-1]] + [_NO_INDICES] * (len(lists) - 1), [main[-1:], *lists[1:]]


def advance(desc, room: int, step: int, lists: list[np.ndarray]) -> None:
    """Write step ``step``'s content (``step >= 1``) into the request's stepped items."""
    fill_source(desc, step_key(room, step), _split(lists)[1])


def verify_running(desc, room: int, step: int, lists: list[np.ndarray], how: str, memory) -> str | None:
    """``verify`` of a request at decode step ``step`` (0: as the prefill wrote it)."""
    if step == 0:
        return verify(desc, room, lists, how, memory)
    kept, stepped = _split(lists)
    return verify(desc, room, kept, how, memory) or verify(desc, step_key(room, step), stepped, how, memory)


def rows_digest(desc, lists: list[np.ndarray]) -> str:
    """xxh3_128 (hex) of every item the lists address, channel by channel, buffer by buffer, in
    list order: two decodes holding the same request state byte for byte give the same digest."""
    import xxhash

    h = xxhash.xxh3_128()
    for chan, idx in zip(_channels_of(desc), lists):
        h.update(idx.size.to_bytes(8, "little"))
        if idx.size == 0:
            continue
        for ptr, n, item in zip(chan.ptrs.tolist(), chan.lens.tolist(), chan.items.tolist()):
            h.update(_items(ptr, n, item)[idx].tobytes())
    return h.hexdigest()


def plan_digest(room: int, lists: list[np.ndarray], desc) -> bytes:
    """Digest of the logical content of a request (room, per-channel item counts, buffer counts)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(room.to_bytes(8, "little"))
    for chan, idx in zip(_channels_of(desc), lists):
        h.update(chan.name.encode() + len(chan.ptrs).to_bytes(4, "little") + idx.size.to_bytes(8, "little"))
        h.update(chan.items.tobytes())
    return h.digest()
