"""``bench_sched``'s keys from a measurement (no SGLang): their shapes and values exactly, in the
summary, and ``null`` where the measurement could not run."""

from __future__ import annotations

from pdstate.devtools import bench_report, bench_sched
from tests.support.bench import fake_bench_result


def _measured() -> dict:
    calls = {"new": 1.0, "init": 2.0, "send": 3.0, "send_metadata": 0.0, "poll": 4.0}
    kinds = {"prefill": {"steady": [30, 60_000], "to Success": [2, 40_000]}}  # two rounds' polls: [count, ns]
    parts = {
        n: {"prefill": {c: [v, v + 2] for c, v in calls.items()}, "decode": {}, "polls": [5.0, 7.0], "kinds": kinds}
        for n in (1, 16)
    }
    return {
        "release": "0.5.19",
        "cpu_us": {"pdstate": {1: [30.0, 10.0, 20.0], 16: [8.0, 6.0]}, "mooncake": {1: [40.0], 16: [9.0]}},
        "parts": {"pdstate": parts, "mooncake": parts},
        "poll_ns": {
            "pdstate": {"prefill": [1000, 3000], "decode": [2000]},
            "mooncake": {"prefill": [500], "decode": [1500, 900]},
        },
    }


def test_the_keys_of_one_release():
    r: dict = {}
    bench_sched.store(r, _measured())
    assert r[bench_sched.CPU_KEY] == {"0.5.19": {"pdstate": {"1": 20.0, "16": 7.0}, "mooncake": {"1": 40.0, "16": 9.0}}}
    assert r[bench_sched.POLL_KEY] == {"0.5.19": {"pdstate": 2.0, "mooncake": 0.9}}  # both sides' polls, median
    detail = r["sglang_sched"]["by_release"]["0.5.19"]["pdstate"]
    assert detail["cpu_us_per_request"]["1"] == {"min": 10.0, "median": 20.0, "max": 30.0}
    assert detail["by_side_and_call_us"]["16"]["prefill"]["init"] == 3.0
    assert detail["polls_per_request"] == {"1": 6.0, "16": 6.0}
    # per request: the count over the rounds' requests (2 rounds of 16 at 1 in flight, of 16 at 16)
    assert detail["polls_by_kind"]["1"] == {
        "prefill": {
            "steady": {"per_request": 30 / 32, "mean_us": 2.0},
            "to Success": {"per_request": 2 / 32, "mean_us": 20.0},
        }
    }
    assert detail["polls_by_kind"]["16"]["prefill"]["to Success"]["per_request"] == 2 / 32
    assert detail["poll_us_by_side"] == {"prefill": 2.0, "decode": 2.0} and detail["polls"] == 3
    s = bench_report.summary(fake_bench_result(**r))
    assert s[bench_sched.CPU_KEY] == r[bench_sched.CPU_KEY] and s[bench_sched.POLL_KEY] == r[bench_sched.POLL_KEY]


def test_the_keys_are_null_without_the_measurement(tmp_path, monkeypatch):
    s = bench_report.summary(fake_bench_result())
    assert s[bench_sched.CPU_KEY] is None and s[bench_sched.POLL_KEY] is None
    monkeypatch.setenv("PDSTATE_SGLANG_ENV", str(tmp_path / "absent"))
    said, results = [], {}
    bench_sched.phase(True, results, progress=said.append)
    why = f"no SGLang environment at {tmp_path / 'absent'} (make sglang-env builds it)"
    assert results == {bench_sched.CPU_KEY: None, bench_sched.POLL_KEY: None, "sglang_sched": {"skipped": why}}
    assert said == [f"skipping the sglang scheduler measurement: {why}"]


def test_a_round_has_at_least_sixteen_requests():
    assert [bench_sched.batches(n) for n in (1, 16, 64)] == [16, 1, 1]
