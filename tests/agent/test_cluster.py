"""An N x M cluster of agent processes (``pdstate demo --prefills N --decodes M``): the demo's
summary, the router, and one of two prefills SIGKILLed mid-batch."""

from __future__ import annotations

import time

import pytest

from pdstate.devtools.cluster import Cluster, Router
from tests.agent.support import SHM_DIR
from tests.support.bounds import within
from tests.support.cluster import collect, router_nodes
from tests.support.faults import DETECT_LATE_QUIET_S, DETECT_SLACK_S
from tests.support.pools import ROOMY
from tests.support.workers import demo_summary


def test_demo_two_prefills_two_decodes_json(tmp_path):
    s = demo_summary(["--preset", "tiny", "--prefills", "2", "--decodes", "2", "--requests", "8"], tmp_path, 240)
    assert (s["requests"], s["verified"], s["failed"]) == (8, 8, 0), s["errors"]
    assert s["gbps"] > 0 and s["bytes"] > 0 and not s["leaked"] and s["worker_exit_codes"] == [0, 0, 0, 0]
    assert set(s["pairs"]) == {"p0->d0", "p1->d0", "p0->d1", "p1->d1"}
    assert sum(r["requests"] for r in s["pairs"].values()) == 8
    assert sum(r["verified"] for r in s["pairs"].values()) == 8
    assert set(s["handshake_ms_pairs"]) == set(s["pairs"])


@pytest.mark.parametrize("policy", ["least-loaded", "round-robin"])
def test_router_spreads_over_every_pair_and_caps_each_node(policy):
    ps, ds = router_nodes(2), router_nodes(2)
    router = Router(ps, ds, concurrency=2, policy=policy)
    picked = []
    while (pair := router.pick()) is not None:
        for node in pair:
            node.load += 1
        picked.append(pair)
    assert len(picked) == 4  # 2 per node: every node is full
    assert len({(id(p), id(d)) for p, d in picked}) == 4
    assert all(n.load == 2 for n in ps + ds)


def test_router_skips_dead_nodes():
    ps, ds = router_nodes(2), router_nodes(2)
    ps[0].alive = False
    router = Router(ps, ds, concurrency=4, policy="least-loaded")
    seen = set()
    for _ in range(4):
        p, d = router.pick()
        assert p is ps[1]
        seen.add(id(d))
        p.load += 1
        d.load += 1
    assert seen == {id(d) for d in ds}
    assert router.pick() is None  # the live prefill is full


def test_one_of_two_prefills_sigkilled_mid_batch():
    SHM_DIR.mkdir(mode=0o700, exist_ok=True)
    cluster = Cluster(ROOMY, 2, 2, segment_dir=str(SHM_DIR))
    try:
        (p0, p1), (d0, d1) = cluster.prefills, cluster.decodes
        batch = {}
        for i, (p, d) in enumerate([(p0, d0), (p0, d1), (p1, d0), (p1, d1)] * 2):
            room = 7000 + i
            batch[room] = (p, d)
            cluster.dispatch(room, 300, p, d, hold=True)  # 2 pages: the first chunk goes, the last waits
        held = collect(cluster, "holding", set(batch), 60)
        assert {ev["state"] for ev, _ in held.values()} == {"transferring"}  # mid-request on every pair
        p0.kill()
        killed = time.monotonic()
        for room, (p, _) in batch.items():
            if p is p1:
                p1.send({"op": "release", "room": room})
        results = collect(cluster, "result", set(batch), 30)
        for room, (p, d) in batch.items():
            ev, at = results[room]
            assert ev["pair"] == f"{p.name}->{d.name}"
            if p is p1:
                assert ev["status"] == "success" and ev["verified"], ev
            else:
                assert ev["status"] == "failed" and not ev["verified"]
                assert ev["error"] == {"type": "PeerGone", "message": f"prefill {p0.address} missed heartbeats for 3 s"}
                # past the heartbeat timeout (peer_timeout_s=3) by one tick and the router's read
                within(
                    "a SIGKILLed prefill's requests failed, past the timeout",
                    at - killed - 3.0,
                    DETECT_SLACK_S,
                    DETECT_LATE_QUIET_S,
                )
        while p0.alive:  # the router learns of the exit from the process's closed stdout
            cluster.next_event(10)
        for d in (d0, d1):
            peers = cluster.request(d, {"op": "stats"}, "stats")["peers"]
            assert peers[p1.address]["state"] == "accepted" and peers[p0.address]["state"] == "gone"
        # the decodes keep serving the live prefill; the router routes nothing to the dead one
        router = Router(cluster.prefills, cluster.decodes, concurrency=4, policy="least-loaded")
        more = {}
        for i in range(4):
            p, d = router.pick()
            assert p is p1
            more[8000 + i] = d
            cluster.dispatch(8000 + i, 1000, p, d)
        after = collect(cluster, "result", set(more), 60)
        assert all(ev["verified"] for ev, _ in after.values()), after
        assert {ev["pair"] for ev, _ in after.values()} == {"p1->d0", "p1->d1"}
        deadline = time.monotonic() + 30
        while cluster.busy():  # every prefill's sender ends too (its "sent" follows the decode's verdict)
            assert time.monotonic() < deadline
            cluster.next_event(10)
        for p in (p1, d0, d1):
            assert cluster.request(p, {"op": "stats"}, "stats")["free"] == p.free_at_start  # nothing leaked
    finally:
        rcs = cluster.close()
    assert rcs[0] == -9 and rcs[1:] == [0, 0, 0]
