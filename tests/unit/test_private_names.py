"""No module of ``src/pdstate`` reads another module's private names: neither an attribute
``x._name`` (``x`` not ``self``/``cls``) whose name only another of our modules defines, nor
``from pdstate.m import _name``. A module that needs something of another one uses its public
name, or is handed it (a callable, a value) by its owner.

What another package keeps private (argparse's actions, SGLang's manager) is out of scope: its
names are not defined under ``src/pdstate``.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import REPO, SRC_DIR

PACKAGE = SRC_DIR / "pdstate"

# module path -> the private names it may read of another module, each with its reason. Keep short.
ALLOWED: dict[str, dict[str, str]] = {
    # The pool is SGLang's (DeepSeekV4TokenToKVPool) or pools.dsv4's stand-in, which keeps
    # upstream's attribute names; SGLang offers its PP stage's layer range under no public name.
    "src/pdstate/pools/interface.py": {
        "_stage_start": "SGLang's pool's own name for it",
        "_stage_end": "SGLang's pool's own name for it",
    },
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def defined_names(tree: ast.AST) -> set[str]:
    """The names a module defines: functions, classes, assigned names and attributes, arguments."""
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            out.add(n.attr)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
        elif isinstance(n, ast.alias) and n.asname:
            out.add(n.asname)
    return out


def private_reads(trees: dict[str, ast.AST]) -> list[tuple[str, int, str, str]]:
    """``(module path, line, name, what)`` for each private name a module reads of another."""
    defined = {path: defined_names(tree) for path, tree in trees.items()}
    ours = set().union(*defined.values()) if defined else set()
    found = []
    for path, tree in trees.items():
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").split(".")[0] == "pdstate"):
                for alias in n.names:
                    if _private(alias.name):
                        found.append((path, n.lineno, alias.name, f"from {n.module} import {alias.name}"))
            elif isinstance(n, ast.Attribute) and _private(n.attr):
                if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                    continue
                if n.attr in defined[path] or n.attr not in ours:
                    continue  # its own, or another package's
                found.append((path, n.lineno, n.attr, ast.unparse(n)))
    return found


def _trees() -> dict[str, ast.AST]:
    return {str(p.relative_to(REPO)): ast.parse(p.read_text(), str(p)) for p in sorted(Path(PACKAGE).rglob("*.py"))}


def test_the_scan_finds_a_private_read_and_a_private_import():
    """Guards the guard: both kinds are found, a module's own and another package's are not."""
    trees = {
        "a.py": ast.parse("class A:\n    def __init__(self):\n        self._loop = 1\n        self._own = 2\n"),
        "b.py": ast.parse(
            "from pdstate.a import _helper\nimport argparse\n"
            "def f(agent):\n    return agent._loop, argparse._StoreAction, agent._x\n"
            "class B:\n    def g(self):\n        return self._own\n"
        ),
        "c.py": ast.parse("_x = 1\n"),
    }
    assert [(p, line, name) for p, line, name, _ in private_reads(trees)] == [
        ("b.py", 1, "_helper"),
        ("b.py", 4, "_loop"),
        ("b.py", 4, "_x"),
    ]


def test_no_module_reads_another_modules_private_names():
    reads = [
        f"{path}:{line}: {what}"
        for path, line, name, what in private_reads(_trees())
        if name not in ALLOWED.get(path, {})
    ]
    assert not reads, "private names read across modules:\n" + "\n".join(reads)


def test_every_allowed_read_is_still_there():
    """An allow-list entry nobody needs any more goes."""
    seen = {(path, name) for path, _, name, _ in private_reads(_trees())}
    stale = [f"{path}: {name}" for path, names in ALLOWED.items() for name in names if (path, name) not in seen]
    assert not stale, "allow-list entries no longer needed:\n" + "\n".join(stale)
