"""The fixtures of the whole suite, defined once (the helpers they use live in ``tests/support``),
and the tables printed at the end of a run: the reliability summary, and every wall-clock bound a
test checked beside the time it measured (``tests/support/bounds.py``).

Tests marked ``slow`` (long fuzz runs) are left out by the default ``-m "not slow and not perf"``
of ``pyproject.toml``; ``pytest -m slow tests/reliability`` runs them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import asdict

import pytest

from tests.support import parallel
from tests.support.bounds import BOUNDS, Measured
from tests.support.summary import SUMMARY, Row
from tests.support.workers import Workers

# --- parallel runs (pytest-xdist: ``make test`` runs ``-n 2``; see tests/support/parallel.py) ----
# The tables below travel from the workers to the controller.


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    return parallel.scheduler(config, log)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker collects in the same order: sglang first
        items.sort(key=lambda item: parallel.sglang_last(item.nodeid))


def pytest_sessionfinish(session):
    out = getattr(session.config, "workeroutput", None)
    if out is not None:  # an xdist worker: hand its rows to the controller
        out["pdstate_bounds"] = [asdict(r) for r in BOUNDS.rows]
        out["pdstate_summary"] = [asdict(r) for r in SUMMARY.rows]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    out = getattr(node, "workeroutput", None) or {}
    BOUNDS.rows.extend(Measured(**r) for r in out.get("pdstate_bounds", []))
    SUMMARY.rows.extend(Row(**r) for r in out.get("pdstate_summary", []))


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
