"""Load: hundreds of requests, 64 in flight, across two worker processes; Busy under a small limit.

Every request must end verified (or, under Busy, verified or failed with a reason); the pools
return to their starting free counts; the resident memory of both processes stays flat between
the end of a warm-up and the end of the run (VmRSS from /proc, printed).
"""

from __future__ import annotations

import random
import time

from tests.support.pools import TINY
from tests.support.summary import tally
from tests.support.waiting import wait_until
from tests.support.workers import (
    assert_all_verified,
    decode_stats,
    first_event,
    leaked,
    prefill_requests,
    rss_kb,
    run_batch,
)

# Room for 64 requests of up to 1024 tokens on both sides.
LOAD = TINY.with_(full_tokens=64 * 1024 + 1024, swa_tokens=64 * 512 + 512, max_num_reqs=64)
TIMERS = dict(heartbeat_interval_s=0.5, peer_timeout_s=5.0, request_deadline_s=60.0)
RSS_GROWTH_LIMIT_KB = 20 * 1024
WARMUP = 128
REQUESTS = 512
IN_FLIGHT = 64


def _lengths(n: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randint(1, 1024) for _ in range(n)]


def _rss(p, d) -> tuple[int, int]:
    return rss_kb(p.pid), rss_kb(d.pid)


def test_512_requests_64_in_flight_memory_flat(workers):
    p, ep = workers.prefill(LOAD, max_inflight=IN_FLIGHT, **TIMERS)
    d = workers.decode(ep, LOAD, worker_id="load", **TIMERS)
    ready = first_event(d, 60)
    assert ready["event"] == "ready", ready
    p_free = prefill_requests(p)["free"]
    rss_start = _rss(p, d)
    warm, done = run_batch(d, _lengths(WARMUP, 1), concurrency=IN_FLIGHT, timeout_s=120)
    assert_all_verified(warm, _lengths(WARMUP, 1))
    rss_warm = _rss(p, d)
    lengths = _lengths(REQUESTS, 2)
    t0 = time.monotonic()
    results, done = run_batch(d, lengths, concurrency=IN_FLIGHT, timeout_s=300)
    took = time.monotonic() - t0
    assert_all_verified(results, lengths)
    rss_end = _rss(p, d)
    assert done["free"] == ready["free"]

    # The decode ends a request when its digest matches; the prefill frees its pages when that
    # verdict reaches it, a moment later: settled, not instant.
    def settled():
        pr = prefill_requests(p)
        return pr if pr["free"] == p_free and pr["in_flight"] == [] else None

    pr = wait_until("the prefill to free every request's pages after the batch", settled, 10.0)
    peak_d = decode_stats(d)["peak_in_flight"]
    assert peak_d == IN_FLIGHT, peak_d
    growth = [e - w for e, w in zip(rss_end, rss_warm)]
    mb = sum(r["bytes"] for r in results) / 1e6
    print(
        f"\nload: {REQUESTS} requests ({mb:.0f} MB), {IN_FLIGHT} in flight on the decode "
        f"(prefill peak {pr['peak_in_flight']}), {took:.2f} s, {REQUESTS / took:.0f} req/s"
    )
    for name, s, w, e in zip(("prefill", "decode"), rss_start, rss_warm, rss_end):
        print(
            f"  VmRSS {name:<8} start {s / 1024:7.1f} MB  after warm-up {w / 1024:7.1f} MB  "
            f"end {e / 1024:7.1f} MB  growth {(e - w) / 1024:+.1f} MB"
        )
    assert max(growth) < RSS_GROWTH_LIMIT_KB, f"RSS grew by {[g // 1024 for g in growth]} MB over the run"
    tally(
        "load: 512 requests, 64 in flight",
        results,
        leaked(ready["free"], done["free"]) + leaked(p_free, pr["free"]),
        None,
        f"{took:.1f} s; RSS growth prefill {growth[0] / 1024:+.1f} MB, decode {growth[1] / 1024:+.1f} MB",
    )


def test_busy_under_a_small_limit(workers):
    limit = 4
    p, ep = workers.prefill(LOAD, max_inflight=limit, **TIMERS)
    d = workers.decode(ep, LOAD, worker_id="busy", **TIMERS)
    ready = first_event(d, 60)
    assert ready["event"] == "ready", ready
    p_free = prefill_requests(p)["free"]
    lengths = _lengths(256, 3)
    warm, _ = run_batch(d, lengths[:64], concurrency=IN_FLIGHT, timeout_s=120)
    rss_warm = _rss(p, d)
    t0 = time.monotonic()
    results, done = run_batch(d, lengths, concurrency=IN_FLIGHT, timeout_s=300)
    took = time.monotonic() - t0
    rss_end = _rss(p, d)
    bad = [
        r
        for r in results + warm
        if not (
            (r["status"] == "success" and r["verified"])
            or (r["status"] == "failed" and r["error"] and r["error"]["message"])
        )
    ]
    assert not bad, bad[:3]
    assert sorted(r["seq_len"] for r in results) == sorted(lengths)
    p_stats = p.command({"cmd": "stats"}, "stats")["stats"]
    d_stats = decode_stats(d)
    assert p_stats["transfers"]["busy"] > 0, "the prefill never said Busy"
    assert d_stats["stats"]["transfers"]["busy"] == p_stats["transfers"]["busy"]
    pr = prefill_requests(p)
    assert pr["peak_in_flight"] <= limit, pr["peak_in_flight"]  # nothing queued past the limit
    assert done["free"] == ready["free"] and pr["free"] == p_free and pr["in_flight"] == []
    growth = [e - w for e, w in zip(rss_end, rss_warm)]
    ok = sum(1 for r in results if r["status"] == "success")
    print(
        f"\nbusy: {len(lengths)} requests, decode {IN_FLIGHT} in flight, prefill limit {limit}: "
        f"{p_stats['transfers']['busy']} Busy answers, {ok} verified, {len(results) - ok} failed, {took:.2f} s; "
        f"RSS growth prefill {growth[0] / 1024:+.1f} MB, decode {growth[1] / 1024:+.1f} MB"
    )
    assert max(growth) < RSS_GROWTH_LIMIT_KB
    tally(
        f"Busy: limit {limit}, 64 in flight",
        results,
        leaked(ready["free"], done["free"]) + leaked(p_free, pr["free"]),
        None,
        f"{p_stats['transfers']['busy']} Busy answers, peak {pr['peak_in_flight']} jobs on the prefill",
    )
