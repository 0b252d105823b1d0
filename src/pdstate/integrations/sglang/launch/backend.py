"""What pdstate's own SGLang backend (``--disaggregation-transfer-backend pdstate``) refuses, as
functions of the launch's topology, so the preflight predicts exactly those refusals.

``pdstate.integrations.sglang.manager`` refuses (with these functions' texts):

at start, where the KV manager raises ``ValueError`` while SGLang builds it, so the server does
not start: context parallelism on either side (``attn_cp_size`` or ``attn_dcp_size`` above 1),
pipeline parallelism on a decode (``pp_size`` above 1: SGLang pairs a PP prefill with a decode of
the same PP size or of one stage; pdstate serves the second only), and a PP prefill with a draft
model (its draft KV has no stage slice in pdstate's decode yet). A PP prefill without a draft
is served into a decode of one stage (``integrations.sglang.stages``). And several tokenizer
workers (``tokenizer_worker_num`` above 1) on an SGLang without ``SGLANG_HTTP_SERVER_APP_PATH``
(0.5.19): its workers import SGLang's own app, which no plugin loader precedes, and would stop the
server with ``'pdstate' is not a valid TransferBackend``. In 0.5.19 the schedulers build the KV
manager (``Scheduler.__init__`` -> ``init_disaggregation`` -> the bootstrap or pre-allocation
queue), and ``launch_server`` waits for every scheduler to be ready (``Engine._launch_subprocesses``)
before uvicorn spawns those workers: the server stops with the scheduler's ``ValueError`` (and
SGLang's own "scheduler is dead" line), before any worker exists (read from 0.5.19's code).
Nothing is refused per request: no pair of servers that both started is refused for its topology.

A prefill attention TP wider than the decode's works (one prefill rank sends, the others complete
as dummies), so does a decode attention TP wider than the prefill's (each prefill rank sends the
whole request to every decode rank SGLang maps to it: DeepSeek-V4's KV is replicated across
attention-TP ranks), and a decode radix cache is served (only the pages past the decode's prefix
move).
The backend calls these very functions with the widths it reads from SGLang, and a unit test checks
that it words none of these refusals itself, so the preflight and the backend cannot drift.
"""

from __future__ import annotations

from pdstate.integrations.sglang import releases


def context_parallel_refusal(attn_cp_size: int, attn_dcp_size: int) -> str | None:
    """Why the backend's KV manager refuses to start on a server with context parallelism, else ``None``."""
    if attn_cp_size > 1 or attn_dcp_size > 1:
        return (
            f"pdstate's SGLang backend does not support context parallelism yet (attn_cp_size={attn_cp_size}, "
            f"attn_dcp_size={attn_dcp_size}): use --disaggregation-transfer-backend mooncake"
        )
    return None


def pipeline_parallel_refusal(pp_size: int, role: str, draft: bool = False) -> str | None:
    """Why the backend's KV manager refuses to start on a ``role`` server with pipeline parallelism,
    else ``None``: a PP prefill is served into a decode of one stage, without a draft model's KV."""
    if pp_size <= 1:
        return None
    if role == "decode":
        return (
            f"pdstate's SGLang backend does not support pipeline parallelism on a decode yet (pp_size={pp_size}; "
            "a PP prefill is served into a decode of one stage): use --disaggregation-transfer-backend mooncake"
        )
    if draft:
        return (
            f"pdstate's SGLang backend does not move a draft model's KV from a pipeline-parallel prefill yet "
            f"(pp_size={pp_size}): use --disaggregation-transfer-backend mooncake"
        )
    return None


def tokenizer_workers_refusal(tokenizer_worker_num: int, app_path_setting: bool) -> str | None:
    """Why the backend's KV manager refuses to start on a server with several tokenizer workers
    whose SGLang has no ``SGLANG_HTTP_SERVER_APP_PATH`` (``app_path_setting`` false), else ``None``."""
    if tokenizer_worker_num <= 1 or app_path_setting:
        return None
    without = " and ".join(r.version for r in releases.RELEASES if not r.tokenizer_workers_app_path)
    first = next((r.version for r in releases.RELEASES if r.tokenizer_workers_app_path), "a newer release")
    return (
        "pdstate's SGLang backend cannot reach the tokenizer worker processes of an SGLang without "
        f"SGLANG_HTTP_SERVER_APP_PATH ({without}; tokenizer_worker_num={tokenizer_worker_num}): "
        f"use --tokenizer-worker-num 1, or SGLang {first}"
    )
