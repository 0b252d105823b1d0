"""README.md's SGLang quick start, run here as far as this machine can (no GPU, no SGLang install):

- the token step, as written, in a scratch directory: the file it makes is one ``auth.token_file``
  accepts (this user's, mode 0600, a token long enough);
- the exported settings and each launch line's own, read by backend pdstate's loader
  (``load_settings``, what a rank reads at start) and passed through the check a rank runs before
  it builds anything (``check_rank_auth``, at an address SGLang would advertise beyond loopback):
  neither refuses them; without the acknowledgement, or without the token, the rank refuses;
- the two launch lines, read by SGLang's own parser, are a compatible pair (``pdstate check --sglang``);
- ``pdstate probe``'s line is a valid command that names every rank endpoint the launches serve
  (``PDSTATE_HTTP__PORT`` + rank for every TP rank), on the host the endpoints bind.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import stat
import subprocess

import pytest

from pdstate import cli
from pdstate.errors import ConfigError, ExitCode
from pdstate.integrations.sglang.endpoint import rank_number
from pdstate.integrations.sglang.launch.command import parse_argv
from pdstate.integrations.sglang.settings import check_rank_auth, load_settings
from pdstate.service.preflight import check_sglang
from pdstate.service.probe_ranks import rank_urls
from pdstate.settings.auth import MIN_TOKEN_BYTES, read_token_file
from tests.support.paths import REPO

ADVERTISED = "10.0.0.5"  # an address SGLang advertises for a rank (beyond loopback: the token is needed)


def quick_start() -> list[str]:
    """The README's SGLang quick start: its one ``sh`` block that launches with backend pdstate, as lines."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"^```sh\n(.*?)^```", text, re.S | re.M) if "transfer-backend pdstate" in b]
    assert len(blocks) == 1, blocks
    return blocks[0].replace("\\\n", " ").splitlines()


LINES = quick_start()


def _words(line: str) -> list[str]:
    return shlex.split(line, comments=True)


def exports(pwd: str) -> dict[str, str]:
    out = {}
    for line in LINES:
        words = _words(line)
        if words[:1] == ["export"]:
            name, _, value = words[1].partition("=")
            out[name] = value.replace("$PWD", pwd)
    return out


def launches() -> dict[str, tuple[dict[str, str], list[str]]]:
    """Per role: the line's own ``VAR=value`` settings and SGLang's arguments (after ``-m sglang.launch_server``)."""
    out = {}
    for line in LINES:
        words = [w for w in _words(line) if w != "&"]
        if "sglang.launch_server" not in words:
            continue
        env = {}
        while re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
            name, _, value = words.pop(0).partition("=")
            env[name] = value
        assert words[:3] == ["python", "-m", "sglang.launch_server"], words
        args = words[3:]
        out[args[args.index("--disaggregation-mode") + 1]] = (env, args)
    assert set(out) == {"prefill", "decode"}, out
    return out


def token_lines() -> list[str]:
    return [line for line in LINES if _words(line)[:1] in (["umask"], ["openssl"])]


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed here")
    where = tmp_path_factory.mktemp("quickstart")
    script = "\n".join(token_lines())
    done = subprocess.run(["bash", "-e", "-c", script], cwd=where, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return where


def test_the_token_step_makes_a_token_file_the_settings_accept(token_dir):
    env = exports(str(token_dir))
    path = env["PDSTATE_AUTH__TOKEN_FILE"]
    assert os.path.dirname(path) == str(token_dir)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    token = read_token_file(path)
    assert len(token) >= MIN_TOKEN_BYTES and re.fullmatch(rb"[0-9a-f]{64}", token)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_each_ranks_settings_pass_the_check_a_rank_runs_at_start(token_dir, role):
    line_env, _ = launches()[role]
    environ = {**exports(str(token_dir)), **line_env}
    settings = load_settings(role, environ)
    check_rank_auth(settings, role, ADVERTISED)  # the rank starts: no ConfigError
    assert settings.engine == "mooncake" and settings.allow_open_listener and settings.token
    assert settings.http_host == "127.0.0.1" and settings.http_port == int(line_env["PDSTATE_HTTP__PORT"])
    unacknowledged = {k: v for k, v in environ.items() if k != "PDSTATE_TRANSFER__MOONCAKE__ALLOW_OPEN_LISTENER"}
    with pytest.raises(ConfigError, match="transfer.mooncake.allow_open_listener"):
        check_rank_auth(load_settings(role, unacknowledged), role, ADVERTISED)
    tokenless = {k: v for k, v in environ.items() if k != "PDSTATE_AUTH__TOKEN_FILE"}
    with pytest.raises(ConfigError, match="no auth token is configured"):
        check_rank_auth(load_settings(role, tokenless), role, ADVERTISED)


def test_the_launch_lines_are_a_compatible_pair_for_sglangs_parser(capsys):
    pair = launches()
    for _, args in pair.values():
        for release in ("0.5.19", "0.5.23"):
            parsed = parse_argv(args, release)
            assert parsed.error is None and parsed.unknown == [], (release, parsed)
            assert parsed.values["disaggregation_transfer_backend"] == "pdstate"
    lines = [shlex.join(pair[role][1]) for role in ("prefill", "decode")]
    assert check_sglang(*lines, [], strict=True, timeout_s=5) == ExitCode.OK
    assert capsys.readouterr().out.rstrip().endswith("compatible")


def test_the_probe_line_names_every_rank_endpoint_the_launches_serve(token_dir):
    (probe,) = [_words(line) for line in LINES if _words(line)[:2] == ["pdstate", "probe"]]
    args = cli.build_parser().parse_args(probe[1:])
    assert args.func is cli._probe and not args.urls
    env = exports(str(token_dir))
    for role in ("prefill", "decode"):
        line_env, sglang_args = launches()[role]
        tp = int(sglang_args[sglang_args.index("--tp") + 1])
        settings = load_settings(role, {**env, **line_env})
        served = [f"http://{settings.http_host}:{settings.http_port + rank_number(t, tp)}" for t in range(tp)]
        named = rank_urls(getattr(args, role), getattr(args, f"{role}_ranks"))
        assert named == served, (role, named, served)
