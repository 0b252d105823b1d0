"""Layout reports of real ``tiny`` pools, cached per settings (shared by the layout/compat tests)."""

from __future__ import annotations

import functools

from pdstate.pools.presets import PoolSettings, build_worker_pools, preset
from pdstate.pools.reporting import build_report
from pdstate.protocol.report import LayoutReport

TINY = preset("tiny")
_KEEP = []  # pools stay alive for the whole session (reports hold their pointers)


@functools.cache
def report_of(settings: PoolSettings) -> LayoutReport:
    pools = build_worker_pools(settings)
    _KEEP.append(pools)
    return build_report(pools.target, pools.draft)[0]


def tiny(**changes) -> LayoutReport:
    return report_of(TINY.with_(**changes))
