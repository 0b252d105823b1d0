"""What a manager's agent is built with: pdstate's usual configuration, and the pool pair's report.

Configuration: the TOML file named by ``PDSTATE_SGLANG_CONFIG`` (optional), then the
``PDSTATE_SECTION__KEY`` variables of ``pdstate.settings.config`` (``PDSTATE_TRANSFER__ENGINE=nixl``,
``PDSTATE_AUTH__TOKEN_FILE=...``, ``PDSTATE_CONTROL__PEER_TIMEOUT_S=...``, ``PDSTATE_HTTP__PORT=...``
for the rank's HTTP endpoint, ``endpoint``); any other ``PDSTATE_*``
name (a misspelled section, ``PDSTATE_ENGINE``) is ignored with one warning naming the nearest key,
never silently. The role is SGLang's disaggregation mode. SGLang's pools are private device memory,
which the ``shm`` engine cannot reach across processes: unless the engine is named, the backend
uses ``mooncake`` (``nixl`` across hosts too; ``loopback`` within one process).

Layout: SGLang hands the manager a ``KVArgs`` only; the pools are in the same process (the
scheduler built them), so the manager finds the DeepSeek-V4 target whose main-KV buffers are the
first ``kv_data_ptrs`` and the draft whose buffers are the rest, and reports that pair as pdstate's
workers do (``pdstate.pools.reporting.build_report``), so every factor is compared at the handshake.

SGLang's own setting the backend reads: whether the running SGLang has ``SGLANG_HTTP_SERVER_APP_PATH``
(``has_app_path_setting``), the app its tokenizer workers import (``plugin``).
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Any

from pdstate.errors import ConfigError
from pdstate.pools.interface import is_dsv4_pool
from pdstate.pools.reporting import build_report
from pdstate.settings.auth import check_open_listener, is_loopback_host
from pdstate.settings.config import load_config
from pdstate.transfer.engines.registry import ENGINES, engine_names

CONFIG_ENV = "PDSTATE_SGLANG_CONFIG"
DEFAULT_ENGINE = "mooncake"
APP_PATH = "SGLANG_HTTP_SERVER_APP_PATH"  # SGLang's setting: the app its HTTP worker processes import

__all__ = [
    "APP_PATH",
    "CONFIG_ENV",
    "AgentSettings",
    "check_rank_auth",
    "find_pools",
    "has_app_path_setting",
    "layout_report",
    "load_settings",
]


def has_app_path_setting() -> bool:
    """Whether the SGLang in this process reads ``SGLANG_HTTP_SERVER_APP_PATH`` (0.5.23: the
    release row's ``tokenizer_workers_app_path``; detected, so an unlisted release is served by what
    it does). Without it (0.5.19) its tokenizer workers cannot know backend ``pdstate``, and the KV
    manager refuses ``--tokenizer-worker-num`` above 1 at start
    (``launch.backend.tokenizer_workers_refusal``)."""
    try:
        from sglang.srt.environ import envs
    except ImportError:
        return False
    return hasattr(envs, APP_PATH)


@dataclass(frozen=True)
class AgentSettings:
    engine: str
    engine_options: dict[str, Any]
    token: bytes | None
    heartbeat_interval_s: float
    peer_timeout_s: float
    allow_insecure_bind: bool = False
    allow_open_listener: bool = False  # transfer.<engine>.allow_open_listener
    verify: str = "sampled"  # transfer.verify
    # the rank's HTTP endpoint (``endpoint``): ``http.port`` when configured (the rank's port is
    # ``http_port + rank``), none otherwise; ``http.host`` when configured, else the rank's address
    http_port: int | None = None
    http_host: str | None = None
    key_dir: str | None = None  # auth.key_dir: without a token, where this uid's control key is
    dead_prefill_release_s: float = 300.0  # control.dead_prefill_release_s (decode; ``agent.landing``)

    def agent_options(self) -> dict[str, Any]:
        """The keywords both agents take from these settings (engine, auth, liveness, verification)."""
        return dict(
            engine=self.engine,
            engine_options=self.engine_options,
            token=self.token,
            key_dir=self.key_dir,
            heartbeat_interval_s=self.heartbeat_interval_s,
            peer_timeout_s=self.peer_timeout_s,
            verify=self.verify,
        )


def check_rank_auth(settings: AgentSettings, role: str, host: str) -> None:
    """Fail closed, as ``pdstate serve`` does: the engine's open listener acknowledged
    (``check_open_listener``), and a rank whose agent is reachable beyond loopback
    (``host``: the address SGLang advertises for the rank, which its prefill agent binds) needs an
    auth token, unless ``auth.allow_insecure_bind`` says otherwise. One line."""
    check_open_listener(settings.engine, settings.allow_open_listener)
    if settings.token is None and not settings.allow_insecure_bind and not is_loopback_host(host):
        raise ConfigError(
            f"auth: this SGLang {role} rank's agent is reachable at {host} (the address SGLang advertises for the "
            "rank) but no auth token is configured; set PDSTATE_AUTH__TOKEN_FILE (or PDSTATE_AUTH__TOKEN) on every "
            "prefill and decode, or PDSTATE_AUTH__ALLOW_INSECURE_BIND=true to run without auth"
        )


def load_settings(role: str, environ=None) -> AgentSettings:
    """The agent settings for ``role`` ("prefill" / "decode"); ``ConfigError`` names a bad key."""
    env = os.environ if environ is None else environ
    cfg = load_config(env.get(CONFIG_ENV) or None, overrides=[f"role={role}"], environ=env, known=(CONFIG_ENV,))
    engine = cfg.transfer.engine if "engine" in cfg.transfer.model_fields_set else DEFAULT_ENGINE
    if ENGINES[engine].shared_memory:
        usable = " or ".join(engine_names(shared_memory=False, in_process=False))
        within = ", ".join(engine_names(shared_memory=False, in_process=True))
        raise ConfigError(
            f"transfer.engine: {engine!r} needs the decode's buffers in /dev/shm, and SGLang's pools are "
            f"private memory: use {usable}" + (f" ({within} within one process)" if within else "")
        )
    transfer = cfg.transfer.model_copy(update={"engine": engine})
    return AgentSettings(
        engine=engine,
        engine_options=transfer.engine_options(),
        token=cfg.auth.secret(),
        key_dir=cfg.auth.key_dir or None,
        heartbeat_interval_s=cfg.control.heartbeat_interval_s,
        peer_timeout_s=cfg.control.peer_timeout_s,
        dead_prefill_release_s=cfg.control.dead_prefill_release_s,
        allow_insecure_bind=cfg.auth.allow_insecure_bind,
        allow_open_listener=transfer.open_listener_acknowledged(),
        verify=cfg.transfer.verify,
        http_port=cfg.http.port if "port" in cfg.http.model_fields_set else None,
        http_host=cfg.http.host if "host" in cfg.http.model_fields_set else None,
    )


def _pointers(pool, method: str) -> list[int]:
    get = getattr(pool, method, None)
    try:
        return [int(p) for p in get()[0]] if get is not None else []
    except Exception:  # a pool without that component (e.g. no unified SWA ring)
        return []


def find_pools(kv_args, candidates=None) -> tuple[object, object | None]:
    """``(target, draft)``: the live DeepSeek-V4 pools behind ``kv_args``, read with the methods
    0.5.19's and 0.5.23's pools share: the target's main-KV buffers are the first ``kv_data_ptrs``;
    the draft's are the rest, and its SWA state (paged or unified ring) is one of the state
    components (a NextN draft may have no main KV of its own). The report built from the pair
    then checks everything else."""
    want = [int(p) for p in kv_args.kv_data_ptrs]
    components = [[int(p) for p in ptrs] for ptrs in kv_args.state_data_ptrs]
    if candidates is None:
        candidates = [o for o in gc.get_objects() if hasattr(type(o), "get_contiguous_buf_infos") and is_dsv4_pool(o)]
    mains = [(pool, _pointers(pool, "get_contiguous_buf_infos")) for pool in candidates]

    def swa_state_is_a_component(pool) -> bool:
        swa = [_pointers(pool, m) for m in ("get_state_buf_infos", "get_unified_swa_ring_buf_infos")]
        return any(p and p in components for p in swa)

    for target, t_main in mains:
        if not t_main or want[: len(t_main)] != t_main:
            continue
        rest = want[len(t_main) :]
        for draft, d_main in mains:
            if draft is not target and d_main == rest and swa_state_is_a_component(draft):
                return target, draft
        if not rest:
            return target, None
    raise TypeError(
        "pdstate's SGLang backend moves DeepSeek-V4 state only: no DeepSeekV4TokenToKVPool pair in this "
        f"process owns the {len(want)} main-KV buffers and {len(components)} state components of this KV manager"
    )


def server_factors(kv_args) -> dict:
    """What the running SGLang's server settings add to the report (0.5.23: the decode allocation
    policy and a DSpark draft's transfer layout; 0.5.19 has neither, so both stay at the default)."""
    out: dict = {}
    try:
        from sglang.srt.runtime_context import get_disagg

        policy = getattr(get_disagg(), "disaggregation_decode_allocation_policy", None)
    except Exception:  # no published server args (an embedding), or a release without the setting
        policy = None
    if policy:
        out["allocation_policy"] = str(policy)
    try:
        from sglang.srt.disaggregation.utils import get_dsv41_spec_layout
    except ImportError:  # 0.5.19
        return out
    try:
        dspark = get_dsv41_spec_layout(kv_args)
    except Exception:  # as SGLang's own manager would raise it: reported by the local check instead
        dspark = None
    if dspark:
        out["dspark"] = dspark
    return out


def layout_report(kv_args, candidates=None):
    """The ``LayoutReport`` of the pool pair behind ``kv_args`` (its local check included), with
    the server settings SGLang 0.5.23 compares across the pair (``server_factors``)."""
    target, draft = find_pools(kv_args, candidates)
    report, _ = build_report(target, draft, **server_factors(kv_args))
    return report
