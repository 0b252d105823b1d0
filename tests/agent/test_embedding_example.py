"""README's "Embedding pdstate in a serving engine" example runs as written (docs/embedding_example.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "docs" / "embedding_example.py"


def test_embedding_example_runs():
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "pages landed: True aux: True"
    assert (
        lines[1]
        == "metrics: ['bytes', 'descriptors', 'digest_s', 'success_at_s', 'transfer_s', 'transferring_at_s', 'waiting_for_input_at_s']"
    )
