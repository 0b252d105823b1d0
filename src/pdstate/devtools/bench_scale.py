"""``pdstate bench``'s scale rows: an agent pair's memory (peak RSS during the bench, growth over
1,000 small requests) and an M x N cluster's aggregate throughput.

- ``worker_memory``: after the agent phase ran its lengths on a ``dsv4-flash`` agent pair,
  ``requests`` small requests (128 tokens: one main-KV page, the SWA component and the draft,
  ~11 MB each) after a warm-up of ``requests // 10``: ``VmRSS`` and ``RssAnon`` (private memory:
  where a leak shows) before and after, summed over the pair; then the pair's peak resident set
  over its life (``VmHWM`` of the prefill plus the decode: pools, torch, the decode's
  ``/dev/shm`` pages it touched and the prefill's mapping of them).
- ``mxn``: ``pdstate demo --prefills 2 --decodes 2`` (``devtools.cluster``: four agent processes
  and the router) on the ``dsv4-flash`` layout, a batch of 8k-token requests at concurrency 2 per
  process: bytes moved over the batch's wall time. The demo's prefill fills each request's pages
  (the stand-in for prefill compute) and its decode checks every landed item, each a pass over
  the bytes on the same cores, so this is the cluster's throughput, not the copy's.
"""

from __future__ import annotations

import time
from collections.abc import Callable

MXN_TOKENS = 8192
SMALL_REQUEST_TOKENS = 128


def proc_status_kb(pid: int) -> dict[str, int]:
    """The ``kB`` fields of ``/proc/<pid>/status`` (``VmHWM``, ``VmRSS``, ``RssAnon``, ...)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                out[key] = int(parts[0])
    return out


def _sum_mb(pids: list[int], field: str) -> float:
    return sum(proc_status_kb(p).get(field, 0) for p in pids) / 1024


def worker_memory(run: Callable[..., dict], pids: list[int], requests: int, tokens: int = SMALL_REQUEST_TOKENS) -> dict:
    """The pair's growth over ``requests`` requests of ``tokens``, and its peak RSS (``VmHWM``:
    over its whole life, the bench's lengths before this included)."""
    for _ in range(max(1, requests // 10)):
        run(tokens, "sample")
    before = {k: _sum_mb(pids, k) for k in ("VmRSS", "RssAnon")}
    t0 = time.perf_counter()
    for _ in range(requests):
        run(tokens, "sample")
    seconds = time.perf_counter() - t0
    after = {k: _sum_mb(pids, k) for k in ("VmRSS", "RssAnon")}
    return {
        # the kernel's VmHWM can lag an RSS just read (its high-water mark is folded in lazily)
        "peak_rss_mb": max(_sum_mb(pids, "VmHWM"), after["VmRSS"]),
        "rss_before_mb": before["VmRSS"],
        "rss_after_mb": after["VmRSS"],
        "rss_growth_mb": after["VmRSS"] - before["VmRSS"],
        "anon_growth_mb": after["RssAnon"] - before["RssAnon"],
        "requests": requests,
        "request_tokens": tokens,
        "seconds": seconds,
    }


def mxn(
    requests: int,
    progress,
    prefills: int = 2,
    decodes: int = 2,
    tokens: int = MXN_TOKENS,
    preset_name: str = "dsv4-flash",
) -> dict:
    """An N x M agent cluster (shm engine): aggregate GB/s over one batch."""
    from pdstate.devtools.cluster import run_cluster
    from pdstate.pools.presets import preset

    progress(f"[mxn] {prefills} prefills x {decodes} decodes, {requests} requests of {tokens} tokens ...")
    out = run_cluster(
        preset(preset_name), prefills, decodes, "shm", {}, [tokens] * requests, 2, "least-loaded", lambda *a: None
    )
    if out["failed"]:
        raise RuntimeError(f"mxn: {out['failed']} of {requests} requests failed: {out['errors']}")
    keep = ("prefills", "decodes", "requests", "verified", "bytes", "seconds", "gbps", "handshake_ms")
    return {k: out[k] for k in keep} | {"request_tokens": tokens}
