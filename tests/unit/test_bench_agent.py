"""The benchmark's agent phase: on a small layout it measures the agent (digests off and on) beside
the ceiling and the physical limit, and the summary carries its ratios and digest times as numbers."""

from __future__ import annotations

from pdstate.devtools import bench_agent, bench_measure, bench_report
from pdstate.devtools.baselines import thread_counts
from pdstate.transfer.engines.shm_copy import host_cores
from tests.support.bench import fake_bench_result


def _row(seconds: float) -> dict:
    return {"seconds": {"median": seconds}}


def test_agent_ratios_are_taken_within_the_agent_phase():
    r = {
        "lengths": [2048],
        "modes": ["paged"],
        "paths": {
            "paged:agent:ceiling": {"2048": _row(1.0)},
            "paged:agent:agent_shm": {"2048": _row(4.0)},
            "paged:agent:agent_shm_digest": {"2048": _row(5.0)},
        },
    }
    out = bench_report.ratios(r)
    assert out["agent_vs_ceiling_by_length"] == {"2048": 0.25}
    assert out["agent_digest_vs_ceiling_by_length"] == {"2048": 0.2}
    assert not [k for k in out if "worker" in k]


def test_an_agent_phase_on_tiny_fills_the_summary_keys_with_numbers():
    src, dst = bench_measure.Side("paged", "tiny"), bench_measure.Side("paged", "tiny")
    results: dict = {"paths": {}, "lengths": [300], "modes": ["paged"]}
    lines: list[str] = []
    bench_agent.phase(src, dst, [300], 2, results, lines.append, preset_name="tiny", memory_requests=20)
    names = {k.split(":", 2)[2] for k in results["paths"] if k.startswith("paged:agent:")}
    physical = {f"physical_{k}t" for k in thread_counts(host_cores())} | {"physical"}
    assert (
        names
        == {
            "ceiling",
            "ceiling_memmove",
            "ceiling_gather_scatter",
            "agent_shm",
            "agent_shm_sampled",
            "agent_shm_digest",
        }
        | physical
    )
    assert results["paths"]["paged:agent:agent_shm_digest"]["300"]["seconds"]["n"] == 2
    results["ratios"] = bench_report.ratios(results)
    for key in (
        "agent_vs_ceiling",
        "agent_digest_vs_ceiling",
        "shm_vs_physical",
    ):
        assert isinstance(results["ratios"][f"{key}_by_length"]["300"], float)
    digest = bench_report.agent_digest_ms(results)
    assert set(digest["300"]) == {"decode", "prefill"}
    assert isinstance(digest["300"]["decode"], float) and digest["300"]["decode"] > 0
    assert digest["300"]["prefill"] == 0  # shm: the prefill's digest is fused into the copy
    assert results["parts"]["paged:agent:agent_shm:digest_s"]["300"]["median"] == 0  # digest off: none
    cost = bench_report.verify_cost(results)
    assert set(cost) == {"sampled", "full"} and all(isinstance(cost[m]["300"], float) for m in cost)
    assert isinstance(results["handshake_ms"]["paged:agent"], float)
    assert any("300 tokens" in line for line in lines)
    mem = results["agent_memory"]
    assert mem["requests"] == 20 and mem["request_tokens"] == 128
    assert mem["peak_rss_mb"] >= mem["rss_after_mb"] > 0 and abs(mem["rss_growth_mb"]) < mem["rss_before_mb"]
    assert src.pools.allocator.full_available_size() == dst.pools.allocator.full_available_size()


def test_verify_cost_is_each_levels_median_over_offs_less_one():
    r = {
        "paths": {
            "paged:agent:agent_shm": {"2048": _row(4.0), "32768": _row(10.0)},
            "paged:agent:agent_shm_sampled": {"2048": _row(4.2), "32768": _row(10.5)},
            "paged:agent:agent_shm_digest": {"2048": _row(6.0)},
        }
    }
    cost = bench_report.verify_cost(r)
    assert {m: {n: round(v, 6) for n, v in c.items()} for m, c in cost.items()} == {
        "sampled": {"2048": 0.05, "32768": 0.05},
        "full": {"2048": 0.5},
    }
    assert bench_report.verify_cost({"paths": {}}) == {}


def test_summary_names_the_agent_keys_even_when_the_phase_did_not_run():
    r = fake_bench_result(ratios={"shm_vs_ceiling": 0.8})
    s = bench_report.summary(r)
    assert {k: s["ratios"][k] for k in ("agent_vs_ceiling", "agent_digest_vs_ceiling")} == {
        "agent_vs_ceiling": None,
        "agent_digest_vs_ceiling": None,
    }
    assert not [k for k in s["ratios"] if "worker" in k]
    assert s["agent_digest_ms_p50_by_length"] == {}
    assert s["verify_cost_by_mode"] == {} and s["sglang_versions"] == []
    r["parts"] = {"paged:agent:agent_shm_digest:digest_s": {"2048": {"median": 0.002}}}
    assert bench_report.summary(r)["agent_digest_ms_p50_by_length"] == {"2048": {"decode": 2.0}}


def _events(nodes: bench_agent.AgentNodes, room: int, until: dict) -> dict:
    """Each node's events of ``room``, in order, until every node in ``until`` told its event."""
    import queue
    import time

    kinds: dict = {node: [] for node in until}
    deadline = time.monotonic() + 60
    while any(last not in kinds[node] for node, last in until.items()):
        try:
            node, ev = nodes.events.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"not all of {list(until.values())} within 60 s: {kinds}") from None
        if ev is not None and ev.get("room") == room:
            kinds.setdefault(node, []).append(ev["event"])
    return kinds


def _decode_events(nodes: bench_agent.AgentNodes, announce: bool) -> list[str]:
    """One empty request, the prefill told first (as ``AgentNodes.run``); the decode's events of
    its room, in order, up to its result."""
    import secrets

    room, p, d = secrets.randbits(63), nodes.prefill, nodes.decodes["off"]
    p.send({"op": "send", "room": room, "seq_len": 0, "announce": True})
    assert _events(nodes, room, {p: "queued"})[p] == ["queued"]
    cmd = {"op": "recv", "room": room, "seq_len": 0, "prefill": p.address}
    d.send(dict(cmd, announce=True) if announce else cmd)
    kinds = _events(nodes, room, {p: "sent", d: "result"})
    assert kinds[p] == ["sent"]
    return kinds[d]


def test_the_decode_node_tells_allocated_only_when_asked():
    # the benchmark times the decode's request sent -> Success; a line to the benchmark process in
    # that window wakes its threads while the request is in flight: it asks for none
    nodes = bench_agent.AgentNodes(bench_measure.settings("paged", "tiny"))
    try:
        assert _decode_events(nodes, announce=False) == ["result"]
        assert _decode_events(nodes, announce=True) == ["allocated", "result"]  # the demo's router asks
        assert nodes.run(0, "off")["transfer_s"] > 0
    finally:
        nodes.close()


def test_the_empty_transfer_and_the_bare_round_trip_are_measured_in_turns():
    out = bench_agent.empty_transfer(2, 3)  # two blocks of three each, after their warm-ups
    assert set(out) == {"control_overhead_ms", "zmq_round_trip_ms", "control_overhead_vs_zmq"}
    for name in ("control_overhead_ms", "zmq_round_trip_ms"):
        row = out[name]
        assert row["n"] == 6 and 0 < row["min"] <= row["median"] <= row["max"] < 1000, (name, row)
    assert out["control_overhead_vs_zmq"] == out["control_overhead_ms"]["median"] / out["zmq_round_trip_ms"]["median"]


def test_the_turns_alternate_blocks_of_each():
    calls: list[str] = []

    class Nodes:
        def run(self, n, level):
            calls.append(f"agent {n} {level}")
            return {"transfer_s": 0.002}

    class Echo:
        def round_trips(self, n):
            calls.append(f"echo {n}")
            return [0.5] * n

    agent, bare = bench_agent.empty_turns(Nodes(), Echo(), 2, 3)
    assert agent == [2.0] * 6 and bare == [0.5] * 6
    warm = ["echo 10"] + ["agent 0 off"] * 5
    block = ["agent 0 off"] * 3 + ["echo 3"]
    assert calls == warm + block + block
