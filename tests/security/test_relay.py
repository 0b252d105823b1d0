"""Relay-proof ownership: a decode's proof of ownership is bound to the address it dialled, and a
prefill takes only proofs given to exactly its own address or an advertised one (a loopback alias
of its port is not its address); a decode's HTTP clients may name only ``control.peer`` and
``control.prefills``, exact addresses.

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

Through a loopback alias (``127.0.0.2`` at a prefill's port, bound by a process of another uid,
skipped where the tests do not run as root): to a second prefill of the host, and to the only
prefill while it restarts, the attacker redialling every 1 ms; it would ask, as the victim, for a
room the prefill's application sends. Measured on the code before proofs named exact addresses
(a prefill took a proof given to any loopback host on its port): accepted, the room written,
~74,600 bytes of the victim's segments changed (tiny, two pages), every run; then refused by the
proof's address. Now a relay of another uid is not of the trust domain (``agent.curve``): the
victim's CURVE handshake with it fails and it receives no frame, 0 bytes change, the victim is
served. The proof's address still stops a relay of the victim's own uid (``same_process``).
"""

from __future__ import annotations

import os

import httpx
import pytest
import torch

import pdstate
from pdstate.agent import PrefillAgent
from pdstate.agent.admission import audience_error
from pdstate.protocol import wire
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
            lambda: (lambda s: s if s.state != "pending" else None)(victim.prefills()[relay.address]),
            15,
        )
        assert state.state == "rejected", state
        if kind == "same_process":  # a relay of the trust domain (this uid): the proof names its address
            assert state.error.model_dump() == {
                "type": "InvalidEndpoint",
                "message": f"shm proof of ownership was given to {relay.address!r}, not to this prefill ({address}): "
                "a register relayed through another address; if decodes reach this prefill by another name, "
                "list it in control.advertise",
            }
        else:  # another uid: not of the domain, its CURVE handshake fails and it gets no frame
            assert state.error.model_dump() == _curve_refusal(relay.address)
            assert relay.frames() == 0
        assert prefill.decodes() == []  # nothing registered, nothing mapped for the relay
        assert changed_bytes(before, segment_image(paths)) == 0
        relay.close()
        relay = None

        victim.connect(address)  # the victim, directly: accepted and served
        wait_until("the victim accepted again", lambda: victim.prefills()[address].state == "accepted", 15)
        agent_transfer(prefill, prefill_pools, victim, victim_pools, room=2)
    finally:
        if relay is not None:
            relay.close()
        victim.close()
        prefill.close()
        memory.close()


ROOM = 77  # a request of the prefill's own (its application made the sender); the attacker claims it


def _as_second_uid() -> None:
    if os.getuid() != 0:
        pytest.skip("not root: the attacker must run as a second uid (65534), which only root can start")


def _attack(victim) -> bytes:
    """The ``AgentRequest`` the attacker sends as the victim once its relayed proof is answered:
    pages 3 and 4 of the victim's pools and one slot of each state component (as
    ``agent_transfer`` names them)."""
    assert len(victim.register_message().kv.components) == 3
    page = pdstate.preset("tiny").page_size
    msg = wire.AgentRequest(
        room=ROOM,
        seq_len=2 * page,
        dst_kv_pages=wire.PackedIndices.pack([3, 4]),
        dst_state_indices=[wire.PackedIndices.pack(x) for x in ([1], [0], [1])],
        deadline_s=5,
        digest=False,
    )
    return wire.encode(msg)


def _serve_room(prefill, pools):
    """The prefill's application sending room ``ROOM`` (random bytes in its first pages) to
    whichever decode asks for it."""
    src = pools.target.c4_kv_buffers[0]
    src[1:3] = torch.randint(0, 256, src[1:3].shape, dtype=torch.uint8)
    send = prefill.sender(room=ROOM, num_pages=2)
    send.send([1])
    send.send([2], state_indices=[[2], [1], [2]])
    return send


def _answered(victim, address: str) -> dict:
    return wait_until(
        "the relayed register answered",
        lambda: (lambda s: s if s.state != "pending" else None)(victim.prefills()[address]),
        15,
    )


def _curve_refusal(address: str) -> dict:
    """The victim's refusal of a relay of another uid: it does not hold the domain's keys."""
    return {
        "type": "AuthError",
        "message": f"prefill {address} failed the CURVE handshake (no detail): it does not hold this worker's "
        "control key (another auth token, a token on one side only, or without a token another uid or "
        "auth.key_dir)",
    }


def test_a_relay_through_a_loopback_alias_to_a_second_prefill_writes_nothing():
    """A process of another uid binds 127.0.0.2 on the port of a second prefill of the host and
    makes the victim dial it: the victim's CURVE handshake with it fails, it receives no frame
    (was: a loopback host on its port was taken; the attacker registered as the victim and the
    prefill wrote its room into the victim's segment; then, proofs bound to the exact address, the
    relayed proof was refused)."""
    _as_second_uid()
    prefill, prefill_pools, victim, victim_pools, memory = agent_pair()
    second_pools = pdstate.build_worker_pools(pdstate.preset("tiny"))
    kv = pdstate.fill_kv_args(second_pools.target, second_pools.draft)
    second = PrefillAgent(kv, (second_pools.target, second_pools.draft))
    relay = None
    try:
        victim.connect(prefill.address)
        agent_transfer(prefill, prefill_pools, victim, victim_pools, room=1)
        alias = f"tcp://127.0.0.2:{second.address.rpartition(':')[2]}"
        paths = segment_paths(os.getpid())
        assert paths
        before = segment_image(paths)

        relay = RelayProcess(second.address, front_bind=alias, inject=_attack(victim))
        assert relay.uid == NOBODY and relay.address == alias
        _serve_room(second, second_pools)
        victim.connect(alias)  # what POST /v1/transfers {"prefill": alias} made it do
        state = _answered(victim, alias)
        assert state.state == "rejected", state
        assert state.error.model_dump() == _curve_refusal(alias)
        assert relay.frames() == 0  # nothing of the victim's reached it: nothing to relay or inject after
        assert relay.injected(0.0) is None
        assert second.decodes() == []
        assert changed_bytes(before, segment_image(paths)) == 0
        relay.close()
        relay = None

        assert victim.prefills()[prefill.address].state == "accepted"
        agent_transfer(prefill, prefill_pools, victim, victim_pools, room=2)  # still served
        victim.connect(second.address)  # and the second prefill, dialled directly, takes it
        wait_until(
            "the victim accepted by the second prefill",
            lambda: victim.prefills()[second.address].state == "accepted",
            15,
        )
        agent_transfer(second, second_pools, victim, victim_pools, room=3)
    finally:
        if relay is not None:
            relay.close()
        victim.close()
        second.close()
        prefill.close()
        memory.close()


def test_a_relay_redialling_through_a_loopback_alias_during_a_restart_writes_nothing():
    """The only prefill restarts; a process of another uid on 127.0.0.2 at its port, redialling
    it every 1 ms, gets no frame of the victim's: the CURVE handshake fails (was: first to reach the
    new prefill with the victim's register, accepted as the victim, its room written into the
    victim's segment, the victim held off with ``WorkerIdInUse``)."""
    _as_second_uid()
    prefill, prefill_pools, victim, victim_pools, memory = agent_pair()
    relay = None
    try:
        victim.connect(prefill.address)
        agent_transfer(prefill, prefill_pools, victim, victim_pools, room=1)
        address = prefill.address
        alias = f"tcp://127.0.0.2:{address.rpartition(':')[2]}"
        prefill.close()  # SIGTERM: goodbye; the victim waits to be asked again
        paths = segment_paths(os.getpid())
        assert paths
        before = segment_image(paths)

        relay = RelayProcess(address, front_bind=alias, reconnect_ivl_ms=1, inject=_attack(victim))
        assert relay.uid == NOBODY
        victim.connect(alias)  # the register waits in the relay for the prefill to be back
        prefill = PrefillAgent(prefill.kv_args, (prefill_pools.target, prefill_pools.draft), bind=address)
        _serve_room(prefill, prefill_pools)
        state = _answered(victim, alias)
        assert state.state == "rejected", state
        assert state.error.model_dump() == _curve_refusal(alias)
        assert relay.frames() == 0
        assert relay.injected(0.0) is None
        assert prefill.decodes() == []
        assert changed_bytes(before, segment_image(paths)) == 0
        relay.close()
        relay = None

        victim.connect(address)
        wait_until("the victim accepted again", lambda: victim.prefills()[address].state == "accepted", 15)
        agent_transfer(prefill, prefill_pools, victim, victim_pools, room=2)
    finally:
        if relay is not None:
            relay.close()
        victim.close()
        prefill.close()
        memory.close()


def test_a_proof_is_taken_for_the_exact_bound_or_advertised_address_only():
    """``audience_error``: the bound address and an advertised one, as written; no other name of
    the host (a loopback alias, ``localhost``), and a wildcard bind only at what it advertises,
    its refusal saying so."""
    bound, named = "tcp://127.0.0.1:5601", ("tcp://prefill:5601",)
    assert audience_error(bound, bound, ()) is None
    assert audience_error("tcp://prefill:5601", bound, named) is None
    for audience in ("tcp://127.0.0.2:5601", "tcp://localhost:5601", "tcp://127.0.0.1:5602", None, 5601):
        assert str(audience_error(audience, bound, named)) == (
            f"shm proof of ownership was given to {audience!r}, not to this prefill (tcp://127.0.0.1:5601, "
            "tcp://prefill:5601): a register relayed through another address; if decodes reach this prefill by "
            "another name, list it in control.advertise"
        )
    for wildcard in ("tcp://*:5601", "tcp://0.0.0.0:5601", "tcp://[::]:5601"):
        assert str(audience_error("tcp://127.0.0.1:5601", wildcard, ())) == (
            f"shm proof of ownership was given to 'tcp://127.0.0.1:5601', not to this prefill ({wildcard}): a "
            "register relayed through another address; this prefill binds a wildcard address: list every address "
            "its decodes dial in control.advertise"
        )
        assert audience_error("tcp://127.0.0.1:5601", wildcard, ("tcp://127.0.0.1:5601",)) is None
    long = "tcp://" + "x" * 1000 + ":1"
    assert str(audience_error(long, bound, ())).startswith(
        f"shm proof of ownership was given to {repr(long)[:256]}..., not to this prefill (tcp://127.0.0.1:5601): "
    )


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
            # another host, a loopback alias of the prefill's port, another port of this host:
            # none configured, none dialled (the alias and the port were taken as loopback)
            alias = f"tcp://127.0.0.2:{ctl.rpartition(':')[2]}"
            for named in ("tcp://10.9.8.7:5601", alias, "tcp://127.0.0.1:1"):
                r = http.post(f"{decode.url}/v1/transfers", json={"tokens": 10, "prefill": named})
                assert r.status_code == 403, r.text
                assert r.json()["detail"] == (
                    f"prefill {named!r} is not one this decode may dial for a transfer "
                    f"(control.peer and control.prefills, exact addresses: [{ctl!r}])"
                )
            assert {p["id"] for p in http.get(f"{decode.url}/v1/compat").json()["peers"]} == {ctl}
            r = http.post(f"{decode.url}/v1/transfers", json={"tokens": 10, "prefill": ctl})
            assert r.status_code == 200 and r.json()["status"] == "success", r.text
        finally:
            for s in reversed(started):
                s.stop()
