"""Identity: a register that reuses a live decode's ``worker_id`` (or its ZeroMQ identity) never
disturbs that decode, on the runtime prefill and on the agent prefill. The hijackers are real
decode processes, a raw DEALER and a second process; the victim's transfers keep verifying
throughout, and a killed decode's restart is accepted at once."""

from __future__ import annotations

import time

import zmq

from pdstate.protocol import wire
from pdstate.protocol.report import ErrorInfo
from tests.support import hostile
from tests.support.bounds import within
from tests.support.hostile import RawDealer, RawDecode, agent_pair, agent_transfer
from tests.support.workers import (
    Workers,
    assert_all_verified,
    collect_batch,
    first_event,
    kill,
    peer_record,
    run_batch,
    start_batch,
)

LENGTHS = [300, 1000, 40, 700]


def _register_of(decode) -> wire.Register:
    return wire.decode(bytes.fromhex(decode.command({"cmd": "describe"}, "describe")["register"]))


def test_a_second_decode_with_a_live_decodes_worker_id_is_refused_and_the_victim_keeps_working():
    with Workers() as ws:
        prefill, endpoint = ws.prefill()
        victim = ws.decode(endpoint, worker_id="victim")
        assert first_event(victim)["event"] == "ready"
        start_batch(victim, LENGTHS * 5, concurrency=2)
        hijacker = ws.decode(endpoint, worker_id="victim")
        ev = first_event(hijacker)
        assert ev["event"] == "refused", ev
        assert ev["type"] == "WorkerIdInUse"
        assert ev["message"].startswith(
            "worker_id 'victim' is held by another live decode (this register's incarnation is "
        )
        assert ev["message"].endswith("a new incarnation is accepted once that one is gone")
        results, _, _ = collect_batch(victim)
        assert_all_verified(results, LENGTHS * 5)
        assert peer_record(prefill, "victim", "accepted")["state"] == "accepted"


def test_a_rejected_newcomer_and_a_copied_zmq_identity_never_disturb_the_accepted_decode():
    """Sustained: a raw client replaying the victim's register and registering under its
    worker_id with a bad and a good layout, over and over, while the victim runs batches. (A
    copy of the victim agent's ZeroMQ identity itself: the agent test below, which can read it.)"""
    with Workers() as ws:
        prefill, endpoint = ws.prefill()
        victim = ws.decode(endpoint, worker_id="victim")
        assert first_event(victim)["event"] == "ready"
        theirs = _register_of(victim)
        attacker = RawDecode(worker_id="victim")
        bad = attacker.register(report=theirs.report.model_copy(update={"page_size": 64}))
        own = RawDealer(endpoint)
        try:
            start_batch(victim, LENGTHS * 10, concurrency=2)
            answers = []
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                answers.append(own.ask(theirs))  # the victim's own register, replayed
                answers.append(own.ask(bad))
                answers.append(own.ask(attacker.register()))
            results, _, _ = collect_batch(victim)
            assert_all_verified(results, LENGTHS * 10)
            assert {a.KIND for a in answers} == {"reject"}
            assert {a.error.type for a in answers} == {"WorkerIdInUse"}
            results, _ = run_batch(victim, LENGTHS)
            assert_all_verified(results, LENGTHS)
        finally:
            own.close()
            attacker.close()


def test_a_killed_decodes_restart_is_accepted_at_once():
    with Workers() as ws:
        prefill, endpoint = ws.prefill(peer_timeout_s=30.0)
        first = ws.decode(endpoint, worker_id="restarts", peer_timeout_s=30.0)
        assert first_event(first)["event"] == "ready"
        kill(first)
        first.close()
        t0 = time.monotonic()
        again = ws.decode(endpoint, worker_id="restarts", peer_timeout_s=30.0)
        assert first_event(again)["event"] == "ready"
        # a new process's start and handshake (1 s on a quiet machine), well before the 30 s peer timeout
        within("a killed decode's restart accepted", time.monotonic() - t0, 25.0, 1.0)
        results, _ = run_batch(again, LENGTHS)
        assert_all_verified(results, LENGTHS)


def test_a_second_process_reusing_a_decode_agents_identity_never_disturbs_it():
    """The agent prefill: a process copying an accepted decode agent's ZeroMQ identity gets no
    answer (no ROUTER_HANDOVER: it cannot take over the pipe), and its register under the decode's
    worker_id from a connection of its own is refused with ``WorkerIdInUse``; the decode keeps
    transferring."""
    prefill, prefill_pools, decode, decode_pools, memory = agent_pair()
    try:
        agent_transfer(prefill, prefill_pools, decode, decode_pools, room=1)
        identity = decode._prefills[prefill.address].sock.getsockopt(zmq.IDENTITY)
        theirs = decode._handshake.register_message()
        got = hostile.run(
            {"address": prefill.address, "register": wire.encode(theirs).hex(), "identity": identity.hex()}
        )
        assert got == {
            "copied_identity_answered": False,
            "answer": "reject",
            "error": {
                "type": "WorkerIdInUse",
                "message": "worker_id 'victim' is held by another live decode (this register's incarnation is "
                f"{theirs.incarnation}); a new incarnation is accepted once that one is gone",
            },
        }
        assert [(d.worker_id, d.incarnation) for d in prefill.decodes()] == [("victim", decode.incarnation)]
        agent_transfer(prefill, prefill_pools, decode, decode_pools, room=2)
    finally:
        decode.close()
        prefill.close()
        memory.close()


def test_a_worker_id_in_use_refusal_names_no_incarnation_but_the_askers():
    """A register under an accepted decode agent's worker_id (no token: anyone on the host may send
    it) learns nothing it did not send: the ``WorkerIdInUse`` refusal names the register's own
    incarnation, never the holder's (which ``/v1/compat`` shows only with the token); no byte of
    the answer holds the holder's incarnation."""
    prefill, prefill_pools, decode, decode_pools, memory = agent_pair()
    intruder = RawDecode(worker_id="victim")
    dealer = RawDealer(prefill.address)
    try:
        agent_transfer(prefill, prefill_pools, decode, decode_pools, room=1)
        dealer.send(intruder.register())
        assert dealer.sock.poll(10_000), "no answer within 10 s"
        frame = dealer.sock.recv()
        assert wire.decode(frame) == wire.Reject(
            worker_id=prefill.worker_id,
            error=ErrorInfo(
                type="WorkerIdInUse",
                message="worker_id 'victim' is held by another live decode (this register's incarnation is "
                f"{intruder.incarnation}); a new incarnation is accepted once that one is gone",
            ),
        )
        assert decode.incarnation.encode() not in frame
        agent_transfer(prefill, prefill_pools, decode, decode_pools, room=2)
    finally:
        dealer.close()
        intruder.close()
        decode.close()
        prefill.close()
        memory.close()
