"""Fixtures of the integration tests (see ``helpers.py``)."""

from __future__ import annotations

import pytest

from tests.integration.helpers import Workers


@pytest.fixture
def workers():
    """Worker processes started through it are closed at the end of the test."""
    w = Workers()
    try:
        yield w
    finally:
        w.close_all()


@pytest.fixture(scope="module")
def module_workers():
    """Like ``workers``, for processes shared by a whole module (a long-lived prefill)."""
    w = Workers()
    try:
        yield w
    finally:
        w.close_all()
