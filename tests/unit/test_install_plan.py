"""``pip install pdstate[sglang]`` into an SGLang environment plans no change to its torch or SGLang.

pip's own resolver is asked, with ``--dry-run --report``, to install the wheel built from this tree
into an environment that holds SGLang 0.5.23 and the torch it requires (2.14.1). Metadata is all
the resolver reads, so the environment is a bare venv holding ``.dist-info`` directories: torch
and sglang at those versions (sglang's own METADATA where ``make sglang-env`` fetched the wheel),
and every other requirement of pdstate at the version this venv has. ``--no-index``, with this
host's pip configuration set aside, keeps pip from fetching anything: a plan that needed another
torch could not be met, and says so.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from tests.support.paths import REPO

SGLANG_METADATA = REPO / ".venv" / "sglang-env-0.5.23" / "sglang-0.5.23.dist-info" / "METADATA"


def _name(req: str) -> str:
    return re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].strip()


def _dist_info(site: Path, name: str, version: str, metadata: str | None = None) -> None:
    d = site / f"{name.replace('-', '_')}-{version}.dist-info"
    d.mkdir()
    (d / "METADATA").write_text(metadata or f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (d / "INSTALLER").write_text("pip\n")
    (d / "RECORD").write_text("")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of this tree, built from a copy of it (a build leaves build/ and egg-info behind)."""
    out, tree = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("tree")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, tree / name)
    shutil.copytree(REPO / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out)]
    subprocess.run([*build, str(tree)], check=True, capture_output=True, timeout=300)
    (whl,) = out.glob("pdstate-*.whl")
    return whl


def _environment(root: Path, torch_version: str) -> Path:
    """A venv with no pip, holding SGLang 0.5.23's metadata, torch at ``torch_version`` and every
    other requirement of pdstate at this venv's versions."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    (site,) = root.glob("lib/python3.*/site-packages")
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    for req in deps:
        name = _name(req)
        if name == "torch" or ("python_version" in req and sys.version_info >= (3, 11)):
            continue
        _dist_info(site, name, md.version(name))
    _dist_info(site, "torch", torch_version)
    sglang = SGLANG_METADATA.read_text() if SGLANG_METADATA.exists() else None
    _dist_info(
        site,
        "sglang",
        "0.5.23",
        sglang or "Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.23\nRequires-Dist: torch==2.14.1\n",
    )
    return root / "bin" / "python"


def _plan(python: Path, wheel: Path, report: Path) -> subprocess.CompletedProcess:
    args = ["install", "--dry-run", "--no-index", "--find-links", str(wheel.parent), "--report", str(report)]
    cmd = [sys.executable, "-m", "pip", "--python", str(python), *args, "--quiet", "pdstate[sglang]"]
    # This host's pip configuration (its wheel folders, its constraints) is not the user's.
    # PYTHONPATH would show the environment a pdstate that is not installed there.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    env["PIP_CONFIG_FILE"] = os.devnull
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def test_an_sglang_0_5_23_environment_keeps_its_torch_and_sglang(wheel, tmp_path):
    python = _environment(tmp_path / "env", "2.14.1")
    run = _plan(python, wheel, tmp_path / "report.json")
    assert run.returncode == 0, run.stderr
    planned = {
        i["metadata"]["name"]: i["metadata"]["version"]
        for i in json.loads((tmp_path / "report.json").read_text())["install"]
    }
    assert planned == {"pdstate": wheel.name.split("-")[1]}, planned  # pdstate alone: no torch, no sglang


def test_a_torch_below_the_range_is_what_the_resolver_would_change(wheel, tmp_path):
    """The same question with torch 2.12: the plan needs another torch, which --no-index cannot
    fetch, so pip refuses naming torch (the check above can fail)."""
    python = _environment(tmp_path / "env", "2.12.0")
    run = _plan(python, wheel, tmp_path / "report.json")
    assert run.returncode != 0
    assert "torch>=2.13" in run.stderr, run.stderr
