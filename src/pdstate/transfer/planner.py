"""Descriptor planning: paired index lists + both sides' buffers -> one ``TransferPlan``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdstate.errors import (
    IndexCountMismatch,
    IndexOutOfRange,
    ItemLengthMismatch,
    PaddingPageIndex,
)
from pdstate.transfer.plan import TransferPlan

# Channels addressed by allocator page ids, where id 0 is the reserved padding page.
PAGE_ADDRESSED = frozenset({"main_kv", "swa"})


@dataclass(frozen=True)
class Channel:
    """One index space: the main KV channel or one state component, with its buffers."""

    name: str  # "main_kv" or the component's state type
    ptrs: np.ndarray  # uint64
    lens: np.ndarray  # uint64, registered bytes per buffer
    items: np.ndarray  # uint64, bytes per index per buffer


def _u64(xs) -> np.ndarray:
    return np.asarray(xs, dtype=np.uint64)


def channels_of(desc) -> list[Channel]:
    """Main KV, then every state component in order, from a ``KVArgs`` or ``wire.KVDesc``."""
    chans = [Channel("main_kv", _u64(desc.kv_data_ptrs), _u64(desc.kv_data_lens), _u64(desc.kv_item_lens))]
    for st, p, n, i in zip(desc.state_types, desc.state_data_ptrs, desc.state_data_lens, desc.state_item_lens):
        chans.append(Channel(getattr(st, "value", st), _u64(p), _u64(n), _u64(i)))
    return chans


@dataclass(frozen=True)
class _Bounds:
    """What index checks need of one side's channel, computed once per pair of layouts."""

    name: str
    worst: int  # items the smallest buffer holds (every index must be below it)
    worst_buffer: int
    worst_len: int
    worst_item: int
    page_addressed: bool

    @classmethod
    def of(cls, chan: Channel) -> _Bounds:
        if chan.items.size == 0:
            return cls(chan.name, -1, 0, 0, 0, chan.name in PAGE_ADDRESSED)
        capacity = chan.lens // np.maximum(chan.items, 1)
        j = int(np.argmin(capacity))
        return cls(chan.name, int(capacity[j]), j, int(chan.lens[j]), int(chan.items[j]), chan.name in PAGE_ADDRESSED)


SMALL_LIST = 64  # below this many indices, checks and runs are plain Python (numpy costs ~us per call)


def _check_indices(side: str, label: str, b: _Bounds, idx: np.ndarray, small: list[int] | None) -> None:
    if idx.size == 0:
        return
    if small is not None:
        lo, hi, distinct = min(small), max(small), len(set(small))
    elif idx.size > 1 and bool((np.diff(idx) > 0).all()):  # ascending (pages as allocated): no sort
        lo, hi, distinct = int(idx[0]), int(idx[-1]), idx.size
    else:
        lo, hi, distinct = int(idx.min()), int(idx.max()), -1
    if lo < 0:
        raise IndexOutOfRange(f"{label}: {side} index {lo} is negative")
    if b.page_addressed and lo == 0:
        raise PaddingPageIndex(f"{label}: {side} index 0 is the reserved padding page")
    if b.worst >= 0 and hi >= b.worst:
        # index * item + item <= data_len for every buffer of the channel
        raise IndexOutOfRange(
            f"{label}: {side} index {hi} is past buffer {b.worst_buffer} "
            f"({b.worst_len} bytes = {b.worst} items of {b.worst_item} bytes)"
        )
    if distinct < 0:
        distinct = np.unique(idx).size
    if distinct != idx.size:
        raise IndexOutOfRange(f"{label}: {side} indices contain duplicates")


def runs(src_idx: np.ndarray, dst_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs where both lists advance by +1: ``(src_starts, dst_starts, lengths)``."""
    n = src_idx.size
    if n == 0:
        e = np.empty(0, dtype=np.int64)
        return e, e, e
    brk = np.flatnonzero((np.diff(src_idx) != 1) | (np.diff(dst_idx) != 1)) + 1
    starts = np.concatenate(([0], brk))
    lengths = np.diff(np.concatenate((starts, [n])))
    return src_idx[starts], dst_idx[starts], lengths


def _run_list(sl: list[int], dl: list[int]) -> list[list[int]]:
    """``[src start, dst start, length]`` of each maximal run, in plain Python (``runs`` for short lists)."""
    out = [[sl[0], dl[0], 1]]
    for s, d in zip(sl[1:], dl[1:]):
        r = out[-1]
        if s == r[0] + r[2] and d == r[1] + r[2]:
            r[2] += 1
        else:
            out.append([s, d, 1])
    return out


def _checked(label: str, si: np.ndarray, di: np.ndarray, static, sb: _Bounds, db: _Bounds):
    """Every refusal of one channel, in order; returns the lists as Python ints when short
    (``None, None`` otherwise) for the checks and runs that follow."""
    if static is not None:
        raise type(static)(str(static))
    if si.size != di.size:
        raise IndexCountMismatch(f"{label}: index count mismatch: prefill={si.size}, decode={di.size}")
    sl, dl = (si.tolist(), di.tolist()) if si.size <= SMALL_LIST else (None, None)
    _check_indices("prefill", label, sb, si, sl)
    _check_indices("decode", label, db, di, dl)
    return sl, dl


def _static_error(label: str, src: Channel, dst: Channel) -> Exception | None:
    if src.items.size != dst.items.size:
        return ItemLengthMismatch(f"{label}: prefill has {src.items.size} buffers, decode has {dst.items.size}")
    if not np.array_equal(src.items, dst.items):
        j = int(np.flatnonzero(src.items != dst.items)[0])
        return ItemLengthMismatch(
            f"{label}: buffer {j} item length differs: prefill={int(src.items[j])}, decode={int(dst.items[j])}"
        )
    return None


class PairPlanner:
    """Plans requests between one prefill layout and one decode layout.

    Everything that depends only on the two layouts (channel order, item lengths, buffer
    capacities) is worked out once here, so a worker keeps one per accepted peer and a request
    pays only for its own indices. ``plan`` raises exactly what ``plan_request`` documents.
    """

    def __init__(self, src_desc, dst_desc) -> None:
        self.dst_desc = dst_desc  # what it was made for: a decode registering again with the same reuses it
        self.src_chans, self.dst_chans = channels_of(src_desc), channels_of(dst_desc)
        src_types = [c.name for c in self.src_chans]
        dst_types = [c.name for c in self.dst_chans]
        self.channel_error = None
        if src_types != dst_types:
            self.channel_error = ItemLengthMismatch(f"channels differ: prefill={src_types}, decode={dst_types}")
            return
        self.labels = ["main KV" if c == 0 else f"component {c - 1} ({sc.name})" for c, sc in enumerate(self.src_chans)]
        self.static = [_static_error(lb, sc, dc) for lb, sc, dc in zip(self.labels, self.src_chans, self.dst_chans)]
        self.src_bounds = [_Bounds.of(c) for c in self.src_chans]
        self.dst_bounds = [_Bounds.of(c) for c in self.dst_chans]
        # every channel's buffers in one set of columns, channel after channel (a plan's order), so
        # a request's descriptors are built in a dozen numpy calls whatever its channel count
        self.buf_src = np.concatenate([c.ptrs for c in self.src_chans])
        self.buf_dst = np.concatenate([c.ptrs for c in self.dst_chans])
        self.buf_item = np.concatenate([c.items for c in self.src_chans])
        self.buf_chan = np.repeat(np.arange(len(self.src_chans)), [c.items.size for c in self.src_chans])
        self.n_bufs = [int(c.items.size) for c in self.src_chans]

    def plan(self, src_lists, dst_lists) -> TransferPlan:
        if self.channel_error is not None:
            raise type(self.channel_error)(str(self.channel_error))
        if not (len(src_lists) == len(dst_lists) == len(self.src_chans)):
            raise IndexCountMismatch(
                f"index lists: prefill sent {len(src_lists)}, decode sent {len(dst_lists)}, "
                f"layout has {len(self.src_chans)} channels"
            )
        arrays = [(np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)) for a, b in zip(src_lists, dst_lists)]
        # every channel's checks first (in order: the first refusal wins), then its runs
        s0: list[int] = []
        d0: list[int] = []
        n0: list[int] = []
        counts = []
        small = SMALL_LIST
        for c, (si, di) in enumerate(arrays):
            sl, dl = _checked(self.labels[c], si, di, self.static[c], self.src_bounds[c], self.dst_bounds[c])
            if si.size == 0 or self.n_bufs[c] == 0:
                counts.append(0)
                continue
            if si.size <= small:
                found = _run_list(sl, dl)
                for r in found:
                    s0.append(r[0])
                    d0.append(r[1])
                    n0.append(r[2])
                counts.append(len(found))
            else:
                rs, rd, rn = runs(si, di)
                s0 += rs.tolist()
                d0 += rd.tolist()
                n0 += rn.tolist()
                counts.append(len(rn))
        if not s0:
            return TransferPlan.empty()
        return self._descriptors(counts, s0, d0, n0)

    def _descriptors(self, counts: list[int], s0: list[int], d0: list[int], n0: list[int]) -> TransferPlan:
        """Each channel's buffers times its runs, buffer-major within a channel, channels in order:
        ``counts[c]`` runs of channel ``c``, all channels' runs in ``s0``/``d0``/``n0``."""
        per_chan = np.array(counts, dtype=np.int64)
        first = np.cumsum(per_chan) - per_chan  # each channel's first run in s0/d0/n0
        rep = per_chan[self.buf_chan]  # runs per buffer
        if max(counts) == 1:  # at most one run a channel (contiguous pages): one descriptor a buffer
            buf = np.flatnonzero(rep)
            run = first[self.buf_chan[buf]]
        else:
            buf = np.repeat(np.arange(rep.size), rep)  # each descriptor's buffer
            start = np.cumsum(rep) - rep  # each buffer's first descriptor
            run = np.repeat(first[self.buf_chan] - start, rep) + np.arange(buf.size)
        item = self.buf_item[buf]
        length = np.array(n0, dtype=np.uint64)[run] * item
        src = self.buf_src[buf] + np.array(s0, dtype=np.uint64)[run] * item
        dst = self.buf_dst[buf] + np.array(d0, dtype=np.uint64)[run] * item
        return TransferPlan(src, dst, length, int(length.sum()))


def plan_channel(label: str, src: Channel, dst: Channel, si: np.ndarray, di: np.ndarray, known=None):
    """Descriptors for one channel, buffer-major; every check runs before anything is built.

    ``known``: ``(static error, src bounds, dst bounds)`` worked out earlier for this pair."""
    static, sb, db = known if known is not None else (_static_error(label, src, dst), _Bounds.of(src), _Bounds.of(dst))
    sl, dl = _checked(label, si, di, static, sb, db)
    if si.size == 0 or src.items.size == 0:
        e = np.empty(0, dtype=np.uint64)
        return e, e, e
    if sl is not None:
        s0, d0, n = (np.array(col, dtype=np.int64) for col in zip(*_run_list(sl, dl)))
    else:
        s0, d0, n = runs(si, di)
    items = src.items[:, None]
    s_addr = src.ptrs[:, None] + s0.astype(np.uint64)[None, :] * items
    d_addr = dst.ptrs[:, None] + d0.astype(np.uint64)[None, :] * items
    length = n.astype(np.uint64)[None, :] * items
    return s_addr.ravel(), d_addr.ravel(), length.ravel()


def plan_request(src_desc, dst_desc, src_lists, dst_lists) -> TransferPlan:
    """Plan one request: ``*_lists[0]`` are main-KV page ids, then one list per state component.

    Raises before anything reaches an engine: ``ItemLengthMismatch`` (component count or item
    lengths differ), ``IndexCountMismatch`` (strictly, for every channel), ``IndexOutOfRange``
    (negative, past a registered buffer, duplicated), ``PaddingPageIndex`` (page 0 of a
    page-addressed channel). A worker planning many requests for one peer keeps a
    ``PairPlanner`` instead.
    """
    return PairPlanner(src_desc, dst_desc).plan(src_lists, dst_lists)


def plan_request_loop(src_desc, dst_desc, src_lists, dst_lists) -> list[tuple[int, int, int]]:
    """Baseline: upstream's shape of planning, a Python loop per run and per buffer (no checks).

    Kept for the benchmark and as the reference the property tests compare against.
    """
    out = []
    for sc, dc, si, di in zip(channels_of(src_desc), channels_of(dst_desc), src_lists, dst_lists):
        si, di = [int(x) for x in si], [int(x) for x in di]
        groups, i = [], 0
        while i < len(si):
            j = i
            while j + 1 < len(si) and si[j + 1] == si[j] + 1 and di[j + 1] == di[j] + 1:
                j += 1
            groups.append((si[i], di[i], j - i + 1))
            i = j + 1
        for sp, dp, item in zip(sc.ptrs.tolist(), dc.ptrs.tolist(), sc.items.tolist()):
            for s, d, n in groups:
                out.append((sp + s * item, dp + d * item, n * item))
    return out
