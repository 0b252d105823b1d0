"""The fixtures of the whole suite, defined once (the helpers they use live in ``tests/support``),
and the tables printed at the end of a run: the reliability summary, and every wall-clock bound a
test checked beside the time it measured (``tests/support/bounds.py``).

Tests marked ``slow`` (long fuzz runs) are left out by the default ``-m "not slow and not perf"``
of ``pyproject.toml``; ``pytest -m slow tests/reliability`` runs them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.bounds import BOUNDS
from tests.support.summary import SUMMARY
from tests.support.workers import Workers


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if SUMMARY.rows:
        terminalreporter.write_sep("=", "pdstate reliability summary")
        terminalreporter.write_line(SUMMARY.table())
    if BOUNDS.rows:
        terminalreporter.write_sep("=", "pdstate wall-clock bounds")
        terminalreporter.write_line(BOUNDS.table())


# --- worker processes ---------------------------------------------------------------------------


@pytest.fixture
def workers() -> Iterator[Workers]:
    """Worker processes started through it are closed at the end of the test (thawed first)."""
    with Workers() as w:
        yield w


@pytest.fixture(scope="module")
def module_workers() -> Iterator[Workers]:
    """Like ``workers``, for processes shared by a whole module (a long-lived prefill)."""
    with Workers() as w:
        yield w
