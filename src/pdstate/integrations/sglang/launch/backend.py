"""What pdstate's own SGLang backend (``--disaggregation-transfer-backend pdstate``) refuses, as
functions of the launch's topology, so the preflight predicts exactly those refusals.

``pdstate.integrations.sglang.manager`` refuses (with these functions' texts):

- at start, on either side: context parallelism (``attn_cp_size`` or ``attn_dcp_size`` above 1):
  the KV manager raises ``ValueError`` while SGLang builds it, so the server does not start;
- per prefill, on every request aimed at it (the decode's scheduler keeps running):
  pipeline-parallel sizes that differ, and a decode attention TP wider than the prefill's.

A prefill attention TP wider than the decode's works (one prefill rank sends, the others complete
as dummies), and a decode radix cache is served (only the pages past the decode's prefix move).
The backend calls these very functions with the widths it reads from SGLang, and a unit test checks
that it words none of these refusals itself, so the preflight and the backend cannot drift.
"""

from __future__ import annotations


def context_parallel_refusal(attn_cp_size: int, attn_dcp_size: int) -> str | None:
    """Why the backend's KV manager refuses to start on a server with context parallelism, else ``None``."""
    if attn_cp_size > 1 or attn_dcp_size > 1:
        return (
            f"pdstate's SGLang backend does not support context parallelism yet (attn_cp_size={attn_cp_size}, "
            f"attn_dcp_size={attn_dcp_size}): use --disaggregation-transfer-backend mooncake"
        )
    return None


def topology_refusal(prefill_pp: int, decode_pp: int, prefill_attn_tp: int, decode_attn_tp: int) -> str | None:
    """Why the backend fails every request from that prefill to this decode, else ``None``."""
    if prefill_pp != decode_pp:
        return (
            f"pipeline-parallel sizes differ: prefill pp_size={prefill_pp}, decode pp_size={decode_pp}; "
            "pdstate's SGLang backend moves a whole layer stack per rank (use the same --pp-size)"
        )
    if decode_attn_tp > prefill_attn_tp:
        return (
            f"decode attention TP size {decode_attn_tp} is larger than the prefill's {prefill_attn_tp}: "
            "pdstate's SGLang backend feeds each decode rank from one prefill rank that sends to it alone "
            "(use a decode attention TP no larger than the prefill's)"
        )
    return None
