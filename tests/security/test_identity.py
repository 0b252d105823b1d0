"""Identity: a register that reuses a live decode's ``worker_id`` (or its ZeroMQ identity) never
disturbs that decode. The hijackers are real decode processes and a raw DEALER; the victim's
transfers keep verifying throughout, and a killed decode's restart is accepted at once."""

from __future__ import annotations

import time

from pdstate.protocol import wire
from tests.support.hostile import RawDealer, RawDecode
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
        assert ev["message"].startswith("worker_id 'victim' is held by a live decode (incarnation ")
        assert ev["message"].endswith("a new incarnation is accepted once that one is gone")
        results, _, _ = collect_batch(victim)
        assert_all_verified(results, LENGTHS * 5)
        assert peer_record(prefill, "victim", "accepted")["state"] == "accepted"


def test_a_rejected_newcomer_and_a_copied_zmq_identity_never_disturb_the_accepted_decode():
    """Sustained: a raw client copying the victim's ZeroMQ identity and worker_id, registering
    with a bad and a good layout, over and over, while the victim runs batches."""
    with Workers() as ws:
        prefill, endpoint = ws.prefill()
        victim = ws.decode(endpoint, worker_id="victim")
        assert first_event(victim)["event"] == "ready"
        theirs = _register_of(victim)
        attacker = RawDecode(worker_id="victim")
        bad = attacker.register(report=theirs.report.model_copy(update={"page_size": 64}))
        copied = RawDealer(endpoint, f"victim/{theirs.incarnation}".encode())  # the victim's identity
        own = RawDealer(endpoint)
        try:
            start_batch(victim, LENGTHS * 10, concurrency=2)
            answers = []
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                copied.send(theirs)  # the victim's own register, replayed from its identity: dropped by ZeroMQ
                answers.append(own.ask(bad))
                answers.append(own.ask(attacker.register()))
            results, _, _ = collect_batch(victim)
            assert_all_verified(results, LENGTHS * 10)
            assert {a.KIND for a in answers} == {"reject"}
            assert {a.error.type for a in answers} == {"WorkerIdInUse"}
            assert copied.sock.poll(200) == 0, "the copied identity got an answer"
            results, _ = run_batch(victim, LENGTHS)
            assert_all_verified(results, LENGTHS)
        finally:
            copied.close()
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
        assert time.monotonic() - t0 < 10.0  # well before the 30 s peer timeout
        results, _ = run_batch(again, LENGTHS)
        assert_all_verified(results, LENGTHS)
