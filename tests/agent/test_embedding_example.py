"""docs/library.md's "Embedding pdstate in a serving engine" example runs as written (docs/embedding_example.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.paths import REPO

EXAMPLE = REPO / "docs" / "embedding_example.py"


def test_embedding_example_runs():
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "pages landed: True aux: True"
    assert (
        lines[1]
        == "metrics: ['bytes', 'copy_s', 'descriptors', 'digest_hashing_s', 'digest_s', 'landed', 'success_at_s', 'transfer_s', 'transferring_at_s', 'verify', 'waiting_for_input_at_s']"
    )


def test_the_docs_show_the_example_verbatim():
    page = (REPO / "docs" / "library.md").read_text(encoding="utf-8")
    assert "## Embedding pdstate in a serving engine" in page
    assert "```python\n" + EXAMPLE.read_text(encoding="utf-8").rstrip() + "\n```" in page
