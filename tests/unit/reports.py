"""Layout reports of real ``tiny`` pools, cached per settings (shared by the layout/compat tests)."""

from __future__ import annotations

import functools

from pdstate.layout import LayoutReport, build_report
from pdstate.presets import PoolSettings, build_worker_pools, preset

TINY = preset("tiny")
_KEEP = []  # pools stay alive for the whole session (reports hold their pointers)


@functools.lru_cache(maxsize=None)
def report_of(settings: PoolSettings) -> LayoutReport:
    pools = build_worker_pools(settings)
    _KEEP.append(pools)
    return build_report(pools.target, pools.draft)[0]


def tiny(**changes) -> LayoutReport:
    return report_of(TINY.with_(**changes))
