"""Fixtures of the reliability tests and the summary table printed at the end of the run.

Tests marked ``slow`` (long fuzz runs) are left out by the default ``-m "not slow and not perf"``
of ``pyproject.toml``; ``pytest -m slow tests/reliability`` runs them.
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.integration.helpers import Workers
from tests.reliability.support import SUMMARY


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if SUMMARY.rows:
        terminalreporter.write_sep("=", "pdstate reliability summary")
        terminalreporter.write_line(SUMMARY.table())


@pytest.fixture
def workers():
    """Worker processes started through it are closed at the end of the test (thawed first)."""
    w = Workers()
    try:
        yield w
    finally:
        for proc in w.started:
            if proc.returncode is None:  # a frozen worker must be thawed to hear its EOF
                try:
                    os.kill(proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        w.close_all()
