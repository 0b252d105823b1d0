"""Worker configuration: a TOML file, then ``PDSTATE_*`` environment, then ``--set`` overrides.

Parsed once, strictly (unknown keys are errors), into frozen pydantic models; errors name the
key. ``PDSTATE_POOL__PAGE_SIZE=512`` sets ``pool.page_size``; ``--set pool.page_size=512`` does
the same and wins over the environment. Values given as strings are parsed as TOML scalars
(``true``, ``4``, ``"paged"``), falling back to the raw string.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdstate.errors import ConfigError
from pdstate.pools.presets import PRESETS, PoolSettings
from pdstate.pools.presets import preset as preset_settings
from pdstate.runtime.common import WorkerOptions

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ENV_PREFIX = "PDSTATE_"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PoolSection(_Section):
    unified_kv: bool | None = None
    speculative_num_draft_tokens: int | None = Field(None, ge=0)
    page_size: int | None = Field(None, gt=0)
    sliding_window: int | None = Field(None, gt=0)
    full_tokens: int | None = Field(None, gt=0)
    swa_tokens: int | None = Field(None, gt=0)
    max_num_reqs: int | None = Field(None, gt=0)
    online_c128: bool | None = None
    online_c128_mtp: bool | None = None
    kv_dtype: str | None = None
    state_dtype: Literal["float32", "bfloat16"] | None = None


class DraftSection(_Section):
    enabled: bool = True
    mapping: Literal["shared", "own", "clone"] = "shared"
    layers: int = Field(1, gt=0)


class ChecksSection(_Section):
    local: bool = True
    verify: Literal["full", "sample"] = "full"


class ControlSection(_Section):
    bind: str = "tcp://127.0.0.1:5601"
    peer: str = "tcp://127.0.0.1:5601"
    heartbeat_interval_s: float = Field(1.0, gt=0)
    peer_timeout_s: float = Field(5.0, gt=0)
    request_deadline_s: float = Field(30.0, gt=0)
    max_inflight: int = Field(64, gt=0)
    inline_max_bytes: int = Field(2 << 20, ge=0)


class HttpSection(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8100, ge=0, lt=65536)


class MooncakeSection(_Section):
    host: str = "127.0.0.1"
    protocol: Literal["tcp", "rdma"] = "tcp"
    device: str = ""


class TransferSection(_Section):
    engine: Literal["shm", "mooncake", "nixl", "loopback"] = "shm"
    mooncake: MooncakeSection = MooncakeSection()


class AuthSection(_Section):
    token: str = ""
    token_file: str = ""

    def secret(self) -> bytes | None:
        if self.token_file:
            try:
                return Path(self.token_file).read_text().strip().encode() or None
            except OSError as exc:
                raise ConfigError(f"auth.token_file: cannot read {self.token_file}: {exc.strerror or exc}") from None
        return self.token.encode() or None


class WorkerConfig(_Section):
    role: Literal["prefill", "decode"]
    worker_id: str = ""
    preset: str = "tiny"
    pool: PoolSection = PoolSection()
    draft: DraftSection = DraftSection()
    checks: ChecksSection = ChecksSection()
    control: ControlSection = ControlSection()
    http: HttpSection = HttpSection()
    transfer: TransferSection = TransferSection()
    auth: AuthSection = AuthSection()

    def pool_settings(self) -> PoolSettings:
        s = preset_settings(self.preset)
        changes = {k: v for k, v in self.pool.model_dump().items() if v is not None}
        if self.pool.speculative_num_draft_tokens == 0:
            changes["speculative_num_draft_tokens"] = None
        changes.update(
            draft_enabled=self.draft.enabled, draft_mapping=self.draft.mapping, draft_layers=self.draft.layers
        )
        return s.with_(**changes)

    def worker_options(self) -> WorkerOptions:
        engine_options: dict[str, Any] = {}
        if self.transfer.engine == "mooncake":
            m = self.transfer.mooncake  # MooncakeEngine names the NIC list ``device_name``
            engine_options = {"host": m.host, "protocol": m.protocol, "device_name": m.device}
        return WorkerOptions(
            role=self.role,
            pool=self.pool_settings(),
            engine=self.transfer.engine,
            engine_options=engine_options,
            bind=self.control.bind,
            peer=self.control.peer,
            worker_id=self.worker_id,
            token=self.auth.secret(),
            heartbeat_interval_s=self.control.heartbeat_interval_s,
            peer_timeout_s=self.control.peer_timeout_s,
            request_deadline_s=self.control.request_deadline_s,
            max_inflight=self.control.max_inflight,
            inline_max_bytes=self.control.inline_max_bytes,
            local_checks=self.checks.local,
            verify=self.checks.verify,
        )


def _scalar(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set_path(tree: dict, dotted: str, value: Any, origin: str) -> None:
    parts = [p for p in dotted.split(".") if p]
    if not parts:
        raise ConfigError(f"{origin}: empty key")
    node = tree
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{origin}: {'.'.join(parts)}: {p} is not a section")
        node = nxt
    node[parts[-1]] = value


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    environ: Mapping[str, str] | None = None,
) -> WorkerConfig:
    """Load, merge and validate; raises ``ConfigError`` naming the offending key."""
    tree: dict = {}
    origins: dict[str, str] = {}  # dotted key -> where its value came from, for error messages
    if path is not None:
        try:
            tree = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    env = os.environ if environ is None else environ
    for key in sorted(env):
        if key.startswith(ENV_PREFIX) and key not in ("PDSTATE_SHARED",):
            dotted = key[len(ENV_PREFIX) :].lower().replace("__", ".")
            _set_path(tree, dotted, _scalar(env[key]), f"environment {key}")
            origins[dotted] = f"environment {key}"
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        k, v = item.split("=", 1)
        _set_path(tree, k.strip(), _scalar(v.strip()), f"--set {item}")
        origins[".".join(p for p in k.strip().split(".") if p)] = f"--set {item}"
    try:
        cfg = WorkerConfig.model_validate(tree)
    except ValidationError as exc:
        msgs = []
        for e in exc.errors():
            loc = ".".join(str(p) for p in e["loc"]) or "<root>"
            where = f" (from {origins[loc]})" if loc in origins else (f" (in {path})" if path is not None else "")
            msgs.append(f"{loc}: {e['msg']}{where}")
        raise ConfigError("invalid configuration: " + "; ".join(msgs)) from None
    if cfg.preset not in PRESETS:
        where = f" (from {origins['preset']})" if "preset" in origins else (f" (in {path})" if path is not None else "")
        raise ConfigError(f"preset: unknown preset {cfg.preset!r}; choose one of {sorted(PRESETS)}{where}")
    return cfg
