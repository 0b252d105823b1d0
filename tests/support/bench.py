"""A bench result with every section ``bench_report.summary`` reads, for plumbing tests."""

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
