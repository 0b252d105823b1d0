import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("PDSTATE_SHARED", REPO.parent / "shared"))


@pytest.fixture(scope="session")
def conformance_data():
    path = SHARED / "conformance" / "setup_state_kv_args.json"
    if not path.exists():
        pytest.skip(f"conformance data not found at {path}")
    return json.loads(path.read_text())
