"""How ``make test`` deals the suite out to its worker processes (pytest-xdist, ``-n 2``): a module
at a time, so that module fixtures are set up once, and ``tests/sglang`` as one unit, first. Its
session fixtures (SGLang children per release) are costly to start and shared by every file
there, and it is the longest unit: one worker starts it while the other takes every other module
in turn. ``tests/conftest.py`` installs the scheduler and the order."""

from __future__ import annotations

SGLANG_UNIT = "tests/sglang"


def unit(nodeid: str) -> str:
    """The unit of work a test belongs to: its module, or the whole of ``tests/sglang``."""
    path = nodeid.split("::", 1)[0]
    return SGLANG_UNIT if path.startswith(SGLANG_UNIT + "/") else path


def sglang_last(nodeid: str) -> bool:
    """A sort key that puts ``tests/sglang`` first (stable: the rest keep their order)."""
    return unit(nodeid) != SGLANG_UNIT


def scheduler(config, log):
    """xdist's scope scheduler, with ``unit`` as the scope."""
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit(nodeid)

    return ByUnit(config, log)
