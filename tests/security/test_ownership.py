"""Ownership of shm segments is proven, not claimed: a registrant names segments and answers the
prefill's challenge with a keyed digest of each segment's secret, which only a process that can
read the segment file (its owner's uid) can compute.

The hostile decode is a process of its own (``python -m tests.support.hostile``). Run as another
uid (``nobody``, where the tests run as root) it is not of the prefill's trust domain and gets no
answer at all (its CURVE handshake fails, ``test_curve.py``); run as a process of the domain that
does not read the segment files, it stands for what the proof alone stops. It names the segments of a victim that exists but
has not registered yet (its frames are held by a ``GatedRelay``; for the agent, a ``DecodeAgent``
that has not met the prefill), so the claimed-by-another-peer rule cannot help: only the proof
does. It is refused with one exact line, nothing of the victim changes, the prefill keeps serving
and the victim then registers and transfers as usual. A register captured on the wire and
replayed to a restarted prefill is refused too.
"""

from __future__ import annotations

import os

import zmq

from pdstate.errors import ProtocolError
from pdstate.protocol import wire
from pdstate.protocol.report import ErrorInfo
from tests.support import hostile
from tests.support.hostile import (
    GatedRelay,
    RawDealer,
    RawDecode,
    agent_pair,
    agent_transfer,
    bound_router,
    changed_bytes,
    segment_image,
    segment_paths,
)
from tests.support.waiting import wait_until
from tests.support.workers import Workers, assert_all_verified, first_event, peer_record, run_batch

LENGTHS = [300, 1000, 40, 700]


def unproven(path: str) -> dict:
    return {
        "type": "InvalidEndpoint",
        "message": f"shm segment {path} does not belong to the registering decode: "
        "its proof of ownership does not match the segment's secret",
    }


def _claim(address: str, theirs: wire.Register) -> dict:
    """``theirs``'s segments claimed by a process of its own. Where the tests run as root, first as
    another uid: its CURVE handshake fails (``agent.curve``), so nothing is delivered or answered.
    Then as a process of the prefill's trust domain (this uid) that does not read the segments:
    the proof behind the session, answered ``challenge`` then ``Reject``; returned."""
    spec = {"address": address, "register": wire.encode(theirs).hex()}
    if os.getuid() == 0:
        other = hostile.run({**spec, "try_read": True}, as_other_uid=True)
        assert other == {"answers": [], "read_error": None, "handshake_failed": "HANDSHAKE_FAILED_NO_DETAIL"}
    return hostile.run(spec)


def test_another_uid_naming_a_not_yet_registered_decodes_segments_is_refused():
    with Workers() as ws:
        front = bound_router()  # the victim dials the prefill through it: a name the prefill advertises
        prefill, endpoint = ws.prefill(advertise=(front.getsockopt_string(zmq.LAST_ENDPOINT),))
        relay = GatedRelay(endpoint, front)
        try:
            victim = ws.decode(relay.address, worker_id="victim", peer_timeout_s=5.0)
            held = wait_until("the victim's register, held by the relay", lambda: relay.held[:1], 30)
            theirs = wire.decode(held[0])
            paths = segment_paths(victim.pid)
            assert sorted({r["path"] for r in theirs.engine.endpoint["regions"]}) == paths
            before = segment_image(paths)

            got = _claim(endpoint, theirs)
            assert got["answers"] == ["challenge", "reject"], got
            assert got["error"] == unproven(paths[0])
            assert got["request"]["type"] == "NotRegistered", got  # nothing was registered
            assert changed_bytes(before, segment_image(paths)) == 0
            assert peer_record(prefill, "attacker")["state"] == "rejected"
            assert prefill.returncode is None

            relay.open.set()  # the victim's next register goes through: challenge, proof, accept
            assert first_event(victim)["event"] == "ready"
            results, _ = run_batch(victim, LENGTHS)
            assert_all_verified(results, LENGTHS)
        finally:
            relay.close()


def test_a_captured_register_replayed_to_a_restarted_prefill_is_refused():
    owner = RawDecode(worker_id="owner")
    try:
        with Workers() as ws:
            first, endpoint = ws.prefill()
            dealer = RawDealer(endpoint)
            challenge = dealer.ask(owner.register())
            assert isinstance(challenge, wire.Challenge), challenge
            captured = wire.encode(
                owner.register({**owner.endpoint, **owner.proof(owner.endpoint, challenge.nonce, audience=endpoint)})
            )
            assert isinstance(dealer.ask(captured), wire.Accept)
            dealer.close()
            first.close()

            again, endpoint = ws.prefill(bind=endpoint)  # a new incarnation, same address: it never issued that nonce
            replayer = RawDealer(endpoint)
            answer = replayer.ask(captured)
            assert isinstance(answer, wire.Reject), answer
            assert answer.error.model_dump() == {
                "type": "InvalidEndpoint",
                "message": f"shm proof of ownership from owner/{owner.incarnation} answers a challenge this "
                "prefill did not issue to it (an earlier prefill's, or one already answered or expired); "
                "register again for a fresh challenge",
            }
            replayer.close()
            fresh = RawDealer(endpoint)
            assert isinstance(owner.handshake(fresh), wire.Accept)  # the owner itself: a fresh proof
            fresh.close()
            assert again.returncode is None
    finally:
        owner.close()


def test_the_agent_prefill_refuses_another_uid_naming_a_decode_agents_segments():
    prefill, prefill_pools, decode, decode_pools, memory = agent_pair()
    try:
        theirs = decode._handshake.register_message()  # what it will send: it has not met the prefill yet
        paths = sorted({r["path"] for r in theirs.engine.endpoint["regions"]})
        before = segment_image(paths)
        got = _claim(prefill.address, theirs)
        assert got["answers"] == ["challenge", "reject"], got
        assert got["error"] == unproven(paths[0])
        assert got["request"]["type"] == "NotRegistered", got
        assert changed_bytes(before, segment_image(paths)) == 0
        assert prefill.decodes() == []
        agent_transfer(prefill, prefill_pools, decode, decode_pools, room=1)
    finally:
        decode.close()
        prefill.close()
        memory.close()


OLDER = {
    "type": "EngineError",
    "message": "this prefill needs the decode to prove it owns its shm segments (protocol message 'challenge'), "
    "which this decode does not know: run the same pdstate version on both sides",
}


def _as_an_older_decode(address: str, owner: RawDecode) -> wire.Message:
    """What an older decode does: register, then answer the unknown ``challenge`` with ``error``."""
    dealer = RawDealer(address)
    try:
        assert isinstance(dealer.ask(owner.register()), wire.Challenge)
        unknown = ProtocolError(f"unknown message kind 'challenge'; known: {['accept', 'reject']}")
        return dealer.ask(wire.Error(error=ErrorInfo.of(unknown)))
    finally:
        dealer.close()


def test_a_decode_that_does_not_know_challenge_is_told_why():
    owner = RawDecode(worker_id="older")
    prefill, _, decode, _, memory = agent_pair()
    try:
        with Workers() as ws:
            _, endpoint = ws.prefill()
            for address in (endpoint, prefill.address):  # the worker prefill, the agent prefill
                answer = _as_an_older_decode(address, owner)
                assert isinstance(answer, wire.Reject) and answer.error.model_dump() == OLDER, answer
    finally:
        decode.close()
        prefill.close()
        memory.close()
        owner.close()
