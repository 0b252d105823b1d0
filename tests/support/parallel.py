"""How ``make test`` deals the suite out to its worker processes (pytest-xdist, ``-n 2``): a module
at a time, so that module fixtures are set up once, and ``tests/sglang`` as one unit per SGLang
release, first. Its session fixtures (SGLang children, one set per release: the ``sglang_release``
parameter) are costly to start and shared by every file there, and the two releases' halves are
the longest units: each worker starts one while the tests no release names, and then every other
module, fill in around them. ``tests/conftest.py`` installs the scheduler and the order."""

from __future__ import annotations

import re

SGLANG_UNIT = "tests/sglang"
# the release a tests/sglang test's parameters name ("[sglang-0.5.19]", "[0.5.23-main]", ...)
_RELEASE = re.compile(r"\[(?:[^\]]*-)?(\d+\.\d+\.\d+)(?:-[^\]]*)?\]$")


def unit(nodeid: str) -> str:
    """The unit of work a test belongs to: its module, or ``tests/sglang`` for one release (the
    release its parameters name; a test naming none is in the unit ``tests/sglang``)."""
    path = nodeid.split("::", 1)[0]
    if not path.startswith(SGLANG_UNIT + "/"):
        return path
    release = _RELEASE.search(nodeid)
    return SGLANG_UNIT if release is None else f"{SGLANG_UNIT}@{release.group(1)}"


def sglang_last(nodeid: str) -> bool:
    """A sort key that puts ``tests/sglang``'s units first (stable: the rest keep their order)."""
    return not unit(nodeid).startswith(SGLANG_UNIT)


def scheduler(config, log):
    """xdist's scope scheduler, with ``unit`` as the scope."""
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit(nodeid)

    return ByUnit(config, log)
