"""What a manager's agent is built with: pdstate's usual configuration, and the pool pair's report.

Configuration: the TOML file named by ``PDSTATE_SGLANG_CONFIG`` (optional), then the
``PDSTATE_SECTION__KEY`` variables of ``pdstate.service.config`` (``PDSTATE_TRANSFER__ENGINE=nixl``,
``PDSTATE_AUTH__TOKEN_FILE=...``, ``PDSTATE_CONTROL__PEER_TIMEOUT_S=...``); ``PDSTATE_*`` variables
that name no section of it (this one, the test harness's) are not configuration. The role is
SGLang's disaggregation mode. SGLang's pools are private device memory, which the ``shm`` engine
cannot reach across processes: unless the engine is named, the backend uses ``mooncake``
(``nixl`` across hosts too; ``loopback`` within one process).

Layout: SGLang hands the manager a ``KVArgs`` only; the pools are in the same process (the
scheduler built them), so the manager finds the DeepSeek-V4 target whose buffers are the first
``kv_data_ptrs`` and the draft whose buffers are the rest, and reports that pair as pdstate's
workers do (``pdstate.pools.reporting.build_report``), so every factor is compared at the handshake.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Any

from pdstate.errors import ConfigError
from pdstate.pools.interface import is_dsv4_pool
from pdstate.pools.kvargs import state_components
from pdstate.pools.reporting import build_report
from pdstate.service.config import ENV_PREFIX, WorkerConfig, load_config

CONFIG_ENV = "PDSTATE_SGLANG_CONFIG"
DEFAULT_ENGINE = "mooncake"

__all__ = ["CONFIG_ENV", "AgentSettings", "find_pools", "layout_report", "load_settings"]


@dataclass(frozen=True)
class AgentSettings:
    engine: str
    engine_options: dict[str, Any]
    token: bytes | None
    heartbeat_interval_s: float
    peer_timeout_s: float


def _config_environ(environ) -> dict[str, str]:
    sections = set(WorkerConfig.model_fields)
    return {
        k: v
        for k, v in environ.items()
        if k.startswith(ENV_PREFIX) and k[len(ENV_PREFIX) :].lower().split("__")[0] in sections
    }


def load_settings(role: str, environ=None) -> AgentSettings:
    """The agent settings for ``role`` ("prefill" / "decode"); ``ConfigError`` names a bad key."""
    env = os.environ if environ is None else environ
    cfg = load_config(env.get(CONFIG_ENV) or None, overrides=[f"role={role}"], environ=_config_environ(env))
    engine = cfg.transfer.engine if "engine" in cfg.transfer.model_fields_set else DEFAULT_ENGINE
    if engine == "shm":
        raise ConfigError(
            "transfer.engine: 'shm' needs the decode's buffers in /dev/shm, and SGLang's pools are "
            "private memory: use mooncake or nixl (loopback within one process)"
        )
    options = cfg.model_copy(update={"transfer": cfg.transfer.model_copy(update={"engine": engine})}).worker_options()
    return AgentSettings(
        engine=engine,
        engine_options=dict(options.engine_options),
        token=options.token,
        heartbeat_interval_s=options.heartbeat_interval_s,
        peer_timeout_s=options.peer_timeout_s,
    )


def _pointers(target, draft) -> tuple[list[int], list[list[int]]]:
    """The main-KV and state-component pointers SGLang's schedulers put in a ``KVArgs`` for this pair."""
    main = [int(p) for pool in (target, draft) if pool is not None for p in pool.get_contiguous_buf_infos()[0]]
    comps = [[int(p) for p in ptrs] for _, (ptrs, _, _) in state_components(target, draft, check=False)]
    return main, comps


def find_pools(kv_args, candidates=None) -> tuple[object, object | None]:
    """``(target, draft)``: the live DeepSeek-V4 pools whose buffers are ``kv_args``'s, main KV
    (target's, then the draft's) and state components (the draft's SWA last) alike."""
    want = ([int(p) for p in kv_args.kv_data_ptrs], [[int(p) for p in ptrs] for ptrs in kv_args.state_data_ptrs])
    if candidates is None:
        candidates = [o for o in gc.get_objects() if hasattr(type(o), "get_contiguous_buf_infos") and is_dsv4_pool(o)]
    first = want[0][:1]
    for target in candidates:
        if [int(p) for p in target.get_contiguous_buf_infos()[0][:1]] != first:
            continue
        if _pointers(target, None) == want:
            return target, None
        for draft in candidates:
            if draft is not target and _pointers(target, draft) == want:
                return target, draft
    raise TypeError(
        "pdstate's SGLang backend moves DeepSeek-V4 state only: no DeepSeekV4TokenToKVPool pair in this "
        f"process owns the {len(want[0])} main-KV buffers and {len(want[1])} state components of this KV manager"
    )


def layout_report(kv_args, candidates=None):
    """The ``LayoutReport`` of the pool pair behind ``kv_args`` (its local check included)."""
    target, draft = find_pools(kv_args, candidates)
    report, _ = build_report(target, draft)
    return report
