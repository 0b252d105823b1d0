"""The declared Python range is the tested range: pdstate's torch-free surface on Python 3.10 and 3.12.

The suite itself runs on 3.11 (everything). For each other interpreter, ``tools/python_env.sh``
builds a cached venv (``make python-envs``: ``.venv/py3.10``, ``.venv/py3.12``) holding pyproject's
runtime dependencies except torch; these tests run this checkout's ``src`` in it as subprocesses:

- every source file compiles with that interpreter's parser;
- no import of the standard library names what that Python lacks (``typing.Self``,
  ``enum.StrEnum``, ``tomllib`` on 3.10 ...), lazy imports included, outside ``TYPE_CHECKING``,
  ``sys.version_info`` branches and ``try: ... except ImportError``;
- every module imports, or fails only for a package that is not a runtime dependency there
  (torch, the engines, SGLang, the dev tools); the architecture test's torch-free modules and
  the CLI import cleanly;
- ``pdstate --version``, ``pdstate check``'s refusals and ``pdstate probe`` (a usage error and
  an unreachable worker), with their exact exit codes and words.

What is not claimed there: ``pdstate check``'s layout comparison builds pdstate's pools (torch),
so it runs on 3.11; no torch wheel for 3.10 or 3.12 lies on this host. When an interpreter is
missing, its tests skip with the build script's one line. ``PYTHON_ENVS_DIR`` replaces the
directory of the venvs (default: this venv's).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from tests.support.paths import REPO, SRC_DIR
from tests.unit.test_architecture import TORCH_FREE

PYTHONS = ("3.10", "3.12")
NO_PYTHON = 3  # tools/python_env.sh: the interpreter is not on this host
BUILD = REPO / "tools" / "python_env.sh"
# What a module may lack in a torch-free venv: torch, the engines, SGLang and the dev tools.
NOT_RUNTIME = {"torch", "mooncake", "nixl", "nixl_cu12", "sglang", "httpx", "pytest", "_pytest", "hypothesis"}


def env_dir(version: str) -> Path:
    return Path(os.environ.get("PYTHON_ENVS_DIR") or sys.prefix) / f"py{version}"


@pytest.fixture(scope="session", params=PYTHONS, ids=lambda v: f"py{v}")
def built(request) -> tuple[str, Path | str]:
    """``(version, interpreter)`` of the cached venv, built (or found stamped) here; where the
    interpreter is missing, ``(version, the build script's one line)``: ``usable`` skips with it."""
    version, target = request.param, env_dir(request.param)
    proc = subprocess.run(
        ["bash", str(BUILD), f"python{version}", str(target)], capture_output=True, text=True, timeout=900
    )
    if proc.returncode == NO_PYTHON:
        return version, proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 0, f"building {target} failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
    return version, target / "bin" / "python"


def usable(built: tuple[str, Path | str]) -> tuple[str, Path]:
    """``built``, or a skip with the build script's line. Called in the test, not a fixture (a
    fixture's skip is reported at each test): one location, so the summary folds a missing
    interpreter's skips into one line."""
    version, py = built
    if isinstance(py, str):
        pytest.skip(py)
    return version, py


def run(python: Path, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """``python ARGS`` over this checkout's ``src``, with no PDSTATE_* setting and no bytecode written."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDSTATE_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PYTHONPATH=str(SRC_DIR), PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([str(python), *args], capture_output=True, text=True, timeout=timeout_s, env=env, cwd=REPO)


def pdstate(python: Path, *args: str) -> subprocess.CompletedProcess:
    return run(python, "-m", "pdstate.cli", *args)


def sources() -> list[str]:
    return sorted(str(p) for p in (SRC_DIR / "pdstate").rglob("*.py"))


def test_the_venv_is_that_python_without_torch(built):
    version, py = usable(built)
    proc = run(py, "-c", "import sys, importlib.util as u; print('%d.%d' % sys.version_info[:2], u.find_spec('torch'))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{version} None\n"


COMPILE = """
import sys
paths = sys.argv[1:]
for path in paths:
    with open(path, "rb") as f:
        compile(f.read(), path, "exec", dont_inherit=True)
print(len(paths))
"""


def test_every_source_file_compiles(built):
    python = usable(built)
    files = sources()
    proc = run(python[1], "-c", COMPILE, *files)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == f"{len(files)}\n"


STDLIB_NAMES = """
import ast, importlib, json, sys

newer = set(json.loads(sys.argv[1])) - set(sys.stdlib_module_names)  # stdlib of 3.11, not of this one
found = []


def guarded(node):
    text = ast.unparse(node.test) if isinstance(node, ast.If) else ""
    if "TYPE_CHECKING" in text or "version_info" in text:
        return True
    if isinstance(node, ast.Try):
        names = {ast.unparse(h.type) for h in node.handlers if h.type is not None}
        return any("ImportError" in n or "ModuleNotFoundError" in n for n in names)
    return False


def check(path, node):
    if isinstance(node, ast.Import):
        modules = [(a.name, []) for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
        modules = [(node.module, [a.name for a in node.names])]
    else:
        return
    for module, names in modules:
        top = module.split(".")[0]
        where = f"{path}:{node.lineno}"
        if top in newer:
            found.append(f"{where}: {module} is not in Python %d.%d" % sys.version_info[:2])
        elif top in sys.stdlib_module_names:
            mod = importlib.import_module(module)
            for name in names:
                sub = hasattr(mod, "__path__") and importlib.util.find_spec(f"{module}.{name}") is not None
                if not hasattr(mod, name) and not sub:
                    found.append(f"{where}: {module}.{name} is not in Python %d.%d" % sys.version_info[:2])


def visit(path, node):
    if guarded(node):
        return
    check(path, node)
    for child in ast.iter_child_nodes(node):
        visit(path, child)


import importlib.util

for path in sys.argv[2:]:
    with open(path, encoding="utf-8") as f:
        visit(path, ast.parse(f.read(), path))
print(json.dumps(found))
"""


def test_no_standard_library_name_this_python_lacks(built):
    python = usable(built)
    proc = run(python[1], "-c", STDLIB_NAMES, json.dumps(sorted(sys.stdlib_module_names)), *sources())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout) == []


IMPORT_ALL = """
import importlib, json, sys, traceback


def lacking(exc):
    # the third-party module whose absence raised exc, however it was re-raised (pdstate's errors)
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ModuleNotFoundError):
            top = (exc.name or "").split(".")[0]
            return top if top and top != "pdstate" else None
        exc = exc.__cause__ or exc.__context__
    return None


out = {"ok": [], "lacks": {}, "failed": {}}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException as exc:
        top = lacking(exc)
        if top:
            out["lacks"][name] = top
        else:
            out["failed"][name] = traceback.format_exc()[-1500:]
    else:
        out["ok"].append(name)
print(json.dumps(out))
"""


def module_names() -> list[str]:
    names = []
    for path in sources():
        parts = list(Path(path).relative_to(SRC_DIR).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(parts))
    return names


def test_every_module_imports_or_lacks_only_what_is_not_a_runtime_dependency(built):
    python = usable(built)
    names = module_names()
    proc = run(python[1], "-c", IMPORT_ALL, *names)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["failed"] == {}
    assert set(out["lacks"].values()) <= NOT_RUNTIME, out["lacks"]
    assert len(out["ok"]) + len(out["lacks"]) == len(names)
    must = {*TORCH_FREE, "pdstate", "pdstate.cli", "pdstate.errors", "pdstate.service.probe"}
    assert must <= set(out["ok"]), sorted(must - set(out["ok"]))


def test_version(built):
    python = usable(built)
    proc = pdstate(python[1], "--version")
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"pdstate {version}\n", "")


SPEC = "--speculative-algorithm EAGLE --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
MODEL = "--model-path deepseek-ai/DeepSeek-V4-Flash --trust-remote-code --tp 8"
PREFILL = f"{MODEL} --disaggregation-mode prefill {SPEC}"
DECODE = f"{MODEL} --disaggregation-mode decode --dp 8 --enable-dp-attention {SPEC}"


def test_check_refuses_what_it_cannot_read_in_its_words(built):
    python = usable(built)
    from pdstate.integrations.sglang import releases

    proc = pdstate(python[1], "check")
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == "pdstate check: nothing to check: give one or two config files, or --sglang PREFILL DECODE\n"
    proc = pdstate(python[1], "check", "--sglang", PREFILL, DECODE, "--sglang-version", "0.5.20")
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == f"pdstate check: --sglang-version 0.5.20: pdstate models SGLang {releases.spelled()}\n"


def test_check_help_names_the_releases(built):
    python = usable(built)
    from pdstate.integrations.sglang import releases

    proc = pdstate(python[1], "check", "--help")
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout.startswith("usage: pdstate check ")
    for row in releases.RELEASES:
        assert row.version in proc.stdout


def test_probe_without_a_url_is_a_usage_error(built):
    python = usable(built)
    proc = pdstate(python[1], "probe")
    assert (proc.returncode, proc.stdout) == (2, "")
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("usage: pdstate probe ")
    assert lines[-1].startswith("pdstate probe: error: ")


def test_probe_of_an_unreachable_worker_fails(built):
    python = usable(built)
    with socket.socket() as held:  # bound, never listening: a refused connection, and no one else's port
        held.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{held.getsockname()[1]}"
        proc = pdstate(python[1], "probe", url, "--timeout", "10")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = proc.stdout.splitlines()[0]
    assert line.startswith(f"{url}: UNREACHABLE: GET {url}/readyz: "), proc.stdout
    assert "Connection refused" in line


def test_the_declared_pythons_are_the_tested_ones():
    """pyproject's classifiers name this suite's interpreter (everything) and ``PYTHONS`` (the
    torch-free surface), no more and no less; requires-python's floor is the oldest of them."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = [
        c.rsplit(" :: ", 1)[1] for c in project["classifiers"] if c.startswith("Programming Language :: Python :: 3.")
    ]
    tested = sorted(
        {f"{sys.version_info[0]}.{sys.version_info[1]}", *PYTHONS}, key=lambda v: tuple(map(int, v.split(".")))
    )
    assert declared == tested
    assert project["requires-python"] == f">={tested[0]}"
