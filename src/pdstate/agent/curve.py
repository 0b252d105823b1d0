"""The control channel's session: ZeroMQ CURVE, with keys derived from the trust domain's secret.

Every control connection is a CURVE session (PROTOCOL §2.1). The prefill's ROUTER is the CURVE
server; a ZAP handler (pyzmq's ``ThreadAuthenticator``, one per prefill agent) lets in only the
domain's client key. A decode's DEALER knows the domain's server key: a process without the
secret cannot complete the handshake with it, so nothing of the decode's reaches a process that
merely stands at the address it dials, whatever that address and whenever it dials.

The secret (``control_keys``): the auth token when there is one; without one, 32 random bytes in
``<key_dir>/control.key`` (``auth.key_dir``, by default ``$XDG_RUNTIME_DIR/pdstate`` or
``/tmp/pdstate-<uid>``), made on first use with mode 0600 in a 0700 directory and refused
unless this uid owns both and nobody else may open them: a token-less worker's peers are the
processes of its own uid (and whoever it shared that file with). HKDF-SHA256 of the secret gives
a server and a client keypair.

A failed handshake is a monitor event on the socket (a decode's ``HANDSHAKE_EVENTS``, a prefill's
``REFUSED_EVENTS``); ``handshake_error`` turns it into the ``AuthError`` each side reports.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets
import stat
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils import z85

from pdstate.errors import AuthError, ConfigError

__all__ = [
    "HANDSHAKE_EVENTS",
    "KEY_FILE",
    "REFUSED_EVENTS",
    "Keys",
    "control_keys",
    "default_key_dir",
    "derive_keys",
    "dial",
    "handshake_error",
    "load_key",
    "serve",
    "start_zap",
]

KEY_FILE = "control.key"
ZAP_DOMAIN = b"pdstate"
MAX_KEY_FILE_BYTES = 4096
HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
# a server's evidence of a peer without the domain's keys; ``NO_DETAIL`` there is a connection
# closed or timed out before its handshake ended (a TCP probe, an idle connection), evidence of nothing
REFUSED_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
KEYS_DIFFER = "it does not hold this worker's control key (another auth token, a token on one side only, or without a token another uid or auth.key_dir)"


@dataclass(frozen=True, slots=True)
class Keys:
    """A trust domain's CURVE keys (z85): the server's (prefills) and the client's (decodes)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def _hkdf(secret: bytes, info: bytes) -> bytes:
    """HKDF-SHA256 (RFC 5869), 32 bytes."""
    prk = hmac.new(b"pdstate control curve v1", secret, hashlib.sha256).digest()
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()


def derive_keys(secret: bytes) -> Keys:
    """The CURVE keypairs of the domain whose secret is ``secret``."""
    server = z85.encode(_hkdf(secret, b"server"))
    client = z85.encode(_hkdf(secret, b"client"))
    return Keys(zmq.curve_public(server), server, zmq.curve_public(client), client)


def default_key_dir() -> str:
    """``$XDG_RUNTIME_DIR/pdstate`` when that is set, else ``/tmp/pdstate-<uid>``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    return os.path.join(runtime, "pdstate") if runtime else f"/tmp/pdstate-{os.getuid()}"


def _private(st: os.stat_result, path: str, what: str) -> None:
    """``ConfigError`` unless ``st`` (of ``path``) is this uid's and closed to group and others."""
    fix = f"remove it, or make it yours with mode {'0700' if what == 'directory' else '0600'}; or set auth.key_dir"
    if st.st_uid != os.getuid():
        raise ConfigError(
            f"auth.key_dir: {what} {path} is owned by uid {st.st_uid}, not this user (uid {os.getuid()}); {fix}"
        )
    if st.st_mode & 0o077:
        raise ConfigError(
            f"auth.key_dir: {what} {path} has mode {stat.S_IMODE(st.st_mode):04o}: group or others may open it; {fix}"
        )


def _read_key(path: str) -> bytes | None:
    """The secret in ``path``; None when there is no such file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        why = "it is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
        raise ConfigError(f"auth.key_dir: cannot open {path}: {why}; remove it (it is made again on start)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"auth.key_dir: {path} is not a regular file; remove it (it is made again on start)")
        _private(st, path, "key file")
        data = os.read(fd, MAX_KEY_FILE_BYTES + 1)
    finally:
        os.close(fd)
    try:
        key = bytes.fromhex(data.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        key = b""
    if len(key) != 32:
        raise ConfigError(
            f"auth.key_dir: {path} does not hold a control key (64 hex digits); remove it (it is made again on start)"
        )
    return key


def load_key(key_dir: str | None = None) -> bytes:
    """The 32-byte secret in ``<key_dir>/control.key``, made (atomically, 0600, in a 0700
    directory) when absent; ``ConfigError`` when the directory or the file is not this uid's
    alone, is a symbolic link or holds no key."""
    key_dir = key_dir or default_key_dir()
    try:
        os.mkdir(key_dir, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"auth.key_dir: cannot make {key_dir}: {exc.strerror}; set auth.key_dir") from None
    st = os.lstat(key_dir)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(
            f"auth.key_dir: {key_dir} is not a directory (a symbolic link?); remove it or set auth.key_dir"
        )
    _private(st, key_dir, "directory")
    path = os.path.join(key_dir, KEY_FILE)
    key = _read_key(path)
    if key is not None:
        return key
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, secrets.token_bytes(32).hex().encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # never a half-written file; a process that made it first wins
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    key = _read_key(path)
    assert key is not None
    return key


def control_keys(token: bytes | None, key_dir: str | None = None) -> Keys:
    """The keys of the trust domain: derived from ``token``, or without one from the uid's key
    file in ``key_dir`` (``load_key``)."""
    return derive_keys(token if token else load_key(key_dir))


def serve(sock: zmq.Socket, keys: Keys) -> None:
    """Make ``sock`` (before it binds) the domain's CURVE server."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)


def dial(sock: zmq.Socket, keys: Keys) -> None:
    """Make ``sock`` (before it connects) a CURVE client of the domain's servers."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)


class _Allow:
    def __init__(self, key: bytes) -> None:
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.key)


def start_zap(ctx: zmq.Context, keys: Keys) -> Any:
    """The ZAP handler of ``ctx``'s CURVE servers, letting in the domain's client key only;
    started (``stop()`` it before the context terminates)."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx, log=None)
    auth.start()
    auth.configure_curve_callback(ZAP_DOMAIN.decode(), credentials_provider=_Allow(keys.client_public))
    return auth


def _reason(event: int, value: int) -> str:
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"its key refused, ZAP status {value}"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        try:
            return zmq.Event(value).name.lower().replace("protocol_error_", "")
        except ValueError:
            return f"protocol error {value:#x}"
    return "no detail"


def handshake_error(event: dict, peer: str | None) -> AuthError:
    """The ``AuthError`` of a failed CURVE handshake (a ``zmq.utils.monitor`` event): ``peer``
    names the prefill a decode dialled, None on the prefill (the peer is not known yet)."""
    ev, value = int(event["event"]), int(event["value"])
    reason = _reason(ev, value)
    mismatch = ev == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
    if peer is None:
        why = (
            "it does not use CURVE (a pdstate decode from before CURVE, or not a pdstate decode)"
            if mismatch
            else KEYS_DIFFER
        )
        return AuthError(f"a decode's connection failed the CURVE handshake ({reason}): {why}")
    why = (
        "it does not use CURVE (a pdstate prefill from before CURVE, or not a pdstate prefill)"
        if mismatch
        else KEYS_DIFFER
    )
    return AuthError(f"prefill {peer} failed the CURVE handshake ({reason}): {why}")
