"""No lockout: registers from other connections naming a decode (its worker id and incarnation are
no secret) cannot evict the nonce the prefill issued it, and a decode refused for a passing
reason registers again by itself, with backoff, until it is accepted.

Both used to lock a decode out: a claimant held at most 8 nonces, so a flood naming it evicted
its pending one, and a refused decode never registered again (503 after the flood stopped).
Real sockets on 127.0.0.1: a prefill worker and raw ZeroMQ clients, then ``pdstate serve``
processes; every wait polls with a deadline.
"""

from __future__ import annotations

import httpx

import pdstate
from pdstate.agent import DecodeAgent
from pdstate.pools.memory import SharedMemory
from pdstate.protocol import wire
from tests.support.hostile import RawDealer, RawDecode, agent_pair, agent_transfer
from tests.support.services import Services, ready, wait_for
from tests.support.waiting import wait_until
from tests.support.workers import Workers

# a live peer answers a heartbeat (every 0.2 s) well inside the timeout on a busy host
TIMERS = ["control.heartbeat_interval_s=0.2", "control.peer_timeout_s=3.0"]


def test_a_flood_naming_the_decode_does_not_evict_its_challenge():
    with Workers() as ws:
        _, endpoint = ws.prefill()
        victim = RawDecode(worker_id="victim")
        dealer, flood = RawDealer(endpoint), [RawDealer(endpoint) for _ in range(4)]
        try:
            challenge = dealer.ask(victim.register())
            assert isinstance(challenge, wire.Challenge)
            for attacker in flood:  # the victim's own register, from other connections, 40 times
                for _ in range(10):
                    assert isinstance(attacker.ask(victim.register()), wire.Challenge)
            proof = victim.proof(victim.endpoint, challenge.nonce, audience=endpoint)
            answer = dealer.ask(victim.register({**victim.endpoint, **proof}))
            assert isinstance(answer, wire.Accept), answer
        finally:
            for d in (dealer, *flood):
                d.close()
            victim.close()


def test_a_refused_decode_registers_again_by_itself_once_the_reason_passes():
    with httpx.Client(timeout=30.0) as http, Services() as services:
        _, ctl = services.prefill(*TIMERS)
        overrides = ["http.port=0", f"control.peer={ctl}", "worker_id=twin", *TIMERS]
        holder = services.start("decode", overrides)
        wait_for(lambda: ready(http, holder.url), 60, "the first decode ready")
        second = services.start("decode", overrides)

        def refused():
            r = http.get(f"{second.url}/readyz")
            return r.json() if r.status_code == 503 and r.json().get("check") == "handshake" else None

        body = wait_for(refused, 60, "the second decode refused")
        assert body["error"]["type"] == "WorkerIdInUse"
        holder.stop()
        # nothing calls it again: the decode registers by itself (1 s, then 2 s, ...)
        wait_for(lambda: ready(http, second.url), 30, "the second decode accepted after the first left")
        r = http.post(f"{second.url}/v1/transfers", json={"tokens": 300})
        assert r.status_code == 200 and r.json()["status"] == "success", r.text


def test_a_refused_decode_agent_registers_again_with_backoff():
    # the agent alone (no serve watcher asks it again): WorkerIdInUse while the twin lives
    prefill, prefill_pools, twin, twin_pools, memory = agent_pair()
    memory2 = SharedMemory()
    pools2 = pdstate.build_worker_pools(pdstate.preset("tiny"), memory=memory2)
    second = DecodeAgent(
        pdstate.fill_kv_args(pools2.target, pools2.draft), (pools2.target, pools2.draft), worker_id="victim"
    )
    try:
        twin.connect(prefill.address)
        wait_until("the first decode accepted", lambda: twin.prefills()[prefill.address].state == "accepted", 10)
        second.connect(prefill.address)
        wait_until("the second refused", lambda: second.prefills()[prefill.address].state == "rejected", 10)
        assert second.prefills()[prefill.address].error.type == "WorkerIdInUse"
        twin.close()
        wait_until("the second accepted by itself", lambda: second.prefills()[prefill.address].state == "accepted", 15)
        assert second.prefills()[prefill.address].handshakes >= 2
        agent_transfer(prefill, prefill_pools, second, pools2, room=5)
    finally:
        for closing in (second, twin, prefill):
            closing.close()
        for pools in (pools2, twin_pools, prefill_pools):
            pools.close()
        for m in (memory2, memory):
            m.close()
