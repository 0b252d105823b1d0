"""The auth rules a configuration must pass before anything starts (``load_config`` runs them).

Fail closed: a token file that cannot be read, is not UTF-8 or is empty; a known placeholder as
the token (``REPLACE-ME...``, ``changeme``, ...); a token that is only whitespace or shorter
than ``MIN_TOKEN_BYTES`` once trimmed; HTTP or the prefill's control socket bound beyond loopback
with no token at all (unless ``auth.allow_insecure_bind = true``). Each is a ``ConfigError`` of
one line naming the key, where its value came from, and the fix.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdstate.errors import ConfigError
from pdstate.protocol.hosts import is_loopback_host

GENERATE_HINT = "openssl rand -hex 32"
MIN_TOKEN_BYTES = 16  # a shared token's least length once trimmed (``openssl rand -hex 32`` gives 64)
# Configuration keys whose values are taken as given, never parsed as TOML (an all-digit token
# stays a string).
STRING_KEYS = frozenset({"auth.token", "auth.token_file"})

# Tokens shipped in examples and templates: never a secret, whatever the file they come from.
# Compared after lower-casing and dropping everything but letters and digits.
PLACEHOLDER_TOKENS = frozenset(
    {"changeme", "replaceme", "secret", "token", "password", "example", "placeholder", "yourtoken", "yoursecret"}
)
_PLACEHOLDER_MARKERS = ("replaceme", "changeme", "placeholder", "yourtoken", "yoursecret")


def is_placeholder_token(token: str) -> bool:
    """A value from an example or template (``REPLACE-ME...``, ``changeme``, ``<your-token>``)."""
    norm = re.sub(r"[^a-z0-9]", "", token.lower())
    return norm in PLACEHOLDER_TOKENS or any(m in norm for m in _PLACEHOLDER_MARKERS)


def read_file_bytes(
    path: str | Path, *, directory: str, unreadable: Callable[[Any], str], missing: str | None = None
) -> bytes:
    """The file's bytes, or a one-line ``ConfigError``: ``directory`` when it is a directory,
    ``missing`` (when given) when it does not exist, else ``unreadable(why)``."""
    try:
        return Path(path).read_bytes()
    except IsADirectoryError:
        raise ConfigError(directory) from None
    except OSError as exc:
        if missing is not None and isinstance(exc, FileNotFoundError):
            raise ConfigError(missing) from None
        raise ConfigError(unreadable(exc.strerror or exc)) from None


def read_token_file(path: str) -> bytes:
    """The trimmed token in ``path``; ``ConfigError`` when unreadable, not UTF-8 or empty."""
    fix = f"write the shared token into it, e.g. {GENERATE_HINT} > {path}"
    data = read_file_bytes(
        path,
        directory=f"auth.token_file: {path} is a directory; name the file that holds the token",
        unreadable=lambda why: f"auth.token_file: cannot read {path}: {why}; make it a file readable by this user",
    )
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"auth.token_file: {path} is not UTF-8 text; {fix}") from None
    if not text:
        raise ConfigError(f"auth.token_file: {path} is empty; {fix}")
    return text.encode()


def control_bind_host(endpoint: str) -> str | None:
    """The host part of a ZeroMQ ``tcp://`` bind endpoint; ``None`` for transports that never
    leave the host (``ipc://``, ``inproc://``)."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme in ("ipc", "inproc"):
        return None
    host, _, _port = rest.rpartition(":")
    return host or rest


def check_token(auth: Any, where: Callable[[str], str]) -> None:
    """The configured token is a real secret: no placeholder, not whitespace only, at least
    ``MIN_TOKEN_BYTES`` once trimmed."""
    if auth.token_file:
        token = auth.secret().decode()  # raises ConfigError for unreadable / non-UTF-8 / empty
        if is_placeholder_token(token):
            raise ConfigError(
                f"auth.token_file: {auth.token_file} holds a placeholder, not a secret; "
                f"replace it with a real one, e.g. {GENERATE_HINT} > {auth.token_file}"
            )
        key, what, fix = "auth.token_file", f"{auth.token_file} holds", f"{GENERATE_HINT} > {auth.token_file}"
    elif auth.token:
        token = auth.token.strip()
        if not token:
            raise ConfigError(
                f"auth.token: the configured value is only whitespace{where('auth.token')}; "
                f"set a real one, e.g. PDSTATE_AUTH__TOKEN=$({GENERATE_HINT}), or leave it unset for no auth"
            )
        if is_placeholder_token(token):
            raise ConfigError(
                f"auth.token: the configured value is a placeholder, not a secret{where('auth.token')}; "
                f"set a real one, e.g. PDSTATE_AUTH__TOKEN=$({GENERATE_HINT})"
            )
        key, what, fix = (
            "auth.token",
            f"the configured value{where('auth.token')} is",
            f"PDSTATE_AUTH__TOKEN=$({GENERATE_HINT})",
        )
    else:
        return
    n = len(token.encode())
    if n < MIN_TOKEN_BYTES:
        raise ConfigError(
            f"{key}: {what} a token of {n} bytes once trimmed; a token needs at least {MIN_TOKEN_BYTES}, e.g. {fix}"
        )


def check_auth(cfg: Any, where: Callable[[str], str]) -> None:
    """Fail closed: a weak or placeholder token, or a listener beyond loopback with no token."""
    auth = cfg.auth
    check_token(auth, where)
    if auth.secret() is None:  # the control channel's keys come from the uid's key file: refused now, not at start
        from pdstate.agent.curve import load_key

        load_key(auth.key_dir or None)
    if auth.secret() is not None or auth.allow_insecure_bind:
        return
    exposed = []
    if not is_loopback_host(cfg.http.host):
        exposed.append(("http.host", cfg.http.host))
    if cfg.role == "prefill":
        host = control_bind_host(cfg.control.bind)
        if host is not None and not is_loopback_host(host):
            exposed.append(("control.bind", cfg.control.bind))
    if exposed:
        key, value = exposed[0]
        raise ConfigError(
            f"{key}: {value!r} is reachable beyond loopback but no auth token is configured{where(key)}; "
            "set auth.token_file (or PDSTATE_AUTH__TOKEN), or auth.allow_insecure_bind = true to serve without auth"
        )


OPEN_ENGINES = ("mooncake", "nixl")  # native listeners pdstate cannot restrict (docs/security.md)


def check_open_listener(engine: str, acknowledged: bool) -> None:
    """``engine``'s native listeners accept anyone on every interface (Mooncake 0.3.13: 0.0.0.0 and
    [::] whatever its host, measured): a worker starts with it only when the operator said so."""
    if engine in OPEN_ENGINES and not acknowledged:
        raise ConfigError(
            f"transfer.{engine}.allow_open_listener: the {engine} engine listens on every interface and "
            "authenticates nobody (whoever reaches its ports can write into this worker's registered memory); "
            f"keep the workers on a private network (deploy/k8s/networkpolicy.yaml) and set "
            f"transfer.{engine}.allow_open_listener = true to acknowledge it"
        )
