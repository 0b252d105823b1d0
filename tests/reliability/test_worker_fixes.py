"""Regression tests of worker bugs the reliability work found (one test per bug), on
``pdstate serve``'s workers (``pdstate.worker``, over the agent).

1. a worker whose ``start()`` failed after building its pools leaked them (shm segments), its
   engine and its sockets;
2. completing a future its caller had cancelled raised ``InvalidStateError`` in a worker thread,
   killing it;
3. ``Stats.latencies_s`` grew without bound (now a window; ``/metrics`` still counts every value);
4. a ``register`` in another protocol version got a generic error instead of one naming both
   versions (``VersionMismatch``);
5. a request answered ``PrefillBusy`` whose deadline then passed kept its pages on the decode
   (the prefill, which never had it, had nothing to fence), and busy re-asks spun;
6. a request its decode gave up while the prefill computed it was reported as a success.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future

import msgpack
import pytest
import zmq

from pdstate.agent import curve
from pdstate.errors import ExitCode, LocalCheckFailed, RoomInFlight
from pdstate.protocol import wire
from pdstate.status.api import Collector
from pdstate.worker.base import settle
from pdstate.worker.decode import AgentDecodeWorker
from pdstate.worker.prefill import AgentPrefillWorker
from pdstate.worker.stats import LATENCY_WINDOW, Stats
from tests.support.bounds import within
from tests.support.faults import FAULT, holding_hooks, release_copies
from tests.support.pools import ROOMY, TINY, report_of
from tests.support.upstream import MAPPING_ERROR
from tests.support.waiting import wait_until
from tests.support.workers import Workers, options, segments, served_pair, transfer


def test_failed_start_releases_segments_engine_and_sockets():
    before = segments(os.getpid())
    d = AgentDecodeWorker(options("decode", TINY.with_(draft_mapping="own"), "shm", peer="tcp://127.0.0.1:9"))
    with pytest.raises(LocalCheckFailed, match=MAPPING_ERROR):
        d.start()
    assert segments(os.getpid()) == before, "a decode refused by its own check left shm segments"
    assert d.pools.memory.segments == []

    # a forked worker process exits on the failed check with nothing left in /dev/shm
    with Workers() as ws:
        w = ws.spawn("decode", TINY.with_(draft_mapping="own"), peer="tcp://127.0.0.1:9")
        assert w.wait(30) == ExitCode.LOCAL_CHECK
        assert segments(w.pid) == []


def test_a_prefill_whose_bind_fails_releases_its_pools():
    with AgentPrefillWorker(options("prefill", TINY, "loopback")) as good:
        clash = AgentPrefillWorker(options("prefill", TINY, "loopback", bind=good.endpoint))
        with pytest.raises(zmq.ZMQError):
            clash.start()
        assert clash.endpoint == "" and clash.agent is None and clash.free_counts() == {}
        assert good.status().endpoint == good.endpoint  # the first one serves on


def test_a_prefill_whose_bind_fails_releases_its_engine():
    """(Was an expected failure: ``PrefillAgent()`` left its engine registered when its bind
    failed; it now closes its loop, ZAP handler and engine.)"""
    with AgentPrefillWorker(options("prefill", TINY, "loopback")) as good:
        from pdstate.transfer.engines import loopback

        live = set(loopback._LIVE)
        clash = AgentPrefillWorker(options("prefill", TINY, "loopback", bind=good.endpoint))
        with pytest.raises(zmq.ZMQError):
            clash.start()
        assert set(loopback._LIVE) == live, "the failed prefill's engine is still registered"


def test_cancelled_futures_never_kill_a_worker_thread():
    with served_pair(ROOMY, hooks=holding_hooks(), **FAULT) as (p, d):
        held = d.submit(300, room=4242)  # held in TRANSFERRING by the fault delay
        wait_until("room 4242 in flight", lambda: p.in_flight() == 1, 5)
        # (a) a second submit of the same room: refused at once, the first one untouched
        with pytest.raises(RoomInFlight, match="room 4242 is already in flight"):
            d.submit(300, room=4242).result(5)
        # (b) a new request whose caller cancels it before it finishes
        gone = d.submit(300, room=4343)
        assert gone.cancel() or gone.done()
        release_copies(p)
        assert held.result(60).verified
        wait_until("room 4343 finished", lambda: d.lookup(4343) is not None and not d.in_flight(), 60)
        assert not d.status().dead_threads and not p.status().dead_threads
        assert d.lookup(4343).status == "success" and d.lookup(4343).verified
        assert transfer(d, 640, deadline_s=10).verified


def test_settle_ignores_a_concurrent_cancel():
    for _ in range(200):
        f: Future = Future()
        t = threading.Thread(target=f.cancel)
        t.start()
        settle(f, 1)  # never raises, whoever wins
        t.join()
        assert f.done()


def test_latency_window_is_bounded_and_metrics_still_count_everything():
    stats = Stats()
    lat = stats.latencies_s
    assert lat.maxlen == LATENCY_WINDOW

    class Source:  # what Collector reads
        role, worker_id, engine = "decode", "w", "shm"

        def __init__(self) -> None:
            self.stats = stats
            self.report = report_of(TINY)

        def readiness(self):
            from pdstate.status.api import Readiness

            return Readiness(True)

        def in_flight(self):
            return 0

        def peers(self):
            return []

        def free_counts(self):
            return {}

    col = Collector(Source())

    def count() -> float:
        hist = [m for m in col.collect() if m.name == "pdstate_transfer_latency_seconds"][0]
        return [s.value for s in hist.samples if s.name.endswith("_count")][0]

    for _ in range(3000):
        lat.append(0.001)
    assert count() == 3000
    for _ in range(3000):
        lat.append(0.002)
    assert len(lat) == LATENCY_WINDOW and lat.total == 6000
    assert count() == 6000  # the window slid; the new values were still counted once each
    assert count() == 6000
    assert stats.as_dict()["latency_count"] == 6000
    import copy

    assert list(copy.deepcopy(lat)) == list(lat)  # dataclasses.asdict still works


def test_register_in_another_version_is_refused_naming_both():
    expected = (
        f"protocol version mismatch: peer speaks v{wire.PROTOCOL_VERSION + 1}, "
        f"this worker speaks v{wire.PROTOCOL_VERSION}"
    )
    with AgentPrefillWorker(options("prefill", TINY, "shm", **FAULT)) as p:
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        curve.dial(dealer, curve.control_keys(None))  # a peer of the prefill's trust domain (this uid)
        dealer.connect(p.endpoint)
        body = msgpack.packb({"worker_id": "x"}, use_bin_type=True)
        for kind in ("register", "heartbeat"):
            env = {"v": wire.PROTOCOL_VERSION + 1, "kind": kind, "body": body}
            dealer.send(msgpack.packb(env, use_bin_type=True))
            assert dealer.poll(5000), kind
            reply = wire.decode(dealer.recv())
            assert isinstance(reply, wire.Error), reply
            assert reply.error.model_dump() == {"type": "VersionMismatch", "message": expected}
        dealer.close(0)
        assert p.status().peers == ()  # nobody registered


def test_busy_then_deadline_returns_the_pages_at_once():
    """Requests refused with ``PrefillBusy`` until their deadline hold nothing on the prefill:
    their pages come back at once, and the busy re-asks back off instead of spinning."""
    with served_pair(ROOMY, hooks=holding_hooks(), prefill={"max_inflight": 1}, **FAULT) as (p, d):
        free0 = d.free_counts()
        holder = d.submit(300, deadline_s=20)
        wait_until("the first request in flight", lambda: p.in_flight() == 1, 5)
        # long enough for the first Busy answer to come back on a loaded host (at 0.4 s, under load
        # 14-21, a request's deadline passed before it: TransferFailed, not PrefillBusy; at 1.5 s
        # once more at load 15-67)
        deadline = 3.0
        bounced = [d.submit(200, deadline_s=deadline) for _ in range(3)]
        for f in bounced:
            r = f.result(10)
            assert r.status == "failed" and r.error.type == "PrefillBusy", r
        busy = d.stats.snapshot().transfers["busy"]
        assert 3 <= busy < 3 * deadline / 0.002 / 4, "busy re-asks must back off"
        wait_until("only the held request keeps pages", lambda: d.in_flight() == 1, 5)
        release_copies(p)
        assert holder.result(60).verified
        wait_until("pages back", lambda: d.free_counts() == free0, 5)


def test_a_sender_the_agent_refuses_ends_the_request_with_its_error_and_frees_its_pages(monkeypatch):
    """The worker's sender is made posted: when the agent's I/O thread refuses to add it (here a
    sender made first for the same room takes the decode's request), the request ends with the
    agent's error, as when the add was waited for, and its pages come back."""
    with served_pair(ROOMY) as (p, d):
        free0 = p.free_counts()
        made = p.agent.sender
        squatters = []

        def squatting(room, num_pages, *args, **kw):
            squatters.append(made(room, num_pages))  # waited for: the room's live sender from now on
            return made(room, num_pages, *args, **kw)

        monkeypatch.setattr(p.agent, "sender", squatting)
        pending = d.submit(300)
        (squatter,) = wait_until("the worker's sender", lambda: squatters, 10)
        rec = wait_until("the prefill's record", lambda: p.finished_records(), 10)
        assert rec[0]["status"] == "failed" and rec[0]["error"] == {
            "type": "ProtocolError",
            "message": f"room {squatter.room} already has a live sender",
        }, rec
        wait_until("pages back", lambda: p.free_counts() == free0, 5)
        squatter.abort("test over")
        res = pending.result(10)
        assert res.status == "failed" and res.room == squatter.room, res


def test_a_request_given_up_while_the_prefill_computes_is_not_a_success():
    with served_pair(ROOMY, hooks=holding_hooks(), **FAULT) as (p, d):
        t0 = time.monotonic()
        res = transfer(d, 300, deadline_s=0.5)
        assert res.status == "failed" and res.error.message.startswith("deadline exceeded"), res
        # the held prefill stopped waiting once given up (its hold is 30 s)
        within("a request given up while the prefill computes", time.monotonic() - t0, 10.0, 1.0)
        rec = wait_until("the prefill's record", lambda: [f for f in p.finished_records() if f["room"] == res.room], 10)
        assert rec[0]["status"] == "failed" and p.stats.snapshot().transfers["success"] == 0
        release_copies(p)
        assert transfer(d, 300).verified
