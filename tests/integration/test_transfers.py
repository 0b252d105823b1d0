"""Transfers land byte-exact in the decode's target AND draft buffers, and nowhere else.

In-process matrix (every engine x {paged, unified} x {draft on, off}): ``pdstate serve``'s prefill
and decode workers (``pdstate.worker``, over the agent) in this process (threads; their own pools,
control sockets over TCP, the engine's real data path — shm still maps the decode's ``/dev/shm``
segments through a second mapping). Before
each transfer every byte of the decode's pools is set to a sentinel; afterwards the pools must
equal, byte for byte, the sentinel everywhere except the items the request's index lists address,
which must hold the room's deterministic content.

Process matrix: a smaller set of real prefill/decode process pairs running the demo's ``run``
command (every result verified, no page leaked on either side), and ``pdstate demo --json``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdstate.worker import requests as rq
from tests.support.engines import ENGINE_PARAMS, require_engine
from tests.support.images import SENTINEL, compare_images, expected_images, fill_regions
from tests.support.pools import TINY
from tests.support.waiting import wait_until
from tests.support.workers import (
    assert_all_verified,
    demo_summary,
    first_event,
    run_batch,
    served_pair,
    transfer,
)

# empty (the control path alone: nothing may change), shorter than the window, exactly the window
# / one C128 group, C128 +1, page -1, one page, page +1, three C128 groups, across many pages
# (tiny: page 256, window 128, 1024 tokens)
LENGTHS = [0, 100, 128, 129, 255, 256, 257, 384, 1000]


@pytest.fixture
def decode_allocations(monkeypatch):
    """Every allocation the workers make, as ``(pools, seq_len, Allocation)``."""
    seen: list = []
    real = rq.allocate

    def recording(pools, names, seq_len):
        a = real(pools, names, seq_len)
        seen.append((pools, seq_len, a))
        return a

    monkeypatch.setattr(rq, "allocate", recording)
    return seen


def _expected_count(name: str, seq_len: int, window: int, page: int) -> int:
    """Index-list length per channel (spec section 5; serve's workers address the SWA component
    by the window's pages in every release: ``worker.requests``)."""
    if name == "main_kv":
        return math.ceil(seq_len / page)
    if name == "swa":
        ws = max(0, seq_len - window) // page * page
        return math.ceil((seq_len - ws) / page)
    if name == "swa_ring":
        return min(seq_len, window)
    if name == "c128_state":
        return 0 if seq_len % 128 == 0 else 1
    raise AssertionError(f"unexpected channel {name}")


@pytest.mark.parametrize("draft", [True, False], ids=["draft", "nodraft"])
@pytest.mark.parametrize("mode", ["paged", "unified"])
@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_transfers_land_exactly_in_target_and_draft(engine, mode, draft, decode_allocations):
    require_engine(engine)
    s = TINY.with_(unified_kv=(mode == "unified"), draft_enabled=draft)
    with served_pair(s, engine) as (p, d):
        regions = d.pools.memory.regions()
        names = rq.channel_names(d.kv_args)
        draft_regions = [i for i, r in enumerate(regions) if r.name.endswith("draft")]
        if draft:
            assert names[-1] == ("swa_ring" if mode == "unified" else "swa")
            assert len(draft_regions) == 1
        else:
            assert not draft_regions
        free_d, free_p = d.free_counts(), p.free_counts()
        for n, seq_len in enumerate(LENGTHS):
            fill_regions(regions, SENTINEL)
            room = 7_000_000 + 1000 * n + seq_len
            res = transfer(d, seq_len, room=room, deadline_s=20)
            assert res.status == "success" and res.verified, (seq_len, res.error)
            allocs = [a for pools, _, a in decode_allocations if pools is d.pools]
            lists = allocs[-1].lists
            assert len(lists) == len(names)
            for name, idx in zip(names, lists):
                want = _expected_count(name, seq_len, s.sliding_window, s.page_size)
                assert len(idx) == want, (name, seq_len)
            expected = expected_images(regions, d.kv_args, room, lists)
            problem = compare_images(regions, expected)
            assert problem is None, f"{seq_len} tokens: {problem}"
            for i in draft_regions:  # the draft really received this request's window
                assert (expected[i] != SENTINEL).any() == (seq_len > 0)
            if seq_len == 0:
                assert res.bytes == 0 and res.descriptors == 0
            assert d.free_counts() == free_d, f"decode pages leaked after {seq_len} tokens"
            wait_until(f"the prefill's pages back after {seq_len} tokens", lambda: p.free_counts() == free_p, 10)
        assert len([1 for pools, _, _ in decode_allocations if pools is d.pools]) == len(LENGTHS)
        assert d.stats.snapshot().transfers["failed"] == 0 and p.stats.snapshot().transfers["failed"] == 0


PROCESS_MATRIX = [
    pytest.param("shm", "paged", True, id="shm-paged-draft"),
    pytest.param("shm", "paged", False, id="shm-paged-nodraft"),
    pytest.param("shm", "unified", True, id="shm-unified-draft"),
    pytest.param("shm", "unified", False, id="shm-unified-nodraft"),
    pytest.param("mooncake", "paged", True, id="mooncake-paged-draft", marks=pytest.mark.mooncake),
    pytest.param("nixl", "unified", True, id="nixl-unified-draft", marks=pytest.mark.nixl),
]


@pytest.mark.parametrize("engine, mode, draft", PROCESS_MATRIX)
def test_process_pair_batch_verified_without_leaks(workers, engine, mode, draft):
    require_engine(engine)
    s = TINY.with_(unified_kv=(mode == "unified"), draft_enabled=draft)
    p, ep = workers.prefill(s, engine=engine)
    d = workers.decode(ep, s, engine=engine)
    ready = first_event(d)
    assert ready["event"] == "ready", ready
    prefill_free = p.command({"cmd": "stats"}, "stats")["free"]
    lengths = [100, 128, 129, 255, 256, 257, 384, 1000, 300, 200, 129, 640]
    results, done = run_batch(d, lengths, concurrency=3)
    assert_all_verified(results, lengths)
    assert done["free"] == ready["free"]

    # the prefill frees a request's pages once its sender ended, a moment after the decode's verdict,
    # and counts the request when its worker thread sees that end: wait (bounded) for both
    def settled():
        st = p.command({"cmd": "stats"}, "stats")
        counted = sum(st["stats"]["transfers"][k] for k in ("success", "failed"))
        return st if st["free"] == prefill_free and counted == len(lengths) else None

    stats = wait_until("the prefill's pages back and every request counted", settled, 10)
    assert stats["stats"]["transfers"]["success"] == len(lengths) and stats["stats"]["transfers"]["failed"] == 0
    assert d.close() == 0 and p.close() == 0


def test_demo_json(tmp_path):
    summary = demo_summary(["--preset", "tiny", "--requests", "4"], tmp_path, 180)
    for key in ("engine", "mode", "requests", "verified", "failed", "bytes", "seconds", "gbps", "handshake_ms"):
        assert key in summary, key
    assert summary["engine"] == "shm" and summary["mode"] == "paged"
    assert summary["requests"] == 4 and summary["verified"] == summary["requests"] and summary["failed"] == 0
    assert summary["bytes"] > 0 and summary["seconds"] > 0 and summary["gbps"] > 0 and summary["handshake_ms"] > 0
    assert np.isfinite(summary["gbps"])
