"""The shape of ``src/pdstate``: layers import only downwards, no import cycles, a torch-free
protocol, a public API that resolves, small modules, and one home for every exception class.

Layers (see the docstring of ``pdstate/__init__.py``)::

    7  cli.py, devtools/
    6  service/, integrations/
    5  worker/
    4  agent/
    3  transfer/
    2  pools/
    1  protocol/, logs.py
    0  errors.py

``pdstate/__init__.py`` is the lazy public API: exempt from the layers, it may import only the
standard library eagerly (its ``TYPE_CHECKING`` block is for type checkers).

Every import counts, for the layers and for cycles alike: at module level, inside functions
(lazy), and under ``TYPE_CHECKING``, between layers and within one layer or package. No two
modules depend on each other, however late the import runs: a module that needs its caller's
type takes a protocol or callables (``KVSender``), or the shared type moves down.
"""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

import pdstate
from tests.support.paths import REPO, SRC_DIR

PACKAGE = SRC_DIR / "pdstate"
LAYERS = {
    "pdstate.errors": 0,
    "pdstate.protocol": 1,
    "pdstate.logs": 1,  # the log lines' helpers (refusals carry protocol.fixes' fix line): for every layer above
    "pdstate.inputs": 1,  # reading an operator's file bounded (regular, at most 16 MiB): for every layer above
    "pdstate.pools": 2,
    "pdstate.transfer": 3,
    "pdstate.agent": 4,  # the embeddable agent
    "pdstate.worker": 5,  # serve's workers, callers of the agent
    "pdstate.service": 6,
    "pdstate.integrations": 6,  # serving-engine adapters: over the agent and below, beside service
    "pdstate.cli": 7,
    "pdstate.devtools": 7,
}
LAYER_NAMES = {
    0: "errors",
    1: "protocol",
    2: "pools",
    3: "transfer",
    4: "agent",
    5: "worker",
    6: "service",
    7: "cli/devtools",
}
EXEMPT = "pdstate"  # the lazy public API
MAX_LINES = 800
TORCH_FREE = (
    "pdstate.protocol",
    "pdstate.protocol.wire",
    "pdstate.protocol.compat",
    "pdstate.protocol.handshake",
    "pdstate.protocol.lifecycle",
    "pdstate.protocol.report",
    "pdstate.protocol.facts",
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC_DIR).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    """Every module under ``src/pdstate``, by dotted name."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int | None:
    """The layer of ``module`` (``None`` for the exempt public API and for what is not ours)."""
    for prefix, layer in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return None


@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    line: int
    runs_on_import: bool  # at module level and not under TYPE_CHECKING


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _targets(importer: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules of ``pdstate`` that ``node`` imports (the most specific one each name names)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name == "pdstate" or a.name.startswith("pdstate.")]
    if node.level:
        base = importer.split(".") if is_package else importer.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    if not (module == "pdstate" or module.startswith("pdstate.")):
        return []
    out = []
    for alias in node.names:
        sub = f"{module}.{alias.name}"
        if sub in modules():
            out.append(sub)
        elif module == "pdstate" and alias.name in getattr(pdstate, "_WHERE", {}):
            out.append(pdstate._WHERE[alias.name])  # a public name: the module that defines it
        else:
            out.append(module)
    return out


@cache
def imports() -> tuple[Import, ...]:
    found: list[Import] = []
    for name, path in modules().items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"

        def visit(node: ast.AST, top: bool, name: str = name, is_package: bool = is_package) -> None:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(name, is_package, node):
                    found.append(Import(name, target, node.lineno, top))
                return
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                top = False
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                for child in node.body:
                    visit(child, False)
                for child in node.orelse:
                    visit(child, top)
                return
            for child in ast.iter_child_nodes(node):
                visit(child, top)

        visit(tree, True)
    return tuple(found)


def test_the_scan_sees_every_layer_and_function_level_imports():
    """Guards the guard: a scan that found nothing would pass every rule below."""
    mods = modules()
    assert {layer_of(m) for m in mods} == {None, 0, 1, 2, 3, 4, 5, 6, 7}
    assert [m for m in mods if layer_of(m) is None] == [EXEMPT], "a module outside every layer"
    found = imports()
    assert len(found) > 100
    assert any(not i.runs_on_import for i in found), "no function-level import seen"
    assert {layer_of(i.importer) for i in found} >= {1, 2, 3, 4, 5, 6, 7}


def upward(found: tuple[Import, ...]) -> list[str]:
    """The imports in ``found`` of a higher layer from a lower one, as ``path:line: ...`` lines."""
    out = []
    for i in found:
        low, high = layer_of(i.importer), layer_of(i.target)
        if i.importer == EXEMPT or low is None or high is None or high <= low:
            continue
        path = modules()[i.importer].relative_to(REPO) if i.importer in modules() else i.importer
        out.append(f"{path}:{i.line}: {i.importer} ({LAYER_NAMES[low]}) imports {i.target} ({LAYER_NAMES[high]})")
    return out


def test_the_layer_rule_fails_when_broken_once():
    """Guards the guard (the real test below is an expected failure until preflight is fixed)."""
    one = Import("pdstate.protocol.compat", "pdstate.worker.synth", 21, True)
    assert upward((one,)) == [
        "src/pdstate/protocol/compat.py:21: pdstate.protocol.compat (protocol) imports pdstate.worker.synth (worker)"
    ]
    fine = (
        Import("pdstate.worker.synth", "pdstate.protocol.compat", 1, True),
        Import("pdstate.cli", "pdstate.devtools.bench", 1, False),
        Import("pdstate", "pdstate.devtools.bench", 1, True),
        Import("pdstate.service.api", "pdstate", 1, True),
    )
    assert upward(fine) == []


def test_relative_and_public_api_imports_resolve_to_the_defining_module():
    def targets(importer: str, code: str, is_package: bool = False) -> list[str]:
        node = ast.parse(code).body[0]
        assert isinstance(node, (ast.Import, ast.ImportFrom))
        return _targets(importer, is_package, node)

    assert targets("pdstate.protocol.compat", "from . import facts") == ["pdstate.protocol.facts"]
    assert targets("pdstate.protocol.compat", "from ..worker import synth") == ["pdstate.worker.synth"]
    assert targets("pdstate.transfer", "from .engines import create_engine", True) == ["pdstate.transfer.engines"]
    assert targets("pdstate.pools.dsv4", "from pdstate import TransferPlan") == ["pdstate.transfer.plan"]
    assert targets("pdstate.service.api", "from pdstate import __version__") == ["pdstate"]
    assert targets("pdstate.worker.synth", "import numpy as np") == []


def test_layers_import_only_downwards():
    found = upward(imports())
    assert not found, "imports of a higher layer from a lower one:\n" + "\n".join(found)


def test_the_public_api_imports_only_the_standard_library_eagerly():
    tree = ast.parse(modules()[EXEMPT].read_text())
    eager = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            eager += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            eager.append(node.module or "")
        elif isinstance(node, ast.ImportFrom):
            eager.append("." * node.level + (node.module or ""))
    not_stdlib = [m for m in eager if m.split(".")[0] not in sys.stdlib_module_names and m != "__future__"]
    assert not not_stdlib, f"pdstate/__init__.py imports {not_stdlib} eagerly"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := dfs(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := dfs(node)):
            return found
    return None


def test_find_cycle_reports_the_path():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"x"}}) == ["x", "x"]


def import_graph(found: tuple[Import, ...]) -> dict[str, set[str]]:
    """Who imports whom among our modules: every import in ``found``, however late it runs (module
    level, in a function, under ``TYPE_CHECKING``)."""
    graph: dict[str, set[str]] = {m: set() for m in modules()}
    for i in found:
        if i.target != i.importer and i.target in graph and i.importer in graph:
            graph[i.importer].add(i.target)
    return graph


def test_a_lazy_or_type_checking_import_closes_a_cycle_too():
    """Guards the guard: a cycle within one package closed by an import under ``TYPE_CHECKING``
    (once missed: ``agent.decode`` <-> ``agent.receiver``), and one closed by a function-level
    import (once missed: ``devtools.bench`` <-> ``devtools.bench_report``)."""
    late = (
        Import("pdstate.agent.receiver", "pdstate.agent.decode", 1, False),
        Import("pdstate.devtools.bench_report", "pdstate.devtools.bench", 1, False),
    )
    for extra in late:
        cycle = find_cycle(import_graph(imports() + (extra,)))
        assert cycle is not None and extra.importer in cycle and extra.target in cycle, (extra, cycle)


def test_no_import_cycles_anywhere():
    cycle = find_cycle(import_graph(imports()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_protocol_imports_without_torch():
    code = "import sys; sys.modules['torch'] = None; import " + ", ".join(TORCH_FREE)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, env=_env()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC_DIR), env.get("PYTHONPATH", "")) if p)
    return env


def test_every_public_name_resolves():
    assert pdstate.__all__, "no public API listed"
    missing = []
    for name in pdstate.__all__:
        try:
            getattr(pdstate, name)
        except AttributeError as exc:
            missing.append(f"{name}: {exc}")
    assert not missing, "\n".join(missing)


def _over_limit() -> list[str]:
    return [
        f"{path.relative_to(REPO)}: {n} lines"
        for path in modules().values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    ]


def test_no_module_is_over_the_line_limit():
    over = _over_limit()
    assert not over, f"modules over {MAX_LINES} lines:\n" + "\n".join(over)


def _exception_classes_outside_errors() -> list[str]:
    """Every ``class`` statement (at any depth) under ``src/pdstate`` with a base that is an
    exception class, outside ``errors.py``; bases are resolved in the module's namespace."""
    import builtins

    found = []
    for name, path in modules().items():
        if name == "pdstate.errors":
            continue
        tree = ast.parse(path.read_text(), str(path))
        classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
        if not classes:
            continue
        try:
            namespace = vars(importlib.import_module(name))
        except ImportError as exc:  # a child-only module of the SGLang drivers: needs SGLang booted
            if not ((exc.name or "").startswith("sglang") or str(exc).startswith("sglang is not in the environment")):
                raise
            namespace = None
        for cls in classes:
            for base in cls.bases:
                if namespace is None:  # by name only: a builtin exception, or a name that says it is one
                    text = ast.unparse(base)
                    if text.endswith(("Error", "Exception", "Exit", "Interrupt")) or text in vars(builtins):
                        value = BaseException if text.endswith(("Error", "Exception")) else vars(builtins)[text]
                    else:
                        value = None
                else:
                    value = _resolve(base, namespace, vars(builtins))
                if isinstance(value, type) and issubclass(value, BaseException):
                    found.append(f"{path.relative_to(REPO)}:{cls.lineno}: class {cls.name}({ast.unparse(base)})")
    return found


def _resolve(expr: ast.expr, namespace: dict, builtins_ns: dict) -> object:
    """The value of a dotted name (``Name`` / ``Attribute``) in ``namespace``; ``None`` otherwise."""
    if isinstance(expr, ast.Name):
        return namespace.get(expr.id, builtins_ns.get(expr.id))
    if isinstance(expr, ast.Attribute):
        owner = _resolve(expr.value, namespace, builtins_ns)
        return getattr(owner, expr.attr, None) if owner is not None else None
    return None


def test_every_exception_class_is_defined_in_errors_py():
    outside = _exception_classes_outside_errors()
    assert not outside, "exception classes defined outside src/pdstate/errors.py:\n" + "\n".join(outside)


def test_the_exception_scan_sees_errors_py_classes():
    """Guards the guard: errors.py itself, scanned the same way, has exception classes."""
    import pdstate.errors as errors_module

    tree = ast.parse(modules()["pdstate.errors"].read_text())
    seen = [
        c.name
        for c in ast.walk(tree)
        if isinstance(c, ast.ClassDef)
        and any(
            isinstance(v := _resolve(b, vars(errors_module), vars(__import__("builtins"))), type)
            and issubclass(v, BaseException)
            for b in c.bases
        )
    ]
    assert "PdStateError" in seen and len(seen) > 20


@pytest.mark.parametrize("module", sorted(LAYERS))
def test_each_layer_root_exists(module):
    assert module in modules(), f"layer root {module} is missing (was a package renamed?)"
