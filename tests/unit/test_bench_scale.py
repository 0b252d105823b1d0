"""The bench's anchors and scale rows: the physical limit copies exactly and names each thread
count, the keys the issue names are in the summary (null when not measured), the README tables
render from one run's JSON, and the M x N row and the pair's memory come from real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from pdstate.devtools import bench_report, bench_scale, bench_tables
from pdstate.devtools.baselines import physical_copy, thread_counts
from tests.support.bench import fake_bench_result, full_bench_result

pytestmark = pytest.mark.timeout(300)


def test_thread_counts_double_up_to_the_cores():
    assert thread_counts(1) == [1]
    assert thread_counts(2) == [1, 2]
    assert thread_counts(6) == [1, 2, 4, 6]
    assert thread_counts(8) == [1, 2, 4, 8]


def test_the_physical_copy_moves_every_byte_with_each_thread_count():
    variants = physical_copy(3 * 1024 * 1024 + 5, cores=3)
    assert sorted(variants) == ["physical_1t", "physical_2t", "physical_3t"]
    for fn in variants.values():
        fn.dst[:] = 0
        fn()
        assert np.array_equal(fn.dst, fn.src) and int(fn.src[-1]) == 1


def test_ratios_and_summary_carry_every_key_of_the_issue():
    r = full_bench_result()
    r["ratios"] = bench_report.ratios(r)
    s = bench_report.summary(r)
    ratios = s["ratios"]
    assert ratios["shm_vs_physical_by_length"] == pytest.approx({"2048": 0.4, "32768": 0.8})
    assert ratios["shm_vs_physical"] == pytest.approx(0.8)
    assert ratios["shm_vs_ceiling_by_length"] == pytest.approx({"2048": 0.8, "32768": 1.6})
    assert ratios["shm_digest_vs_ceiling"] == pytest.approx(0.8)
    assert ratios["shm_digest_vs_ceiling_by_length"] == pytest.approx({"2048": 0.8, "32768": 0.8})
    assert not [k for k in ratios if "worker" in k]  # the baselines: ceiling, physical limit, raw engines
    assert ratios["mxn_vs_physical"] == pytest.approx(4.0 / 12.5)
    assert s["physical_limit_gbps"] == pytest.approx(12.5) and s["physical_limit_threads"] == 2
    assert s["physical_limit_gbps_by_length"] == pytest.approx({"2048": 5.0, "32768": 12.5})
    assert (s["control_overhead_ms_p50"], s["zmq_round_trip_ms_p50"]) == (0.9, 0.3)
    assert s["control_overhead_vs_zmq"] == pytest.approx(3.0)
    assert s["mxn_2x2_gbps"] == 4.0 and s["mxn_2x2"]["requests"] == 16
    assert (s["peak_rss_mb"], s["rss_growth_mb"], s["rss_anon_growth_mb"], s["rss_growth_requests"]) == (
        3000.0,
        0.5,
        -0.25,
        1000,
    )
    assert not [k for k in s if k.startswith("worker_")]
    json.dumps(s)  # the --json line


def test_keys_not_measured_are_null_not_absent():
    s = bench_report.summary(fake_bench_result())
    for key in ("physical_limit_gbps", "mxn_2x2_gbps", "peak_rss_mb", "rss_growth_mb", "control_overhead_vs_zmq"):
        assert key in s and s[key] is None
    for key in (
        "shm_vs_physical",
        "shm_digest_vs_ceiling",
        "shm_vs_ceiling_by_length",
        "mxn_vs_physical",
        "sglang_backend_vs_sglang_mooncake_by_length",
    ):
        assert key in s["ratios"] and s["ratios"][key] is None
    assert s["sglang_mooncake_ms_by_length"] is None and s["sglang_backend_ms_by_length"] is None


def test_the_readme_tables_render_from_one_run():
    r = full_bench_result()
    r["ratios"] = bench_report.ratios(r)
    md = bench_tables.markdown(r, bench_report.summary(r)).splitlines()
    assert md[0] == "| ratio (medians, one run) | 2k | 32k |"
    assert "| shm end to end (agent) / physical limit | 0.40 | 0.80 |" in md
    assert "| shm end to end (agent) / ceiling | 0.80 | 1.60 |" in md
    assert "| agent, every byte digested (full) / ceiling | 0.80 | 0.80 |" in md
    assert "| agent, sampled digests (the default) / ceiling | 0.73 | 1.52 |" in md
    assert "| `sampled` | +10.0% | +5.0% |" in md and "| `full` | +0.0% | +100.0% |" in md
    assert not any(line.startswith("| Mooncake") for line in md)  # not measured: no row
    assert "| shm end to end (agent), digests off | 2.00 (1.80–2.20) | 10.00 (9.00–11.00) |" in md
    assert "| physical limit (one contiguous copy, best thread count) | 5.00 | 12.50 |" in md
    assert (
        "| physical limit at 32k (`physical_limit_gbps`) | 12.50 GB/s with 2 thread(s); shm end to end (agent) reaches "
        "0.80 of it |"
    ) in md
    assert "| empty transfer (agent) p50 / bare ZeroMQ round trip p50 | 0.90 ms / 0.30 ms = 3.00x |" in md
    assert (
        "| 2 prefills x 2 decodes, aggregate (`mxn_2x2_gbps`) | 4.00 GB/s over 16 requests of 8192 tokens = "
        "0.32 x the physical limit |"
    ) in md
    assert "| agent pair: RSS growth over 1000 requests (`rss_growth_mb`) | +0.5 MB (-0.2 MB private) |" in md
    assert not any("today's worker pair" in line for line in md)


def test_the_tables_print_again_from_a_saved_run(tmp_path):
    r = full_bench_result()
    r["ratios"] = bench_report.ratios(r)
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(r))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    cmd = [sys.executable, "-m", "pdstate.devtools.bench_report"]
    out = subprocess.run([*cmd, str(path)], capture_output=True, text=True, env=env, check=True).stdout
    assert out == bench_tables.markdown(r, bench_report.summary(r))
    bad = subprocess.run([*cmd, str(tmp_path / "none.json")], capture_output=True, text=True, env=env)
    assert bad.returncode == 1 and bad.stderr.startswith(f"bench_report: cannot read {tmp_path / 'none.json'}: ")


def test_proc_status_reads_this_process():
    me = bench_scale.proc_status_kb(os.getpid())
    assert 0 < me["VmRSS"] <= me["VmHWM"]


def test_a_2x2_cluster_row_on_tiny_verifies_every_request():
    lines: list[str] = []
    row = bench_scale.mxn(6, lines.append, tokens=300, preset_name="tiny")
    assert (row["prefills"], row["decodes"], row["requests"], row["verified"]) == (2, 2, 6, 6)
    assert row["gbps"] > 0 and row["bytes"] > 0 and row["request_tokens"] == 300
    assert lines == ["[mxn] 2 prefills x 2 decodes, 6 requests of 300 tokens ..."]


def test_the_sglang_row_renders_both_backends_and_their_ratio() -> None:
    r = {
        "sglang_mooncake_ms_by_length": {"2048": 20.0, "32768": 80.0},
        "sglang_backend_ms_by_length": {"2048": 25.0, "32768": 64.0},
    }
    assert bench_tables.sglang_table(r) == [
        "| SGLang 0.5.19, send -> Success, ms (median) | 2k | 32k |",
        "|---|---|---|",
        "| SGLang's own Mooncake backend | 20.0 | 80.0 |",
        "| backend pdstate (Mooncake engine, `sampled`) | 25.0 | 64.0 |",
        "| ratio, `sampled` (above 1: pdstate faster) | 0.80 | 1.25 |",
    ]
    r["sglang_backend_full_ms_by_length"] = {"2048": 40.0, "32768": 100.0}
    r["sglang"] = {"versions": ["0.5.23"]}
    table = bench_tables.sglang_table(r)
    assert table[0] == "| SGLang 0.5.23, send -> Success, ms (median) | 2k | 32k |"
    assert table[4:] == [
        "| backend pdstate, `full` | 40.0 | 100.0 |",
        "| ratio, `sampled` (above 1: pdstate faster) | 0.80 | 1.25 |",
        "| ratio, `full` | 0.50 | 0.80 |",
    ]
    assert bench_tables.sglang_table({"sglang_mooncake_ms_by_length": {"2048": 20.0}}) == []


def test_the_sglang_rows_come_one_table_per_release() -> None:
    r = {
        "sglang_by_release": {
            "0.5.19": {"mooncake": {"2048": 20.0}, "pdstate": {"2048": 25.0}, "pdstate@full": {"2048": 40.0}},
            "0.5.23": {"mooncake": {"2048": 30.0}, "pdstate": {"2048": 20.0}, "pdstate@full": {}},
        }
    }
    table = bench_tables.sglang_table(r)
    assert table[0] == "| SGLang 0.5.19, send -> Success, ms (median) | 2k |"
    assert table[7:] == [
        "",
        "| SGLang 0.5.23, send -> Success, ms (median) | 2k |",
        "|---|---|",
        "| SGLang's own Mooncake backend | 30.0 |",
        "| backend pdstate (Mooncake engine, `sampled`) | 20.0 |",
        "| ratio, `sampled` (above 1: pdstate faster) | 1.50 |",
    ]
