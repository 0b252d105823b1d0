"""Find (or build) the cached SGLang environment of a release and run ``probe.py`` in child processes.

Every suite here runs against each release of ``RELEASES`` (the table's:
``integrations.sglang.releases``). A release's environment is its row's ``env_dir`` under
``sys.prefix`` (the venv running pytest: ``<venv>/sglang-env`` for the lock's own line, else
``<venv>/sglang-env-<release>``; ``make sglang-env`` builds them there); ``$PDSTATE_SGLANG_ENV``
replaces the environment of the release it holds (``pair.env_dir``). A missing or stale one is
built by ``tools/sglang_env.sh`` (cached by its stamp; the release's version is its third argument
but for the lock's own line); when that script says the sglang wheel cannot be fetched (exit 3) that
release's tests skip with its one line, and any other failure fails them.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdstate.devtools.sglang_pair.pair import env_dir as _release_env
from pdstate.integrations.sglang import releases
from tests.support.paths import REPO

__all__ = [
    "DEFAULT_RELEASE",
    "RELEASES",
    "row",
    "EnvUnavailable",
    "Release",
    "ensure_env",
    "queue_env",
    "closing_together",
    "env_dir",
    "run_probe",
    "run_variants",
]


RELEASES = releases.versions()  # oldest first
DEFAULT_RELEASE = releases.in_lock().version  # the lock's own sglang line


def row(version: str) -> releases.SGLangRelease:
    """``version``'s row of the table: the traits a test expects of it."""
    return releases.row(version)


@dataclass(frozen=True)
class Release:
    """One SGLang release under test: its version and its environment's directory."""

    version: str
    env: Path

    @property
    def row(self) -> releases.SGLangRelease:
        return releases.row(self.version)

    @property
    def new_api(self) -> bool:
        """0.5.23's internals (``keyword_api``: keyword-only sender, ``DSV4_REQUEST_STATE``)."""
        return self.row.keyword_api


HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = REPO / "tools" / "sglang_env.sh"
NO_WHEEL_STATUS = 3  # the build script's status for "the sglang wheel cannot be fetched"
NO_WHEEL = "sglang-env: cannot fetch"  # how its one line (and so the skip reason) starts


class EnvUnavailable(Exception):
    """The sglang wheel cannot be fetched here: the tests skip with this one line."""


def env_dir(release: str = DEFAULT_RELEASE) -> Path:
    return _release_env(release)


def ensure_env(release: str = DEFAULT_RELEASE) -> Path:
    """The directory of ``release``'s environment, built first if its stamp is missing or stale (cached)."""
    target = env_dir(release)
    version = [v] if (v := releases.row(release).env_version) else []  # none: the lock's own line
    proc = subprocess.run(
        ["bash", str(BUILD_SCRIPT), sys.executable, str(target), *version],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    if proc.returncode == NO_WHEEL_STATUS:
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith(NO_WHEEL)]
        raise EnvUnavailable(lines[-1] if lines else f"{NO_WHEEL} the sglang wheel")
    if proc.returncode != 0:
        raise RuntimeError(f"building {target} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    return target


def _child_env(target: Path, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    env.update(extra)
    env["PDSTATE_SGLANG_ENV"] = str(target)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["PYTHONWARNINGS"] = "ignore"
    env["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    return env


def run_probe(
    target: Path, extra_env: dict[str, str], scenarios: list, timeout: float = 600, script: str = "probe.py"
) -> dict:
    """Run ``script`` (``probe.py`` unless told) on ``scenarios`` in a fresh interpreter; its JSON answer."""
    proc = subprocess.run(
        [sys.executable, str(HERE / script)],
        input=json.dumps(scenarios),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_child_env(target, extra_env),
        cwd=str(REPO),
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{script} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1])


def run_variants(
    target: Path, variants: dict[str, tuple[dict[str, str], list[dict]]], extra_env: dict[str, str] | None = None
) -> dict[str, dict]:
    """Every variant in its own child process (two at a time); results by variant name."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            name: pool.submit(run_probe, target, {**(extra_env or {}), **env}, scen)
            for name, (env, scen) in variants.items()
        }
        return {name: f.result() for name, f in futures.items()}


# A driver's child ends at once when its stdin closes (``child.serve``); one still busy with a
# command does not: a pair's children are told together and waited for against one deadline, not
# 5 s each in turn.
CLOSE_GRACE_S = 5.0


@contextmanager
def closing_together(pair):
    """``with closing_together(QueuePair(...)) as pair:``: the pair (``sglang_pair``'s or
    ``sglang_queues``') with every child of it closed at once on the way out (``close_together``)."""
    try:
        yield pair
    finally:
        close_together(pair)


def close_together(pair, grace_s: float = CLOSE_GRACE_S) -> None:
    """Close every child of ``pair`` (its stdin, as its own ``close`` does) at once, wait for them
    all within ``grace_s``, kill those still running, then ``pair.close()`` for the rest."""
    children = [*getattr(pair, "prefills", [pair.prefill]), *getattr(pair, "decodes", [pair.decode])]
    for child in children:
        if child.proc.poll() is None:
            try:
                child.proc.stdin.close()
            except OSError:
                pass
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()
    pair.close()


def skip(exc: EnvUnavailable):
    """Skip the current test with the build script's one line."""
    pytest.skip(str(exc))


def queue_env(release: str) -> Path:
    """``release``'s environment for the two-process queue drivers; their tests skip with one line
    when it cannot be built or Mooncake's transfer engine (SGLang's own backend there) is missing."""
    from pdstate.devtools.sglang_pair.pair import mooncake_missing

    try:
        target = ensure_env(release)
    except EnvUnavailable as exc:
        skip(exc)
    if why := mooncake_missing():
        pytest.skip(why)
    return target


# Where every such skip is reported from, so pytest's summary folds them into one line.
SKIP_AT = (__file__, inspect.getsourcelines(skip)[1] + 1)
