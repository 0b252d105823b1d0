"""Relay-proof ownership: a decode's proof of ownership is bound to the address it dialled, and a
prefill takes only proofs given to one of its own addresses; a decode's HTTP clients may name
only allowed prefills.

The attack it stops (it used to write 1,477,632 bytes into the victim's segment): a fake prefill
makes the victim decode dial it, relays the real prefill's challenge to the victim and the
victim's answer back, and so registers as the victim after a prefill restart; the real prefill
then maps the victim's segments for the relay. Now the victim's proof names the relay's address,
the prefill refuses it, 0 bytes of the victim change, and the victim registers directly and is
served once the relay is gone.

Two uids: the relay runs as a process of its own as ``nobody`` where the tests run as root
(``other_uid``; the victim decode and the prefill are root's). The single-uid variant
(``same_process``: the relay in this process, on real sockets on 127.0.0.1) runs everywhere: the
relay never reads a segment (that is the point of the attack), so its uid changes nothing of what
it can do.
"""

from __future__ import annotations

import os

import httpx
import pytest

from pdstate.agent import PrefillAgent
from tests.support.hostile import (
    NOBODY,
    GatedRelay,
    RelayProcess,
    agent_pair,
    agent_transfer,
    changed_bytes,
    segment_image,
    segment_paths,
)
from tests.support.services import Service, ready, wait_for
from tests.support.waiting import wait_until


def _open_relay(kind: str, upstream: str):
    if kind == "same_process":
        relay = GatedRelay(upstream)
        relay.open.set()
        return relay
    if os.getuid() != 0:
        pytest.skip("not root: no second uid to run the relay as (the same_process variant covers it)")
    relay = RelayProcess(upstream, as_other_uid=True)
    assert relay.uid == NOBODY
    return relay


@pytest.mark.parametrize("kind", ["same_process", "other_uid"])
def test_a_relay_through_a_fake_prefill_after_a_restart_writes_nothing(kind):
    prefill, prefill_pools, victim, victim_pools, memory = agent_pair()
    relay = None
    try:
        victim.connect(prefill.address)
        agent_transfer(prefill, prefill_pools, victim, victim_pools, room=1)
        address = prefill.address
        prefill.close()  # the restart: the victim is told goodbye and waits to be asked again
        prefill = PrefillAgent(prefill.kv_args, (prefill_pools.target, prefill_pools.draft), bind=address)
        paths = segment_paths(os.getpid())  # the victim's segments (the prefill's pools are private)
        assert paths
        before = segment_image(paths)

        relay = _open_relay(kind, address)
        victim.connect(relay.address)  # what POST /v1/transfers {"prefill": relay} made it do
        state = wait_until(
            "the relayed register answered",
            lambda: (lambda s: s if s["state"] != "pending" else None)(victim.prefills()[relay.address]),
            15,
        )
        assert state["state"] == "rejected", state
        assert state["error_info"] == {
            "type": "InvalidEndpoint",
            "message": f"shm proof of ownership was given to {relay.address!r}, not to this prefill ({address}): "
            "a register relayed through another address; if decodes reach this prefill by another name, "
            "list it in control.advertise",
        }
        assert prefill.decodes() == []  # nothing registered, nothing mapped for the relay
        assert changed_bytes(before, segment_image(paths)) == 0
        relay.close()
        relay = None

        victim.connect(address)  # the victim, directly: accepted and served
        wait_until("the victim accepted again", lambda: victim.prefills()[address]["state"] == "accepted", 15)
        agent_transfer(prefill, prefill_pools, victim, victim_pools, room=2)
    finally:
        if relay is not None:
            relay.close()
        victim.close()
        prefill.close()
        memory.close()


def test_a_transfer_may_name_only_allowed_prefills():
    started: list[Service] = []
    with httpx.Client(timeout=30.0) as http:
        try:
            prefill = Service("prefill", ["http.port=0", "control.bind=tcp://127.0.0.1:0"])
            started.append(prefill)
            ctl = prefill.wait_listening()["control"]
            decode = Service("decode", ["http.port=0", f"control.peer={ctl}"])
            started.append(decode)
            wait_for(lambda: ready(http, decode.url), 60, "decode ready")
            r = http.post(f"{decode.url}/v1/transfers", json={"tokens": 10, "prefill": "tcp://10.9.8.7:5601"})
            assert r.status_code == 403
            assert r.json()["detail"] == (
                f"prefill 'tcp://10.9.8.7:5601' is not one this decode may dial for a transfer "
                f"(control.prefills: [{ctl!r}] and loopback)"
            )
            assert "tcp://10.9.8.7:5601" not in {p["id"] for p in http.get(f"{decode.url}/v1/compat").json()["peers"]}
            r = http.post(f"{decode.url}/v1/transfers", json={"tokens": 10, "prefill": ctl})
            assert r.status_code == 200 and r.json()["status"] == "success", r.text
        finally:
            for s in reversed(started):
                s.stop()
