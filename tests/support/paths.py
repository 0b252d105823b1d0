"""Where things are: the repository, its sources, the shared upstream recordings."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SRC_DIR = REPO / "src"
SERVICES = REPO / "services"
SHARED = Path(os.environ.get("PDSTATE_SHARED", REPO.parent / "shared"))
# A vendored copy of the recorded upstream outcomes, so a clone is self-contained; a test checks it
# still equals ../shared/conformance when that is present.
CONFORMANCE_JSON = REPO / "tests" / "conformance" / "data" / "setup_state_kv_args.json"
