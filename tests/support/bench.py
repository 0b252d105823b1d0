"""Bench results for plumbing tests: one with every section ``bench_report.summary`` reads, and one
with every row the README's performance tables render."""

from __future__ import annotations

from typing import Any


def fake_bench_result(**sections: Any) -> dict[str, Any]:
    """Planner and control sections as a real run fills them; ``sections`` add or replace."""
    return {
        "ratios": {"shm_vs_ceiling": 0.8},
        "planner": {
            "fragmented_ms": 1.0,
            "contiguous_ms": 0.5,
            "loop_fragmented_ms": 20.0,
            "descriptors_contiguous": 148,
            "descriptors_fragmented": 31830,
        },
        "control": {
            "handshake_ms": {"median": 7.0},
            "control_overhead_ms": {"median": 0.9},
            "request_1_token_ms": {"median": 2.0},
            "request_1_token_overhead_ms": {"median": 1.1},
            "first_handshake_flash_ms": 4.0,
        },
        **sections,
    }


def _row(seconds: float, nbytes: int = 10**9, spread: float = 0.0) -> dict[str, Any]:
    g = nbytes / seconds / 1e9
    gbps = {"median": g} | ({"min": g * (1 - spread), "max": g * (1 + spread)} if spread else {})
    return {"bytes": nbytes, "seconds": {"median": seconds}, "gbps": gbps}


def full_bench_result() -> dict[str, Any]:
    """Two lengths (2048, 32768), 1 GB each, with the physical limit (1 and 2 threads), the agent
    phase, the M x N row, the agent pair's memory and the ZeroMQ round trip; ``ratios`` left for
    ``bench_report.ratios`` to fill."""
    lengths = ["2048", "32768"]

    def per_len(*secs: float, spread: float = 0.0) -> dict[str, Any]:
        return {n: _row(s, spread=spread) for n, s in zip(lengths, secs)}

    r = fake_bench_result(
        lengths=[2048, 32768],
        modes=["paged"],
        paths={
            "paged:agent:physical_1t": per_len(0.2, 0.1),
            "paged:agent:physical_2t": per_len(0.25, 0.08),
            "paged:agent:physical": per_len(0.2, 0.08),
            "paged:agent:ceiling": per_len(0.4, 0.16),
            "paged:agent:agent_shm": per_len(0.5, 0.1, spread=0.1),
            "paged:agent:agent_shm_sampled": per_len(0.55, 0.105),
            "paged:agent:agent_shm_digest": per_len(0.5, 0.2),
        },
        mxn={"prefills": 2, "decodes": 2, "requests": 16, "request_tokens": 8192, "gbps": 4.0, "verified": 16},
        agent_memory={"peak_rss_mb": 3000.0, "rss_growth_mb": 0.5, "anon_growth_mb": -0.25, "requests": 1000},
    )
    r["control"]["zmq_round_trip_ms"] = {"median": 0.3}
    return r
