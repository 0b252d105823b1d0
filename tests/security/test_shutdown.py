"""Graceful shutdown: a prefill's SIGTERM is announced (``goodbye``). Every request in flight ends
within a second with "prefill shutting down" on both sides, the decode is unready for that
prefill within a second and accepted again when it is back; with ``drain_s`` the running
requests finish first."""

from __future__ import annotations

import time

from tests.support.faults import holding_hooks
from tests.support.pools import ROOMY
from tests.support.term_prefill import TermPrefill
from tests.support.workers import (
    Workers,
    assert_all_verified,
    collect_batch,
    decode_stats,
    first_event,
    options,
    run_batch,
    start_batch,
    wait_decode,
)

LENGTHS = [300, 1000, 40, 700]
BOUND_S = 1.0
REASON = "prefill shutting down"


def test_sigterm_during_a_batch_ends_every_request_within_a_second_on_both_sides():
    prefill = TermPrefill(options("prefill", ROOMY), holding_hooks())
    again = None
    try:
        with Workers() as ws:
            d = ws.decode(prefill.endpoint, ROOMY, worker_id="d")  # peer_timeout_s 3.0: well past the bound
            assert first_event(d)["event"] == "ready"
            start_batch(d, LENGTHS, concurrency=len(LENGTHS))
            prefill.wait_in_flight(len(LENGTHS))
            t_term = prefill.term()
            results, _, t_done = collect_batch(d, timeout_s=10)
            ended_s = t_done - t_term
            state = decode_stats(d)["peer_state"]
            unready_s = time.monotonic() - t_term
            stopped = prefill.read_event(10)
            assert len(results) == len(LENGTHS)
            assert {(r["status"], r["error"]["message"]) for r in results} == {("failed", REASON)}, results
            assert ended_s < BOUND_S, ended_s
            assert state != "accepted" and unready_s < BOUND_S, (state, unready_s)
            records = stopped["finished"]
            assert len(records) == len(LENGTHS)
            assert {(r["status"], r["error"]["message"]) for r in records} == {("failed", REASON)}, records
            assert prefill.proc.wait(10) == 0
            print(f"SIGTERM: requests ended in {ended_s:.3f} s, decode unready by {unready_s:.3f} s")
            # back on the same address: the decode registers again by itself
            again = TermPrefill(options("prefill", ROOMY, bind=prefill.endpoint))
            wait_decode(d, "the decode accepted again", lambda s: s["peer_state"] == "accepted", timeout_s=15)
            results, _ = run_batch(d, LENGTHS)
            assert_all_verified(results, LENGTHS)
    finally:
        prefill.close()
        if again is not None:
            again.close()


def test_sigterm_with_drain_lets_the_running_requests_finish():
    prefill = TermPrefill(options("prefill", ROOMY, drain_s=20.0), holding_hooks(0.3))
    try:
        with Workers() as ws:
            d = ws.decode(prefill.endpoint, ROOMY, worker_id="d")
            assert first_event(d)["event"] == "ready"
            start_batch(d, LENGTHS, concurrency=len(LENGTHS))
            prefill.wait_in_flight(len(LENGTHS))
            prefill.term()
            results, _, _ = collect_batch(d, timeout_s=20)
            assert_all_verified(results, LENGTHS)
            stopped = prefill.read_event(20)
            assert {r["status"] for r in stopped["finished"]} == {"success"}
            wait_decode(d, "the decode unready", lambda s: s["peer_state"] != "accepted", timeout_s=BOUND_S)
            assert prefill.proc.wait(10) == 0
    finally:
        prefill.close()
