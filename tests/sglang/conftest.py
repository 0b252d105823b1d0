"""Fixtures of the SGLang harness: nothing is built or imported at collection.

``sglang_results`` builds the cached environment if needed (``tools/sglang_env.sh``), then runs
every scenario of ``scenarios.VARIANTS`` in child processes once per session; ``sglang_pair`` is
the two-process driver's pair of children, shared by the tests that use it. When the sglang
wheel cannot be fetched every test here skips with the build script's reason, reported as one
line (pytest would otherwise list a fixture's skip once per test function).
"""

from __future__ import annotations

import pytest

from tests.sglang import runner, scenarios


@pytest.fixture(scope="session")
def sglang_env():
    try:
        return runner.ensure_env()
    except runner.EnvUnavailable as exc:
        runner.skip(exc)


@pytest.fixture(scope="session")
def sglang_results(sglang_env) -> dict[str, dict]:
    return runner.run_variants(sglang_env, scenarios.VARIANTS)


@pytest.fixture(scope="session")
def sglang_pair(sglang_env):
    """One prefill child and one decode child of ``devtools.sglang_pair`` for every test that drives
    SGLang's disaggregation code across processes (each case gets its own managers)."""
    from pdstate.devtools.sglang_pair.pair import PDSTATE_ENGINE_ENV, Pair, mooncake_missing

    if why := mooncake_missing():
        pytest.skip(why)
    with Pair(sglang_env, extra_env=PDSTATE_ENGINE_ENV) as pair:
        yield pair


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    longrepr = report.longrepr
    if report.skipped and isinstance(longrepr, tuple) and runner.NO_WHEEL in str(longrepr[2]):
        report.longrepr = (*runner.SKIP_AT, longrepr[2])  # one location: the summary folds them into one line
    return report
