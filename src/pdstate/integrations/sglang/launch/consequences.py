"""What SGLang 0.5.19's own transfer backend does at run time when a pair whose layouts differ is
launched anyway, one differing factor at a time (measured, ``shared/reference/sglang_cpu.md``)."""

from __future__ import annotations

from typing import Any

TIMEOUT = "the decode's timeout (300 s by default)"


def consequence(factor: str, p: Any, d: Any) -> str:
    """Run-time effect of one differing factor under SGLang 0.5.19's own transfer backend."""
    if factor == "page_size":
        return (
            "SGLang's decode refuses the bootstrap (\"Page size mismatch ... Both servers must use the same "
            '--page-size value."), but the prefill waits in Bootstrapping until its timeout'
        )
    if factor == "kv_dtype":
        return (
            'SGLang\'s decode refuses the bootstrap ("KV cache dtype mismatch", the check beside the page '
            "size's), and the prefill waits in Bootstrapping until its timeout"
        )
    if factor == "layout":
        return (
            "paged and unified state components do not pair: wrong bytes or a failed transfer (SGLang compares neither)"
        )
    if factor == "compression_ratios":
        if isinstance(p, list) and isinstance(d, list) and sorted(p) == sorted(d):
            return (
                "same C4/C128 counts in another order: SGLang reports Success, but (layer, page) slots receive "
                "another layer's KV (measured: 640 of 750 slots wrong)"
            )
        return (
            f"different C4/C128 counts: SGLang's prefill transfer thread dies; requests hang until {TIMEOUT} "
            "and that prefill queue stays dead"
        )
    if factor == "stage":
        return "the buffers pair with other layers: wrong KV"
    if factor == "sliding_window":
        return (
            f"sliding window {p} vs {d}: SGLang reports Success (a log warning only), but every SWA entry lands "
            "one page off: wrong sliding-window KV"
        )
    if factor == "c4_ring":
        return (
            f"C4 state rings {p} vs {d}: wrong state; SGLang 0.5.19 reports Success while C4 compressor state "
            "lands in other ring slots (measured: 42 of 301 destination items wrong for a 700-token request), "
            "0.5.23 refuses the pair on both sides"
        )
    if factor == "c128_ring":
        if None in (p, d):
            return "one side has no C128 state: the components pair with the wrong buffers"
        if 1 in (p, d):
            return f"C128 state ring {p} vs {d} (online vs offline): wrong C128 state, no error (SGLang does not compare item lengths)"
        return (
            f"C128 state rings {p} vs {d}: wrong state; the partial 128-token group's state goes to another "
            "ring block, no error"
        )
    if factor == "online_c128":
        return "online vs offline C128 state: item sizes differ, wrong C128 state, no error"
    if factor in ("c4_state_dtype", "c128_state_dtype"):
        return f"compressor state in {p} vs {d}: item sizes differ, the decode reads misaligned state (SGLang does not compare item lengths)"
    if factor == "draft":
        if p and not d:
            return (
                "the prefill sends a draft SWA component the decode has no buffers for: SGLang's prefill transfer "
                f"thread dies; requests hang until {TIMEOUT} and that prefill queue stays dead"
            )
        if d and not p:
            return (
                "SGLang reports Success, but the decode's draft SWA KV is never written: the draft starts from "
                "stale state"
            )
        return "the two drafts' SWA geometry differs: the draft SWA lands at the wrong slots or sizes"
    if factor == "allocation_policy":
        return (
            "SGLang 0.5.23's decode fails every request of the pair (\"Disaggregation decode allocation policy "
            f"mismatch: prefill={p}, decode={d}\"), and pdstate's handshake refuses it"
        )
    if factor == "main_kv_item_lens":
        return "main KV pages of different sizes: misaligned KV (SGLang does not compare item lengths)"
    if factor == "components":
        return "state components pair by position: every one after the first difference meets the wrong buffers"
    return "the state layouts differ: wrong bytes"
