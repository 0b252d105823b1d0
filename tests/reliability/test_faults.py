"""Faults with real worker processes: a peer killed or frozen mid-transfer, a prefill restarted, an
engine failing one request, a Mooncake session torn down.

In every case: each request that entered ends SUCCESS or FAILED with a specific reason on both
sides (the killed side's records die with it) within the heartbeat timeout; nothing reports
success unless its bytes verified; the survivor's pools return to their starting free counts
(a decode frees a request's pages only once nothing of it can land: the abort confirmed, or the
prefill gone); the survivor serves new, verified requests after the peer returns (a new
handshake; the old incarnation's requests failed). The workers are ``pdstate serve``'s, over the
agent (``devtools.processes``).

Requests are held in TRANSFERRING by the prefill's fault-injection delay
(``tests/support/faults.py``: ``hold_copies``); the tests wait for that state by polling the
prefill's records, never by sleeping.
"""

from __future__ import annotations

import signal
import time

import pytest

from pdstate.transfer.engines.loopback import ScriptedDelay, ScriptedFailure
from tests.support.bounds import within
from tests.support.engines import require_engine
from tests.support.faults import (
    DETECT_LATE_QUIET_S,
    DETECT_SLACK_S,
    FAULT,
    PEER_TIMEOUT_S,
    hold_copies,
    release_copies,
)
from tests.support.pools import ROOMY
from tests.support.summary import tally
from tests.support.waiting import wait_until
from tests.support.workers import (
    assert_all_verified,
    collect_batch,
    decode_stats,
    first_event,
    kill,
    leaked,
    peer_record,
    prefill_requests,
    run_batch,
    segments,
    served_pair,
    start_batch,
    transfer,
    wait_decode,
    wait_prefill_settled,
    wait_transferring,
)

LENGTHS = [300, 129, 1000, 256]
# A prefill restarted on its endpoint is heard by the decode (a new process started, its handshake)
# in RESTART_QUIET_S on a quiet machine; the heartbeat timeout is far beyond that (tests.support.bounds)
RESTART_PEER_TIMEOUT_S, RESTART_QUIET_S = 20.0, 1.0
# A batch submitted, seen TRANSFERRING and its prefill frozen (SIGSTOP), on a quiet machine: well
# inside the batch's deadline (FREEZE_DEADLINE_S: 10x that, since a loaded host's polls of the
# prefill's records can take a second), itself a second inside the peer timeout (FREEZE_TIMEOUT_S)
FREEZE_QUIET_S = 0.2
FREEZE_DEADLINE_S, FREEZE_TIMEOUT_S = 2.0, 3.0
# A frozen decode's batch ends at this deadline once thawed: long past its start and freeze (FREEZE_QUIET_S)
FROZEN_DEADLINE_S = 5.0
AFTER = [100, 257, 640, 1000]


def _specific(rec: dict, etype: str, prefix: str) -> None:
    """A failure with the expected type and reason (a result event or a prefill record)."""
    assert rec["status"] == "failed", rec
    assert not rec.get("verified", False), rec
    assert rec["error"]["type"] == etype and rec["error"]["message"].startswith(prefix), rec["error"]


def _prefill_free(p, free: dict) -> None:
    """Until the prefill's pools are back to ``free`` (it frees a request's pages once its sender
    ended, which may follow the decode's verdict by a moment)."""
    wait_until("the prefill's pages back", lambda: prefill_requests(p)["free"] == free, 10)


def _ready(d) -> dict:
    ev = first_event(d)
    assert ev["event"] == "ready", ev
    return ev


def _serves_again(p, d, free0: dict, p_free: dict) -> tuple[list, dict]:
    """The ``AFTER`` batch through the recovered pair: every request verified, neither side's
    pages leaked. Returns the batch's results and its final event."""
    after, done = run_batch(d, AFTER, concurrency=2)
    assert_all_verified(after, AFTER)
    assert done["free"] == free0
    _prefill_free(p, p_free)
    return after, done


def _detected(what: str, detect_s: float, timeout_s: float) -> None:
    """A peer declared gone ``detect_s`` after it fell silent: past ``timeout_s`` by little."""
    within(f"{what}, past the timeout", detect_s - timeout_s, DETECT_SLACK_S, DETECT_LATE_QUIET_S)


def _silence_fails_the_batch(
    d, ep: str, timeout_s: float, t_fault: float, free0: dict, dead: bool
) -> tuple[list, float]:
    """The batch in flight fails ``PeerGone`` (missed heartbeats) within ``timeout_s`` of the
    prefill's fault at ``t_fault`` (plus slack). A ``dead`` prefill's pages are free again (its
    process exited: the session it held closed); a silent one's are quarantined: it may still
    write them (they come back once it confirms, or a new process holds its address). Returns the
    results and how long the decode took to see it."""
    results, done, t_done = collect_batch(d)
    detect_s = t_done - t_fault
    for r in results:
        _specific(r, "PeerGone", f"prefill {ep} missed heartbeats for {timeout_s:g} s")
    if dead:
        assert done["free"] == free0
    else:
        assert done["free"] != free0
        assert decode_stats(d)["quarantined"] == len(results)
    _detected("the decode's detection of a silent prefill", detect_s, timeout_s)
    return results, detect_s


def _serves_again_and_tally(p, d, free0: dict, p_free: dict, case: str, failed: list, detect_s: float, note: str):
    """``_serves_again``, then the case's row: the failed batch and the one served after it."""
    after, done = _serves_again(p, d, free0, p_free)
    tally(case, failed + after, leaked(free0, done["free"]), detect_s, note)


def _frozen_mid_batch(workers, worker_id: str, deadline_s: float | None = None) -> tuple:
    """A prefill holding its copies and a decode ``worker_id`` with a batch in flight there (its
    requests' deadline ``deadline_s``, else the decode's): ``(p, ep, p_free, d, free0, inc,
    lengths)``, ``inc`` the prefill's incarnation as the decode knew it before the batch."""
    p, ep = workers.prefill(ROOMY, **hold_copies(), **FAULT)
    p_free = prefill_requests(p)["free"]
    d = workers.decode(ep, ROOMY, worker_id=worker_id, **FAULT)
    free0 = _ready(d)["free"]
    inc = decode_stats(d)["prefill_incarnation"]
    lengths = LENGTHS[:3]
    start_batch(d, lengths, concurrency=len(lengths), deadline_s=deadline_s)
    wait_transferring(p, worker_id, jobs=len(lengths))
    return p, ep, p_free, d, free0, inc, lengths


def test_decode_killed_mid_transfer(workers):
    p, ep = workers.prefill(ROOMY, **hold_copies(), **FAULT)
    p_free = prefill_requests(p)["free"]
    d = workers.decode(ep, ROOMY, worker_id="victim", **FAULT)
    _ready(d)
    old_incarnation = peer_record(p, "victim")["incarnation"]
    start_batch(d, LENGTHS, concurrency=len(LENGTHS))
    wait_transferring(p, "victim", jobs=len(LENGTHS))
    t_kill = kill(d)

    records, free = wait_prefill_settled(p, "victim", len(LENGTHS), timeout_s=PEER_TIMEOUT_S + 10)
    detect_s = time.monotonic() - t_kill
    for rec in records:
        _specific(rec, "PeerGone", f"decode {rec['peer']} missed heartbeats for {PEER_TIMEOUT_S:g} s")
    assert free == p_free, "the prefill leaked pages of the dead decode's requests"
    _detected("the prefill's detection of a killed decode", detect_s, PEER_TIMEOUT_S)
    assert d.wait(10) == -signal.SIGKILL

    release_copies(p)
    d2 = workers.decode(ep, ROOMY, worker_id="victim", **FAULT)
    ready = _ready(d2)
    assert segments(d.pid) == [], "a new decode must remove the crashed decode's stale segments"
    rec = peer_record(p, "victim", "accepted")
    assert rec["incarnation"] != old_incarnation
    results, _ = _serves_again(p, d2, ready["free"], p_free)
    tally(
        "decode SIGKILL mid-transfer (shm)",
        records + results,
        leaked(p_free, free),
        detect_s,
        "prefill: PeerGone; new incarnation served",
    )


def test_prefill_killed_mid_transfer_and_restarted_after_timeout(workers):
    # 1. Requests whose decode deadline passes while the prefill is frozen fail once the prefill
    #    is silent past the timeout, but keep their pages (the prefill might still write: its
    #    abort is not confirmed) until a new process holds its address (step 2).
    #    The timeout is longer here so the deadline surely falls between the freeze and the
    #    decode declaring the prefill gone, however slowly this machine polls.
    timeout_s = FREEZE_TIMEOUT_S
    timers = {**FAULT, "peer_timeout_s": timeout_s}
    p1, ep = workers.prefill(ROOMY, **hold_copies(), **timers)
    d = workers.decode(ep, ROOMY, worker_id="survivor", **timers)
    free0 = _ready(d)["free"]
    inc1 = decode_stats(d)["prefill_incarnation"]
    t_submit = time.monotonic()
    start_batch(d, [300, 200, 129], concurrency=3, deadline_s=FREEZE_DEADLINE_S)
    wait_transferring(p1, "survivor", jobs=3)
    t_stop = kill(p1, signal.SIGSTOP)  # it can no longer answer the decode's aborts
    # else too slow to freeze the prefill before the batch's deadline
    within("the prefill frozen after the batch's submission", t_stop - t_submit, FREEZE_DEADLINE_S, FREEZE_QUIET_S)
    quarantined, done_q, t_q = collect_batch(d)
    for r in quarantined:
        assert r["status"] == "failed" and r["error"]["type"] in ("TransferFailed", "PeerGone"), r
    detect_q = t_q - t_stop  # the prefill fell silent when it was frozen
    assert detect_q >= timeout_s * 0.8, "the pages came back before the prefill was gone"
    _detected("the decode's detection of a frozen prefill", detect_q, timeout_s)
    assert done_q["free"] != free0
    assert decode_stats(d)["quarantined"] == len(quarantined)
    kill(p1)
    tally(
        "decode deadline, prefill frozen",
        quarantined,
        0,
        detect_q,
        "pages held until a new prefill process holds its address",
    )

    # 2. A prefill killed with requests in flight: the decode fails them all at the timeout.
    p2, ep2 = workers.prefill(ROOMY, bind=ep, **hold_copies(), **timers)
    assert ep2 == ep
    s = wait_decode(d, "a handshake with the restarted prefill", lambda s: s["peer_state"] == "accepted")
    s = wait_decode(d, "the quarantined pages back", lambda s: s["free"] == free0 and s["quarantined"] == 0)
    inc2 = s["prefill_incarnation"]
    assert inc2 != inc1
    start_batch(d, LENGTHS, concurrency=len(LENGTHS))
    wait_transferring(p2, "survivor", jobs=len(LENGTHS))
    t_kill = kill(p2)
    results, detect_s = _silence_fails_the_batch(d, ep, timeout_s, t_kill, free0, dead=True)

    # 3. The same endpoint comes back: a new handshake, verified transfers, nothing leaked.
    p3, _ = workers.prefill(ROOMY, bind=ep, **timers)
    p_free = prefill_requests(p3)["free"]
    s = wait_decode(d, "a handshake with the third prefill", lambda s: s["peer_state"] == "accepted")
    assert s["prefill_incarnation"] not in (inc1, inc2)
    _serves_again_and_tally(
        p3,
        d,
        free0,
        p_free,
        "prefill SIGKILL mid-transfer",
        results,
        detect_s,
        f"decode: PeerGone ({timeout_s:.0f} s timeout); same endpoint re-handshaken",
    )


def test_prefill_restarted_while_decode_runs(workers):
    """A quick restart on the same endpoint, before the heartbeat timeout: the decode hears the new
    incarnation, fails what the old one had, and registers again at once."""
    slow = {**FAULT, "peer_timeout_s": RESTART_PEER_TIMEOUT_S}
    p1, ep = workers.prefill(ROOMY, **hold_copies(), **slow)
    d = workers.decode(ep, ROOMY, worker_id="runner", **slow)
    free0 = _ready(d)["free"]
    inc1 = decode_stats(d)["prefill_incarnation"]
    start_batch(d, LENGTHS, concurrency=len(LENGTHS))
    wait_transferring(p1, "runner", jobs=len(LENGTHS))
    t_kill = kill(p1)
    p2, _ = workers.prefill(ROOMY, bind=ep, **slow)
    p_free = prefill_requests(p2)["free"]
    results, done, t_done = collect_batch(d)
    detect_s = t_done - t_kill
    for r in results:
        _specific(r, "PeerGone", f"prefill {ep} restarted (incarnation ")
    assert done["free"] == free0
    # a new process's start (its imports) and handshake, well before the heartbeat timeout
    within("a restarted prefill heard by the decode", detect_s, RESTART_PEER_TIMEOUT_S, RESTART_QUIET_S)
    s = wait_decode(d, "a handshake with the new prefill", lambda s: s["peer_state"] == "accepted")
    assert s["prefill_incarnation"] != inc1
    after, done = _serves_again(p2, d, free0, p_free)
    assert peer_record(p2, "runner")["state"] == "accepted"
    tally(
        "prefill restarted (same endpoint)",
        results + after,
        leaked(free0, done["free"]),
        detect_s,
        "decode: 'prefill restarted'",
    )


def test_prefill_frozen_past_timeout_then_thawed(workers):
    p, ep, p_free, d, free0, inc, lengths = _frozen_mid_batch(workers, "patient")
    t_stop = kill(p, signal.SIGSTOP)
    try:
        results, detect_s = _silence_fails_the_batch(d, ep, PEER_TIMEOUT_S, t_stop, free0, dead=False)
    finally:
        kill(p, signal.SIGCONT)
    # thawed: the prefill ends the abandoned requests (the decode registered again), and the
    # decode is accepted again by the same incarnation
    records, free = wait_prefill_settled(p, "patient", len(lengths), timeout_s=10)
    for rec in records:
        assert rec["status"] == "failed" and rec["error"]["type"] in ("TransferFailed", "PeerGone"), rec
        msg = rec["error"]["message"]
        assert "registered again" in msg or "missed heartbeats" in msg or "is gone" in msg, rec
    assert {r["room"] for r in records} == {r["room"] for r in results}
    assert free == p_free
    s = wait_decode(d, "the decode accepted again", lambda s: s["peer_state"] == "accepted", timeout_s=30)
    assert s["prefill_incarnation"] == inc
    release_copies(p)
    _serves_again_and_tally(
        p,
        d,
        free0,
        p_free,
        "prefill SIGSTOP > timeout, SIGCONT",
        results,
        detect_s,
        "both sides failed the frozen requests",
    )


def test_decode_frozen_past_timeout_then_thawed(workers):
    # the thawed decode hears nothing more of its requests (the prefill forgot it): they end at
    # their deadline, short here (FROZEN_DEADLINE_S, not FAULT's 20 s)
    p, ep, p_free, d, free0, _, lengths = _frozen_mid_batch(workers, "sleeper", FROZEN_DEADLINE_S)
    t_stop = kill(d, signal.SIGSTOP)
    try:
        records, free = wait_prefill_settled(p, "sleeper", len(lengths), timeout_s=PEER_TIMEOUT_S + 10)
        detect_s = time.monotonic() - t_stop
        for rec in records:
            _specific(rec, "PeerGone", f"decode {rec['peer']} missed heartbeats for {PEER_TIMEOUT_S:g} s")
        assert free == p_free
        _detected("the prefill's detection of a frozen decode", detect_s, PEER_TIMEOUT_S)
        assert peer_record(p, "sleeper")["state"] == "gone"
    finally:
        kill(d, signal.SIGCONT)
    results, done, _ = collect_batch(d)
    for r in results:  # the prefill's reason, or the decode's own (it heard nothing while frozen)
        assert r["status"] == "failed" and r["error"]["type"] in ("PeerGone", "TransferFailed"), r["error"]
        assert "prefill gone" not in r["error"]["message"], r  # the decode was the silent side
    assert {r["room"] for r in results} == {r["room"] for r in records}
    wait_decode(d, "the thawed decode accepted again", lambda s: s["peer_state"] == "accepted")
    # pages whose abort the prefill (which forgot this decode) never confirmed come back once it
    # accepted the decode again
    wait_decode(d, "the decode's pages back", lambda s: s["free"] == free0 and s["quarantined"] == 0)
    peer_record(p, "sleeper", "accepted")
    release_copies(p)
    after, done = _serves_again(p, d, free0, p_free)
    tally(
        "decode SIGSTOP > timeout, SIGCONT",
        records + after,
        leaked(p_free, free),
        detect_s,
        "prefill: PeerGone; decode re-registers",
    )


def test_engine_failure_on_one_request_in_process():
    """The loopback engine (in-process only) fails the 2nd copy after writing part of it, and
    times out another: those requests fail with the engine's words on both sides; the others
    verify; engine errors are counted by class (``TransferTimedOut`` is an ``EngineError``)."""
    # a request at the default level (sampled) is one submit: the 2nd is the 2nd request's
    fail = ScriptedFailure(nth_submit=2, after_bytes=4096, message="scripted loopback failure: link down")
    # and the 4th (the 4th request's) lands only 2 s after it was submitted: past its deadline
    late_copy = ScriptedDelay(nth_submit=4, delay_s=2.0)
    options = {"failures": [fail], "delays": [late_copy]}
    with served_pair(ROOMY, "loopback", prefill={"engine_options": options}, **FAULT) as (p, d):
        free_d, free_p = d.free_counts(), p.free_counts()
        results = [transfer(d, n, deadline_s=10) for n in (300, 300, 1000)]
        assert [r.status for r in results] == ["success", "failed", "success"]
        assert results[0].verified and results[2].verified and not results[1].verified
        assert results[1].error.model_dump() == {"type": "EngineError", "message": fail.message}
        rec = wait_until(
            "the prefill's record of the failed copy",
            lambda: [f for f in p.finished_records() if f["room"] == results[1].room],
            5,
        )
        assert rec[0]["status"] == "failed" and rec[0]["error"] == results[1].error.model_dump()
        assert p.stats.snapshot().engine_errors == 1
        # an engine timeout: the copy takes longer than the request's deadline
        t0 = time.monotonic()
        late = transfer(d, 300, deadline_s=0.3)
        assert late.status == "failed" and not late.verified
        assert late.error.message.startswith("deadline exceeded") or late.error.type == "TransferTimedOut", late.error
        rec = wait_until(
            "the prefill's record of the timed-out copy",
            lambda: [f for f in p.finished_records() if f["room"] == late.room],
            10,
        )[0]
        assert rec["status"] == "failed", rec
        wait_until("the decode's pages back", lambda: d.free_counts() == free_d and not d.in_flight(), 10)
        detect_s = time.monotonic() - t0
        # the late copy's fence (up to the 2 s delay, past the 1 s peer timeout) is pending work on
        # the prefill's I/O thread, which answers heartbeats meanwhile: the decode never lost it
        assert d.status().peer.state.value == "accepted" and p.stats.snapshot().handshakes["accepted"] == 1
        ok = transfer(d, 640, deadline_s=10)
        assert ok.status == "success" and ok.verified, (ok.status, ok.error)
        wait_until("the prefill's pages back", lambda: p.free_counts() == free_p, 10)
        assert d.free_counts() == free_d
        outs = [r.as_dict() for r in results + [late, ok]]
    tally("engine failure injected (loopback)", outs, 0, detect_s, "EngineError, and a copy past its deadline")


@pytest.mark.mooncake
def test_mooncake_session_torn_down(workers):
    """The decode's Mooncake session dies (process killed) while the prefill is about to write
    into it: the write fails in the engine, the request fails with the engine's code on the
    prefill, counted as an engine error; a new decode session is served."""
    require_engine("mooncake")
    p, ep = workers.prefill(ROOMY, engine="mooncake", **hold_copies(0.8), **FAULT)
    p_free = prefill_requests(p)["free"]
    d = workers.decode(ep, ROOMY, engine="mooncake", worker_id="mc-victim", **FAULT)
    _ready(d)
    start_batch(d, [300, 300], concurrency=2)
    wait_transferring(p, "mc-victim", jobs=2)
    t_kill = kill(d)
    records, free = wait_prefill_settled(p, "mc-victim", 2, timeout_s=PEER_TIMEOUT_S + 15)
    detect_s = time.monotonic() - t_kill
    engine_failures = [r for r in records if r["error"]["type"] == "NativeEngineError"]
    assert engine_failures, records
    assert engine_failures[0]["error"]["message"].startswith(
        ("mooncake transfer_submit_write to ", "mooncake transfer_check_status to ")
    ), engine_failures[0]
    for r in records:
        assert r["status"] == "failed" and r["error"]["type"] in ("NativeEngineError", "PeerGone"), r
    assert free == p_free
    stats = p.command({"cmd": "stats"}, "stats")["stats"]
    assert stats["engine_errors"] == len(engine_failures)
    release_copies(p)
    d2 = workers.decode(ep, ROOMY, engine="mooncake", worker_id="mc-victim", **FAULT)
    after, _ = _serves_again(p, d2, _ready(d2)["free"], p_free)
    tally(
        "mooncake session torn down",
        records + after,
        leaked(p_free, free),
        detect_s,
        f"{len(engine_failures)} NativeEngineError",
    )
