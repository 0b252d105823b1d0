"""Regression tests of runtime bugs the reliability work found (one test per bug).

1. a worker whose ``start()`` failed after building its pools leaked them (shm segments), its
   engine and its sockets;
2. completing a future its caller had cancelled raised ``InvalidStateError`` in the decode's
   control thread, killing it;
3. ``Stats.latencies_s`` grew without bound (now a window; ``/metrics`` still counts every value);
4. a ``register`` in another protocol version got a generic ``Error`` instead of the ``Reject``
   naming both versions, so the decode never raised ``VersionMismatch``;
5. engine errors were counted by type-name prefix, missing ``TransferTimedOut``,
   ``NativeEngineError`` ... (see ``test_faults.py``: the loopback timeout and the Mooncake
   session torn down assert the count);
6. a request answered ``Busy`` whose deadline then passed was quarantined on the decode for good
   (the prefill, which never had it, ignored the abort), and Busy re-sends ran every 2 ms;
7. a copy that ran after its request was cancelled was reported as a success by the prefill.
"""

from __future__ import annotations

import os
import secrets
import threading
from concurrent.futures import Future

import msgpack
import pytest
import zmq

from pdstate.errors import ExitCode, LocalCheckFailed, VersionMismatch
from pdstate.protocol import wire
from pdstate.runtime import control
from pdstate.runtime.commands import Submit
from pdstate.runtime.decode import DecodeWorker
from pdstate.runtime.prefill import PrefillWorker
from pdstate.runtime.stats import LATENCY_WINDOW, Stats
from pdstate.runtime.worker import settle
from pdstate.service.api import _Collector
from tests.support.faults import FAULT, holding_hooks, release_copies
from tests.support.pools import ROOMY, TINY, report_of
from tests.support.upstream import MAPPING_ERROR
from tests.support.waiting import wait_until
from tests.support.workers import Workers, options, segments


def test_failed_start_releases_segments_engine_and_sockets():
    before = segments(os.getpid())
    d = DecodeWorker(options("decode", TINY.with_(draft_mapping="own"), "shm", peer="tcp://127.0.0.1:9"))
    with pytest.raises(LocalCheckFailed, match=MAPPING_ERROR):
        d.start()
    assert segments(os.getpid()) == before, "a decode refused by its own check left shm segments"
    assert d.pools.memory.segments == []

    # a prefill whose bind fails, after its pools and engine were built
    with PrefillWorker(options("prefill", TINY, "loopback")) as good:
        from pdstate.transfer.engines import loopback

        live = set(loopback._LIVE)
        clash = PrefillWorker(options("prefill", TINY, "loopback", bind=good.endpoint))
        with pytest.raises(zmq.ZMQError):
            clash.start()
        assert set(loopback._LIVE) == live, "the failed prefill's engine is still registered"
        with pytest.raises(Exception, match="closed"):
            clash.engine.endpoint()
        assert clash.endpoint == ""

    # and a forked worker process exits on the failed check with nothing left in /dev/shm
    with Workers() as ws:
        w = ws.spawn("decode", TINY.with_(draft_mapping="own"), peer="tcp://127.0.0.1:9")
        assert w.wait(30) == ExitCode.LOCAL_CHECK
        assert segments(w.pid) == []


def test_cancelled_futures_never_kill_the_control_thread():
    with (
        PrefillWorker(options("prefill", ROOMY, "shm", **FAULT), holding_hooks()) as p,
        DecodeWorker(options("decode", ROOMY, "shm", peer=p.endpoint, **FAULT)) as d,
    ):
        d.wait_ready(10)
        held = d.submit(300, room=4242)  # held in TRANSFERRING by the fault delay
        wait_until("room 4242 in flight", lambda: p.jobs and True, 5)
        # (a) a second submit of the same room whose caller already cancelled it
        dup: Future = Future()
        dup.cancel()
        d._inbox.put(Submit(4242, 300, 5.0, dup, "full"))
        # (b) a new request whose caller cancels it before it finishes
        gone: Future = Future()
        gone.cancel()
        d._inbox.put(Submit(4343, 300, 5.0, gone, "full"))
        release_copies(p)
        for job in list(p.jobs.values()):
            job.cancel_event.set()  # let the held copy go (it was not cancelled: it just stops waiting)
        assert held.result(10).verified
        wait_until("room 4343 finished", lambda: 4343 in d.finished, 10)
        assert not d.status().dead_threads, "the decode's control thread died"
        assert d.finished[4343].status == "success" and d.finished[4343].verified
        assert d.transfer(640, deadline_s=10).verified


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

    class Source:  # what _Collector reads
        role, worker_id, engine = "decode", "w", "shm"

        def __init__(self) -> None:
            self.stats = stats
            self.report = report_of(TINY)

        def readiness(self):
            from pdstate.service.api import Readiness

            return Readiness(True)

        def in_flight(self):
            return 0

        def peers(self):
            return []

        def free_counts(self):
            return {}

    col = _Collector(Source())

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


def _register_v2(self, msg):
    """``ControlClient.send`` of a decode that speaks protocol v2."""
    env = msgpack.unpackb(wire.encode(msg, self.token))
    env["v"] = wire.PROTOCOL_VERSION + 1
    self.sock.send(msgpack.packb(env, use_bin_type=True), flags=zmq.NOBLOCK)


def test_register_in_another_version_is_rejected_naming_both(monkeypatch):
    expected = (
        f"protocol version mismatch: peer speaks v{wire.PROTOCOL_VERSION + 1}, "
        f"this worker speaks v{wire.PROTOCOL_VERSION}"
    )
    with PrefillWorker(options("prefill", TINY, "shm", **FAULT)) as p:
        # a raw register frame in v2 is answered with a Reject
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(p.endpoint)
        body = msgpack.packb({"worker_id": "x"}, use_bin_type=True)
        dealer.send(msgpack.packb({"v": 2, "kind": "register", "body": body}, use_bin_type=True))
        assert dealer.poll(5000)
        reply = wire.decode(dealer.recv())
        assert isinstance(reply, wire.Reject), reply
        assert reply.error.model_dump() == {"type": "VersionMismatch", "message": expected}
        # other frames in v2 still get an Error
        dealer.send(msgpack.packb({"v": 2, "kind": "heartbeat", "body": body}, use_bin_type=True))
        assert dealer.poll(5000)
        assert isinstance(wire.decode(dealer.recv()), wire.Error)
        dealer.close(0)
        # a real decode speaking v2 raises VersionMismatch and stays up, not ready
        monkeypatch.setattr(control.ControlClient, "send", _register_v2)
        with DecodeWorker(options("decode", TINY, "shm", peer=p.endpoint, **FAULT)) as d:
            with pytest.raises(VersionMismatch) as got:
                d.wait_ready(10)
            assert str(got.value) == expected
            assert not d.ready and d.peer_error.type == "VersionMismatch"
        assert p.stats.handshakes["rejected"] == 2


def test_busy_then_deadline_does_not_quarantine_forever():
    """Requests bounced with Busy until their deadline hold nothing on the prefill: their pages
    come back at once, and Busy re-sends back off instead of spinning."""
    po = options("prefill", ROOMY, "shm", max_inflight=1, **FAULT)
    with (
        PrefillWorker(po, holding_hooks()) as p,
        DecodeWorker(options("decode", ROOMY, "shm", peer=p.endpoint, **FAULT)) as d,
    ):
        d.wait_ready(10)
        free0 = d.free_counts()
        holder = d.submit(300, deadline_s=10)
        wait_until("the first request in flight", lambda: p.jobs and True, 5)
        bounced = [d.submit(200, deadline_s=0.4) for _ in range(3)]
        for f in bounced:
            r = f.result(10)
            assert r.status == "failed" and r.error.message == "deadline exceeded"
        assert d.stats.transfers["busy"] >= 3
        assert d.stats.transfers["busy"] < 3 * 0.4 / 0.002 / 4, "Busy re-sends must back off"
        wait_until("no quarantine", lambda: not d.quarantine, 5)
        release_copies(p)
        for job in list(p.jobs.values()):
            job.cancel_event.set()
        assert holder.result(10).verified
        wait_until("pages back", lambda: d.free_counts() == free0, 5)


def test_abort_for_a_room_the_prefill_never_had_releases_the_quarantine():
    with PrefillWorker(options("prefill", ROOMY, "shm", **FAULT)) as p:
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.IDENTITY, b"raw-" + secrets.token_hex(4).encode())
        dealer.connect(p.endpoint)
        dealer.send(wire.encode(wire.Abort(room=77, reason="deadline exceeded on decode")))
        assert dealer.poll(5000)
        reply = wire.decode(dealer.recv())
        assert isinstance(reply, wire.TransferDone) and reply.room == 77 and reply.status == "failed"
        assert reply.error.message.startswith("room 77 is not in flight here")
        dealer.close(0)


def test_a_copy_that_ran_after_cancellation_is_not_a_success():
    with (
        PrefillWorker(options("prefill", ROOMY, "shm", **FAULT)) as p,
        DecodeWorker(options("decode", ROOMY, "shm", peer=p.endpoint, **FAULT)) as d,
    ):
        d.wait_ready(10)
        gate = threading.Event()
        real = p.engine.submit

        def slow_submit(peer_id, plan, notify=b""):
            gate.wait(10)
            return real(peer_id, plan, notify)

        p.engine.submit = slow_submit  # the copy starts only when the test says so
        fut = d.submit(300, deadline_s=10)
        wait_until("the copy started", lambda: [j for j in p.jobs.values() if j.state.value == "transferring"], 5)
        job = list(p.jobs.values())[0]
        p._cancel(job, "aborted by decode: test")  # (the control thread would do this on Abort)
        gate.set()
        res = fut.result(10)
        assert res.status == "failed" and res.error.message == "aborted by decode: test"
        rec = wait_until("the prefill's record", lambda: [f for f in p.finished_records() if f["room"] == res.room], 5)
        assert rec[0]["status"] == "failed" and p.stats.transfers["success"] == 0
