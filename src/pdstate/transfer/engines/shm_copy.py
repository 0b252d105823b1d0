"""The shm engine's copy: a plan's descriptors, already translated to this process's addresses,
copied with ``memmove`` — on the submitting thread alone, or cut into jobs of about
``JOB_BYTES`` that the submitting thread and helper threads take in turn.

One core copies at most what one core's memory path allows (about 12 GB/s on the development
VM); a host with more cores copies a large request faster with several threads. A copy uses
several threads only when it is large (``SPLIT_MIN_BYTES``), and no more threads than leave each
``SHARE_MIN_BYTES``, so small requests stay on one thread and the copy's threads are busy only for
the large ones. ``ctypes.memmove`` releases the GIL, so the jobs run in parallel. Each thread
takes the next job until none is left, so a helper the scheduler does not run in time delays
nothing (the submitting thread copies the jobs it would have taken), and a slow one holds at most
one small job at the end. The helper threads run ``HELPER_NICE`` steps nicer than the process, so
a decode or a model's compute on the same cores is scheduled before them: the copy uses cores
that would otherwise idle.
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

SPLIT_MIN_BYTES = 16 << 20
SHARE_MIN_BYTES = 8 << 20
MAX_COPY_THREADS = 8
HELPER_NICE = 5
HASH_PIECE_BYTES = 512 << 10  # copied then hashed while still in the core's cache
JOB_BYTES = 4 << 20  # a large copy is cut into jobs of about this size that the threads take in turn
MAX_JOBS = 256


def host_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_copy_threads() -> int:
    """Every core this process may use, up to ``MAX_COPY_THREADS``."""
    return max(1, min(MAX_COPY_THREADS, host_cores()))


def split_descriptors(
    dst: np.ndarray, src: np.ndarray, length: np.ndarray, parts: int
) -> list[tuple[list[int], list[int], list[int]]]:
    """At most ``parts`` shares ``(dst, src, length)`` of about equal bytes that together copy
    exactly the bytes of the descriptors, in order; a descriptor across a share boundary is cut
    in two. Descriptors must be non-empty (the engine drops empty ones before submitting)."""
    if len(length) == 0:
        return []
    cum = np.cumsum(length, dtype=np.uint64)
    total = int(cum[-1])
    parts = max(1, min(parts, total))
    cuts = [total * k // parts for k in range(parts + 1)]
    shares = []
    for lo, hi in zip(cuts, cuts[1:]):
        if hi <= lo:
            continue
        i = int(np.searchsorted(cum, lo, side="right"))  # the descriptor holding byte lo
        j = int(np.searchsorted(cum, hi, side="left"))  # the descriptor holding byte hi - 1
        d, s, n = dst[i : j + 1].tolist(), src[i : j + 1].tolist(), length[i : j + 1].tolist()
        head = lo - (int(cum[i]) - n[0])  # bytes of descriptor i before this share
        d[0], s[0], n[0] = d[0] + head, s[0] + head, n[0] - head
        n[-1] -= int(cum[j]) - hi  # bytes of descriptor j after this share
        shares.append((d, s, n))
    return shares


def _nicer() -> None:
    """Lower this (helper) thread's scheduling priority; where that is not allowed, leave it."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + HELPER_NICE))
    except (AttributeError, OSError):
        pass


def _copy_list(dst: list[int], src: list[int], length: list[int]) -> None:
    memmove = ctypes.memmove
    for d, s, n in zip(dst, src, length):
        memmove(d, s, n)


def _copy_hash(
    dst: list[int], src: list[int], length: list[int], hashers: list, index: list[int], subs: list | None = None
) -> None:
    """Copy each descriptor in pieces of at most ``HASH_PIECE_BYTES`` and hash each piece's source
    right after copying it (a stream hashed piece by piece has the same digest). With ``subs``, a
    descriptor whose entry is not ``None`` is copied whole and then only its ``(offset, nbytes)``
    ranges are hashed, in order (a sample of its items; still in cache)."""
    memmove, char, piece = ctypes.memmove, ctypes.c_char, HASH_PIECE_BYTES
    for j, (d, s, n, h) in enumerate(zip(dst, src, length, index)):
        update = hashers[h].update
        sub = None if subs is None else subs[j]
        if sub is not None:
            memmove(d, s, n)
            for off, m in sub:
                update((char * m).from_address(s + off))
            continue
        for off in range(0, n, piece):
            m = min(piece, n - off)
            memmove(d + off, s + off, m)
            update((char * m).from_address(s + off))


class Copier:
    """Copies descriptor arrays with up to ``threads`` threads (the caller's plus helpers, started
    on the first large copy and kept until ``close``)."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = default_copy_threads() if threads is None else max(1, int(threads))
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def shares_for(self, total_bytes: int) -> int:
        if total_bytes < SPLIT_MIN_BYTES:
            return 1
        return max(1, min(self.threads, total_bytes // SHARE_MIN_BYTES))

    def copy(self, dst: np.ndarray, src: np.ndarray, length: np.ndarray, total_bytes: int) -> None:
        """Copy every descriptor; returns once all bytes are written."""
        parts = self.shares_for(total_bytes)
        if parts == 1:
            _copy_list(dst.tolist(), src.tolist(), length.tolist())
            return
        jobs = max(parts, min(MAX_JOBS, total_bytes // JOB_BYTES))
        self._run(_copy_list, split_descriptors(dst, src, length, jobs), parts)

    def copy_hashed(
        self, dst: np.ndarray, src: np.ndarray, length: np.ndarray, total_bytes: int, streams: tuple[list, np.ndarray]
    ) -> None:
        """Copy every descriptor and feed its source bytes, right after copying them (still in
        cache), to its stream's hasher: ``streams = (hashers, index)`` or ``(hashers, index, subs)``,
        ``index[k]`` naming the hasher of descriptor ``k`` and ``subs[k]`` (``None``: all of it)
        the ``(offset, nbytes)`` ranges of it to hash. Each stream gets its descriptors in plan
        order, on one thread; the streams are packed by bytes into jobs the threads take in turn."""
        hashers, index = streams[0], np.asarray(streams[1], dtype=np.int64)
        subs = streams[2] if len(streams) > 2 else None
        order = np.argsort(index, kind="stable")  # by stream, plan order within each

        def job(sel: np.ndarray) -> tuple:
            picked = None if subs is None else [subs[i] for i in sel.tolist()]
            return (dst[sel].tolist(), src[sel].tolist(), length[sel].tolist(), hashers, index[sel].tolist(), picked)

        parts = min(self.shares_for(total_bytes), len(hashers))
        if parts <= 1:
            _copy_hash(*job(order))
            return
        n_jobs = max(parts, min(MAX_JOBS, len(hashers), total_bytes // JOB_BYTES))
        load = np.bincount(index, weights=length.astype(np.float64), minlength=len(hashers))
        group_of = np.zeros(len(hashers), dtype=np.int64)
        sums = [0.0] * n_jobs
        for h in np.argsort(-load, kind="stable").tolist():  # largest stream first, to the lightest job
            g = sums.index(min(sums))
            group_of[h], sums[g] = g, sums[g] + float(load[h])
        owner = group_of[index[order]]
        jobs = []
        for g in range(n_jobs):
            sel = order[owner == g]
            if sel.size:
                jobs.append(job(sel))
        self._run(_copy_hash, jobs, parts)

    def _run(self, fn, jobs: list[tuple], threads: int) -> None:
        """``fn(*job)`` for every job, each exactly once, on up to ``threads`` threads: this one
        and helpers take the next job until none is left, so a helper the scheduler has not run
        yet delays nothing (its call is cancelled, or finds no job) and one running slowly holds
        at most one small job at the end; returns once every job is done."""
        lock, left = threading.Lock(), list(reversed(jobs))

        def take_all() -> None:
            while True:
                with lock:
                    if not left:
                        return
                    job = left.pop()
                fn(*job)

        pool = self._helpers()
        futures = [pool.submit(take_all) for _ in range(min(len(jobs), threads) - 1)]
        try:
            take_all()
        finally:
            for f in futures:
                if not f.cancel():
                    f.result()  # running: it may hold a job

    def _helpers(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.threads - 1, thread_name_prefix="pdstate-shm-copy", initializer=_nicer
                )
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
