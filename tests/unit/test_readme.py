"""The front door and the manual keep their promises: README.md stays short and links every page
of docs/, the library example runs as written, and docs/architecture.md's code map is the tree."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
PACKAGE = ROOT / "src" / "pdstate"
MAX_README_LINES = 300
PAGES = ("operations", "sglang", "configuration", "errors", "performance", "security", "architecture", "library")


def _section(text: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, f"no section {title!r}"
    return m.group(1)


def _code_map() -> set[str]:
    """Paths listed in the code map's ``src/pdstate/`` block, from their indentation."""
    block = re.search(r"```\nsrc/pdstate/\n(.*?)```", _section(ARCHITECTURE, "Layers"), re.S)
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
    assert sorted(tree - listed) == [], "in the tree but not in docs/architecture.md's code map"
    assert sorted(listed - tree) == [], "in docs/architecture.md's code map but not in the tree"


def test_readme_is_the_front_door():
    assert len(README.splitlines()) <= MAX_README_LINES
    first_screen = "\n".join(README.splitlines()[:12])
    assert "DeepSeek-V4" in first_screen and "It is for" in first_screen
    for heading in ("## The two commands", "## Three ways to use it", "## Documentation", "## License"):
        assert f"\n{heading}\n" in README
    assert "runtime/" not in README


def test_readme_links_every_page_and_every_link_resolves():
    for page in PAGES:
        assert f"(docs/{page}.md)" in README, f"README does not link docs/{page}.md"
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", doc.read_text(encoding="utf-8")):
            assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)} links {target}, which does not exist"


def test_library_example_runs_as_written():
    start = README.index("\n### 3. The library\n")
    block = re.compile(r"```python\n(.*?)```", re.S).search(README, start)
    assert block, "README's library section has no python block"
    out = subprocess.run([sys.executable, "-c", block.group(1)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "SWAIndexMappingNotShared - DSV4 target and draft pools must share the SWA index mapping" in out.stdout
    assert "True DSV4 target and draft pools must share the SWA index mapping" in out.stdout
