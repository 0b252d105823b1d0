"""The shm engine's copy split across threads: shares cover exactly the descriptors' bytes, and a
large plan submitted through the engine lands byte for byte with the bytes around it untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdstate.pools.memory import BufferSpec, Region, SharedMemory
from pdstate.transfer.engines.shm import ShmEngine
from pdstate.transfer.engines.shm_copy import HELPER_NICE, SPLIT_MIN_BYTES, Copier, split_descriptors
from pdstate.transfer.plan import TransferPlan
from tests.support.engines import proven
from tests.support.images import SENTINEL

pytestmark = pytest.mark.timeout(60)


def _bytes_of(shares) -> list[tuple[int, int, int]]:
    """(dst, src, n) runs of the shares, adjacent runs merged (a cut descriptor becomes whole)."""
    out: list[list[int]] = []
    for d, s, n in shares:
        for a, b, c in zip(d, s, n):
            assert c > 0
            if out and out[-1][0] + out[-1][2] == a and out[-1][1] + out[-1][2] == b:
                out[-1][2] += c
            else:
                out.append([a, b, c])
    return [tuple(x) for x in out]


@pytest.mark.parametrize(
    ("lengths", "parts"),
    [([100], 3), ([7, 1, 50, 3, 3, 99], 4), ([10] * 9, 3), ([5, 5], 8), ([1 << 30, 12, 1 << 20], 2)],
)
def test_shares_cover_exactly_the_descriptors_in_order(lengths, parts) -> None:
    n = np.array(lengths, dtype=np.uint64)
    src = np.cumsum(np.concatenate(([0], n[:-1] + 64))).astype(np.uint64) + np.uint64(1 << 40)
    dst = src[::-1].copy()  # another order on the destination: not mergeable across descriptors
    shares = split_descriptors(dst, src, n, parts)
    assert 1 <= len(shares) <= parts
    sizes = [sum(s[2]) for s in shares]
    assert sum(sizes) == int(n.sum()) and max(sizes) - min(sizes) <= max(1, int(n.sum()) // parts)
    assert _bytes_of(shares) == list(zip(dst.tolist(), src.tolist(), n.tolist()))


def test_small_copies_stay_on_the_submitting_thread() -> None:
    c = Copier(threads=4)
    assert c.shares_for(SPLIT_MIN_BYTES - 1) == 1
    assert c.shares_for(1 << 30) == 4
    assert Copier(threads=1).shares_for(1 << 30) == 1


@pytest.mark.parametrize("threads", [1, 3])
def test_a_large_scattered_plan_lands_exactly(threads) -> None:
    size = 3 * SPLIT_MIN_BYTES
    rng = np.random.default_rng(5)
    src = torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8))
    with SharedMemory() as shm:
        (dst,) = shm.allocate("dst", [BufferSpec("b", (size + (1 << 20),), torch.uint8)])
        dst.fill_(SENTINEL)
        decode, prefill = ShmEngine(copy_threads=1), ShmEngine(copy_threads=threads)
        with decode, prefill:
            decode.register([Region("dst", dst.data_ptr(), dst.nbytes)])
            prefill.register([Region("src", src.data_ptr(), size)])
            peer = prefill.connect(proven(prefill, decode.endpoint()))
            # 1 MiB pages written in reverse order, plus one 9 MiB run and a 3-byte tail
            pages = [(i << 20, (size - (1 << 20) - (i << 20)) + 512, 1 << 20) for i in range(0, size >> 20, 2)]
            spans = pages + [((1 << 20) * 1, 7, 3)]
            s, d, n = (np.array(x, dtype=np.uint64) for x in zip(*spans))
            base_s, base_d = np.uint64(src.data_ptr()), np.uint64(dst.data_ptr())
            plan = TransferPlan.from_arrays(s + base_s, d + base_d, n)
            assert prefill._copier.shares_for(plan.total_bytes) == min(threads, plan.total_bytes // (8 << 20))
            prefill.wait(prefill.submit(peer, plan), 10.0)
        want = np.full(size + (1 << 20), SENTINEL, dtype=np.uint8)
        a = src.numpy()
        for so, do, ln in spans:
            want[do : do + ln] = a[so : so + ln]
        assert np.array_equal(dst.numpy(), want)


@pytest.mark.parametrize("threads", [1, 3])
def test_a_hashed_copy_lands_exactly_and_feeds_each_stream_its_bytes_in_order(threads) -> None:
    import xxhash

    size = 3 * SPLIT_MIN_BYTES
    rng = np.random.default_rng(9)
    src = torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8))
    a = src.numpy()
    with SharedMemory() as shm:
        (dst,) = shm.allocate("dst", [BufferSpec("b", (size,), torch.uint8)])
        dst.fill_(SENTINEL)
        decode, prefill = ShmEngine(copy_threads=1), ShmEngine(copy_threads=threads)
        with decode, prefill:
            decode.register([Region("dst", dst.data_ptr(), size)])
            prefill.register([Region("src", src.data_ptr(), size)])
            peer = prefill.connect(proven(prefill, decode.endpoint()))
            # four streams of 1 MiB pieces, interleaved in the plan; each written elsewhere
            pieces = [(i << 20, ((i * 7) % 48) << 20, 1 << 20, i % 4) for i in range(48)]
            s, d, n, stream = (np.array(x) for x in zip(*pieces))
            base_s, base_d = np.uint64(src.data_ptr()), np.uint64(dst.data_ptr())
            plan = TransferPlan.from_arrays(s.astype(np.uint64) + base_s, d.astype(np.uint64) + base_d, n)
            hashers = [xxhash.xxh3_128() for _ in range(4)]
            seen = []

            def hash_src(src_addr, length):
                seen.append((src_addr.copy(), length.copy()))
                return hashers, stream

            prefill.wait(prefill.submit(peer, plan, hash_src=hash_src), 10.0)
        assert len(seen) == 1 and np.array_equal(seen[0][0], plan.src)
        want = np.full(size, SENTINEL, dtype=np.uint8)
        for so, do, ln, _ in pieces:
            want[do : do + ln] = a[so : so + ln]
        assert np.array_equal(dst.numpy(), want)
        for k in range(4):
            ref = xxhash.xxh3_128()
            for so, _, ln, st in pieces:
                if st == k:
                    ref.update(a[so : so + ln].tobytes())
            assert hashers[k].digest() == ref.digest()


def test_helper_threads_run_nicer_than_the_submitting_thread() -> None:
    import os
    import threading

    c = Copier(threads=2)
    try:
        pool = c._helpers()
        mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        helper = pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result(10)
        assert helper == min(19, mine + HELPER_NICE)
    finally:
        c.close()


def test_a_copy_does_not_wait_for_a_helper_that_never_runs() -> None:
    import threading

    size = 2 * SPLIT_MIN_BYTES
    src = np.random.default_rng(2).integers(0, 256, size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    c = Copier(threads=2)
    gate = threading.Event()
    try:
        busy = c._helpers().submit(gate.wait, 30)  # the one helper is taken
        u64 = np.uint64
        c.copy(
            np.array([dst.ctypes.data], u64), np.array([src.ctypes.data], u64), np.array([size], u64), size
        )  # returns: this thread copied every share itself
        assert np.array_equal(dst, src) and not busy.done()
    finally:
        gate.set()
        c.close()


def test_a_descriptor_is_copied_and_hashed_in_pieces_with_a_short_last_one(monkeypatch) -> None:
    import xxhash

    from pdstate.transfer.engines import shm_copy

    monkeypatch.setattr(shm_copy, "HASH_PIECE_BYTES", 1000)
    src = np.random.default_rng(4).integers(0, 256, 2500, dtype=np.uint8)
    dst = np.zeros(2500, dtype=np.uint8)
    h = xxhash.xxh3_128()
    shm_copy._copy_hash([dst.ctypes.data], [src.ctypes.data], [2500], [h], [0])
    assert np.array_equal(dst, src) and h.digest() == xxhash.xxh3_128(src.tobytes()).digest()
