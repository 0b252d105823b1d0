"""``pdstate.integrations.sglang.launch`` (what ``pdstate check --sglang`` runs) imports neither
torch nor SGLang, and ``pdstate check`` imports it only when asked for ``--sglang``."""

from __future__ import annotations

import subprocess
import sys

from tests.support.paths import REPO

MODULES = (
    "argtable",
    "command",
    "coverage",
    "model",
    "side",
    "rules",
    "prediction",
    "knobs",
    "consequences",
    "comparison",
    "backend",
    "recipe",
)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_the_launch_package_imports_without_torch_or_sglang():
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['sglang'] = None; "
        + "; ".join(f"import pdstate.integrations.sglang.launch.{m}" for m in MODULES)
        + "; heavy = [m for m in ('numpy', 'zmq', 'fastapi') if m in sys.modules]; assert not heavy, heavy"
    )
    done = _run(code)
    assert done.returncode == 0, done.stderr[-3000:]


def test_check_loads_the_launch_package_only_for_sglang():
    code = (
        "import sys, pdstate.cli, pdstate.service.preflight; "
        "loaded = [m for m in sys.modules if m.startswith('pdstate.integrations')]; "
        "assert not loaded, loaded"
    )
    done = _run(code)
    assert done.returncode == 0, done.stderr[-3000:]
