"""The control channel is a CURVE session of the trust domain (``pdstate.agent.curve``): a process
that does not hold the domain's secret (the token, or without one this uid's ``control.key``)
neither receives a frame of a decode's, whatever address it stands at, nor gets an answer from a
prefill. The attacker is a process of another uid (``nobody``) where the tests run as root.

On the code before (no CURVE): the impostor at the address the decode dials received its
register (layout report, segment names, worker id), and another uid's raw client was answered
``challenge`` then ``Reject`` by a token-less prefill.
"""

from __future__ import annotations

import os

import pytest

import pdstate
from pdstate.agent import DecodeAgent, PrefillAgent, curve
from pdstate.pools.memory import SharedMemory
from pdstate.protocol import wire
from tests.support import hostile
from tests.support.hostile import (
    NOBODY,
    RelayProcess,
    agent_pair,
    agent_transfer,
    changed_bytes,
    segment_image,
    segment_paths,
)
from tests.support.waiting import wait_until

KEYS_DIFFER = (
    "it does not hold this worker's control key (another auth token, a token on one side only, or without a token "
    "another uid or auth.key_dir)"
)


def _as_second_uid() -> None:
    if os.getuid() != 0:
        pytest.skip("not root: the attacker must run as a second uid (65534), which only root can start")


def test_an_impostor_at_the_exact_address_a_decode_dials_gets_no_frame_of_it():
    """The only prefill stops; a process of another uid binds its exact address (the one the
    decode is configured to dial) and the decode registers there: the CURVE handshake fails, the
    impostor receives no frame, the decode names the failure; once the prefill is back the decode
    registers with it and is served, none of its bytes changed meanwhile."""
    _as_second_uid()
    prefill, prefill_pools, victim, victim_pools, memory = agent_pair()
    impostor = None
    try:
        victim.connect(prefill.address)
        agent_transfer(prefill, prefill_pools, victim, victim_pools, room=1)
        address = prefill.address
        prefill.close()
        paths = segment_paths(os.getpid())
        assert paths
        before = segment_image(paths)

        impostor = RelayProcess("tcp://127.0.0.1:1", front_bind=address)  # it relays to nothing: it listens
        assert impostor.uid == NOBODY and impostor.address == address
        victim.reregister(address)
        state = wait_until(
            "the decode's handshake with the impostor failed",
            lambda: (lambda s: s if s.state == "rejected" else None)(victim.prefills()[address]),
            15,
        )
        assert state.error.model_dump() == {
            "type": "AuthError",
            "message": f"prefill {address} failed the CURVE handshake (no detail): {KEYS_DIFFER}",
        }
        assert victim.auth_failures.count >= 1
        assert impostor.frames() == 0  # nothing of the decode's reached it
        assert changed_bytes(before, segment_image(paths)) == 0
        impostor.close()
        impostor = None

        prefill = PrefillAgent(prefill.kv_args, (prefill_pools.target, prefill_pools.draft), bind=address)
        victim.reregister(address)
        wait_until("the victim accepted again", lambda: victim.prefills()[address].state == "accepted", 15)
        agent_transfer(prefill, prefill_pools, victim, victim_pools, room=2)
    finally:
        if impostor is not None:
            impostor.close()
        victim.close()
        prefill.close()
        memory.close()


@pytest.mark.parametrize(
    ("knows_server_key", "event", "prefill_sees"),
    [
        (False, "HANDSHAKE_FAILED_NO_DETAIL", "zmtp_cryptographic"),
        (True, "HANDSHAKE_FAILED_AUTH", "its key refused, ZAP status 400"),
    ],
)
def test_another_uids_client_gets_no_answer_from_a_token_less_prefill(knows_server_key, event, prefill_sees):
    """Another uid's raw client names the victim's segments to a token-less prefill, with its own
    uid's keys, or with the prefill's server public key (public keys are not secrets) and its own
    client key: no frame is delivered (the prefill's ZAP handler refuses a client key not of its
    domain), nothing is answered; the prefill counts the failure and keeps serving the victim."""
    _as_second_uid()
    prefill, prefill_pools, victim, victim_pools, memory = agent_pair()
    try:
        victim.connect(prefill.address)
        agent_transfer(prefill, prefill_pools, victim, victim_pools, room=1)
        paths = segment_paths(os.getpid())
        before = segment_image(paths)
        spec = {"address": prefill.address, "register": wire.encode(victim.register_message()).hex()}
        if knows_server_key:
            spec["server_public"] = curve.control_keys(None).server_public.decode()
        got = hostile.run(spec, as_other_uid=True)
        assert got == {"answers": [], "read_error": None, "handshake_failed": event}
        assert prefill.auth_failures.count >= 1
        assert prefill.auth_failures.latest.model_dump() == {
            "type": "AuthError",
            "message": f"a decode's connection failed the CURVE handshake ({prefill_sees}): {KEYS_DIFFER}",
        }
        assert [d.worker_id for d in prefill.decodes()] == ["victim"]
        assert changed_bytes(before, segment_image(paths)) == 0
        assert victim.prefills()[prefill.address].state == "accepted"
        agent_transfer(prefill, prefill_pools, victim, victim_pools, room=2)
    finally:
        victim.close()
        prefill.close()
        memory.close()


def test_a_decode_refused_at_the_handshake_is_taken_once_the_prefill_holds_its_key():
    """A decode whose token differs from the prefill's is refused at the CURVE handshake, on both
    sides, without a frame; its register stays queued while ZeroMQ dials again, so once a prefill
    with its token listens at that address it is accepted without being asked to register again."""
    pools = pdstate.build_worker_pools(pdstate.preset("tiny"))
    kv = pdstate.fill_kv_args(pools.target, pools.draft)
    memory = SharedMemory()
    decode_pools = pdstate.build_worker_pools(pdstate.preset("tiny"), memory=memory)
    decode_kv = pdstate.fill_kv_args(decode_pools.target, decode_pools.draft)
    prefill = PrefillAgent(kv, (pools.target, pools.draft), token=b"b" * 32)
    decode = DecodeAgent(decode_kv, (decode_pools.target, decode_pools.draft), token=b"a" * 32)
    try:
        address = prefill.address
        decode.connect(address)
        state = wait_until(
            "the decode refused at the handshake",
            lambda: (lambda s: s if s.state == "rejected" else None)(decode.prefills()[address]),
            15,
        )
        assert state.error.model_dump() == {
            "type": "AuthError",
            "message": f"prefill {address} failed the CURVE handshake (no detail): {KEYS_DIFFER}",
        }
        wait_until("the prefill's count", lambda: prefill.auth_failures.count >= 1, 15)
        assert prefill.auth_failures.latest.message == (
            f"a decode's connection failed the CURVE handshake (zmtp_cryptographic): {KEYS_DIFFER}"
        )
        assert prefill.decodes() == []
        prefill.close()
        prefill = PrefillAgent(kv, (pools.target, pools.draft), token=b"a" * 32, bind=address)
        wait_until("accepted by itself", lambda: decode.prefills()[address].state == "accepted", 15)
        agent_transfer(prefill, pools, decode, decode_pools, room=1)
    finally:
        decode.close()
        prefill.close()
        memory.close()
