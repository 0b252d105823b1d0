"""A decode agent and several prefill agents: refusal, SIGKILL, restart."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from pdstate.agent import RequestState
from pdstate.errors import PeerGone, SWAIndexMappingNotShared
from tests.agent.support import assert_images_equal, expected, snapshot
from tests.agent.test_transfer import PREFILL_SEED, decode, request_lists, source_image  # noqa: F401
from tests.support.bounds import within
from tests.support.faults import DETECT_LATE_QUIET_S, DETECT_SLACK_S

SEED_ERROR = "DSV4 target and draft pools must share the SWA index mapping"


def run_request(agent, pf, kv, room, rng, num_pages=4):
    src_pages, dst_pages, src_state, dst_state = request_lists(kv, rng, num_pages)
    recv = agent.receiver(pf.address, room)
    pf.ask(op="sender", room=room, num_pages=num_pages)
    recv.init(dst_pages, dst_state)
    pf.ask(op="send", room=room, pages=src_pages, state=src_state)
    moves = [(0, src_pages, dst_pages)] + [(c + 1, s, d) for c, (s, d) in enumerate(zip(src_state, dst_state))]
    return recv, moves


def test_refused_prefill_fails_only_its_requests(decode, prefills, source_image):  # noqa: F811
    side, agent = decode
    kv = side.kv_args
    good, bad = prefills(PREFILL_SEED), prefills(PREFILL_SEED, bad_pair=True, worker_id="bad")
    assert not agent.accepted(good.address)  # never dialled
    refused = [agent.receiver(bad.address, room) for room in (1, 2)]
    before = snapshot(kv)
    recv, moves = run_request(agent, good, kv, 3, np.random.default_rng(3))
    for r in refused:  # deadlines for a state, not bounds: a loaded host's handshakes take seconds
        assert r.wait(30) is RequestState.FAILED
        exc = r.failure_exception()
        assert type(exc) is SWAIndexMappingNotShared and str(exc) == SEED_ERROR
    assert recv.wait(30) is RequestState.SUCCESS, recv.failure_exception()
    assert_images_equal(snapshot(kv), expected(before, source_image, kv, moves))
    peers = agent.prefills()
    assert (
        peers[bad.address].state == "rejected"
        and peers[bad.address].reason == f"SWAIndexMappingNotShared: {SEED_ERROR}"
    )
    assert peers[good.address].state == "accepted"
    # read without the I/O thread: accepted, refused, never dialled
    assert (agent.accepted(good.address), agent.accepted(bad.address)) == (True, False)
    assert not agent.accepted("tcp://127.0.0.1:1")


def test_prefill_sigkill_mid_batch(decode, prefills):  # noqa: F811
    side, agent = decode
    kv = side.kv_args
    a, b = prefills(PREFILL_SEED, worker_id="a"), prefills(PREFILL_SEED, worker_id="b")
    rng = np.random.default_rng(8)
    # 6 pages per request over disjoint destination pages: a's three requests, b's three
    pages = rng.permutation(np.arange(1, 16))[:12].tolist()
    recvs_a, recvs_b = [], []
    for i in range(2):
        for pf, out, base in ((a, recvs_a, 10), (b, recvs_b, 20)):
            room = base + i
            dst = pages[:3] if pf is a and i == 0 else pages[3:6] if pf is a else pages[6:9] if i == 0 else pages[9:12]
            r = agent.receiver(pf.address, room)
            pf.ask(op="sender", room=room, num_pages=3)
            r.init(dst, [[], [], []])
            pf.ask(op="send", room=room, pages=[1])  # the first chunk only
            out.append(r)
    for r in recvs_a + recvs_b:
        assert r.wait(30, until=lambda s: s is RequestState.TRANSFERRING) is RequestState.TRANSFERRING
    a.kill()
    killed = time.monotonic()
    for i in range(len(recvs_b)):
        b.ask(op="send", room=20 + i, pages=[2, 3], state=[[], [], []])
    for r in recvs_b:
        assert r.wait(30) is RequestState.SUCCESS, r.failure_exception()
    for r in recvs_a:
        assert r.wait(30) is RequestState.FAILED
        assert type(r.failure_exception()) is PeerGone
        assert str(r.failure_exception()) == f"prefill {a.address} missed heartbeats for 3 s"
    late = time.monotonic() - killed - agent.peer_timeout_s
    within("a killed prefill's requests failed, past the timeout", late, DETECT_SLACK_S, DETECT_LATE_QUIET_S)
    assert agent.prefills()[b.address].state == "accepted"
    # the decode still serves the live prefill after the other died
    r, _ = run_request(agent, b, kv, 30, np.random.default_rng(9))
    assert r.wait(30) is RequestState.SUCCESS, r.failure_exception()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def patient_decode():
    """A decode whose peer timeout outlasts a prefill process's restart on a loaded host: the
    restart is seen by the new incarnation's Accept, not raced against the heartbeat timeout."""
    from pdstate.agent import DecodeAgent
    from tests.agent.support import fill, make_side
    from tests.agent.test_transfer import DECODE_SEED

    side = make_side(True)
    fill(side.kv_args, DECODE_SEED)
    agent = DecodeAgent(side.kv_args, (side.pools.target, side.pools.draft), peer_timeout_s=15.0)
    yield side, agent
    agent.close()
    side.close()


def test_rehandshake_after_prefill_restart(patient_decode, prefills):
    side, agent = patient_decode
    kv = side.kv_args
    bind = f"tcp://127.0.0.1:{free_port()}"
    first = prefills(PREFILL_SEED, bind=bind)
    r, _ = run_request(agent, first, kv, 40, np.random.default_rng(1))
    assert r.wait(30) is RequestState.SUCCESS
    inflight = agent.receiver(first.address, 41)
    first.ask(op="sender", room=41, num_pages=2)
    inflight.init([5, 6], [[], [], []])
    # the old process has the request (so it cannot go to the new one)
    assert first.ask(op="wait", room=41, timeout=10, until="waiting_for_input")["state"] == "waiting_for_input"
    first.kill()
    second = prefills(PREFILL_SEED, bind=bind)
    assert second.address == first.address
    r2, _ = run_request(agent, second, kv, 42, np.random.default_rng(2))
    assert r2.wait(30) is RequestState.SUCCESS, r2.failure_exception()
    assert inflight.wait(10) is RequestState.FAILED
    assert type(inflight.failure_exception()) is PeerGone
    assert agent.prefills()[second.address].handshakes == 2


def test_prefill_serves_two_decodes(prefills, source_image):  # noqa: F811
    from pdstate.agent import DecodeAgent
    from tests.agent.support import fill, make_side

    pf = prefills(PREFILL_SEED)
    sides, agents = [], []
    try:
        for seed in (1, 2):
            side = make_side(True)
            fill(side.kv_args, seed)
            sides.append(side)
            agents.append(DecodeAgent(side.kv_args, (side.pools.target, side.pools.draft), worker_id=f"decode-{seed}"))
        work = []
        for i, (side, agent) in enumerate(zip(sides, agents)):
            before = snapshot(side.kv_args)
            recv, moves = run_request(agent, pf, side.kv_args, 50 + i, np.random.default_rng(50 + i))
            work.append((side, recv, before, moves))
        for side, recv, before, moves in work:
            assert recv.wait(30) is RequestState.SUCCESS, recv.failure_exception()
            assert_images_equal(snapshot(side.kv_args), expected(before, source_image, side.kv_args, moves))
        assert sorted(d["worker_id"] for d in pf.ask(op="decodes")["decodes"]) == ["decode-1", "decode-2"]
    finally:
        for a in agents:
            a.close()
        for s in sides:
            s.close()
