"""``pdstate.agent`` imports errors, logs, protocol, pools and transfer only (the layers below it)."""

from __future__ import annotations

import ast
from pathlib import Path

AGENT = Path(__file__).resolve().parents[2] / "src" / "pdstate" / "agent"
ALLOWED = ("pdstate.errors", "pdstate.logs", "pdstate.protocol", "pdstate.pools", "pdstate.transfer", "pdstate.agent")


def test_agent_imports_only_lower_layers():
    bad = []
    for path in sorted(AGENT.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module == "pdstate":  # from pdstate import logs
                names = [f"pdstate.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name.startswith("pdstate") and not name.startswith(ALLOWED):
                    bad.append(f"{path.name}: {name}")
    assert bad == []
