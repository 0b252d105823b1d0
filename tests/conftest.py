import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("PDSTATE_SHARED", REPO.parent / "shared"))
# A vendored copy of the recorded upstream outcomes, so a clone is self-contained; a test checks it
# still equals ../shared/conformance when that is present.
CONFORMANCE_JSON = REPO / "tests" / "conformance" / "data" / "setup_state_kv_args.json"


@pytest.fixture(scope="session")
def conformance_data():
    return json.loads(CONFORMANCE_JSON.read_text())
