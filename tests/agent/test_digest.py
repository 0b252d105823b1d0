"""Request digests off the critical path: hashed in the background (the prefill, beside the copy)
or spread over threads (the decode), a digest is the same value over the same bytes as the plain
streamed one, a flipped byte changes it, and cancelled work reads nothing more."""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

from pdstate.agent import digest as digest_mod
from pdstate.agent.digest import RequestDigest

ITEM = 4096


@pytest.fixture
def layout():
    rng = np.random.default_rng(3)
    bufs = [rng.integers(0, 256, 64 * ITEM, dtype=np.uint8) for _ in range(5)]
    ptrs = [b.ctypes.data for b in bufs]
    # main KV: 3 buffers; one state component: 2 buffers with another item length
    return bufs, [(ptrs[:3], [ITEM] * 3), (ptrs[3:], [ITEM // 2] * 2)]


UPDATES = [(0, [1, 2, 3, 9]), (0, [10, 11, 40]), (1, [5, 6, 7, 100, 2])]


def _plain(layout) -> RequestDigest:
    d = RequestDigest(layout)
    for c, idx in UPDATES:
        d.update(c, idx)
    return d


def test_background_and_parallel_digests_equal_the_streamed_one(layout, monkeypatch):
    bufs, lay = layout
    monkeypatch.setattr(digest_mod, "PARALLEL_MIN_BYTES", 1)  # share even this small request
    plain = _plain(lay)
    background = RequestDigest(lay)
    background.update_async(UPDATES[:2])
    background.update_async(UPDATES[2:])
    parallel = RequestDigest(lay)
    parallel.update_many(UPDATES, threads=3)
    assert plain.digest() == background.digest() == parallel.digest()
    assert plain.bytes == background.bytes == parallel.bytes == 3 * 7 * ITEM + 2 * 5 * ITEM // 2
    assert background.seconds > 0 and parallel.seconds > 0
    bufs[4][100 * ITEM // 2 + 7] ^= 0x10  # one bit of an item the state component lists
    flipped = RequestDigest(lay)
    flipped.update_many(UPDATES, threads=3)
    assert flipped.digest() != plain.digest()


def test_background_work_waits_for_earlier_updates_in_order(layout):
    _, lay = layout
    d = RequestDigest(lay)
    d.update_async([(0, [1, 2])])
    d.update(0, [3, 9])  # after the background part: the same stream as one update of [1, 2, 3, 9]
    d.update_async([(0, [10, 11, 40])])
    d.update(1, [5, 6, 7, 100, 2])
    assert d.digest() == _plain(lay).digest()


def test_cancelled_background_work_is_not_hashed(layout, monkeypatch):
    """An earlier chunk is being hashed (held inside ``hash_rows``) when more is queued and the
    digest is cancelled: cancel waits for that chunk, and what was queued is never hashed."""
    _, lay = layout
    first = [(0, [1, 2])]
    alone = RequestDigest(lay)
    alone.update_async(first)
    expected = alone.digest()  # hashed before the patch below: under load its background work could start after it
    hashing, go = threading.Event(), threading.Event()
    real = digest_mod.hash_rows

    def held(rows) -> None:
        hashing.set()
        assert go.wait(10)
        real(rows)

    monkeypatch.setattr(digest_mod, "hash_rows", held)
    d = RequestDigest(lay)
    d.update_async(first)
    assert hashing.wait(10)
    d.update_async(UPDATES)
    canceller = threading.Thread(target=d.cancel)
    canceller.start()
    canceller.join(0.2)
    assert canceller.is_alive()  # cancel waits for the running work
    go.set()
    canceller.join(10)
    assert not canceller.is_alive()
    monkeypatch.setattr(digest_mod, "hash_rows", real)
    assert d.digest() == expected  # the first chunk, and nothing queued after it


def test_streams_map_a_buffer_major_plan_to_the_streamed_digest(layout):
    """Hashing each descriptor of a plan (buffer-major, runs in list order, as the planner builds
    it) into the stream ``streams`` names gives the digest of the same lists streamed."""
    _, lay = layout
    src, length = [], []
    for c, idx in UPDATES:
        ptrs, items = lay[c]
        for p, item in zip(ptrs, items):  # buffer-major; one descriptor per item (no merging)
            for i in idx:
                src.append(p + i * item)
                length.append(item)
    d = RequestDigest(lay)
    hashers, index = d.streams(np.array(src, dtype=np.uint64), np.array(length, dtype=np.uint64))
    for s, n, k in zip(src, length, index.tolist()):
        hashers[k].update(ctypes.string_at(s, n))
    plain = _plain(lay)
    assert d.fused and d.bytes == plain.bytes and d.digest() == plain.digest()


class _Engine:
    """An engine whose submit records the digest's state at submission (a synchronous copy)."""

    def __init__(self, digest) -> None:
        self.digest, self.hashed_at_submit = digest, None

    def submit(self, peer_id, plan):
        self.hashed_at_submit = self.digest.bytes
        return "handle"


class _Plan:
    def __init__(self, total_bytes: int) -> None:
        self.total_bytes = total_bytes


@pytest.mark.parametrize("copy_bytes", [1 << 20, digest_mod.INLINE_COPY_BYTES])
def test_a_sampled_digest_of_a_short_copy_is_read_on_the_submitting_thread(layout, copy_bytes):
    """A host-form sampled digest (``inline``) of a copy under ``INLINE_COPY_BYTES`` is read on
    the submitting thread right after the submission (read when ``submit_digested`` returns, not
    before the copy); of a longer copy, in the background. Either way the same digest as one
    read at once."""
    from pdstate.agent.verify import SampleDigest

    _, lay = layout
    updates = [(0, np.array([1, 2, 3, 9])), (1, np.array([5, 6, 7]))]
    d = SampleDigest(lay, seed=9, lengths=[4, 3])
    engine = _Engine(d)
    assert digest_mod.submit_digested(engine, "peer", _Plan(copy_bytes), d, updates) == "handle"
    if copy_bytes < digest_mod.INLINE_COPY_BYTES:
        assert engine.hashed_at_submit == 0 and d.bytes > 0  # the copy first, then the sample, here
    want = SampleDigest(lay, seed=9, lengths=[4, 3])
    want.update_many(updates)
    assert d.digest() == want.digest()
