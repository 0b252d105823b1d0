"""Auth fails closed: every operator mistake that used to start a worker without auth (or with a
traceback) is refused by ``pdstate serve`` with exit code 2 and exactly one line on stderr.

Each case runs a real ``pdstate serve`` process (``python -m pdstate.cli``, this checkout's
``src`` on ``PYTHONPATH``); the refusal happens while loading the config, before any pool, socket
or port exists, so every case ends in well under a second of work. ``load_config`` itself is
covered below for the details (which addresses count as loopback, the opt-out, placeholders).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pdstate.errors import ConfigError
from pdstate.settings.auth import read_token_file
from pdstate.settings.config import (
    control_bind_host,
    is_loopback_host,
    load_config,
)
from pdstate.worker.options import WorkerOptions
from tests.support.paths import REPO, SERVICES
from tests.support.paths import SRC_DIR as SRC

HINT = "openssl rand -hex 32"
INSECURE_FIX = "set auth.token_file (or PDSTATE_AUTH__TOKEN), or auth.allow_insecure_bind = true to serve without auth"


def serve(config: Path | str, *overrides: str, env: dict[str, str] | None = None, prefix: list[str] = ()):
    """``pdstate serve --config CONFIG --set ...``; returns (exit code, stderr lines)."""
    cmd = [*prefix, sys.executable, "-m", "pdstate.cli", "serve", "--config", str(config)]
    for o in overrides:
        cmd += ["--set", o]
    base = {k: v for k, v in os.environ.items() if not k.startswith("PDSTATE_") or k == "PDSTATE_SHARED"}
    base["PYTHONPATH"] = str(SRC)
    proc = subprocess.run(cmd, env={**base, **(env or {})}, capture_output=True, text=True, timeout=60, cwd=REPO)
    return proc.returncode, proc.stderr.splitlines(), proc.stdout


def refused(expected_line: str, *args, **kw) -> None:
    rc, err, out = serve(*args, **kw)
    assert (rc, err) == (2, [expected_line]), (rc, err, out)
    assert out == ""  # nothing started: no "listening" event


@pytest.fixture
def decode_cfg(tmp_path) -> Path:
    p = tmp_path / "decode.toml"
    shutil.copy(SERVICES / "decode" / "config.toml", p)
    return p


@pytest.fixture
def prefill_cfg(tmp_path) -> Path:
    p = tmp_path / "prefill.toml"
    shutil.copy(SERVICES / "prefill" / "config.toml", p)
    return p


# --- the token file --------------------------------------------------------------------------


def token_file(path: Path, data: str | bytes, mode: int = 0o600) -> Path:
    """A token file as an operator makes one: this user's, ``mode``."""
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    path.chmod(mode)
    return path


def test_empty_token_file_is_refused(decode_cfg, tmp_path):
    token = token_file(tmp_path / "token", "  \n")  # whitespace only: was "no auth"
    refused(
        f"pdstate: auth.token_file: {token} is empty; write the shared token into it, e.g. {HINT} > {token}",
        decode_cfg,
        f"auth.token_file={token}",
    )


def test_missing_token_file_is_refused(decode_cfg, tmp_path):
    token = tmp_path / "absent"
    refused(
        f"pdstate: auth.token_file: cannot read {token}: No such file or directory; "
        "make it a file readable by this user",
        decode_cfg,
        f"auth.token_file={token}",
    )


def test_token_file_that_is_a_directory_is_refused(decode_cfg, tmp_path):
    refused(
        f"pdstate: auth.token_file: {tmp_path} is a directory; name the file that holds the token",
        decode_cfg,
        f"auth.token_file={tmp_path}",
    )


def test_unreadable_token_file_is_refused(decode_cfg, tmp_path):
    token = tmp_path / "token"
    token.write_text("a-real-secret-0123456789\n")
    token.chmod(0)
    refused(
        f"pdstate: auth.token_file: cannot read {token}: Permission denied; make it a file readable by this user",
        decode_cfg,
        f"auth.token_file={token}",
        prefix=_without_dac_override(),
    )


def test_token_file_not_utf8_is_refused(decode_cfg, tmp_path):
    token = token_file(tmp_path / "token", b"\xff\xfe\x00secret")
    refused(
        f"pdstate: auth.token_file: {token} is not UTF-8 text; write the shared token into it, e.g. {HINT} > {token}",
        decode_cfg,
        f"auth.token_file={token}",
    )


@pytest.mark.parametrize("placeholder", ["REPLACE-ME-with-a-random-secret", "changeme"])
def test_placeholder_token_file_is_refused(decode_cfg, tmp_path, placeholder):
    # REPLACE-ME-with-a-random-secret: what deploy/k8s/secret.yaml used to ship
    token = token_file(tmp_path / "token", placeholder + "\n")
    refused(
        f"pdstate: auth.token_file: {token} holds a placeholder, not a secret; "
        f"replace it with a real one, e.g. {HINT} > {token}",
        decode_cfg,
        f"auth.token_file={token}",
    )


def test_placeholder_token_in_the_environment_is_refused(decode_cfg):
    refused(
        "pdstate: auth.token: the configured value is a placeholder, not a secret "
        f"(from environment PDSTATE_AUTH__TOKEN); set a real one, e.g. PDSTATE_AUTH__TOKEN=$({HINT})",
        decode_cfg,
        env={"PDSTATE_AUTH__TOKEN": "CHANGE_ME"},
    )


@pytest.mark.parametrize(("token", "n"), [("x", 1), ("  short-token-15b  ", 15), ("123456789", 9)])
def test_short_token_in_the_environment_is_refused(decode_cfg, token, n):
    # each used to pass the non-loopback rule
    refused(
        "pdstate: auth.token: the configured value (from environment PDSTATE_AUTH__TOKEN) is a token of "
        f"{n} bytes once trimmed; a token needs at least 16, e.g. PDSTATE_AUTH__TOKEN=$({HINT})",
        decode_cfg,
        "http.host=0.0.0.0",
        env={"PDSTATE_AUTH__TOKEN": token},
    )


def test_whitespace_token_is_refused(decode_cfg):
    refused(
        "pdstate: auth.token: the configured value is only whitespace (from environment PDSTATE_AUTH__TOKEN); "
        f"set a real one, e.g. PDSTATE_AUTH__TOKEN=$({HINT}), or leave it unset for no auth",
        decode_cfg,
        "http.host=0.0.0.0",
        env={"PDSTATE_AUTH__TOKEN": "    "},
    )


def test_short_token_file_is_refused(decode_cfg, tmp_path):
    token = token_file(tmp_path / "token", "abc\n")
    refused(
        f"pdstate: auth.token_file: {token} holds a token of 3 bytes once trimmed; a token needs at least 16, "
        f"e.g. {HINT} > {token}",
        decode_cfg,
        f"auth.token_file={token}",
    )


GOOD = "3f1c0a9e8b7d6c5b4a39281706f5e4d3"


@pytest.mark.parametrize("mode", [0o640, 0o620, 0o604, 0o602, 0o644, 0o666])
def test_token_file_accessible_to_others_is_refused(decode_cfg, tmp_path, mode):
    token = token_file(tmp_path / "token", GOOD, mode)  # was: accepted
    refused(
        f"pdstate: auth.token_file: {token} is accessible to other users (mode {mode:04o}); chmod 600 {token}",
        decode_cfg,
        f"auth.token_file={token}",
    )


def _not_ours() -> int:
    """A uid other than this process's (as root: ``nobody``'s); chown needs root."""
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    return 65534


def test_token_file_owned_by_another_user_is_refused(decode_cfg, tmp_path):
    token = token_file(tmp_path / "token", GOOD, 0o400)
    uid = _not_ours()
    os.chown(token, uid, uid)
    refused(
        f"pdstate: auth.token_file: {token} is owned by uid {uid}, not by this user (uid 0) or root; chown 0 {token}",
        decode_cfg,
        f"auth.token_file={token}",
    )


def test_token_file_that_is_a_symlink_is_refused(decode_cfg, tmp_path):
    target = token_file(tmp_path / "real", GOOD)
    link = tmp_path / "token"
    link.symlink_to(target)
    uid = os.geteuid()
    if uid == 0:  # root's own links are followed (Kubernetes' secret volumes): another user's link
        uid = 65534
        os.lchown(link, uid, uid)
    refused(
        f"pdstate: auth.token_file: {link} is a symbolic link (owned by uid {uid}); "
        f"name the regular file itself (readlink -f {link})",
        decode_cfg,
        f"auth.token_file={link}",
    )


def test_token_file_that_is_a_fifo_is_refused_without_blocking(decode_cfg, tmp_path):
    fifo = tmp_path / "token"
    os.mkfifo(fifo, 0o600)  # nobody writes it: reading would block forever (was: blocked)
    t0 = time.monotonic()
    refused(
        f"pdstate: auth.token_file: {fifo} is a FIFO; write the shared token into it, e.g. {HINT} > {fifo}",
        decode_cfg,
        f"auth.token_file={fifo}",
    )
    assert time.monotonic() - t0 < 30  # the process's own start; a blocked read never returns


def test_token_file_over_4_kib_is_refused_without_reading_it(decode_cfg, tmp_path):
    token = token_file(tmp_path / "token", GOOD)
    os.truncate(token, 64 << 20)  # 64 MiB, sparse: was read whole and accepted
    refused(
        f"pdstate: auth.token_file: {token} has {64 << 20} bytes; a token file holds at most 4096, "
        f"e.g. {HINT} > {token}",
        decode_cfg,
        f"auth.token_file={token}",
    )


@pytest.mark.parametrize(
    ("token", "why"),
    [
        ("a" * 16, "one character repeated"),
        ("ab" * 16, "only 2 distinct characters (at least 8)"),
        ("0123456" * 4, "only 7 distinct characters (at least 8)"),
        ("Zq7-x9Kp" + "x" * 16 + "Lm3", "a run of 16 of one character (at most 15)"),
    ],
)
def test_weak_tokens_are_refused(decode_cfg, tmp_path, token, why):
    path = token_file(tmp_path / "token", token + "\n")  # was: accepted (16 bytes or more)
    refused(
        f"pdstate: auth.token_file: {path} holds a weak token: {why}; use a random one, e.g. {HINT} > {path}",
        decode_cfg,
        f"auth.token_file={path}",
    )
    with pytest.raises(ConfigError) as err:
        load_config(decode_cfg, [], environ={"PDSTATE_AUTH__TOKEN": token})
    assert str(err.value) == (
        "auth.token: the configured value (from environment PDSTATE_AUTH__TOKEN) is a weak token: "
        f"{why}; use a random one, e.g. PDSTATE_AUTH__TOKEN=$({HINT})"
    )


@pytest.fixture
def open_dir():
    """A directory any user can pass through (``tmp_path``'s parents are root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="pdstate-token-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def test_roots_links_and_group_are_how_a_secret_volume_hands_the_token_over(open_dir):
    # Kubernetes' secret volume: token -> ..data/token, ..data -> ..<timestamp>, both root's links
    # to a root-owned file; with fsGroup the file is 0440 root:<the pod's group>
    if os.geteuid() != 0:
        pytest.skip("root's links and files need root")
    tmp_path = open_dir
    stamp = tmp_path / "..2026_12_06"
    stamp.mkdir()
    token_file(stamp / "token", GOOD + "\n", 0o400)
    (tmp_path / "..data").symlink_to(stamp.name)
    (tmp_path / "token").symlink_to("..data/token")
    assert read_token_file(str(tmp_path / "token")) == GOOD.encode()  # root's: 0400
    os.chown(stamp / "token", 0, 10001)
    os.chmod(stamp / "token", 0o440)
    pid = os.fork()
    if pid == 0:  # the pod's user: uid 10001 in group 10001 (its fsGroup)
        code = 1
        try:
            os.setgroups([10001])
            os.setgid(10001)
            os.setuid(10001)
            code = 0 if read_token_file(str(tmp_path / "token")) == GOOD.encode() else 3
        except BaseException:
            code = 2
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0


# --- listeners beyond loopback without a token -----------------------------------------------


def test_http_on_all_interfaces_without_token_is_refused(decode_cfg):
    refused(
        "pdstate: http.host: '0.0.0.0' is reachable beyond loopback but no auth token is configured "
        f"(from --set http.host=0.0.0.0); {INSECURE_FIX}",
        decode_cfg,
        "http.host=0.0.0.0",
    )


def test_prefill_control_on_all_interfaces_without_token_is_refused(prefill_cfg):
    refused(
        "pdstate: control.bind: 'tcp://0.0.0.0:5601' is reachable beyond loopback but no auth token is "
        f"configured (from --set control.bind=tcp://0.0.0.0:5601); {INSECURE_FIX}",
        prefill_cfg,
        "control.bind=tcp://0.0.0.0:5601",
    )


def test_control_bind_in_the_file_is_named_with_the_file(prefill_cfg):
    prefill_cfg.write_text(prefill_cfg.read_text().replace('bind = "tcp://127.0.0.1:5601"', 'bind = "tcp://*:5601"'))
    refused(
        "pdstate: control.bind: 'tcp://*:5601' is reachable beyond loopback but no auth token is configured "
        f"(in {prefill_cfg}); {INSECURE_FIX}",
        prefill_cfg,
    )


def test_compose_command_without_its_token_volume_is_refused(prefill_cfg):
    # docker-compose.yml's prefill command, with the token volume missing (a mistake in a copy)
    if Path("/run/pdstate/token").exists():
        pytest.skip("/run/pdstate/token exists on this host")
    refused(
        "pdstate: auth.token_file: cannot read /run/pdstate/token: No such file or directory; "
        "make it a file readable by this user",
        prefill_cfg,
        "control.bind=tcp://0.0.0.0:5601",
        "http.host=0.0.0.0",
        "auth.token_file=/run/pdstate/token",
    )


# --- transfer engines whose native listeners cannot be restricted ---------------------------


def test_mooncake_without_the_open_listener_acknowledgement_is_refused(prefill_cfg):
    # Mooncake 0.3.13 listens on 0.0.0.0 and [::] whatever its host (docs/security.md)
    refused(
        "pdstate: transfer.mooncake.allow_open_listener: the mooncake engine listens on every interface and "
        "authenticates nobody (whoever reaches its ports can write into this worker's registered memory); keep "
        "the workers on a private network (deploy/k8s/networkpolicy.yaml) and set "
        "transfer.mooncake.allow_open_listener = true to acknowledge it",
        prefill_cfg,
        "transfer.engine=mooncake",
    )


# --- the config path itself ------------------------------------------------------------------


def test_config_path_that_is_a_directory_is_refused(tmp_path):
    refused(f"pdstate: config file {tmp_path} is a directory; --config takes a TOML file", tmp_path)


def test_config_file_not_utf8_is_refused(tmp_path):
    p = tmp_path / "worker.toml"
    p.write_bytes(b'role = "decode"\n# \xe9t\xe9\n')  # latin-1
    refused(
        f"pdstate: config file {p} is not UTF-8 text (byte 18); --config takes a TOML file, which is UTF-8",
        p,
    )


def test_unreadable_config_file_is_refused(decode_cfg):
    decode_cfg.chmod(0)
    refused(
        f"pdstate: config file {decode_cfg}: cannot read: Permission denied; "
        "--config takes a TOML file readable by this user",
        decode_cfg,
        prefix=_without_dac_override(),
    )


def test_missing_config_file_is_refused(tmp_path):
    refused(f"pdstate: config file not found: {tmp_path / 'absent.toml'}", tmp_path / "absent.toml")


def _without_dac_override() -> list[str]:
    """As root, permission bits do not stop reads: run the worker without the two capabilities
    that bypass them (setpriv, util-linux), so a mode-0 file is unreadable as for anyone else."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: cannot make a file unreadable")
    caps = "-dac_override,-dac_read_search"
    return [setpriv, f"--bounding-set={caps}", f"--inh-caps={caps}"]


# --- load_config: the rules ------------------------------------------------------------------


BASE = 'role = "{role}"\n'


def load(tmp_path, *overrides: str, role: str = "decode", environ: dict | None = None):
    p = tmp_path / "w.toml"
    p.write_text(BASE.format(role=role))
    return load_config(p, list(overrides), environ=environ or {})


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("*", False),
        ("10.0.0.1", False),
        ("eth0", False),  # an interface name (ZeroMQ accepts them): fail closed
        ("myhost", False),  # no DNS lookup at load time: fail closed
        ("::ffff:127.0.0.1", False),
    ],
)
def test_is_loopback_host(host, loopback):
    assert is_loopback_host(host) is loopback


def test_control_bind_host():
    assert control_bind_host("tcp://127.0.0.1:5601") == "127.0.0.1"
    assert control_bind_host("tcp://[::1]:0") == "[::1]"
    assert control_bind_host("tcp://*:5601") == "*"
    assert control_bind_host("ipc:///tmp/pdstate.sock") is None
    assert control_bind_host("inproc://x") is None


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["http.host=localhost"],
        ["http.host=::1"],
        ["control.bind=tcp://0.0.0.0:5601"],  # a decode does not bind its control socket
    ],
)
def test_loopback_without_token_loads(tmp_path, overrides):
    cfg = load(tmp_path, *overrides)
    assert cfg.auth.secret() is None


@pytest.mark.parametrize(
    "overrides",
    [["control.bind=tcp://127.0.0.1:0"], ["control.bind=ipc:///tmp/pdstate-ctl"], ["control.bind=tcp://[::1]:5601"]],
)
def test_prefill_local_control_without_token_loads(tmp_path, overrides):
    assert load(tmp_path, *overrides, role="prefill").auth.secret() is None


def test_insecure_bind_opt_out(tmp_path):
    with pytest.raises(ConfigError, match=r"^http\.host: '0\.0\.0\.0' is reachable beyond loopback"):
        load(tmp_path, "http.host=0.0.0.0")
    cfg = load(tmp_path, "http.host=0.0.0.0", "control.bind=tcp://0.0.0.0:5601", "auth.allow_insecure_bind=true")
    assert cfg.auth.allow_insecure_bind is True and cfg.auth.secret() is None
    cfg = load(
        tmp_path,
        role="prefill",
        environ={"PDSTATE_CONTROL__BIND": "tcp://0.0.0.0:5601", "PDSTATE_AUTH__ALLOW_INSECURE_BIND": "true"},
    )
    assert cfg.control.bind == "tcp://0.0.0.0:5601"
    # the opt-out does not excuse a placeholder or a broken token file
    with pytest.raises(ConfigError, match="placeholder"):
        load(tmp_path, "http.host=0.0.0.0", "auth.allow_insecure_bind=true", "auth.token=replace_me")
    with pytest.raises(ConfigError, match="is empty"):
        token_file(tmp_path / "empty", "")
        load(tmp_path, "auth.allow_insecure_bind=true", f"auth.token_file={tmp_path / 'empty'}")


def test_a_token_allows_any_bind(tmp_path):
    token = token_file(tmp_path / "token", "3f1c0a9e8b7d6c5b4a39281706f5e4d3\n")
    cfg = load(tmp_path, "http.host=0.0.0.0", "control.bind=tcp://*:5601", f"auth.token_file={token}", role="prefill")
    assert cfg.auth.secret() == b"3f1c0a9e8b7d6c5b4a39281706f5e4d3"
    cfg = load(tmp_path, "http.host=0.0.0.0", environ={"PDSTATE_AUTH__TOKEN": "integration-token-7f3a"})
    assert WorkerOptions.from_config(cfg).token == b"integration-token-7f3a"


@pytest.mark.parametrize(
    "token",
    ["changeme", "CHANGE-ME", "change_me", "REPLACE-ME-with-a-random-secret", "replace_me", "<your-token>", "secret"],
)
def test_placeholders_are_refused(tmp_path, token):
    with pytest.raises(ConfigError, match=r"^auth\.token: the configured value is a placeholder"):
        load(tmp_path, environ={"PDSTATE_AUTH__TOKEN": token})


@pytest.mark.parametrize("token", ["reliability-secret", "integration-token-7f3a", "0123456789012345"])
def test_real_looking_tokens_are_accepted(tmp_path, token):
    assert load(tmp_path, environ={"PDSTATE_AUTH__TOKEN": token}).auth.secret() == token.encode()


def test_an_all_digit_token_stays_a_string(tmp_path):
    # was parsed as a TOML integer: "auth.token: Input should be a valid string"
    digits = "12345678901234567890"
    assert load(tmp_path, environ={"PDSTATE_AUTH__TOKEN": digits}).auth.secret() == digits.encode()
    assert load(tmp_path, f"auth.token={digits}").auth.secret() == digits.encode()
    assert load(tmp_path, f'auth.token="{digits}"').auth.secret() == digits.encode()


def test_a_token_is_trimmed(tmp_path):
    assert load(tmp_path, environ={"PDSTATE_AUTH__TOKEN": " tok-0123456789abcdef\n"}).auth.secret() == (
        b"tok-0123456789abcdef"
    )


def test_the_refusals_are_one_line(tmp_path):
    bad = [
        lambda: load(tmp_path, "http.host=0.0.0.0"),
        lambda: load(tmp_path, "control.bind=tcp://0.0.0.0:1", role="prefill"),
        lambda: load(tmp_path, environ={"PDSTATE_AUTH__TOKEN": "changeme"}),
        lambda: load(tmp_path, f"auth.token_file={tmp_path}"),
        lambda: load_config(tmp_path, environ={}),
    ]
    for call in bad:
        with pytest.raises(ConfigError) as info:
            call()
        assert "\n" not in str(info.value) and str(info.value)


def test_a_key_dir_open_to_others_is_refused(prefill_cfg, tmp_path):
    """Without a token the control channel's keys come from ``auth.key_dir``'s ``control.key``
    (``agent.curve``): a directory others may open is refused before anything starts."""
    key_dir = tmp_path / "keys"
    key_dir.mkdir()
    os.chmod(key_dir, 0o755)
    refused(
        f"pdstate: auth.key_dir: directory {key_dir} has mode 0755: group or others may open it; remove it, or "
        "make it yours with mode 0700; or set auth.key_dir",
        prefill_cfg,
        "http.port=0",
        "control.bind=tcp://127.0.0.1:0",
        f"auth.key_dir={key_dir}",
    )
