"""The bench's sglang phase, without SGLang: its ratio and summary keys, and its skip line where the
SGLang environment is missing (the phase itself runs in ``tests/sglang/test_bench_phase.py``)."""

from __future__ import annotations

import pytest

from pdstate.devtools import bench_ranks, bench_report, bench_sglang, bench_tables
from tests.support.bench import fake_bench_result


def test_ratio_is_sglang_mooncake_over_backend_pdstate_per_length():
    r = {
        "lengths": [],
        "modes": [],
        "paths": {},
        "sglang_mooncake_ms_by_length": {"2048": 30.0, "8192": 50.0, "32768": 90.0},
        "sglang_backend_ms_by_length": {"2048": 20.0, "32768": 120.0},
        "sglang_backend_full_ms_by_length": {"2048": 60.0},
    }
    out = bench_report.ratios(r)
    assert out["sglang_backend_vs_sglang_mooncake_by_length"] == {"2048": 1.5, "32768": 0.75}
    assert out["sglang_backend_vs_sglang_mooncake"] == 0.75  # the 32k-token value
    assert out["sglang_backend_full_vs_sglang_mooncake_by_length"] == {"2048": 0.5}


def test_ratios_per_sglang_release():
    r = {
        "lengths": [],
        "modes": [],
        "paths": {},
        "sglang_by_release": {
            "0.5.19": {"mooncake": {"2048": 30.0}, "pdstate": {"2048": 20.0}, "pdstate@full": {"2048": 60.0}},
            "0.5.23": {"mooncake": {"2048": 30.0, "8192": 40.0}, "pdstate": {"2048": 25.0}, "pdstate@full": {}},
        },
    }
    out = bench_report.ratios(r)
    assert out["sglang_backend_vs_sglang_mooncake_by_release"] == {"0.5.19": {"2048": 1.5}, "0.5.23": {"2048": 1.2}}
    assert out["sglang_backend_full_vs_sglang_mooncake_by_release"] == {"0.5.19": {"2048": 0.5}, "0.5.23": {}}


def test_no_ratio_without_the_pdstate_backend():
    r = {"lengths": [], "modes": [], "paths": {}, "sglang_mooncake_ms_by_length": {"2048": 30.0}}
    assert "sglang_backend_vs_sglang_mooncake_by_length" not in bench_report.ratios(r)


def test_summary_carries_the_phase_keys_null_when_it_did_not_run():
    times = {"2048": 30.0}
    s = bench_report.summary(fake_bench_result(sglang_mooncake_ms_by_length=times))
    assert s["sglang_mooncake_ms_by_length"] == times and s["sglang_backend_ms_by_length"] is None
    s = bench_report.summary(fake_bench_result())
    assert s["sglang_mooncake_ms_by_length"] is None and s["ratios"]["sglang_backend_vs_sglang_mooncake"] is None


def test_phase_skips_with_one_line_without_the_sglang_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSTATE_SGLANG_ENV", str(tmp_path / "absent"))
    said, results = [], {}
    bench_sglang.phase(1, results, progress=said.append)
    why = f"no SGLang environment at {tmp_path / 'absent'} (make sglang-env builds it)"
    assert said == [f"skipping the sglang phase: {why}"]
    assert results == {"sglang": {"lengths": [256, 2048, 8192, 32768], "runs": 1, "skipped": {"phase": why}}}


def test_rank_endpoint_keys_ratio_summary_and_table():
    r = {"lengths": [], "modes": [], "paths": {}}
    cpu = {
        "off": {"prefill": 20.0, "decode": 30.0, "endpoint": 0.0, "wall_s": 4.0, "scrapes": 0},
        "scraped": {"prefill": 30.0, "decode": 36.75, "endpoint": 150.0, "wall_s": 4.1, "scrapes": 100},
    }
    out = {"times": {"off": [10.0, 12.0, 11.0], "scraped": [12.0, 13.0, 14.0, 13.2]}, "scrapes": 40, "cpu": cpu}
    bench_ranks.store(r, "0.5.19", out)
    info = r["sglang_rank_endpoints"]
    assert info["release"] == "0.5.19" and info["tokens"] == 4096 and info["http_requests"] == 40
    assert info["off"] == {
        "min": 10.0, "median": 11.0, "max": 12.0, "ms": [10.0, 12.0, 11.0],
        "cpu_ms": {"prefill": 20.0, "decode": 30.0, "endpoint": 0.0}, "window_s": 4.0,
    }  # fmt: skip
    assert info["scraped"]["median"] == 13.1
    assert (r["sglang_rank_endpoint_off_ms"], r["sglang_rank_endpoint_scraped_ms"]) == (11.0, 13.1)
    # beyond the off rate over as long (20 ms in 4 s -> 20.5 in 4.1 s), per scrape of that rank (50)
    cost = r["sglang_rank_endpoint_cpu_ms_per_scrape"]
    assert cost == {"prefill": pytest.approx((30.0 - 20.5) / 50), "decode": pytest.approx(6.0 / 50)}
    assert r["sglang_rank_endpoint_child_cpu_ms_per_scrape"] == 1.5
    assert r["sglang_rank_endpoint_scrapes"] == {"served": 100, "expected": 328}  # 4 GETs per 50 ms for 4.1 s
    r["ratios"] = bench_report.ratios(r)
    assert r["ratios"]["sglang_rank_endpoint_scraped_vs_off"] == 13.1 / 11.0
    s = bench_report.summary(fake_bench_result(**r))
    assert s["ratios"]["sglang_rank_endpoint_scraped_vs_off"] == 13.1 / 11.0
    assert (s["sglang_rank_endpoint_off_ms"], s["sglang_rank_endpoint_scraped_ms"]) == (11.0, 13.1)
    assert s["sglang_rank_endpoint_child_cpu_ms_per_scrape"] == 1.5
    assert s["sglang_rank_endpoint_scrapes"] == {"served": 100, "expected": 328}
    assert bench_tables.rank_endpoint_table(r) == [
        "| SGLang 0.5.19 rank endpoints, 4k tokens, send -> Success, ms | median | min | max | requests |",
        "|---|---|---|---|---|",
        "| endpoints off | 11.0 | 10.0 | 12.0 | 3 |",
        "| endpoints on, scraped every 50 ms | 13.1 | 12.0 | 14.0 | 4 |",
        "| ratio scraped / off (above 1: slower) | 1.19 | | | |",
        "| prefill rank's own CPU per scrape it served, ms (no request running) | 0.19 | | | |",
        "| decode rank's own CPU per scrape it served, ms (no request running) | 0.12 | | | |",
        "| the endpoints' processes' CPU per scrape, ms | 1.50 | | | |",
        "| scrapes served / expected (no request running) | 100 / 328 | | | |",
    ]
    assert "| endpoints off | 11.0 |" in bench_tables.markdown(r, s)


def test_rank_endpoint_keys_null_without_the_measurement(tmp_path, monkeypatch):
    s = bench_report.summary(fake_bench_result())
    assert s["ratios"]["sglang_rank_endpoint_scraped_vs_off"] is None and s["sglang_rank_endpoint_off_ms"] is None
    assert s["sglang_rank_endpoint_cpu_ms_per_scrape"] is None and s["sglang_rank_endpoint_scrapes"] is None
    assert bench_tables.rank_endpoint_table({}) == []
    monkeypatch.setenv("PDSTATE_SGLANG_ENV", str(tmp_path / "absent"))
    results = {}
    bench_ranks.phase(True, results, progress=None)
    why = f"no SGLang environment at {tmp_path / 'absent'} (make sglang-env builds it)"
    assert results == {"sglang_rank_endpoints": {"tokens": 4096, "runs": 8, "scrape_s": 0.05, "skipped": why}}


def test_bootstrap_interval_of_the_ratio_of_medians_is_seeded_and_exact():
    theirs = [30.0, 34.0, 31.0, 29.0, 40.0, 33.0, 28.0, 36.0]
    ours = [20.0, 25.0, 22.0, 21.0, 30.0, 24.0, 26.0, 23.0]
    assert bench_sglang.ratio_ci95(theirs, ours) == [1.183673469387755, 1.5217391304347827]  # seed 37
    assert bench_sglang.ratio_ci95(theirs, ours) == bench_sglang.ratio_ci95(theirs, ours, seed=bench_sglang.SEED)
    assert bench_sglang.ratio_ci95(theirs, ours, seed=2) == [1.1875, 1.5]
    low, high = bench_sglang.ratio_ci95(theirs, ours)
    assert low < 32.0 / 23.5 < high  # the point ratio of the medians lies inside
    assert bench_sglang.ratio_ci95([10.0] * 4, [5.0] * 4) == [2.0, 2.0]  # no spread, no width
    assert bench_sglang.ratio_ci95(theirs, ours[:5]) == [1.05, 1.675]  # unequal counts: drawn apart


def test_decode_ratio_per_release_beside_the_prefill_one():
    r = {
        "lengths": [],
        "modes": [],
        "paths": {},
        "sglang_by_release": {"0.5.19": {"mooncake": {"2048": 30.0}, "pdstate": {"2048": 20.0}}},
        "sglang_decode_by_release": {
            "0.5.19": {"mooncake": {"2048": 33.0, "8192": 40.0}, "pdstate": {"2048": 22.0}},
            "0.5.23": {"mooncake": {"2048": 30.0}, "pdstate": {"2048": 40.0}},
        },
    }
    out = bench_report.ratios(r)
    assert out["sglang_backend_vs_sglang_mooncake_by_release"] == {"0.5.19": {"2048": 1.5}}
    assert out["sglang_backend_vs_sglang_mooncake_decode_by_release"] == {
        "0.5.19": {"2048": 1.5},
        "0.5.23": {"2048": 0.75},
    }


SGLANG_KEYS = ("sglang_ratio_ci95_by_release", "sglang_bytes_by_release", "sglang_descriptors_by_release")


def test_summary_carries_the_new_sglang_keys_null_when_the_phase_did_not_run():
    s = bench_report.summary(fake_bench_result())
    assert all(s[k] is None for k in SGLANG_KEYS)
    assert s["ratios"]["sglang_backend_vs_sglang_mooncake_decode_by_release"] is None
    values = {k: {"0.5.19": {"pdstate": {"2048": i}}} for i, k in enumerate(SGLANG_KEYS)}
    ratio = {"sglang_backend_vs_sglang_mooncake_decode_by_release": {"0.5.19": {"2048": 1.25}}}
    s = bench_report.summary(fake_bench_result(ratios=ratio, **values))
    assert {k: s[k] for k in SGLANG_KEYS} == values
    assert s["ratios"]["sglang_backend_vs_sglang_mooncake_decode_by_release"] == {"0.5.19": {"2048": 1.25}}


def test_sglang_table_shows_the_decode_the_intervals_and_the_counts():
    """The one-page length (256 tokens, ``ONE_PAGE_TOKENS``) is a column like the others."""
    r = {
        "sglang_by_release": {
            "0.5.19": {"mooncake": {"2048": 30.0, "256": 9.0}, "pdstate": {"2048": 20.0, "256": 12.0}}
        },
        "sglang_decode_by_release": {
            "0.5.19": {"mooncake": {"2048": 33.0, "256": 10.0}, "pdstate": {"2048": 22.0, "256": 8.0}}
        },
        "sglang_ratio_ci95_by_release": {
            "0.5.19": {
                "prefill": {"2048": [1.2, 1.8], "256": [0.6, 0.9]},
                "decode": {"2048": [0.9, 1.6], "256": [1.1, 1.4]},
            }
        },
        "sglang_bytes_by_release": {
            "0.5.19": {"mooncake": {"2048": 18025472, "256": 2408448}, "pdstate": {"2048": 18025472, "256": 2408448}}
        },
        "sglang_descriptors_by_release": {
            "0.5.19": {"mooncake": {"2048": 220, "256": 41}, "pdstate": {"2048": 221, "256": 40}}
        },
    }
    assert bench_tables.sglang_table(r) == [
        "| SGLang 0.5.19, send -> Success, ms (median) | 256 | 2k |",
        "|---|---|---|",
        "| SGLang's own Mooncake backend | 9.0 | 30.0 |",
        "| backend pdstate (Mooncake engine, `sampled`) | 12.0 | 20.0 |",
        "| ratio, `sampled` (above 1: pdstate faster) | 0.75 | 1.50 |",
        "| decode, metadata -> Success: SGLang's own Mooncake backend | 10.0 | 33.0 |",
        "| decode, metadata -> Success: backend pdstate (`sampled`) | 8.0 | 22.0 |",
        "| ratio, decode (above 1: pdstate faster) | 1.25 | 1.50 |",
        "| ratio's bootstrap 95% interval, prefill | 0.60-0.90 | 1.20-1.80 |",
        "| ratio's bootstrap 95% interval, decode | 1.10-1.40 | 0.90-1.60 |",
        "| bytes moved a request, SGLang's own Mooncake backend | 2,408,448 | 18,025,472 |",
        "| bytes moved a request, backend pdstate | 2,408,448 | 18,025,472 |",
        "| descriptors moved a request, SGLang's own Mooncake backend | 41 | 220 |",
        "| descriptors moved a request, backend pdstate | 40 | 221 |",
    ]


def test_a_request_moves_what_both_children_counted():
    r = {
        "tokens": 2048,
        "send_to_success_ms": 20.0,
        "metadata_to_success_ms": 21.5,
        "prefill": {"outcome": "Success", "moved": {"bytes": 1000, "descriptors": 4, "calls": 2}},
        "decode": {
            "outcome": "Success",
            "wrong_items": 0,
            "outside_bytes": 0,
            "moved": {"bytes": 24, "descriptors": 1},
        },
    }
    assert bench_sglang.figures("pdstate", r) == {"prefill": 20.0, "decode": 21.5, "bytes": 1024, "descriptors": 5}
    r["decode"]["wrong_items"] = 1
    with pytest.raises(RuntimeError, match="pdstate at 2048 tokens did not land every byte"):
        bench_sglang.figures("pdstate", r)
