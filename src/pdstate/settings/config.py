"""Worker configuration: a TOML file, then ``PDSTATE_*`` environment, then ``--set`` overrides.

Parsed once, strictly (unknown keys are errors), into frozen pydantic models; errors name the
key. ``PDSTATE_POOL__PAGE_SIZE=512`` sets ``pool.page_size``; ``--set pool.page_size=512`` does
the same and wins over the environment. Values given as strings are parsed as TOML scalars
(``true``, ``4``, ``"paged"``), falling back to the raw string; ``auth.token`` and
``auth.token_file`` are always taken as the string given.

Environment names: only ``PDSTATE_SECTION__KEY`` (``PDSTATE_KEY`` for the top-level ``role``,
``worker_id`` and ``preset``) is configuration, and an unknown key under a known section is an
error like any other. Any other ``PDSTATE_*`` name (``PDSTATE_ENGINE``, ``PDSTATE_AUTH_TOKEN``, a
misspelled section) is not configuration: it gets one warning per process naming the nearest
valid key (``stray_environment``), and the load goes on. Serve, check and the SGLang backend all
load through ``load_config``, so they warn alike.

Auth fails closed, at load time (so ``pdstate serve`` exits 2 with one line before anything
starts): the rules are in ``pdstate.settings.auth``.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import sys
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pdstate.errors import ConfigError
from pdstate.pools.dsv4 import UPSTREAM_RELEASES
from pdstate.pools.presets import PRESETS, PoolSettings
from pdstate.pools.presets import preset as preset_settings
from pdstate.settings.auth import (  # noqa: F401  (re-exported: the auth rules' old home)
    GENERATE_HINT,
    STRING_KEYS,
    check_auth,
    control_bind_host,
    is_loopback_host,
    is_placeholder_token,
    read_file_bytes,
    read_token_file,
)
from pdstate.transfer.engines.registry import ENGINES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ENV_PREFIX = "PDSTATE_"

log = logging.getLogger("pdstate.config")

# PDSTATE_* names that are not configuration but belong to pdstate's own tools: never warned about.
TOOL_NAMES = {
    "PDSTATE_SHARED": "the test harness's shared directory",
    "PDSTATE_SGLANG_ENV": "the SGLang drivers' cached environment",
}
# Read by one part of pdstate only: warned about elsewhere, saying where it belongs.
OWN_NAMES = {
    "PDSTATE_SGLANG_CONFIG": "read by the SGLang backend only (its TOML file); pdstate serve and check take --config"
}


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
    # the SGLang release whose pool layout and checks to reproduce (None: the preset's, the newest)
    upstream: str | None = None

    @field_validator("upstream", mode="before")
    @classmethod
    def _known_release(cls, v: Any) -> Any:
        if v is not None and v not in UPSTREAM_RELEASES:
            raise ValueError(
                f"unknown SGLang release {v!r}; choose one of {', '.join(repr(r) for r in UPSTREAM_RELEASES)}"
            )
        return v


class DraftSection(_Section):
    enabled: bool = True
    mapping: Literal["shared", "own", "clone"] = "shared"
    layers: int = Field(1, gt=0)


class ChecksSection(_Section):
    local: bool = True
    verify: Literal["full", "sample"] = "full"


# fnmatch's pattern characters (``control.prefills`` were patterns; now exact addresses), outside
# a bracketed IPv6 host
_PATTERN = re.compile(r"[*?\[\]]")
_IPV6_HOST = re.compile(r"^tcp://\[[0-9A-Fa-f:.]+\]")


def _exact_address(entry: str, advice: str) -> None:
    """Refuse ``entry`` if it is a pattern (outside a bracketed IPv6 host); ``advice`` says what
    to list instead."""
    if _PATTERN.search(_IPV6_HOST.sub("tcp://", entry, count=1)):
        raise ValueError(f"{entry[:200]!r} is a pattern; {advice}")


class ControlSection(_Section):
    bind: str = "tcp://127.0.0.1:5601"
    peer: str = "tcp://127.0.0.1:5601"
    heartbeat_interval_s: float = Field(1.0, gt=0)
    peer_timeout_s: float = Field(5.0, gt=0)
    request_deadline_s: float = Field(30.0, gt=0)
    max_inflight: int = Field(64, gt=0)
    inline_max_bytes: int = Field(32 << 20, ge=0)
    drain_s: float = Field(0.0, ge=0, le=3600)
    # prefill: a request's verdict is awaited this long; the most of the pools one decode may hold
    # while another is registered (``pdstate.agent.fairness``)
    verdict_timeout_s: float = Field(5.0, gt=0, le=3600)
    decode_share: float = Field(0.5, gt=0, le=1)
    # decode: how long after a prefill's completed control session closed its requests' pages
    # come back, no session with its address completed meanwhile (Mooncake, NIXL; ``agent.landing``)
    dead_prefill_release_s: float = Field(300.0, gt=0)
    # prefill: other addresses decodes dial it at (a DNS name, a proxy, the names of a wildcard
    # bind): a proof of ownership is bound to the address its decode dialled, and a prefill takes
    # only proofs given to its bind address or one of these; decode: the prefills POST
    # /v1/transfers may name besides control.peer (exact addresses; patterns are refused)
    advertise: list[str] = []
    prefills: list[str] = []

    @model_validator(mode="after")
    def _timeout_spans_heartbeats(self) -> ControlSection:
        # a peer is heard once per heartbeat interval: a timeout within two intervals declares a
        # live peer gone on its first late heartbeat (a busy host, a GC pause)
        if self.peer_timeout_s < 2 * self.heartbeat_interval_s:
            raise ValueError(
                f"control.peer_timeout_s ({self.peer_timeout_s:g}) is under twice "
                f"control.heartbeat_interval_s ({self.heartbeat_interval_s:g}): a live peer would be "
                "declared gone on its first late heartbeat; raise the timeout or shorten the interval"
            )
        return self

    @field_validator("prefills")
    @classmethod
    def _exact_prefills(cls, v: list[str]) -> list[str]:
        for entry in v:
            _exact_address(
                entry,
                "list each prefill a transfer may name by its exact control address "
                "(tcp://host:port): a decode dials only addresses named exactly",
            )
        return v


# a ZeroMQ tcp endpoint: tcp://host:port, the host an IP literal, a [v6] literal or a name
_TCP_ENDPOINT = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9.-]{1,200}|\*):([0-9]{1,5})$")
_WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]")


def _endpoint_port(entry: str) -> tuple[str, int]:
    m = _TCP_ENDPOINT.match(entry)
    if m is None or int(m.group(2)) > 65535:
        raise ValueError(f"{entry[:200]!r} is not tcp://host:port (a port 0-65535)")
    return m.group(1), int(m.group(2))


class MigrationSection(_Section):
    """Decode: where a migrating decode's listener binds, the address its targets are told to
    dial (``""``: the bound address), and (on a target) the listeners beyond loopback a migration
    may name (``POST /v1/migrations/incoming``; exact addresses, patterns refused)."""

    bind: str = "tcp://127.0.0.1:0"
    advertise: str = ""
    sources: list[str] = Field(default_factory=list, max_length=256)

    @field_validator("bind")
    @classmethod
    def _bind_endpoint(cls, v: str) -> str:
        _endpoint_port(v)
        return v

    @field_validator("advertise")
    @classmethod
    def _dialable(cls, v: str) -> str:
        if v:
            host, port = _endpoint_port(v)
            if host in _WILDCARD_HOSTS or port == 0:
                raise ValueError(
                    f"{v[:200]!r} cannot be dialled; name the host and port a target "
                    "reaches this decode's migration listener at"
                )
        return v

    @field_validator("sources")
    @classmethod
    def _exact_sources(cls, v: list[str]) -> list[str]:
        for entry in v:
            _exact_address(
                entry,
                "list each migrating decode's listener by its exact address (its migration.advertise, tcp://host:port)",
            )
            host, port = _endpoint_port(entry)
            if host in _WILDCARD_HOSTS or port == 0:
                raise ValueError(f"{entry[:200]!r} is not one listener's address")
        return v

    @model_validator(mode="after")
    def _advertised_wildcard(self) -> MigrationSection:
        host, _ = _endpoint_port(self.bind)
        if host in _WILDCARD_HOSTS and not self.advertise:
            raise ValueError(
                f"migration.bind: {self.bind!r} binds every interface; set migration.advertise to the "
                "address a target dials"
            )
        return self


class HttpSection(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8100, ge=0, lt=65536)


class MooncakeSection(_Section):
    host: str = "127.0.0.1"
    protocol: Literal["tcp", "rdma"] = "tcp"
    device: str = ""
    # the native listeners are on every interface, unauthenticated: start only when acknowledged
    allow_open_listener: bool = False

    def engine_options(self) -> dict[str, Any]:
        return {"host": self.host, "protocol": self.protocol, "device_name": self.device}  # MooncakeEngine's NIC list


class NixlSection(_Section):
    allow_open_listener: bool = False
    # UCX_NET_DEVICES for the agent ("lo": its TCP listener on loopback only); "": UCX's choice (all)
    net_devices: str = ""

    def engine_options(self) -> dict[str, Any]:
        return {"ucx_env": {"UCX_NET_DEVICES": self.net_devices}} if self.net_devices else {}


class TransferSection(_Section):
    engine: str = "shm"  # a name of the engine registry (``transfer.engines.registry``)
    mooncake: MooncakeSection = MooncakeSection()
    nixl: NixlSection = NixlSection()
    # what each request's digests cover (``pdstate.agent.verify``): a sample, every byte, nothing
    verify: Literal["sampled", "full", "off"] = "sampled"

    @field_validator("engine")
    @classmethod
    def _registered_engine(cls, v: str) -> str:
        if v not in ENGINES:
            names = [repr(n) for n in ENGINES]
            expected = " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
            raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})
        return v

    def _section(self) -> _Section | None:
        """The configured engine's own section (``[transfer.<engine>]``), if it has one."""
        section = getattr(self, self.engine, None)
        return section if isinstance(section, _Section) else None

    def engine_options(self) -> dict[str, Any]:
        """The options the engine is constructed with: its own section's, if it has one."""
        section = self._section()
        return section.engine_options() if section is not None else {}

    def open_listener_acknowledged(self) -> bool:
        """Whether the engine may start: one without an open listener always; one with, when its
        section's ``allow_open_listener`` says so (``settings.auth.check_open_listener``)."""
        if not ENGINES[self.engine].open_listener:
            return True
        return bool(getattr(self._section(), "allow_open_listener", False))


class AuthSection(_Section):
    token: str = ""
    token_file: str = ""
    # Serve HTTP / the control socket beyond loopback without a token (refused unless true).
    allow_insecure_bind: bool = False
    # Without a token: the directory of this uid's control key (``control.key``), which keys the
    # control channel's CURVE session; "" is $XDG_RUNTIME_DIR/pdstate, else /tmp/pdstate-<uid>.
    key_dir: str = ""

    def secret(self) -> bytes | None:
        """The shared token (trimmed), or ``None`` when none is configured. ``token_file`` wins
        over ``token``; a token file that cannot be read, is not UTF-8 or is empty is a
        ``ConfigError`` (an operator who names a file means to turn auth on: never fall back to no
        auth)."""
        if self.token_file:
            return read_token_file(self.token_file)
        return self.token.strip().encode() or None


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
    migration: MigrationSection = MigrationSection()

    def pool_settings(self) -> PoolSettings:
        s = preset_settings(self.preset)
        changes = {k: v for k, v in self.pool.model_dump().items() if v is not None}
        if self.pool.speculative_num_draft_tokens == 0:
            changes["speculative_num_draft_tokens"] = None
        changes.update(
            draft_enabled=self.draft.enabled, draft_mapping=self.draft.mapping, draft_layers=self.draft.layers
        )
        return s.with_(**changes)


def _read_config_text(path: str | Path) -> str:
    toml = "--config takes a TOML file"
    data = read_file_bytes(
        path,
        directory=f"config file {path} is a directory; {toml}",
        unreadable=lambda why: f"config file {path}: cannot read: {why}; {toml} readable by this user",
        missing=f"config file not found: {path}",
    )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {exc.start}); --config takes a TOML file, which is UTF-8"
        ) from None


def _scalar(text: str, key: str = "") -> Any:
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    if key in STRING_KEYS and not isinstance(value, str):  # a secret as given: an all-digit token is no integer
        return text
    return value


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


def environment_names() -> list[str]:
    """Every configuration key as its environment name, in model order (``PDSTATE_ROLE``,
    ``PDSTATE_POOL__PAGE_SIZE``, ``PDSTATE_TRANSFER__MOONCAKE__HOST``, ...)."""
    names: list[str] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                walk(field.annotation, f"{prefix}{name}__")
            else:
                names.append(f"{ENV_PREFIX}{prefix}{name}".upper())

    walk(WorkerConfig, "")
    return names


def nearest_name(name: str) -> str | None:
    """The configuration name ``name`` most likely meant, or ``None`` when none is close.

    A name equal to a key without its section (``PDSTATE_ENGINE``) means that key; otherwise the
    closest by ``difflib``, with ``_`` and ``__`` counted alike (``PDSTATE_AUTH_TOKEN``)."""
    names = environment_names()
    rest = name[len(ENV_PREFIX) :].upper()
    for candidate in names:
        if candidate.rsplit("__", 1)[-1] == rest and "__" in candidate:
            return candidate
    flat = {candidate.replace("__", "_"): candidate for candidate in names}
    close = difflib.get_close_matches(name.upper().replace("__", "_"), list(flat), n=1, cutoff=0.75)
    return flat[close[0]] if close else None


def stray_environment(environ: Mapping[str, str], known: Collection[str] = ()) -> tuple[dict[str, str], list[str]]:
    """Split ``environ``'s ``PDSTATE_*`` names into configuration and warnings.

    Returns ``(configuration, warnings)``: the names whose first part is a key or section of
    ``WorkerConfig``, and one sentence per other ``PDSTATE_*`` name (``TOOL_NAMES`` and ``known``
    aside) saying it is ignored and naming the nearest valid key."""
    heads = set(WorkerConfig.model_fields)
    config: dict[str, str] = {}
    warnings: list[str] = []
    for key in sorted(environ):
        if not key.startswith(ENV_PREFIX) or key in TOOL_NAMES or key in known:
            continue
        if key[len(ENV_PREFIX) :].lower().split("__")[0] in heads:
            config[key] = environ[key]
            continue
        if key in OWN_NAMES:
            warnings.append(f"environment {key} is not configuration here: {OWN_NAMES[key]}; ignored")
            continue
        near = nearest_name(key)
        hint = (
            f"did you mean {near}?"
            if near
            else "configuration names are PDSTATE_SECTION__KEY, e.g. PDSTATE_TRANSFER__ENGINE"
        )
        warnings.append(f"environment {key} is not a configuration name and is ignored; {hint}")
    return config, warnings


_WARNED: set[str] = set()  # one warning per name per process, however many loads


def warn_stray_environment(environ: Mapping[str, str], known: Collection[str] = ()) -> dict[str, str]:
    """``stray_environment``, each warning logged once per process; returns the configuration."""
    config, warnings = stray_environment(environ, known)
    for text in warnings:
        if text not in _WARNED:
            _WARNED.add(text)
            log.warning("%s", text)
    return config


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    environ: Mapping[str, str] | None = None,
    known: Collection[str] = (),
) -> WorkerConfig:
    """Load, merge and validate; raises ``ConfigError`` naming the offending key.

    ``environ`` (default ``os.environ``) contributes its ``PDSTATE_SECTION__KEY`` names; any other
    ``PDSTATE_*`` name is warned about once and ignored, except those in ``known`` (names the
    caller reads itself, such as the SGLang backend's ``PDSTATE_SGLANG_CONFIG``)."""
    tree: dict = {}
    origins: dict[str, str] = {}  # dotted key -> where its value came from, for error messages
    if path is not None:
        text = _read_config_text(path)
        try:
            tree = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    env = warn_stray_environment(os.environ if environ is None else environ, known)
    for key in sorted(env):
        dotted = key[len(ENV_PREFIX) :].lower().replace("__", ".")
        _set_path(tree, dotted, _scalar(env[key], dotted), f"environment {key}")
        origins[dotted] = f"environment {key}"
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        k, v = item.split("=", 1)
        _set_path(tree, k.strip(), _scalar(v.strip(), k.strip()), f"--set {item}")
        origins[".".join(p for p in k.strip().split(".") if p)] = f"--set {item}"
    try:
        cfg = WorkerConfig.model_validate(tree)
    except ValidationError as exc:
        msgs = []
        for e in exc.errors():
            loc = ".".join(str(p) for p in e["loc"]) or "<root>"
            where = f" (from {origins[loc]})" if loc in origins else (f" (in {path})" if path is not None else "")
            near = None
            if e["type"] == "extra_forbidden" and origins.get(loc, "").startswith("environment "):
                near = nearest_name(origins[loc].removeprefix("environment "))
            msgs.append(f"{loc}: {e['msg']}{where}" + (f"; did you mean {near}?" if near else ""))
        raise ConfigError("invalid configuration: " + "; ".join(msgs)) from None

    def where(key: str) -> str:
        return f" (from {origins[key]})" if key in origins else (f" (in {path})" if path is not None else "")

    if cfg.preset not in PRESETS:
        raise ConfigError(f"preset: unknown preset {cfg.preset!r}; choose one of {sorted(PRESETS)}{where('preset')}")
    check_auth(cfg, where)
    return cfg
