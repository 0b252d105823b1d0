"""The auth rules a configuration must pass before anything starts (``load_config`` runs them).

Fail closed: a token file that cannot be read, is not UTF-8 or is empty, is not a regular file
(a symlink, a FIFO, a device), is owned by another user or accessible to others, or is larger
than ``MAX_TOKEN_FILE_BYTES``; a known placeholder as the token (``REPLACE-ME...``,
``changeme``, ...); a token that is only whitespace or shorter than ``MIN_TOKEN_BYTES`` once
trimmed, or obviously weak (``weak_token_reason``); HTTP or the prefill's control socket bound beyond loopback
with no token at all (unless ``auth.allow_insecure_bind = true``). Each is a ``ConfigError`` of
one line naming the key, where its value came from, and the fix.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdstate.errors import ConfigError
from pdstate.inputs import file_kind, read_input_file
from pdstate.protocol.hosts import is_loopback_host
from pdstate.transfer.engines.registry import ENGINES

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
    ``missing`` (when given) when it does not exist, else ``unreadable(why)`` (also a FIFO, a
    device, or a file over ``pdstate.inputs.MAX_INPUT_BYTES``, never opened or read)."""
    return read_input_file(path, directory=directory, unreadable=unreadable, missing=missing)


MAX_TOKEN_FILE_BYTES = 4096  # a token file's largest size (``openssl rand -hex 32`` writes 65 bytes)
MIN_DISTINCT_CHARS = 8  # a token's fewest distinct characters
MAX_RUN = 16  # a token's longest run of one repeated character, exclusive


def _may_share_group(st: os.stat_result) -> bool:
    """A root-owned file whose group is one of this (non-root) user's: how Kubernetes (``fsGroup``)
    and volume setups hand a secret to a container's user. Root chose who reads it."""
    euid = os.geteuid()
    return euid != 0 and st.st_uid == 0 and st.st_gid in {os.getegid(), *os.getgroups()}


MAX_LINKS = 8


def _through_root_links(path: str, key: str) -> str:
    """``path``, or where the symbolic links it names lead while root owns each (Kubernetes'
    secret volumes: ``token -> ..data/token``); a link of any other owner is refused."""
    p = path
    for _ in range(MAX_LINKS):
        try:
            st = os.lstat(p)
        except OSError:
            return p  # opening it tells why
        if not stat.S_ISLNK(st.st_mode):
            return p
        if st.st_uid != 0:
            raise ConfigError(
                f"{key}: {path} is a symbolic link (owned by uid {st.st_uid}); "
                f"name the regular file itself (readlink -f {path})"
            )
        p = os.path.join(os.path.dirname(p), os.readlink(p))
    raise ConfigError(f"{key}: {path} goes through more than {MAX_LINKS} symbolic links; name the file itself")


def read_token_file(path: str, key: str = "auth.token_file") -> bytes:
    """The trimmed token in ``path``; a one-line ``ConfigError`` (naming ``key``) unless it is a
    regular file (not a symlink, unless root owns it: ``O_NOFOLLOW``; FIFOs and devices are never read, the file is
    opened ``O_NONBLOCK``), owned by this user or root, neither group- nor world-accessible (but a
    root-owned file readable by one of this user's groups, see ``_may_share_group``), at most
    ``MAX_TOKEN_FILE_BYTES``, UTF-8 and not empty."""
    fix = f"write the shared token into it, e.g. {GENERATE_HINT} > {path}"
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(_through_root_links(path, key), flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(
                f"{key}: {path} is a symbolic link; name the regular file itself (readlink -f {path})"
            ) from None
        raise ConfigError(
            f"{key}: cannot read {path}: {exc.strerror or exc}; make it a file readable by this user"
        ) from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{key}: {path} is a directory; name the file that holds the token")
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{key}: {path} is {file_kind(st.st_mode)}; {fix}")
        if st.st_uid not in (os.geteuid(), 0):
            raise ConfigError(
                f"{key}: {path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}) or root; "
                f"chown {os.geteuid()} {path}"
            )
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o007 or mode & 0o030 or (mode & 0o040 and not _may_share_group(st)):
            raise ConfigError(f"{key}: {path} is accessible to other users (mode {mode:04o}); chmod 600 {path}")
        if st.st_size > MAX_TOKEN_FILE_BYTES:
            raise ConfigError(
                f"{key}: {path} has {st.st_size} bytes; a token file holds at most {MAX_TOKEN_FILE_BYTES}, "
                f"e.g. {GENERATE_HINT} > {path}"
            )
        data = os.read(fd, MAX_TOKEN_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(
            f"{key}: cannot read {path}: {exc.strerror or exc}; make it a file readable by this user"
        ) from None
    finally:
        os.close(fd)
    if len(data) > MAX_TOKEN_FILE_BYTES:  # it grew since fstat
        raise ConfigError(
            f"{key}: {path} has more than {MAX_TOKEN_FILE_BYTES} bytes; a token file holds at most "
            f"{MAX_TOKEN_FILE_BYTES}, e.g. {GENERATE_HINT} > {path}"
        )
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"{key}: {path} is not UTF-8 text; {fix}") from None
    if not text:
        raise ConfigError(f"{key}: {path} is empty; {fix}")
    return text.encode()


def weak_token_reason(token: str) -> str | None:
    """Why ``token`` is obviously guessable, or ``None``: one character repeated, fewer than
    ``MIN_DISTINCT_CHARS`` distinct characters, or a run of ``MAX_RUN`` of one character."""
    distinct = len(set(token))
    if distinct == 1:
        return "one character repeated"
    if distinct < MIN_DISTINCT_CHARS:
        return f"only {distinct} distinct characters (at least {MIN_DISTINCT_CHARS})"
    run = longest = 1
    for a, b in zip(token, token[1:]):
        run = run + 1 if a == b else 1
        longest = max(longest, run)
    if longest >= MAX_RUN:
        return f"a run of {longest} of one character (at most {MAX_RUN - 1})"
    return None


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
    if why := weak_token_reason(token):
        raise ConfigError(f"{key}: {what} a weak token: {why}; use a random one, e.g. {fix}")


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
    elif not is_loopback_host(control_bind_host(cfg.migration.bind) or "localhost"):
        exposed.append(("migration.bind", cfg.migration.bind))
    if exposed:
        key, value = exposed[0]
        raise ConfigError(
            f"{key}: {value!r} is reachable beyond loopback but no auth token is configured{where(key)}; "
            "set auth.token_file (or PDSTATE_AUTH__TOKEN), or auth.allow_insecure_bind = true to serve without auth"
        )


def check_open_listener(engine: str, acknowledged: bool) -> None:
    """An engine registered with ``open_listener`` (``transfer.engines.registry``) has native
    listeners that accept anyone on every interface (Mooncake 0.3.13: 0.0.0.0 and [::] whatever its
    host, measured; docs/security.md): a worker starts with it only when the operator said so."""
    if ENGINES[engine].open_listener and not acknowledged:
        raise ConfigError(
            f"transfer.{engine}.allow_open_listener: the {engine} engine listens on every interface and "
            "authenticates nobody (whoever reaches its ports can write into this worker's registered memory); "
            f"keep the workers on a private network (deploy/k8s/networkpolicy.yaml) and set "
            f"transfer.{engine}.allow_open_listener = true to acknowledge it"
        )
