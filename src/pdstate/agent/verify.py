"""Verification levels, the per-request page sample, and digests bound to positions, on the host
or on the device where the memory lives.

Levels (``transfer.verify``): ``sampled`` (the default) digests every state-component item and aux
row, the first and last main-KV page of the request and a seeded sample (1 in ``SAMPLE_RATE``) of
the others; ``full`` digests every byte (``RequestDigest`` as it always did); ``off`` digests
nothing (the handshake's checks alone). The decode names the level in its ``AgentRequest``
(``verify``; a request without the field asks ``full`` when ``digest`` is true); the prefill refuses
a request that asks less than its own level, so what ran is what both sides agreed to.

The sample is a pure function of the request (``sample_seed``: its room and the decode's packed
page list, which both sides hold), so both sides pick the same list positions. The digest is bound
to them: the sampled items' list positions are hashed with the items (in device form each item's
value beside its position), so a shifted, stale, misplaced or missing write changes the digest.

Forms: ``host`` hashes item bytes with xxh3 on the CPU. ``device`` reduces each item where its
memory lives to one 64-bit value (``lane_values``: the sum of its words times fixed odd
multipliers, modulo 2**64; a change of any one word changes it), with torch on the memory's device,
so only these values (8 bytes an item) cross to the CPU; a host region in a ``device`` request is
reduced by numpy (``lane_values_host``) to the same value. A request is digested in ``device`` form
when either side's memory is on a device (the decode asks with ``digest_form``; a prefill whose
memory is on a device answers in that form and says so in ``TransferDone``).
"""

from __future__ import annotations

import ctypes
import functools
import time
from typing import Literal

import numpy as np
import xxhash

from pdstate.agent.digest import RequestDigest, hash_rows
from pdstate.pools.placement import memory_devices

__all__ = [
    "DEFAULT_LEVEL",
    "LEVELS",
    "PositionDigest",
    "SAMPLE_RATE",
    "check_level",
    "lane_values",
    "lane_values_host",
    "level_of",
    "memory_devices",
    "new_digest",
    "sample_mask",
    "sample_seed",
    "weaker",
]

Level = Literal["sampled", "full", "off"]
LEVELS: tuple[str, ...] = ("off", "sampled", "full")  # weakest first
DEFAULT_LEVEL = "sampled"
SAMPLE_RATE = 8
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


def sample_seed(room: int, packed_pages: bytes) -> int:
    """The request's sample seed: both sides hold its room and the decode's packed page list."""
    return xxhash.xxh3_64_intdigest(b"pdstate-sample|%d|" % room + packed_pages)


def _splitmix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def sample_mask(seed: int, positions: np.ndarray, n: int, rate: int = SAMPLE_RATE) -> np.ndarray:
    """Which list ``positions`` (of a list of ``n``) the sample holds: the first, the last, and
    those whose mixed (seed, position) falls in 1 of ``rate``."""
    pos = np.asarray(positions, dtype=np.uint64)
    keep = _splitmix(pos ^ np.uint64(seed & _M64)) % np.uint64(max(1, rate)) == 0
    return keep | (pos == 0) | (pos == np.uint64(max(n - 1, 0)))


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


class PositionDigest(RequestDigest):
    """A request's digest at ``sampled`` (host or device form) or ``full`` in device form: per
    (channel, buffer) one xxh3_128 stream of its items in list order — their bytes (host form; the
    sample's positions in a stream per channel) or ``(list position, lane value)`` records (device
    form) — see ``proto/PROTOCOL.md`` §3. ``devices``: per channel, per buffer,
    ``None`` (host memory) or a torch device; the device form on a host buffer uses numpy unless
    ``torch_on_host`` (the device path on CPU tensors)."""

    def __init__(
        self,
        layout,
        *,
        level: str,
        seed: int,
        n_pages: int,
        form: str = "host",
        devices: list[list[str | None]] | None = None,
        torch_on_host: bool = False,
    ) -> None:
        super().__init__(layout)
        self.level, self.seed, self.n_pages, self.form = level, seed, n_pages, form
        self._devices = devices or [[None] * len(p) for p, _ in layout]
        self._torch_on_host = torch_on_host
        self._next = [0] * len(layout)  # per channel: list positions taken so far
        # per channel: the list positions of the items sampled, in order (both sides' are the same)
        self._pos_hashers = [xxhash.xxh3_128() for _ in layout]

    @property
    def fusable(self) -> bool:
        """The host form is hashed inside the shm copy (``fused_streams``); the device form is not."""
        return self.form == "host"

    def _positions(self, channel: int, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
        """The items of ``idx`` this digest takes (all, or channel 0's sample) and their list
        positions, the channel's count moved on; and whether it is the sample."""
        start = self._next[channel]
        self._next[channel] += idx.size
        pos = np.arange(start, start + idx.size, dtype=np.int64)
        sampled = channel == 0 and self.level == "sampled"
        if sampled:
            keep = sample_mask(self.seed, pos, self.n_pages)
            idx, pos = idx[keep], pos[keep]
            if self.form == "host":
                self._pos_hashers[channel].update(pos.astype("<u8").tobytes())
        return idx, pos, sampled

    def _rows(self, channel: int, indices) -> list:
        """What one update hashes. Host form: ``RequestDigest``'s rows ``(hasher, addresses,
        sizes)`` of the items taken (a whole state or aux channel; the sample of main KV, its
        positions into the channel's positions stream), by runs in list order, never gathered.
        Device form: ``(channel, buffer, items, positions)``."""
        idx, pos, _ = self._positions(channel, np.asarray(indices, dtype=np.int64))
        if idx.size == 0:
            return []
        if self.form == "host":
            return super().rows_of(channel, idx)  # counts its bytes
        ptrs, items = self._layout[channel]
        self.bytes += int(idx.size * int(items.sum()))
        return [(channel, b, idx, pos) for b in range(len(ptrs))]

    def fused_streams(self, updates):
        """``hash_src`` for the shm copy of the plan made from ``updates`` (host form): state and
        aux descriptors hashed whole, as ``RequestDigest`` does; a main-KV descriptor copied
        whole and only its sampled items hashed, from the cache, right after. ``None`` (hashed
        beside the copy instead) when a main-KV page repeats in the list: the sample is picked by
        page id there."""
        main = [np.asarray(i) for c, i in updates if c == 0]
        if any(np.unique(i).size != i.size for i in main):
            self.update_async(updates)
            return None
        self.wait()
        picked = np.empty(0, dtype=np.int64)
        with self._lock:
            for c, indices in updates:
                idx, _, sampled = self._positions(c, np.asarray(indices, dtype=np.int64))
                if sampled:
                    picked = np.sort(idx)
        n_main = len(self._layout[0][0])

        def streams(src: np.ndarray, length: np.ndarray):
            hashers, index = self.stream_index(src)
            self.fused = True
            subs: list = [None] * len(index)
            ptrs, items = self._layout[0]
            length = np.asarray(length, dtype=np.int64)
            main = np.flatnonzero(index < n_main)
            n = np.maximum(items[index[main]].astype(np.int64), 1)
            first = (np.asarray(src, dtype=np.uint64)[main] - ptrs[index[main]]).astype(np.int64) // n
            lo = np.searchsorted(picked, first)
            hi = np.searchsorted(picked, first + length[main] // n)
            for k, f, a, z, m in zip(main.tolist(), first.tolist(), lo.tolist(), hi.tolist(), n.tolist()):
                subs[k] = [((p - f) * m, m) for p in picked[a:z].tolist()]
            self.bytes += int(((hi - lo) * n).sum()) + int(length[index >= n_main].sum())
            return hashers, index, subs

        return streams

    def _run(self, rows: list) -> None:
        t0 = time.perf_counter()
        if self.form == "host":
            hash_rows(rows)
            self.seconds += time.perf_counter() - t0
            return
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

    def update_many(self, updates, threads: int | None = None) -> None:
        """``update`` for each ``(channel, indices)``: the host form's rows spread over the
        host's cores as ``RequestDigest``'s; the device form's on this thread (only their
        values cross to the CPU)."""
        if self.form == "host":
            super().update_many(updates, threads)
            return
        self.wait()
        with self._lock:
            self._run([r for c, idx in updates for r in self._rows(c, idx)])

    def streams(self, src, length):
        raise ValueError("a sampled or device-form digest is fused into the copy by fused_streams")

    def digest(self) -> bytes:
        self.wait()
        head = b"pdstate-verify|%s|%s|%d|%d|%s|" % (
            self.level.encode(),
            self.form.encode(),
            self.seed,
            self.n_pages,
            ",".join(map(str, self._next)).encode(),
        )
        head += b"".join(h.digest() for h in self._pos_hashers)
        return xxhash.xxh3_128(head + b"".join(h.digest() for hs in self._hashers for h in hs)).digest()


def new_digest(
    layout, level: str, *, room: int, packed_pages: bytes, n_pages: int, form: str = "host", devices=None
) -> RequestDigest | None:
    """The digest one side keeps for a request at ``level`` (``None`` at ``off``): ``full`` in host
    form is ``RequestDigest`` (every byte, as before the levels); the rest is a ``PositionDigest``."""
    if level == "off":
        return None
    if level == "full" and form == "host":
        return RequestDigest(layout)
    return PositionDigest(
        layout, level=level, seed=sample_seed(room, packed_pages), n_pages=n_pages, form=form, devices=devices
    )


def layout_devices(layout) -> list[list[str | None]]:
    """``memory_devices`` per channel of a digest layout (``common.channel_layout``)."""
    return [memory_devices([int(p) for p in ptrs]) for ptrs, _ in layout]


def on_device(devices) -> bool:
    return any(d is not None for ds in devices for d in ds)


def request_digest(layout, devices, req, n_channels: int, level: str, form: str | None = None):
    """One side's digest of the request ``req`` (a ``wire.AgentRequest``) at ``level``: its
    channels (aux only when the request names an aux slot), in ``form`` (default: ``device`` when
    the request asks it or this side's memory is on a device)."""
    k = len(layout) if req.dst_aux is not None else n_channels
    if form is None:
        form = "device" if req.digest_form == "device" or on_device(devices[:k]) else "host"
    return new_digest(
        layout[:k],
        level,
        room=req.room,
        packed_pages=req.dst_kv_pages.data,
        n_pages=len(req.dst_kv_pages),
        form=form,
        devices=devices[:k],
    )


def wire_form(digest) -> str | None:
    """``TransferDone.digest_form`` for a digest: ``"device"``, or ``None`` for the host form."""
    return "device" if getattr(digest, "form", "host") == "device" else None
