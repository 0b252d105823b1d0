"""Fixtures of the SGLang harness: nothing is built or imported at collection.

``sglang_release`` is parametrised over ``runner.RELEASES`` (the table's): it builds that
release's cached environment if needed (``tools/sglang_env.sh``) and every fixture over it runs
once per release, so a test that uses ``sglang_results`` (every scenario of ``scenarios.VARIANTS``
in child processes), ``sglang_pair`` (the two-process driver's pair of children) or ``queue_pair``
/ ``queue_runs`` (the scheduler-queue driver's) runs against each release, with the release in its
id. ``sglang_env`` is the lock's release's environment alone (the suites that have not moved to both releases).
When a release's wheel cannot be fetched its tests skip with the build script's reason, reported
as one line (pytest would otherwise list a fixture's skip once per test function).
"""

from __future__ import annotations

import pytest

from tests.sglang import queue_cases, runner, scenarios


@pytest.fixture(scope="session")
def sglang_env():
    try:
        return runner.ensure_env()
    except runner.EnvUnavailable as exc:
        runner.skip(exc)


@pytest.fixture(scope="session", params=list(runner.RELEASES), ids=lambda v: f"sglang-{v}")
def sglang_release(request) -> runner.Release:
    try:
        return runner.Release(request.param, runner.ensure_env(request.param))
    except runner.EnvUnavailable as exc:
        runner.skip(exc)


@pytest.fixture(scope="session")
def sglang_results(sglang_release) -> dict[str, dict]:
    return runner.run_variants(sglang_release.env, scenarios.VARIANTS)


@pytest.fixture(scope="session")
def sglang_pair(sglang_release):
    """One prefill child and one decode child of ``devtools.sglang_pair`` for every test that drives
    SGLang's disaggregation code across processes (each case gets its own managers)."""
    from pdstate.devtools.sglang_pair.pair import PDSTATE_ENGINE_ENV, Pair, mooncake_missing

    if why := mooncake_missing():
        pytest.skip(why)
    with runner.closing_together(Pair(sglang_release.env, extra_env=PDSTATE_ENGINE_ENV)) as pair:
        pair.release = sglang_release.version
        yield pair


@pytest.fixture(scope="session")
def queue_pair(sglang_release):
    """One prefill child and one decode child of ``devtools.sglang_queues`` per release (pdstate's
    engine settings), shared by the suites that drive SGLang's scheduler queues in one prefill and
    one decode: ``queue_runs`` first, then ``test_rank_endpoints`` and the bench's rank endpoints
    (``pdstate`` alone; their fixtures request ``queue_runs`` so that SGLang's Mooncake cases run
    in fresh children: ``queue_cases``). Every case sets up managers (and ports) of its own;
    starting a pair costs two imports of SGLang (about 8.5 s of CPU each)."""
    from pdstate.devtools.sglang_pair.pair import PDSTATE_ENGINE_ENV
    from pdstate.devtools.sglang_queues.pair import QueuePair

    target = runner.queue_env(sglang_release.version)
    with runner.closing_together(QueuePair(target, extra_env=PDSTATE_ENGINE_ENV)) as pair:
        yield pair


@pytest.fixture(scope="session")
def queue_runs(sglang_release, queue_pair) -> tuple[str, dict]:
    """``(release, {(backend, case): result})``: ``test_scheduler_queues``' runs (``queue_cases.run``)."""
    return sglang_release.version, queue_cases.run(queue_pair, sglang_release.version)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    longrepr = report.longrepr
    if report.skipped and isinstance(longrepr, tuple) and runner.NO_WHEEL in str(longrepr[2]):
        report.longrepr = (*runner.SKIP_AT, longrepr[2])  # one location: the summary folds them into one line
    return report
