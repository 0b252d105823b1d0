"""The N x M cluster of ``pdstate demo --prefills N --decodes M`` in tests: stand-in nodes for the
router, and collecting the cluster's events per room."""

from __future__ import annotations

import time
from types import SimpleNamespace

from pdstate.devtools.cluster import Cluster


def router_nodes(n: int) -> list[SimpleNamespace]:
    """What the router reads of a node (``alive``, ``load``), without a process."""
    return [SimpleNamespace(alive=True, load=0) for _ in range(n)]


def collect(cluster: Cluster, event: str, rooms: set[int], timeout_s: float) -> dict[int, tuple[dict, float]]:
    """``room -> (event, monotonic time it came)`` for ``event`` of every room in ``rooms``."""
    got: dict[int, tuple[dict, float]] = {}
    deadline = time.monotonic() + timeout_s
    while set(got) != rooms:
        _, ev = cluster.next_event(deadline - time.monotonic())
        if ev is not None and ev.get("event") == event and ev.get("room") in rooms:
            got[ev["room"]] = (ev, time.monotonic())
    return got
