"""README's promises: the code map is the tree, and the library example runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
PACKAGE = ROOT / "src" / "pdstate"


def _section(title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", README, re.S | re.M)
    assert m, f"README has no section {title!r}"
    return m.group(1)


def _code_map() -> set[str]:
    """Paths listed in the code map's ``src/pdstate/`` block, from their indentation."""
    block = re.search(r"```\nsrc/pdstate/\n(.*?)```", _section("Layout of the code"), re.S)
    assert block, "the code map has no src/pdstate/ block"
    listed, stack = set(), []
    for line in block.group(1).splitlines():
        if not line.strip():
            continue
        indent = (len(line) - len(line.lstrip(" "))) // 2
        if indent == 0:  # the next top-level folder: the package's map has ended
            break
        name = line.split()[0]
        stack = stack[: indent - 1] + [name.rstrip("/")]
        listed.add("/".join(stack) + ("/" if name.endswith("/") else ""))
    return listed


def _tree() -> set[str]:
    out = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if "__pycache__" in rel.parts:
            continue
        out.add(rel.as_posix())
        for i in range(1, len(rel.parts)):
            out.add("/".join(rel.parts[:i]) + "/")
    return out


def test_code_map_equals_the_tree():
    listed, tree = _code_map(), _tree()
    assert sorted(tree - listed) == [], "in the tree but not in README's code map"
    assert sorted(listed - tree) == [], "in README's code map but not in the tree"


def test_library_example_runs_as_written():
    block = re.search(r"```python\n(.*?)```", _section("Library use"), re.S)
    assert block, "README's Library use section has no python block"
    out = subprocess.run([sys.executable, "-c", block.group(1)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "SWAIndexMappingNotShared - DSV4 target and draft pools must share the SWA index mapping" in out.stdout
    assert "True DSV4 target and draft pools must share the SWA index mapping" in out.stdout
