"""``pdstate serve``'s workers on the agent, both in this process over shared memory: a request
computed on demand and checked, the busy prefill asked again, the deadline's fenced abort, a
prefill's drain, and the pages of both sides all free again after each."""

from __future__ import annotations

import threading

import pytest

from pdstate.worker import prefill as agent_prefill
from pdstate.worker.decode import AgentDecodeWorker
from pdstate.worker.prefill import AgentPrefillWorker
from tests.support.faults import holding_hooks, release_copies
from tests.support.pools import ROOMY
from tests.support.waiting import wait_until
from tests.support.workers import options


class Held:
    """Holds the prefill's synthetic compute of every request until ``release()``."""

    def __init__(self, monkeypatch) -> None:
        self.gate, self.entered = threading.Event(), threading.Semaphore(0)
        real = agent_prefill.synth.fill_source

        def held(desc, room, lists):
            self.entered.release()
            self.gate.wait(30)
            real(desc, room, lists)

        monkeypatch.setattr(agent_prefill.synth, "fill_source", held)

    def wait_entered(self, n: int = 1) -> None:
        for _ in range(n):
            assert self.entered.acquire(timeout=10), "no request reached the prefill's compute"

    def submit(self, decode, tokens: int, **kw):
        """``decode.submit(tokens)``, once its request reached the prefill's compute (held there)."""
        fut = decode.submit(tokens, **kw)
        self.wait_entered()
        return fut

    def release(self) -> None:
        self.gate.set()


@pytest.fixture
def pair(request):
    kw = getattr(request, "param", {})
    pool = kw.get("pool", ROOMY)
    p = AgentPrefillWorker(options("prefill", pool, **kw.get("prefill", {}))).start()
    d = None
    try:
        d = AgentDecodeWorker(options("decode", pool, peer=p.endpoint, **kw.get("decode", {}))).start()
        wait_until("the decode accepted", lambda: d.status().peer.state.value == "accepted", 10)
        free = (p.free_counts(), d.free_counts())
        yield p, d
        stopped = p._closed  # the drain test stops its prefill itself
        wait_until(
            "every page free again", lambda: (free[0] if stopped else p.free_counts(), d.free_counts()) == free, 10
        )
    finally:
        if d is not None:
            d.stop()
        p.stop()


def test_requests_are_computed_on_demand_sent_and_checked(pair):
    p, d = pair
    for tokens, verify in ((700, "full"), (0, "full"), (1000, "sample"), (129, "sample")):
        res = d.submit(tokens, verify=verify).result(30).as_dict()
        assert (res["status"], res["verified"], res["error"], res["seq_len"]) == ("success", True, None, tokens), res
        assert (res["bytes"] > 0) == (tokens > 0) and res["prefill"] == p.endpoint
        assert d.lookup(res["room"]).as_dict() == res
    assert d.stats.snapshot().transfers == {"success": 4, "failed": 0, "busy": 0}
    # the prefill's sender ends at the decode's verdict, just after the decode's result
    wait_until(
        "the prefill counted them", lambda: p.stats.snapshot().transfers == {"success": 4, "failed": 0, "busy": 0}, 10
    )
    assert p.stats.snapshot().handshakes == {"accepted": 1, "rejected": 0} == d.stats.snapshot().handshakes
    (decode,) = p.status().peers
    assert (decode.id, decode.state.value, decode.incarnation) == (d.worker_id, "accepted", d.incarnation)
    assert p.finished_records()[-1]["decode"] == d.worker_id


@pytest.mark.parametrize("pair", [{"prefill": {"max_inflight": 1}}], indirect=True)
def test_a_busy_prefill_is_asked_again_until_it_has_room(pair, monkeypatch):
    p, d = pair
    held = Held(monkeypatch)
    first = held.submit(d, 300)
    second = d.submit(500)
    wait_until("the prefill said busy", lambda: p.stats.snapshot().transfers["busy"] >= 1, 10)
    assert not second.done()
    held.release()
    for fut, tokens in ((first, 300), (second, 500)):
        res = fut.result(30)
        assert (res.status, res.verified, res.seq_len) == ("success", True, tokens), res
    assert d.stats.snapshot().transfers["busy"] >= 1 and d.stats.snapshot().transfers["failed"] == 0


@pytest.mark.parametrize("pair", [{"prefill": {"max_inflight": 1}}], indirect=True)
def test_requests_waiting_out_a_busy_prefill_hold_no_thread_each(pair, monkeypatch):
    p, d = pair
    held = Held(monkeypatch)
    before = {t.name for t in threading.enumerate()}
    futs = [d.submit(100)]
    held.wait_entered()
    futs += [d.submit(100 + i) for i in range(40)]  # asked again on timers, not on threads
    wait_until("the prefill said busy to many", lambda: p.stats.snapshot().transfers["busy"] >= 40, 10)
    assert d.in_flight() == 41
    new = {t.name for t in threading.enumerate()} - before
    assert not any(n.startswith("pdstate-decode") for n in new), new
    held.release()
    for i, fut in enumerate(futs):
        res = fut.result(30)
        assert (res.status, res.verified, res.seq_len) == ("success", True, 100 + max(0, i - 1)), res


MANY = 24  # requests in flight at once on the prefill: more than the 16 threads it once ran them on


@pytest.mark.parametrize("pair", [{"pool": ROOMY.with_(max_num_reqs=32, swa_tokens=16384)}], indirect=True)
def test_many_requests_in_flight_on_the_prefill_hold_no_thread_each(pair):
    p, d = pair
    before = {t.name for t in threading.enumerate()}
    p.set_hooks(holding_hooks())  # every request computed, then held before its copy
    futs = [d.submit(100 + i, verify="full") for i in range(MANY)]
    wait_until(
        "every request computed and held on the prefill",
        lambda: [r.state.value for r in p.status().requests] == ["transferring"] * MANY,
        20,
    )
    new = {t.name for t in threading.enumerate()} - before
    assert {n for n in new if n.startswith("pdstate-prefill")} <= {"pdstate-prefill-compute_0"}, new
    assert len(new) <= 1, new  # the one compute thread, at most
    assert p.status().peak_in_flight == MANY and d.in_flight() == MANY
    release_copies(p)
    results = [fut.result(30) for fut in futs]
    assert [(r.status, r.verified, r.error, r.seq_len) for r in results] == [
        ("success", True, None, 100 + i) for i in range(MANY)
    ]
    assert all(r.bytes > 0 for r in results)
    wait_until("the prefill counted them", lambda: p.stats.snapshot().transfers["success"] == MANY, 10)
    assert [r["status"] for r in p.finished_records()] == ["success"] * MANY


def test_a_request_past_its_deadline_fails_and_its_pages_are_free_after_the_fence(pair, monkeypatch):
    p, d = pair
    held = Held(monkeypatch)
    fut = held.submit(d, 300, deadline_s=0.5)
    res = fut.result(30)
    assert (res.status, res.error.type, res.error.message) == ("failed", "TransferFailed", "deadline exceeded")
    held.release()  # the prefill finds the decode gone: it frees its pages too (the fixture checks)
    wait_until("the prefill's request ended", lambda: p.status().in_flight == 0, 10)
    assert d.submit(300).result(30).status == "success"


def test_a_request_given_up_during_its_fill_keeps_its_pages_until_the_fill_is_back(pair, monkeypatch):
    """On the compute thread the sender is made before the fill: the decode's abort ends it while
    the fill still writes the pages, which go back only once the fill is back on the loop."""
    p, d = pair
    monkeypatch.setattr(agent_prefill, "INLINE_FILL_BYTES", 0)  # every fill on the compute thread
    free = p.free_counts()
    held = Held(monkeypatch)
    res = held.submit(d, 300, deadline_s=0.5).result(30)
    assert (res.status, res.error.type, res.error.message) == ("failed", "TransferFailed", "deadline exceeded")
    ended = lambda: p.agent.senders()[res.room].record.state.terminal  # noqa: E731
    wait_until("the prefill's sender ended (the decode's abort)", ended, 10)
    assert (p.status().in_flight, p.free_counts() != free) == (1, True)  # the pages are still the fill's
    held.release()
    wait_until("the prefill's request ended", lambda: p.status().in_flight == 0, 10)
    assert p.free_counts() == free
    rec = [r for r in p.finished_records() if r["room"] == res.room]
    assert (rec[0]["status"], rec[0]["error"]["type"]) == ("failed", "TransferAborted"), rec
    assert d.submit(300).result(30).status == "success"


@pytest.mark.parametrize("pair", [{"prefill": {"drain_s": 10.0}}], indirect=True)
def test_a_draining_prefill_finishes_what_it_holds_and_refuses_the_rest(pair, monkeypatch):
    p, d = pair
    held = Held(monkeypatch)
    running = held.submit(d, 300)
    stopper = threading.Thread(target=p.stop)
    stopper.start()
    wait_until("draining", p._draining.is_set, 5)
    late = d.submit(200).result(30)
    assert (late.status, late.error.type, late.error.message) == ("failed", "AgentClosed", "prefill shutting down")
    held.release()
    res = running.result(30)
    assert (res.status, res.verified) == ("success", True)
    stopper.join(15)
    assert not stopper.is_alive()
    wait_until("the decode saw the goodbye", lambda: d.status().peer.state.value == "gone", 5)
    assert d.status().peer.error.message == "prefill shutting down"
    gone = d.submit(100).result(30)  # fails at once with the reason the prefill went
    assert (gone.status, gone.error.type, gone.error.message) == ("failed", "PeerGone", "prefill shutting down")


def test_each_request_end_is_one_info_line_on_both_sides(pair, caplog):
    p, d = pair
    caplog.set_level("INFO", logger="pdstate.worker")
    res = d.submit(700, verify="full").result(30).as_dict()
    assert res["status"] == "success", res
    room = res["room"]
    wait_until(
        "the prefill logged the request's end",
        lambda: any(r.name == "pdstate.worker.prefill" and f"room={room}" in r.getMessage() for r in caplog.records),
        10,
    )
    ends = [r for r in caplog.records if "request end" in r.getMessage() and f"room={room}" in r.getMessage()]
    assert sorted(r.name for r in ends) == ["pdstate.worker.decode", "pdstate.worker.prefill"], ends
    (dec,) = [r.getMessage() for r in ends if r.name == "pdstate.worker.decode"]
    assert f"peer={p.endpoint}" in dec and f"bytes={res['bytes']}" in dec
    assert "outcome=ok" in dec and "verification=sampled+full" in dec
    assert all(r.levelname == "INFO" for r in ends)


def test_a_small_request_is_filled_on_the_request_loop_and_a_large_one_on_the_compute_thread(pair, monkeypatch):
    _, d = pair
    real, threads = agent_prefill.synth.fill_source, []

    def recorded(desc, room, lists):
        threads.append(threading.current_thread().name)
        real(desc, room, lists)

    monkeypatch.setattr(agent_prefill.synth, "fill_source", recorded)
    monkeypatch.setattr(agent_prefill, "INLINE_FILL_BYTES", 1_400_000)  # 1 token: 1.33 MB here, 1000: 1.48 MB
    for tokens in (1, 1000):
        res = d.submit(tokens, verify="full").result(30).as_dict()
        assert (res["status"], res["verified"]) == ("success", True), res
    assert threads[0] == "pdstate-prefill-requests" and threads[1].startswith("pdstate-prefill-compute"), threads
