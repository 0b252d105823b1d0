"""Every shell command shown in README.md and docs/*.md, as written.

Each fenced ``sh`` block must parse as bash (``bash -n``). Each command in it is then checked by
what it starts with: a ``pdstate`` command line must be accepted by the real argument parser (and
the offline ones, ``pdstate check`` and ``pdstate --version``, are run and must end 0 or 1 without
a traceback); ``make`` must name a Makefile target; ``python -m MODULE`` must name an importable
module (``python FILE`` an existing file); anything else must be one of the outside tools the docs
use (curl, docker, ...). Commands that need a GPU, a network or a second host are only parsed.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pdstate import cli
from tests.support.paths import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
EXTERNAL = {"curl", "docker", "kubectl", "openssl", "echo", "export", "pip", "cat", "chmod", "ibv_devices", "umask"}
OUTSIDE_MODULES = {"sglang.launch_server"}  # SGLang's own launcher: the user's install, not ours
RUN = ("check", "--version")  # pdstate commands cheap and offline enough to run here


def sh_blocks() -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for i, m in enumerate(re.finditer(r"^```sh\n(.*?)^```", text, re.S | re.M)):
            out.append((f"{page.relative_to(REPO)}#{i + 1}", m.group(1)))
    return out


def commands(block: str) -> list[list[str]]:
    """The block's commands as argv lists: continuations joined, comments, ``&`` and leading
    ``VAR=value`` assignments dropped, ``&&`` / ``;`` / ``|`` split."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        argv: list[str] = []
        for word in [*words, ";"]:
            if word in (";", "&&", "||", "|", "&"):
                while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
                    argv.pop(0)
                if argv:
                    out.append(argv)
                argv = []
            else:
                argv.append(word)
    return out


BLOCKS = sh_blocks()


def test_the_docs_show_commands():
    assert len(BLOCKS) >= 8
    assert {name.split("#")[0] for name, _ in BLOCKS} >= {"README.md", "docs/operations.md", "docs/sglang.md"}


@pytest.mark.parametrize(("name", "block"), BLOCKS, ids=[n for n, _ in BLOCKS])
def test_each_block_is_valid_bash(name, block):
    done = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"{name}: {done.stderr}"


def _make_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*):", text, re.M))


def _check_one(argv: list[str], name: str) -> None:
    head = argv[0]
    if head == "pdstate":
        try:
            cli.build_parser().parse_args(argv[1:])
        except SystemExit as exc:  # --help / --version exit 0; a usage error exits 2
            assert exc.code == 0, f"{name}: pdstate rejects {shlex.join(argv)}"
    elif head == "make":
        missing = set(argv[1:]) - _make_targets()
        assert not missing, f"{name}: no Makefile target {sorted(missing)}"
    elif head in ("python", "python3"):
        if argv[1] == "-m":
            if argv[2] not in OUTSIDE_MODULES:
                assert importlib.util.find_spec(argv[2]) is not None, f"{name}: no module {argv[2]}"
        else:
            assert (REPO / argv[1]).is_file(), f"{name}: no file {argv[1]}"
    else:
        assert head in EXTERNAL, f"{name}: unknown command {head!r} in {shlex.join(argv)}"


@pytest.mark.parametrize(("name", "block"), BLOCKS, ids=[n for n, _ in BLOCKS])
def test_each_command_is_one_the_tools_accept(name, block):
    for argv in commands(block):
        _check_one(argv, name)


def _offline() -> list[tuple[str, list[str]]]:
    out = []
    for name, block in BLOCKS:
        for argv in commands(block):
            if argv[0] == "pdstate" and len(argv) > 1 and argv[1] in RUN and "--help" not in argv:
                out.append((name, argv))
    return out


OFFLINE = _offline()


@pytest.mark.parametrize(("name", "argv"), OFFLINE, ids=[f"{n}:{' '.join(a[:3])}" for n, a in OFFLINE])
def test_offline_commands_run_as_written(name, argv):
    exe = str(Path(sys.executable).with_name("pdstate"))
    done = subprocess.run([exe, *argv[1:]], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode in (0, 1), f"{name}: {shlex.join(argv)} exited {done.returncode}: {done.stderr[-2000:]}"
    assert "Traceback" not in done.stderr, f"{name}: {done.stderr[-2000:]}"
    assert done.stdout.strip(), f"{name}: {shlex.join(argv)} printed nothing"
