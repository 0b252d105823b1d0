"""Request digests over real bytes: xxh3_128 of what the prefill sent and what landed on the decode.

A request's digest is one xxh3_128 per (channel, buffer) — channels are main KV, each state
component in ``KVArgs.state_types`` order, then aux — streamed over that buffer's items in the
order of the side's own index list, and combined as ``xxh3_128(concat(per-buffer digests))``.
Each stream only depends on the bytes of the listed items in list order, so the prefill (which
sees main KV chunk by chunk, state and aux with the last chunk) and the decode (which sees its
whole destination lists at once) compute the same value exactly when the same bytes are in the
same places. Contiguous indices are hashed as one run: the Python loop is over (buffer, run),
never over items; addresses come from numpy.

Off the critical path: on the shm engine the prefill's copy hashes each descriptor's source bytes
right after copying them, while they are still in cache (``streams``; one stream per thread);
on other engines the prefill hashes a chunk in the background (``update_async``) while the
engine copies the same source bytes (sources do not change while a request is TRANSFERRING), and
``digest()`` waits for it (a sampled digest, a few dozen KB, of a copy under
``INLINE_COPY_BYTES`` is read on the submitting thread right after the submission instead:
``inline``); the decode hashes what landed with its buffers spread over several
threads (``update_many``: the per-buffer streams are independent). xxhash and ``memmove`` both
release the GIL, so hashing, copying and the I/O thread run at once.

Measured on the development VM (128 MiB random buffer, best of 3; 2 cores): xxh3_128 32 GB/s
(16 in an earlier, busier run), xxh3_64 33, zlib.crc32 4.2, hashlib.blake2b 0.9, blake3 2.4;
xxh3_128 and blake2b both release the GIL (a Python thread kept its full speed while they ran);
two threads hashing halves reached 31 GB/s (the memory path, not the core, is the bound there).
"""

from __future__ import annotations

import ctypes
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

from pdstate.transfer.engines.shm_copy import host_cores

__all__ = ["RequestDigest", "executor", "hash_rows", "index_runs", "submit_digested"]

PARALLEL_MIN_BYTES = 4 << 20  # below this a digest runs on the calling thread alone
# an ``inline`` digest of a copy this big or bigger is read in the background beside it instead (a
# copy of tens of ms hides it there; a short one does not, and the thread hop is then the cost)
INLINE_COPY_BYTES = 32 << 20
MAX_DIGEST_THREADS = 8

_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def executor() -> ThreadPoolExecutor:
    """One process-wide pool for background and parallel hashing (threads started on first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(
                max(2, min(MAX_DIGEST_THREADS, host_cores())), thread_name_prefix="pdstate-digest"
            )
        return _pool


def digest_threads() -> int:
    return max(1, min(MAX_DIGEST_THREADS, host_cores()))


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


def hash_rows(rows: list) -> None:
    char = ctypes.c_char
    for h, a_row, n_row in rows:
        update = h.update
        for a, n in zip(a_row, n_row):
            if n:
                update((char * n).from_address(a))


class RequestDigest:
    """Streaming digest of one request; ``layout`` is ``[(ptrs, item_lens), ...]`` per channel.

    ``seconds``: time spent hashing (on whichever thread did it)."""

    def __init__(self, layout: list[tuple[list[int], list[int]]]) -> None:
        self._layout = [(np.asarray(p, dtype=np.uint64), np.asarray(i, dtype=np.uint64)) for p, i in layout]
        self._hashers = [[xxhash.xxh3_128() for _ in p] for p, _ in layout]
        self.bytes = 0
        self.seconds = 0.0
        self._lock = threading.Lock()  # held while hashing: one stream is never hashed twice at once
        self._qlock = threading.Lock()  # guards the queue (short holds only)
        self._queue: list[list] = []  # background work, in submission order
        self._pending: list = []  # futures of background drains
        self._cancelled = False
        self._flat: tuple | None = None  # sorted buffer addresses, their stream index, hashers
        self.fused = False  # hashed by the copy itself (``streams``): its time is in the copy's

    fusable = True  # ``streams`` can hash it inside the shm copy
    # a last chunk's state goes first, in a piece of its own the decode is told of (``wire.Landed``),
    # so that the decode hashes it while the main KV copies (``agent.prefill_copy``)
    split_state = True

    def _rows(self, channel: int, indices) -> list:
        """``(hasher, addresses, sizes)`` per buffer of ``channel`` for the items ``indices``."""
        return self.rows_of(channel, indices)

    def rows_of(self, channel: int, indices) -> list:
        """The rows of ``channel``'s items ``indices``, by runs (what ``_rows`` returns here;
        a subclass that hashes some channels otherwise calls it for the rest)."""
        starts, lengths = index_runs(indices)
        if starts.size == 0:
            return []
        ptrs, items = self._layout[channel]
        addr = ptrs[:, None] + starts.astype(np.uint64)[None, :] * items[:, None]
        size = lengths.astype(np.uint64)[None, :] * items[:, None]
        self.bytes += int(size.sum())
        return list(zip(self._hashers[channel], addr.tolist(), size.tolist()))

    def _run(self, rows: list) -> None:
        t0 = time.perf_counter()
        hash_rows(rows)
        self.seconds += time.perf_counter() - t0

    def update(self, channel: int, indices) -> None:
        """Hash the items ``indices`` of every buffer of ``channel`` (after those hashed before)."""
        self.wait()
        with self._lock:
            self._run(self._rows(channel, indices))

    def update_many(self, updates: list[tuple[int, object]], threads: int | None = None) -> None:
        """``update`` for each ``(channel, indices)`` in order, the buffers spread over up to
        ``threads`` threads (this one included) when there are enough bytes to share."""
        self.wait()
        with self._lock:
            rows = [r for c, idx in updates for r in self._rows(c, idx)]
            sizes = [sum(n) for _, _, n in rows]
            k = min(threads or digest_threads(), len(rows), max(1, sum(sizes) // PARALLEL_MIN_BYTES))
            if k <= 1:
                self._run(rows)
                return
            groups: list[list] = [[] for _ in range(k)]
            load = [0] * k
            for row, n in sorted(zip(rows, sizes), key=lambda x: -x[1]):  # largest first, to the lightest
                j = load.index(min(load))
                groups[j].append(row)
                load[j] += n
            t0 = time.perf_counter()
            futures = [executor().submit(hash_rows, g) for g in groups[1:]]
            try:
                hash_rows(groups[0])
            finally:
                for f in futures:
                    f.result()
            self.seconds += time.perf_counter() - t0

    def update_async(self, updates: list[tuple[int, object]]) -> None:
        """Queue ``(channel, indices)`` updates to be hashed in the background, in order, after
        every update queued before; ``digest()`` and ``wait()`` wait for them. The bytes must not
        change until then."""
        with self._qlock:
            self._queue.append([r for c, idx in updates for r in self._rows(c, idx)])
        self._pending.append(executor().submit(self._drain))

    def _drain(self) -> None:
        with self._lock:
            while True:
                with self._qlock:
                    if not self._queue or self._cancelled:
                        return
                    rows = self._queue.pop(0)
                self._run(rows)

    def streams(self, src: np.ndarray, length: np.ndarray) -> tuple[list, np.ndarray]:
        """For a copy that hashes as it goes (``ShmEngine.submit(hash_src=...)``): every hasher,
        and for each descriptor (source address ``src[k]``, in a plan built from this side's
        lists: buffer-major, items in list order) the index of the stream it belongs to."""
        self.wait()
        hashers, index = self.stream_index(src)
        self.bytes += int(np.asarray(length, dtype=np.uint64).sum())
        self.fused = True
        return hashers, index

    def stream_index(self, src: np.ndarray) -> tuple[list, np.ndarray]:
        """Every hasher (channel by channel, buffer by buffer), and the stream of each descriptor
        whose source address is ``src[k]``."""
        if self._flat is None:
            ptrs = np.concatenate([p for p, _ in self._layout]) if self._layout else np.empty(0, dtype=np.uint64)
            order = np.argsort(ptrs, kind="stable")
            self._flat = (ptrs[order], order, [h for hs in self._hashers for h in hs])
        sorted_ptrs, order, hashers = self._flat
        pos = np.searchsorted(sorted_ptrs, np.asarray(src, dtype=np.uint64), side="right") - 1
        if pos.size and int(pos.min()) < 0:
            raise ValueError("a descriptor's source lies below every buffer of the digest")
        return hashers, order[pos]

    def fused_streams(self, updates: list[tuple[int, object]]):
        """What the copy of the plan made from ``updates`` hashes (``submit(hash_src=...)``):
        here every byte of it, so ``streams`` (a subclass may return ``None``: it hashed the
        updates otherwise)."""
        return self.streams

    def wait(self) -> float:
        """Wait for the background work; returns the seconds waited."""
        t0 = time.perf_counter()
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()
        return time.perf_counter() - t0

    def cancel(self) -> None:
        """Drop the background work not started and wait for the running one (after this, no
        thread reads the request's bytes)."""
        self._cancelled = True
        self.wait()

    def digest(self) -> bytes:
        self.wait()
        return xxhash.xxh3_128(b"".join(h.digest() for hs in self._hashers for h in hs)).digest()


def submit_digested(engine, peer_id: str, plan, digest: RequestDigest | None, updates: list[tuple[int, object]]):
    """``engine.submit(peer_id, plan)``, the plan's source bytes (``updates``: this side's
    ``(channel, indices)``) going into ``digest``: hashed by the copy itself where the engine can
    (shm), else in the background beside the engine's copy, or (a digest ``inline``: a small
    sample, of a copy under ``INLINE_COPY_BYTES``) on this thread right after the submission.
    Returns the engine's handle."""
    if digest is None:
        return engine.submit(peer_id, plan)
    if getattr(engine, "supports_hashed_copy", False) and digest.fusable:
        return engine.submit(peer_id, plan, hash_src=digest.fused_streams(updates))  # None: hashed beside it
    if getattr(digest, "inline", False) and plan.total_bytes < INLINE_COPY_BYTES:  # read here, after the submission
        handle = engine.submit(peer_id, plan)
        digest.update_many(updates)
        return handle
    if not digest.fusable:  # the device form: hashed beside the copy (the copy need not wait for it)
        digest.update_async(updates)
        return engine.submit(peer_id, plan)
    handle = engine.submit(peer_id, plan)  # the copy first: hashing the same bytes waits behind it
    digest.update_async(updates)
    return handle
