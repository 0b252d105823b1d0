"""``pdstate check`` (and ``serve``'s ``--config``) read the files they are given bounded: a YAML
alias bomb, a FIFO, a 300 MiB launch script and the like are refused with one line, exit 2,
before the process blocks or grows.

Each case runs a real ``pdstate`` process (``python -m pdstate.cli``, this checkout's ``src``)
under a deadline, and reads the child's peak RSS from ``wait4``. They used to: grow to 2 GB and die
with ``MemoryError`` (the 710-byte alias nest), block forever (a FIFO), end in ``MemoryError``
(300 MiB read whole).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pdstate.inputs import MAX_INPUT_BYTES
from pdstate.integrations.sglang.launch.command import MAX_YAML_NODES, load_yaml
from tests.support.paths import REPO, SERVICES, SRC_DIR

MODEL = "--model-path deepseek-ai/DeepSeek-V4-Flash --trust-remote-code --tp 8"
PREFILL = f"{MODEL} --disaggregation-mode prefill"
DECODE = f"{MODEL} --disaggregation-mode decode"
DEADLINE_S = 30  # a refusal takes ~1 s (the interpreter's start); what blocks never returns
RSS_BOUND_KB = 1 << 20  # 1 GiB: the process's peak is ~240 MB (the interpreter and its imports); the bomb reached 2 GB


def pdstate(*args: str) -> tuple[int, list[str], int]:
    """``pdstate ARGS``: (exit code, stderr lines, peak RSS in KiB as last read), killed at ``DEADLINE_S``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSTATE_") or k == "PDSTATE_SHARED"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdstate.cli", *args],
        env={**env, "PYTHONPATH": str(SRC_DIR)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=REPO,
    )
    deadline = time.monotonic() + DEADLINE_S
    peak_kb = 0
    while True:
        peak_kb = max(peak_kb, _hwm_kb(proc.pid))
        pid, status, _ = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            pytest.fail(f"pdstate {' '.join(args)} still running after {DEADLINE_S} s")
        time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode(errors="replace").splitlines()
    proc.stderr.close()
    return proc.returncode, err, peak_kb


def _hwm_kb(pid: int) -> int:
    """The process's own peak RSS (``VmHWM``, of its address space since its exec). Not
    ``ru_maxrss``: Linux carries the forking process's peak over the exec into it, so a child of a
    test process grown to a GB reads a GB."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass  # exited (or a zombie without its memory): the last reading stands
    return 0


def billion_laughs(path) -> None:
    """The classic nest: 9 levels of 9 aliases, 9^9 values once expanded (342 bytes)."""
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [{','.join(['*' + prev] * 9)}]")
    path.write_text("\n".join(lines) + "\n")


def test_a_yaml_alias_bomb_is_refused_small_and_fast(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    billion_laughs(bomb)
    assert bomb.stat().st_size < 1024
    t0 = time.monotonic()
    rc, err, rss_kb = pdstate("check", "--sglang", PREFILL, f"{DECODE} --config {bomb}")
    elapsed = time.monotonic() - t0
    assert (rc, err) == (
        2,
        [
            f"pdstate check: --config {bomb}: its YAML aliases expand to more than {MAX_YAML_NODES} values; "
            "write the values out"
        ],
    )
    assert rss_kb < RSS_BOUND_KB, rss_kb
    assert elapsed < DEADLINE_S


def test_a_recipe_alias_bomb_is_refused(tmp_path):
    bomb = tmp_path / "recipe.yaml"
    billion_laughs(bomb)
    rc, err, rss_kb = pdstate("check", "--recipe", str(bomb))
    assert (rc, err) == (
        2,
        [
            f"pdstate check: --recipe {bomb}: its YAML aliases expand to more than {MAX_YAML_NODES} values; "
            "write the values out"
        ],
    )
    assert rss_kb < RSS_BOUND_KB, rss_kb


def test_a_yaml_alias_that_holds_itself_is_refused(tmp_path):
    loop = tmp_path / "loop.yaml"
    loop.write_text("a: &a [1, *a]\n")
    rc, err, _ = pdstate("check", "--sglang", PREFILL, f"{DECODE} --config {loop}")
    assert (rc, err) == (
        2,
        [f"pdstate check: --config {loop}: a YAML alias refers to a node that holds it; write the values out"],
    )


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "spec.yaml"
    os.mkfifo(fifo)  # nobody writes it: opening it for reading blocks (was: forever)
    rc, err, _ = pdstate("check", "--sglang", PREFILL, f"{DECODE} --config {fifo}")
    assert (rc, err) == (2, [f"pdstate check: --config {fifo}: it is a FIFO, not a regular file"])
    rc, err, _ = pdstate("check", "--sglang", PREFILL, f"@{fifo}")
    assert (rc, err) == (2, [f"pdstate check: @{fifo}: it is a FIFO, not a regular file"])
    rc, err, _ = pdstate("check", str(fifo))  # pdstate's own config
    assert (rc, err) == (
        2,
        [
            f"pdstate check: config file {fifo}: cannot read: it is a FIFO, not a regular file; "
            "--config takes a TOML file readable by this user"
        ],
    )


def test_a_device_is_refused(tmp_path):
    rc, err, _ = pdstate("check", "--sglang", PREFILL, DECODE, "--model-config", "/dev/zero")
    assert (rc, err) == (
        2,
        ["pdstate check: --model-config /dev/zero: it is a character device, not a regular file"],
    )


def test_a_300_mib_launch_script_is_refused_by_its_size_without_reading_it(tmp_path):
    script = tmp_path / "launch.sh"
    script.write_text(f"python -m sglang.launch_server {DECODE}\n")
    os.truncate(script, 300 << 20)  # sparse: 300 MiB of zeros after the line
    rc, err, rss_kb = pdstate("check", "--sglang", PREFILL, f"@{script}")
    assert (rc, err) == (
        2,
        [f"pdstate check: @{script}: it has {300 << 20} bytes, more than the limit of {MAX_INPUT_BYTES}"],
    )
    assert rss_kb < RSS_BOUND_KB, rss_kb  # was: read whole, then MemoryError
    config = tmp_path / "big.toml"
    config.write_text((SERVICES / "decode" / "config.toml").read_text())
    os.truncate(config, 300 << 20)
    rc, err, _ = pdstate("check", str(config))
    assert (rc, err) == (
        2,
        [
            f"pdstate check: config file {config}: cannot read: it has {300 << 20} bytes, more than the limit of "
            f"{MAX_INPUT_BYTES}; --config takes a TOML file readable by this user"
        ],
    )


def test_aliases_within_the_bound_still_load():
    # anchors, aliases and merge keys, as recipes and compose files use them
    text = "base: &base {tp: 8, dp: 1}\nprefill:\n  <<: *base\n  dp: 2\ndecode: *base\n"
    assert load_yaml(text, "x") == {
        "base": {"tp": 8, "dp": 1},
        "prefill": {"tp": 8, "dp": 2},
        "decode": {"tp": 8, "dp": 1},
    }
