"""The benchmark's own plumbing: a phase on a small layout yields every variant, and the ratios are
what the issue defines (ceiling / agent for shm, raw / pdstate for native engines, per phase)."""

from __future__ import annotations

import pytest

from pdstate.devtools import bench, bench_measure, bench_report
from pdstate.transfer.plan import TransferPlan
from tests.support.bench import fake_bench_result


def _row(seconds: float) -> dict:
    return {"seconds": {"median": seconds}}


def test_ratios_are_taken_within_each_phase():
    r = {
        "lengths": [2048, 32768],
        "modes": ["paged"],
        "paths": {
            "paged:agent:ceiling": {"2048": _row(1.0), "32768": _row(4.0)},
            "paged:agent:agent_shm": {"2048": _row(2.0), "32768": _row(5.0)},
            "paged:mooncake:raw_mooncake": {"32768": _row(9.0)},
            "paged:mooncake:pdstate_mooncake": {"32768": _row(10.0)},
            "paged:mooncake:pdstate_mooncake_full_verify": {"32768": _row(18.0)},
            "paged:mooncake:pdstate_mooncake_off": {"32768": _row(7.5)},
        },
    }
    out = bench_report.ratios(r)
    assert out["shm_vs_ceiling_by_length"] == {"2048": 0.5, "32768": 0.8} and out["shm_vs_ceiling"] == 0.8
    assert not [k for k in out if "worker" in k]  # no worker pair keys: the baselines are ceiling, limit, raw
    assert out["mooncake_vs_raw"] == 0.9 and out["mooncake_full_verify_vs_raw"] == 0.5 and "nixl_vs_raw" not in out
    assert out["mooncake_off_vs_raw"] == 1.2  # transfer.verify off, the prefill's compute left out


def test_mooncake_ratios_take_the_faster_raw_row_per_length_and_keep_each_row():
    r = {
        "lengths": [8192, 32768],
        "paths": {
            "paged:mooncake:raw_mooncake": {"8192": _row(3.0), "32768": _row(9.0)},
            "paged:mooncake:raw_mooncake_polled": {"8192": _row(4.0), "32768": _row(6.0)},
            "paged:mooncake:pdstate_mooncake_off": {"8192": _row(5.0), "32768": _row(7.5)},
            "paged:mooncake:pdstate_mooncake": {"8192": _row(6.0)},
            "paged:nixl:raw_nixl": {"8192": _row(2.0)},
            "paged:nixl:pdstate_nixl_off": {"8192": _row(2.5)},
        },
    }
    out = bench_report.ratios(r)
    assert out["mooncake_off_vs_raw_by_length"] == {"8192": 0.6, "32768": 0.8}  # sync at 8k, polled at 32k
    assert out["mooncake_vs_raw_by_length"] == {"8192": 0.5}
    assert out["mooncake_off_vs_raw_mooncake_by_length"] == {"8192": 0.6, "32768": 1.2}
    assert out["mooncake_off_vs_raw_mooncake_polled_by_length"] == {"8192": 0.8, "32768": 0.8}
    assert out["nixl_off_vs_raw_by_length"] == {"8192": 0.8}  # the prefill's raw row did not run here
    assert (
        out["nixl_off_vs_raw_nixl_by_length"] == {"8192": 0.8} and "nixl_off_vs_raw_nixl_prefill_by_length" not in out
    )


def test_a_phase_on_tiny_measures_every_variant_and_verifies():
    """An engine phase (run here on shm, the engine every host has): serve's worker pair beside the
    ceiling, each request verified."""
    src, dst = bench_measure.Side("paged", "tiny"), bench_measure.Side("paged", "tiny")
    results: dict = {"paths": {}, "lengths": [300], "modes": ["paged"]}
    lines: list[str] = []
    bench._phase("paged", "shm", src, dst, [300], 2, results, lines.append, preset_name="tiny")
    names = {k.split(":", 2)[2] for k in results["paths"]}
    assert names == {"ceiling", "ceiling_memmove", "ceiling_gather_scatter", "pdstate_shm", "pdstate_shm_full_verify"}
    assert "memory" not in results  # the pair's memory is the agent phase's (``agent_memory``)
    row = results["paths"]["paged:shm:pdstate_shm"]["300"]
    assert row["seconds"]["n"] == 2 and row["bytes"] > 0 and row["gbps"]["median"] > 0
    assert row["bytes"] == results["paths"]["paged:shm:ceiling"]["300"]["bytes"]
    assert results["parts"]["paged:shm:pdstate_shm:verify_s"]["300"]["median"] > 0
    assert any("300 tokens" in line for line in lines)
    assert src.pools.allocator.full_available_size() == dst.pools.allocator.full_available_size()


def test_summary_carries_the_keys_the_issue_names():
    r = fake_bench_result(ratios={"shm_vs_ceiling": 0.8, "shm_vs_ceiling_by_length": {"32768": 0.8}})
    s = bench_report.summary(r)
    assert set(s["ratios"]) >= {"shm_vs_ceiling", "mooncake_vs_raw", "nixl_vs_raw"}
    assert s["ratios"]["mooncake_vs_raw"] is None  # an engine that did not run is null, not absent
    assert s["plan_speedup_vs_loop"] == 20.0
    assert {
        k: s[k]
        for k in ("plan_fragmented_128k_ms", "plan_contiguous_128k_ms", "handshake_ms_p50", "control_overhead_ms_p50")
    } == {
        "plan_fragmented_128k_ms": 1.0,
        "plan_contiguous_128k_ms": 0.5,
        "handshake_ms_p50": 7.0,
        "control_overhead_ms_p50": 0.9,
    }


def test_zmq_round_trip_baseline_runs_between_two_processes():
    from pdstate.devtools.baselines import ZmqEcho, zmq_round_trip

    r = zmq_round_trip(20)
    assert r["n"] == 20 and 0 < r["min"] <= r["median"] <= r["max"] < 1000
    with ZmqEcho() as echo:  # in blocks, the echo process kept between them
        first, second = echo.round_trips(3), echo.round_trips(4)
        pid = echo._proc.pid
    assert (len(first), len(second)) == (3, 4) and all(0 < x < 1000 for x in first + second)
    assert echo._proc.poll() == 0, f"echo process {pid} did not stop"


def test_outputs_json_and_a_plot_where_matplotlib_is_installed(tmp_path):
    import json

    r = {
        "paths": {
            "paged:agent:ceiling": {"8192": {"gbps": {"median": 5.0}}, "2048": {"gbps": {"median": 4.0}}},
            "paged:agent:agent_shm": {"2048": {"gbps": {"median": 2.0}, "seconds": {"median": 1.0}}},
            "paged:mooncake:ceiling": {"2048": {"gbps": {"median": 4.0}}},
        }
    }
    try:
        import matplotlib  # noqa: F401

        expected = {"bench.json", "bench.md", "bench.png"}
    except ImportError:
        expected = {"bench.json", "bench.md"}
    files = bench_report.write_outputs(r, tmp_path / "out")
    assert {f.name for f in files} == expected
    assert json.loads((tmp_path / "out" / "bench.json").read_text()) == r
    md = (tmp_path / "out" / "bench.md").read_text().splitlines()
    assert md[:2] == ["| GB/s, median (min–max over the runs) | 2k | 8k |", "|---|---|---|"]


@pytest.mark.mooncake
def test_a_native_engine_phase_writes_raw_into_the_decode_worker():
    from pdstate.transfer.engines.base import EngineUnavailable, engine_class

    try:
        engine_class("mooncake").check_available()
    except EngineUnavailable as exc:
        pytest.skip(str(exc))
    src, dst = bench_measure.Side("paged", "tiny"), bench_measure.Side("paged", "tiny")
    results: dict = {"paths": {}, "lengths": [300], "modes": ["paged"]}
    bench._phase("paged", "mooncake", src, dst, [300], 2, results, lambda m: None, preset_name="tiny")
    goal_n = bench_measure.GOAL_RUNS * 2  # the goal's rows: their own rounds' samples only
    pd = results["paths"]["paged:mooncake:pdstate_mooncake"]["300"]
    raw = results["paths"]["paged:mooncake:raw_mooncake"]["300"]
    assert pd["seconds"]["n"] == 2 and raw["seconds"]["n"] == goal_n and raw["bytes"] == pd["bytes"]
    polled = results["paths"]["paged:mooncake:raw_mooncake_polled"]["300"]
    assert polled["seconds"]["n"] == goal_n and polled["bytes"] == raw["bytes"]
    assert 0 < bench_report.ratios(results)["mooncake_vs_raw_by_length"]["300"] < 20
    off = results["paths"]["paged:mooncake:pdstate_mooncake_off"]["300"]
    assert off["seconds"]["n"] == goal_n and off["bytes"] == raw["bytes"]
    assert results["parts"]["paged:mooncake:pdstate_mooncake_off:copy_s"]["300"]["n"] == goal_n
    assert 0 < bench_report.ratios(results)["mooncake_off_vs_raw_by_length"]["300"] < 20


_PLAN = TransferPlan.from_arrays([0], [8], [4])  # one descriptor, 4 bytes (``measure`` reads its size only)


def test_the_goal_rows_get_their_own_rounds_in_alternating_order():
    """``measure``: every variant ``runs`` times round-robin, then the engine goal's rows alone,
    ``GOAL_RUNS * runs`` more rounds, forward then backward, which alone give the goal rows'
    figures; the other rows keep their ``runs``."""
    calls: list[str] = []

    def variant(name: str, dt: float | None = None):
        def run():
            calls.append(name)
            return {"transfer_s": dt, "copy_s": dt / 2} if dt is not None else None

        return run

    names = ["ceiling_memmove", "ceiling_gather_scatter", "raw_mooncake", "raw_mooncake_polled"]
    variants = {k: variant(k) for k in names}
    variants["pdstate_mooncake"] = variant("pdstate_mooncake", 0.5)
    variants["pdstate_mooncake_off"] = variant("pdstate_mooncake_off", 0.25)
    seen = {"n": 0}
    inner = variants["pdstate_mooncake_off"]

    def off_slower_in_the_phase_rounds():  # its warm-up and phase turns at 9 s, its own rounds at 0.25
        seen["n"] += 1
        out = inner()
        return {**out, "transfer_s": 9.0} if seen["n"] <= 3 else out

    variants["pdstate_mooncake_off"] = off_slower_in_the_phase_rounds
    results: dict = {"paths": {}}
    times = bench_measure.measure("paged", "mooncake", 7, _PLAN, variants, 2, results)
    goal = ["raw_mooncake", "raw_mooncake_polled", "pdstate_mooncake_off"]
    rounds = 2 * bench_measure.GOAL_RUNS
    assert calls == [*variants, *(names + ["pdstate_mooncake", "pdstate_mooncake_off"]) * 2] + [
        k for r in range(rounds) for k in (goal if r % 2 == 0 else goal[::-1])
    ]
    assert {k: len(v) for k, v in times.items()} == {
        "ceiling_memmove": 2,
        "ceiling_gather_scatter": 2,
        "raw_mooncake": rounds,
        "raw_mooncake_polled": rounds,
        "pdstate_mooncake": 2,
        "pdstate_mooncake_off": rounds,
    }
    assert times["pdstate_mooncake_off"] == [0.25] * rounds  # its own time, its own rounds only
    off = results["paths"]["paged:mooncake:pdstate_mooncake_off"]["7"]
    assert off["seconds"] == {"median": 0.25, "min": 0.25, "max": 0.25, "n": rounds}
    assert results["parts"]["paged:mooncake:pdstate_mooncake_off:copy_s"]["7"]["n"] == rounds
    assert results["paths"]["paged:mooncake:pdstate_mooncake"]["7"]["seconds"]["n"] == 2


def test_an_engine_without_goal_rows_keeps_runs_samples_per_row():
    calls: list[str] = []
    variants = {k: (lambda k=k: calls.append(k)) for k in ("ceiling_memmove", "ceiling_gather_scatter", "raw_nixl")}
    times = bench_measure.measure("paged", "nixl", 7, _PLAN, variants, 3, {"paths": {}})
    assert calls == list(variants) * 4 and {len(v) for v in times.values()} == {3}
