"""Graceful shutdown: a prefill's SIGTERM is announced (``goodbye``). Every request in flight ends
at once (``BOUND_S``) with "prefill shutting down" on both sides, the decode is unready for that
prefill as soon, and accepted again when it is back; with ``drain_s`` the running
requests finish first. The first two drive ``PrefillWorker.stop()`` in a process of their own
(``TermPrefill``, with the test seams that hold copies); the last sends SIGTERM to a real
``pdstate serve`` prefill serving a real ``pdstate serve`` decode."""

from __future__ import annotations

import re
import threading
import time

import httpx

from tests.support.bounds import within
from tests.support.faults import holding_hooks
from tests.support.pools import ROOMY
from tests.support.term_prefill import Served, TermPrefill
from tests.support.waiting import wait_until
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
# Requests end, and the decode turns unready, this long after the SIGTERM at most (tests.support.bounds;
# BOUND_QUIET_S: the longest of those on a quiet machine): at once, short of the decode's 3 s peer timeout
BOUND_S, BOUND_QUIET_S = 2.5, 0.2
REASON = "prefill shutting down"


def test_sigterm_during_a_batch_ends_every_request_at_once_on_both_sides():
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
            within("SIGTERM: the batch ended on the decode", ended_s, BOUND_S, BOUND_QUIET_S)
            assert state != "accepted", state
            within("SIGTERM: the decode unready", unready_s, BOUND_S, BOUND_QUIET_S)
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


SERVE_REQUESTS = 24  # three times the dsv4-flash decode's 8 request slots: a batch long enough to catch
SERVE_TOKENS = 32768  # ~138 MB a request: the prefill takes a while over each, so some queue up


def test_sigterm_through_pdstate_serve_during_a_batch():
    """Real ``pdstate serve`` processes (the dsv4-flash preset, so requests take long enough to be
    caught in flight without test hooks): SIGTERM to the prefill while the decode's HTTP
    transfers are running. Every transfer still running ends at once (``BOUND_S``), failed with
    "prefill shutting down" (the decode's HTTP answers; the prefill ends those it held, its log
    says how many), and the decode's ``/readyz`` turns unready for that prefill as soon."""
    flash = ["preset=dsv4-flash", "http.port=0"]
    prefill = Served("prefill", [*flash, "control.bind=tcp://127.0.0.1:0"])
    decode = None
    try:
        decode = Served("decode", [*flash, f"control.peer={prefill.listening['control']}", "checks.verify=sample"])
        with httpx.Client(timeout=60.0) as http:
            wait_until("the decode ready", lambda: http.get(f"{decode.url}/readyz").status_code == 200, 60)
            answers: list[tuple[float, dict]] = []

            def transfer(room: int) -> None:
                r = http.post(f"{decode.url}/v1/transfers", json={"tokens": SERVE_TOKENS, "room": room})
                answers.append((time.monotonic(), {"code": r.status_code, **r.json()}))

            threads = [threading.Thread(target=transfer, args=(room,)) for room in range(1, SERVE_REQUESTS + 1)]
            for t in threads:
                t.start()
            rooms = range(1, SERVE_REQUESTS + 1)  # every transfer entered on the decode before the signal
            wait_until(
                "every transfer entered on the decode",
                lambda: all(http.get(f"{decode.url}/v1/transfers/{room}").status_code == 200 for room in rooms),
                60,
                pause_s=0.01,
            )
            wait_until("requests queued on the prefill", lambda: _in_flight(http, prefill.url) >= 2, 60, pause_s=0.01)
            t_term = prefill.term()
            unready = wait_until(
                "the decode unready",
                lambda: (lambda r: r if r.status_code == 503 else None)(http.get(f"{decode.url}/readyz")),
                10,
                pause_s=0.01,
            )
            unready_s = time.monotonic() - t_term
            for t in threads:
                t.join(30)
        assert prefill.proc.wait(20) == 0, prefill.err()[-2000:]
        ended = [(t - t_term, a) for t, a in answers]
        failed = [(s, a) for s, a in ended if a["status"] == "failed"]
        assert len(ended) == SERVE_REQUESTS and failed, ended
        assert {(a["code"], a["error"]["message"]) for _, a in failed} == {(200, REASON)}, failed
        assert all(a["status"] == "success" and a["verified"] for s, a in ended if a["status"] != "failed"), ended
        within("serve SIGTERM: the requests in flight ended", max(s for s, _ in failed), BOUND_S, BOUND_QUIET_S)
        assert unready.json()["ready"] is False, unready.json()
        within("serve SIGTERM: the decode's /readyz 503", unready_s, BOUND_S, BOUND_QUIET_S)
        assert REASON in unready.json()["reason"], unready.json()  # the goodbye's reason, not a silence
        told = re.search(r"stopping: told 1 decode\(s\), ended (\d+) request\(s\)", prefill.err())
        # the prefill ended those it held (the others were still the decode's alone: no slot yet)
        assert told and 1 <= int(told.group(1)) <= len(failed), prefill.err()[-2000:]
        print(
            f"pdstate serve SIGTERM: {len(failed)} in flight ended by {max(s for s, _ in failed):.3f} s, decode unready by {unready_s:.3f} s"
        )
    finally:
        if decode is not None:
            decode.close()
        prefill.close()


def _in_flight(http, url: str) -> float:
    for line in http.get(f"{url}/metrics").text.splitlines():
        if line.startswith("pdstate_transfers_in_flight "):
            return float(line.split()[1])
    return 0.0
