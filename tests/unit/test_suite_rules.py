"""Rules of the test suite itself: one home for helpers and constants (``tests/support``), one set
of fixtures (``tests/conftest.py``), and no test importing a conftest as a module."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

from tests.support.paths import REPO

TESTS = REPO / "tests"
SUPPORT = TESTS / "support"
# The one module that names the runtime's fault-injection knob (see its docstring).
FAULTS = SUPPORT / "faults.py"
KNOB_WORDS = ("delay_before_copy_s",)  # WorkerHooks.delay_before_copy_s, and the process's fault command


@cache
def suite_files() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(), str(p)) for p in sorted(TESTS.rglob("*.py"))}


def rel(p: Path) -> str:
    return str(p.relative_to(REPO))


def conftest_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """Every place ``tree`` imports a conftest as a module (any depth, relative or not, or by a
    string given to ``importlib.import_module`` / ``__import__``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if "conftest" in a.name.split(".")]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if "conftest" in (node.module or "").split("."):
                found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{a.name}") for a in node.names if a.name == "conftest"]
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("importlib.import_module", "__import__"):
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and "conftest" in arg.value.split("."):
                found.append((node.lineno, arg.value))
    return found


@pytest.mark.parametrize(
    "source,caught",
    [
        ("from tests.conftest import REPO", True),
        ("import tests.engines.conftest as c", True),
        ("from .conftest import x", True),
        ("from . import conftest", True),
        ("from tests.engines import conftest", True),
        ("def f():\n    from tests.conftest import SHARED", True),
        ("import importlib\nimportlib.import_module('tests.conftest')", True),
        ("from tests.support.paths import REPO", False),
        ("import conftest_like_name", False),
    ],
)
def test_the_conftest_import_scan_catches_every_form(source, caught):
    assert bool(conftest_imports(ast.parse(source))) is caught


def test_no_test_imports_a_conftest():
    found = [
        f"{rel(p)}:{line}: imports {what}" for p, tree in suite_files().items() for line, what in conftest_imports(tree)
    ]
    assert not found, "import helpers from tests/support, never from a conftest:\n" + "\n".join(found)


def _is_fixture(node: ast.AST) -> bool:
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    for d in node.decorator_list:
        f = d.func if isinstance(d, ast.Call) else d
        if ast.unparse(f) in ("pytest.fixture", "fixture"):
            return True
    return False


def test_conftests_hold_only_fixtures_and_hooks():
    """So there is nothing in a conftest for a test to import."""
    offenders = []
    for p, tree in suite_files().items():
        if p.name != "conftest.py":
            continue
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)) or _is_fixture(node):
                continue
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):  # the docstring
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("pytest_"):
                continue
            if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["pytest_plugins"]:
                continue
            offenders.append(f"{rel(p)}:{node.lineno}: {ast.unparse(node).splitlines()[0]}")
    assert not offenders, "helpers and constants belong in tests/support:\n" + "\n".join(offenders)


def test_a_conftest_fixture_is_defined_once():
    """No conftest fixture is defined again (in another conftest, or shadowed in a test module)."""
    where: dict[str, list[str]] = {}
    shared: set[str] = set()
    for p, tree in suite_files().items():
        for node in ast.walk(tree):
            if _is_fixture(node):
                where.setdefault(node.name, []).append(f"{rel(p)}:{node.lineno}")  # type: ignore[union-attr]
                if p.name == "conftest.py":
                    shared.add(node.name)  # type: ignore[union-attr]
    twice = {name: places for name, places in where.items() if name in shared and len(places) > 1}
    assert not twice, f"conftest fixtures defined more than once: {twice}"


def test_support_defines_no_fixtures_or_tests():
    found = [
        f"{rel(p)}:{node.lineno}: {node.name}"  # type: ignore[union-attr]
        for p, tree in suite_files().items()
        if SUPPORT in p.parents
        for node in ast.walk(tree)
        if _is_fixture(node) or (isinstance(node, ast.FunctionDef) and node.name.startswith("test_"))
    ]
    assert not found, "fixtures live in tests/conftest.py, tests in test modules:\n" + "\n".join(found)


def _constants(tree: ast.Module) -> dict[str, int]:
    """Module-level UPPER_CASE names a module assigns, with their lines."""
    out = {}
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for t in targets:
            if isinstance(t, ast.Name) and t.id.isupper():
                out[t.id] = node.lineno
    return out


def test_support_constants_are_defined_once():
    """``TINY``, ``SENTINEL``, ``ENGINE_OPTIONS``, ``FAULT`` ...: one definition, in one support
    module; everything else imports it."""
    owner: dict[str, str] = {}
    twice = []
    files = suite_files()
    for p, tree in files.items():
        if SUPPORT in p.parents:
            for name, line in _constants(tree).items():
                if name in owner:
                    twice.append(f"{rel(p)}:{line}: {name} (also {owner[name]})")
                owner[name] = f"{rel(p)}:{line}"
    assert {"TINY", "ROOMY", "SENTINEL", "ENGINE_OPTIONS", "ENGINE_PARAMS", "FAULT", "REPO"} <= set(owner)
    for p, tree in files.items():
        if SUPPORT not in p.parents:
            twice += [
                f"{rel(p)}:{line}: {name} (defined in {owner[name]})"
                for name, line in _constants(tree).items()
                if name in owner
            ]
    assert not twice, "constants of tests/support defined again:\n" + "\n".join(twice)


def test_the_fault_injection_knob_is_named_in_one_place():
    """When the runtime's knob changes, ``tests/support/faults.py`` is the one file to change."""
    found = [
        f"{rel(p)}:{i}: {line.strip()}"
        for p in suite_files()
        if p not in (FAULTS, Path(__file__))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if any(w in line for w in KNOB_WORDS)
    ]
    assert not found, "use tests.support.faults (hold_copies, release_copies):\n" + "\n".join(found)
    assert all(w in FAULTS.read_text() for w in KNOB_WORDS)


def test_a_wall_clock_bound_is_at_least_five_times_its_quiet_measurement():
    """``within`` refuses a bound tighter than ``MARGIN`` times what it measured quietly (whatever the
    time measured now), and fails a time past its bound naming both."""
    from tests.support.bounds import BOUNDS, MARGIN, within

    assert MARGIN == 5.0
    rows = len(BOUNDS.rows)
    with pytest.raises(AssertionError, match=r"^tight: bound 0\.9 s is under 5x its quiet 0\.2 s$"):
        within("tight", 0.01, 0.9, 0.2)
    assert len(BOUNDS.rows) == rows  # refused before it was recorded
    with pytest.raises(AssertionError, match=r"^late: 1\.500 s, bound 1 s \(quiet: 0\.2 s\)$"):
        within("late", 1.5, 1.0, 0.2)
    assert within("quick", 0.25, 1.0, 0.2) == 0.25
    assert [(r.what, r.measured_s) for r in BOUNDS.rows[rows:]] == [("late", 1.5), ("quick", 0.25)]
    del BOUNDS.rows[rows:]  # not this test's bounds in the run's table


def test_a_pairs_children_are_closed_together():
    """``closing_together``: every child told at once (stdin closed), one deadline for all, a
    child still running then killed, and the pair's own ``close`` after."""
    import subprocess
    import sys

    from tests.sglang.runner import close_together

    class Child:
        def __init__(self, code: str) -> None:
            self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)

    class Pair:
        closed = False

        def __init__(self) -> None:
            self.prefill = Child("import time\nwhile True: time.sleep(1)")  # never ends by itself
            self.decode = Child("import sys\nsys.stdin.read()")  # ends when its stdin closes

        def close(self) -> None:
            self.closed = True

    pair = Pair()
    close_together(pair, grace_s=1.0)
    assert pair.closed
    assert pair.prefill.proc.returncode == -9 and pair.decode.proc.returncode == 0
