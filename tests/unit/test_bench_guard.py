"""The bench never loses a run: a phase that raises is recorded in ``bench_errors`` and every other
phase still reports, the summary has every key whatever ran, ``bench.json`` and the summary line are
always written and the exit status says a phase failed; the rank endpoints' CPU readings survive a
child that has ended."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdstate import cli
from pdstate.devtools import bench, bench_ranks, bench_report, bench_scale, bench_tables
from pdstate.errors import ExitCode

pytestmark = pytest.mark.timeout(300)


def test_error_text_is_one_bounded_line_type_first():
    assert bench.error_text(ValueError("bad\nvalue\t\x00")) == "ValueError: bad\\nvalue\\t\\x00"
    long = bench.error_text(RuntimeError("x" * 5000), limit=100)
    assert len(long) == 100
    assert long == "RuntimeError: " + "x" * 69 + " ... [5014 chars]"


def test_a_failing_phase_is_recorded_and_the_next_one_runs():
    results: dict = {}
    lines: list[str] = []
    with bench.guarded("one", results, lines.append):
        raise KeyError("gone")
    with bench.guarded("two", results, lines.append):
        results["two"] = 2
    assert results == {"bench_errors": [{"phase": "one", "error": "KeyError: 'gone'"}], "two": 2}
    assert lines == ["[one] phase failed, the others go on: KeyError: 'gone'"]
    with pytest.raises(KeyboardInterrupt):  # the user's interrupt still ends the run
        with bench.guarded("three", results, lines.append):
            raise KeyboardInterrupt
    assert len(results["bench_errors"]) == 1


def test_the_summary_has_every_key_whatever_ran():
    full = bench_report.summary({"bench_errors": []})
    for r in ({}, {"planner": {"fragmented_ms": 1.0}}, {"control": {}, "ratios": None, "paths": {}}):
        s = bench_report.summary(r)
        assert set(s) == set(full) and set(s["ratios"]) == set(full["ratios"])
        json.dumps(s)
    assert full["bench_errors"] == [] and full["plan_speedup_vs_loop"] is None
    for key in bench_report.RESULT_KEYS:
        assert key in full
    for key in (
        "sglang_scheduler_cpu_us_per_request_by_release",
        "sglang_poll_us_by_release",
        "sglang_ratio_ci95_by_release",
        "sglang_bytes_by_release",
        "sglang_descriptors_by_release",
    ):
        assert full[key] is None
    assert full["ratios"]["sglang_backend_vs_sglang_mooncake_decode_by_release"] is None
    assert full["ratios"]["sglang_backend_vs_sglang_mooncake_by_release"] is None
    filled = bench_report.summary({"sglang_poll_us_by_release": {"0.5.19": {"pdstate": 9.0, "mooncake": 6.0}}})
    assert filled["sglang_poll_us_by_release"] == {"0.5.19": {"pdstate": 9.0, "mooncake": 6.0}}
    assert bench_report.ratios({}) == {}
    assert bench_tables.markdown({}, bench_report.summary({})) == "\n"


def test_the_bench_command_writes_everything_when_phases_fail(tmp_path, monkeypatch, capsys):
    """``pdstate bench --json`` as users run it, the cheap phases only: the planner and the paged
    pools (real), the agent phase (forced to fail), the M x N row (real, on ``tiny``: 2 requests of
    300 tokens) and the control phase (forced to fail, with a message to escape). Both errors are in
    ``bench.json`` and the summary, the other phases' figures beside them, and the exit status is
    FAILED."""
    from pdstate.devtools import bench_agent

    def no_agent(src, dst, lengths, runs, results, progress):
        raise RuntimeError(f"forced: no agent phase over {len(lengths)} lengths")

    def no_control(runs):
        raise OSError(f"forced\ncontrol failure after {runs} runs")

    real_mxn = bench_scale.mxn
    monkeypatch.setattr(bench_agent, "phase", no_agent)
    monkeypatch.setattr(bench, "bench_control", no_control)
    monkeypatch.setattr(bench_scale, "mxn", lambda n, progress: real_mxn(2, progress, tokens=300, preset_name="tiny"))
    monkeypatch.setattr("pdstate.worker.base.tune_interpreter", lambda: None)  # this process's switch interval
    out = tmp_path / "out"
    argv = ["bench", "--quick", "--json", "--engines", "shm", "--modes", "paged", "--no-sglang"]
    assert cli.main([*argv, "--out", str(out)]) == ExitCode.FAILED
    expected = [
        {"phase": "paged:agent", "error": "RuntimeError: forced: no agent phase over 4 lengths"},
        {"phase": "control", "error": "OSError: forced\\ncontrol failure after 20 runs"},
    ]
    saved = json.loads((out / "bench.json").read_text())
    assert saved["bench_errors"] == expected
    assert saved["planner"]["fragmented_ms"] > 0 and saved["mxn"]["verified"] == 2
    assert "control" not in saved and saved["paths"] == {}
    std = capsys.readouterr()
    summary = json.loads(std.out.splitlines()[-1])
    assert summary["bench_errors"] == expected
    assert summary["plan_fragmented_128k_ms"] == saved["planner"]["fragmented_ms"]
    assert summary["mxn_2x2_gbps"] == saved["mxn"]["gbps"] > 0
    assert summary["handshake_ms_p50"] is None and summary["physical_limit_gbps"] is None
    assert summary["ratios"]["shm_vs_ceiling"] is None
    assert "pdstate bench: phase paged:agent failed: RuntimeError: forced: no agent phase over 4 lengths" in std.err
    assert (out / "bench.md").read_text().startswith("| figure | value |\n")


def test_every_phase_that_runs_leaves_bench_errors_empty(monkeypatch):
    """No engine: the planner (real) and the control phase (a stand-in); no pools are built for a
    mode no phase uses."""
    monkeypatch.setattr(bench, "bench_control", lambda runs: {"handshake_ms": {"median": 1.5}})
    built: list[str] = []
    real_side = bench.Side

    def side(mode):
        built.append(mode)
        return real_side(mode)

    monkeypatch.setattr(bench, "Side", side)
    r = bench.run_bench(True, [], ["paged", "unified"], progress=lambda m: None, agent=True, sglang=False)
    assert r["bench_errors"] == [] and r["engines"] == []
    assert built == ["paged", "paged"]  # the planner's two sides; no mode's pools
    s = bench_report.summary(r)
    assert s["bench_errors"] == [] and s["handshake_ms_p50"] == 1.5 and s["plan_contiguous_128k_ms"] > 0


def test_cpu_of_an_ended_process_is_none_and_counts_with_its_last_reading():
    code = "import sys; sum(range(3_000_000)); sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    try:
        last: dict[int, float] = {}
        first = bench_ranks._cpu({"prefill": child.pid}, [child.pid], last)
        assert first["prefill"] == first["endpoint"] == last[child.pid] >= 0
    finally:
        child.communicate(b"")  # it ends and is reaped: its /proc entry is gone
    assert bench_ranks.cpu_ms(child.pid) is None
    again = bench_ranks._cpu({"prefill": child.pid}, [child.pid], last)
    assert again == first
    assert bench_ranks._cpu({}, [child.pid], {}) == {"endpoint": 0.0}  # never read: nothing to count
