"""``pdstate bench --sglang``'s phase for real: SGLang's own Mooncake backend, and backend pdstate
on the same pools, every byte checked (three runs of the one-page length, sent as one chunk with its
state): both sides' times, the ratio's bootstrap interval, and the bytes and descriptors each
backend moved, counted."""

from __future__ import annotations

import statistics

import pytest

from pdstate.devtools import bench_ranks, bench_report, bench_sglang
from pdstate.devtools.sglang_pair.cases import ONE_PAGE_TOKENS
from tests.sglang import runner

LOCK = runner.DEFAULT_RELEASE  # the lock's own release (the table's ``in_lock`` row)
N = str(ONE_PAGE_TOKENS)  # the bench's first length: one page


# The bench measures on the lock's release (the pair suite covers both).
@pytest.mark.parametrize("sglang_release", [LOCK], indirect=True, ids=[f"sglang-{LOCK}"])
def test_phase_times_both_backends_on_the_same_requests(sglang_release, sglang_pair, monkeypatch):
    monkeypatch.setenv("PDSTATE_SGLANG_ENV", str(sglang_release.env))
    said, results = [], {}
    runs = 3  # identical requests: each backend's counts must agree across them
    bench_sglang.phase(runs, results, progress=said.append, lengths=(ONE_PAGE_TOKENS,), pair=sglang_pair)
    limit_ms = bench_sglang.DEADLINE_S * 1000
    assert 0 < results["sglang_mooncake_ms_by_length"][N] < limit_ms
    assert 0 < results["sglang_backend_ms_by_length"][N] < limit_ms
    assert 0 < results["sglang_backend_full_ms_by_length"][N] < limit_ms
    assert results["sglang"]["versions"] == [LOCK]
    # the decode's metadata -> Success, per backend, beside the prefill's send -> Success
    assert set(results["sglang_decode_by_release"]) == {LOCK}
    decode = results["sglang_decode_by_release"][LOCK]
    assert set(decode) == set(bench_sglang.BACKENDS)
    assert all(set(by) == {N} and 0 < by[N] < limit_ms for by in decode.values())
    # the bootstrap interval, both sides, a pair of floats around the ratio of medians
    ci = results["sglang_ratio_ci95_by_release"]
    assert set(ci) == {LOCK} and set(ci[LOCK]) == {"prefill", "decode"}
    by_side = {"prefill": results["sglang_by_release"][LOCK], "decode": decode}
    ms = results["sglang"]["ms_by_release"][LOCK]
    for side, per in ci[LOCK].items():
        theirs, ours = ms["mooncake"][side][N], ms["pdstate"][side][N]
        assert len(theirs) == len(ours) == runs
        assert by_side[side]["mooncake"][N] == statistics.median(theirs)
        assert per[N] == bench_sglang.ratio_ci95(theirs, ours)  # from these requests, seeded
        assert 0 < per[N][0] <= per[N][1]
    # bytes and descriptors, counted at Mooncake's engine calls, for both backends on the same requests
    for key in ("sglang_bytes_by_release", "sglang_descriptors_by_release"):
        assert set(results[key]) == {LOCK} and set(results[key][LOCK]) == {"pdstate", "mooncake"}
        assert all(set(v) == {N} and v[N] > 0 for v in results[key][LOCK].values()), results[key]
    seen = results["sglang"]["moved_by_release"][LOCK]
    for backend in ("pdstate", "mooncake"):  # one count each: identical requests moved the same
        assert seen[backend][N] == {
            "bytes": [results["sglang_bytes_by_release"][LOCK][backend][N]],
            "descriptors": [results["sglang_descriptors_by_release"][LOCK][backend][N]],
        }
    assert results["sglang"]["by_release"][LOCK]["pdstate"][N]["median"] > 0
    results.update(lengths=[], modes=[], paths={})
    ratios = bench_report.ratios(results)
    assert ratios["sglang_backend_vs_sglang_mooncake_by_length"][N] > 0
    assert ratios["sglang_backend_full_vs_sglang_mooncake_by_length"][N] > 0
    assert set(ratios["sglang_backend_vs_sglang_mooncake_by_release"][LOCK]) == {N}
    assert ratios["sglang_backend_vs_sglang_mooncake_decode_by_release"][LOCK][N] > 0


@pytest.mark.parametrize("sglang_release", [LOCK], indirect=True, ids=[f"sglang-{LOCK}"])
def test_rank_endpoints_off_and_scraped_through_the_scheduler_queues(
    sglang_release, queue_pair, queue_runs, monkeypatch
):
    """On the shared scheduler-queue children, after ``queue_runs`` (SGLang's Mooncake cases first)."""
    monkeypatch.setattr(bench_ranks, "BLOCKS", 1)
    said, results = [], {"lengths": [], "modes": [], "paths": {}}
    out = bench_ranks.measure(queue_pair, 2, progress=said.append)
    assert said == [f"[sglang rank endpoints] block 1/1, {m}: 2 x 4096 tokens ..." for m in ("off", "scraped")]
    assert all(0 < ms < bench_ranks.DEADLINE_S * 1000 for v in out["times"].values() for ms in v)
    assert [len(v) for v in out["times"].values()] == [2, 2]
    assert out["scrapes"] >= 4  # GET /metrics and /v1/compat answered 200 on both ranks at least once
    bench_ranks.store(results, LOCK, out)
    # Scrapes cost the ranks' own processes (the schedulers') nothing: each endpoint is another
    # process, which spends ~1 ms a scrape. Served by a thread of the rank instead, each rank spent
    # 0.9-1.9 ms per scrape here (no request running, 2 s, ~65 scrapes a rank; the CPU clock's 10 ms
    # tick is ~0.15 ms of that per rank, and its processes spend ~10 ms per 2 s idle).
    served = results["sglang_rank_endpoint_scrapes"]["served"]
    assert 40 <= served <= results["sglang_rank_endpoint_scrapes"]["expected"] + 4
    cost = results["sglang_rank_endpoint_cpu_ms_per_scrape"]
    assert set(cost) == {"prefill", "decode"} and all(ms < 0.6 for ms in cost.values()), cost
    assert results["sglang_rank_endpoint_child_cpu_ms_per_scrape"] > 0.2
    assert bench_report.ratios(results)["sglang_rank_endpoint_scraped_vs_off"] > 0
