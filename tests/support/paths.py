"""Where things are: the repository, its sources, the shared upstream recordings; Python run over them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SRC_DIR = REPO / "src"
SERVICES = REPO / "services"
SHARED = Path(os.environ.get("PDSTATE_SHARED", REPO.parent / "shared"))
# A vendored copy of the recorded upstream outcomes, so a clone is self-contained; a test checks it
# still equals ../shared/conformance when that is present.
CONFORMANCE_JSON = REPO / "tests" / "conformance" / "data" / "setup_state_kv_args.json"


def run_python(code: str, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """``python -c CODE ARGS`` in a fresh interpreter that imports this checkout's ``src``."""
    env = {**os.environ, "PYTHONPATH": str(SRC_DIR)}
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout_s, env=env
    )
