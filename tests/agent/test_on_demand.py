"""The agent surface a caller that computes on demand uses (``pdstate serve``'s workers): the
decode's ``seq_len``, the prefill's ``on_request`` hook and ``refuse``, ``Goodbye`` at close, the
decode's ``connect`` (a gone prefill stays GONE, with its reason, until it accepts again) and the
peer tables of both sides. Both agents in this process over the loopback engine."""

from __future__ import annotations

import queue
import time

import pytest

from pdstate.agent import DecodeAgent, PrefillAgent, RequestState
from pdstate.agent.sender import EndedSender
from pdstate.errors import AllocationError, PeerGone, PrefillBusy, ProtocolError
from pdstate.protocol.lifecycle import PeerState
from pdstate.protocol.peers import PeerSnapshot
from tests.support.bounds import within
from tests.support.waiting import wait_until

S = RequestState


def _prefill(side, **kw) -> PrefillAgent:
    return PrefillAgent(side.kv_args, (side.pools.target, side.pools.draft), engine="loopback", **kw)


def _decode(side, **kw) -> DecodeAgent:
    return DecodeAgent(side.kv_args, (side.pools.target, side.pools.draft), engine="loopback", **kw)


def test_on_request_gets_the_seq_len_and_the_sender_made_later_serves_it(sides):
    p, d = sides
    asked: queue.Queue = queue.Queue()
    with _prefill(p, on_request=lambda room, seq_len, who: asked.put((room, seq_len, who))) as pa:
        with _decode(d, worker_id="d-1") as da:
            recv = da.receiver(pa.address, 11)
            recv.init([3, 4], [[1], [0], [1]], seq_len=300)
            assert asked.get(timeout=10) == (11, 300, "d-1")
            assert pa.requested(11) and pa.pending_pages(11) == 2
            send = pa.sender(11, 2)
            send.send([1, 2], [[2], [1], [2]])
            assert recv.wait(10) is S.SUCCESS, recv.failure_exception()
            assert send.wait(10) is S.SUCCESS
            # without seq_len the hook hears None
            other = da.receiver(pa.address, 12)
            other.init([5], [[2], [1], [2]])
            assert asked.get(timeout=10) == (12, None, "d-1")
            pa.sender(12, 1).send([3], [[3], [2], [3]])
            assert other.wait(10) is S.SUCCESS


@pytest.mark.parametrize(
    "error", [PrefillBusy("prefill busy: 3 requests in flight (max_inflight 3)"), ProtocolError("no")]
)
def test_a_request_the_hook_refuses_fails_with_that_error(sides, error):
    p, d = sides

    def hook(room, seq_len, who):
        raise error

    with _prefill(p, on_request=hook) as pa, _decode(d) as da:
        recv = da.receiver(pa.address, 21)
        recv.init([3], [[1], [0], [1]], seq_len=10)
        assert recv.wait(10) is S.FAILED
        exc = recv.failure_exception()
        assert (type(exc), str(exc)) == (type(error), str(error))
        assert not pa.requested(21)


def test_refuse_fails_the_waiting_request_and_only_it(sides):
    p, d = sides
    with _prefill(p, on_request=lambda *a: None) as pa, _decode(d) as da:
        recv = da.receiver(pa.address, 31)
        recv.init([3], [[1], [0], [1]], seq_len=10)
        wait_until("the request waiting", lambda: pa.requested(31), 10)
        assert pa.refuse(31, AllocationError("out of pages: asked for 1, 0 free")) is True
        assert recv.wait(10) is S.FAILED
        assert (type(recv.failure_exception()), str(recv.failure_exception())) == (
            AllocationError,
            "out of pages: asked for 1, 0 free",
        )
        assert pa.refuse(31, AllocationError("again")) is False  # nothing waits any more


def test_close_says_goodbye_and_the_decode_fails_at_once_with_its_reason(sides):
    p, d = sides
    pa = _prefill(p, peer_timeout_s=30.0)
    try:
        with _decode(d, peer_timeout_s=30.0) as da:
            recv = da.receiver(pa.address, 41)
            recv.init([3], [[1], [0], [1]])
            wait_until("the request reached the prefill", lambda: pa.requested(41), 10)
            t0 = time.monotonic()
            pa.close("prefill shutting down")
            assert recv.wait(5) is S.FAILED
            # the goodbye, not the 30 s heartbeat timeout
            within("a goodbye failing the decode's request", time.monotonic() - t0, 10.0, 0.05)
            assert (type(recv.failure_exception()), str(recv.failure_exception())) == (
                PeerGone,
                "prefill shutting down",
            )
            info = da.prefills()[pa.address]
            assert info.state == "gone"
            assert (info.error.type, info.error.message) == ("PeerGone", "prefill shutting down")
            # a caller that redials itself: a request naming the gone prefill fails at once
            late = da.receiver(pa.address, 42, redial_gone=False)
            assert late.state is S.FAILED and str(late.failure_exception()) == "prefill shutting down"
            assert da.prefills()[pa.address].state == "gone"
    finally:
        pa.close()


def test_connect_keeps_a_gone_prefill_gone_until_a_new_one_accepts(sides):
    p, d = sides
    pa = _prefill(p)
    address = pa.address
    with _decode(d, worker_id="d-2") as da:
        da.connect(address)
        wait_until("accepted", lambda: da.prefills()[address].state == "accepted", 10)
        first = da.prefills()[address]
        assert first.fingerprint == pa.peers()[0].fingerprint and first.handshake_s > 0
        assert pa.peers() == [PeerSnapshot("d-2", PeerState.ACCEPTED, da.incarnation, first.fingerprint, None)]
        pa.close()
        wait_until("gone", lambda: da.prefills()[address].state == "gone", 10)
        for _ in range(3):  # dialled again, nobody there: still gone, still with the goodbye's reason
            da.connect(address)
            info = da.prefills()[address]
            assert info.state == "gone" and info.reason == "PeerGone: prefill shutting down"
        pb = _prefill(p, bind=address)
        try:
            wait_until(
                "accepted again", lambda: (da.connect(address), da.prefills()[address])[1].state == "accepted", 10
            )
            info = da.prefills()[address]
            assert info.incarnation == pb.incarnation != first.incarnation and info.error is None
            assert da.handshakes["accepted"] == 2 and pb.handshakes == {"accepted": 1, "rejected": 0}
        finally:
            pb.close()


def test_ended_senders_are_trimmed_and_capped(sides, monkeypatch):
    """An ended sender is kept as a tombstone (a late AgentRequest or Abort for its room is
    answered; no index lists, handles, digest or metrics), only the newest ``MAX_ENDED`` of them;
    the caller's ``KVSender`` keeps the sender's metrics."""
    from pdstate.agent import prefill as prefill_module

    monkeypatch.setattr(prefill_module, "MAX_ENDED", 2)
    p, d = sides
    with _prefill(p) as pa, _decode(d) as da:
        senders = []
        for room in range(51, 55):
            recv, send = da.receiver(pa.address, room), pa.sender(room, 1)
            recv.init([3], [[1], [0], [1]])
            send.send([1], [[2], [1], [2]])
            assert recv.wait(10) is S.SUCCESS and send.wait(10) is S.SUCCESS
            senders.append(send)
        wait_until("the oldest ended senders forgotten", lambda: sorted(pa.senders()) == [53, 54], 5)
        kept_senders = pa.senders()
        for room in (53, 54):
            kept = kept_senders[room]
            assert type(kept) is EndedSender and kept.request is prefill_module.ANSWERED
            assert kept.record.state is S.SUCCESS and kept.record.error is None and kept.handles == ()
        assert all(s.metrics["bytes"] > 0 and s.state is S.SUCCESS for s in senders)  # the caller's own
        # a late request for a kept room is not served twice: it waits for a new sender
        again = da.receiver(pa.address, 54)
        again.init([3], [[1], [0], [1]])
        wait_until("the late request waiting", lambda: pa.requested(54), 5)
        again.abort("done with it")
        assert again.state is S.FAILED


def test_a_late_request_for_a_failed_senders_tombstone_gets_its_failure(sides):
    """A sender aborted before any decode asked for it becomes a tombstone at the next tick; a
    decode asking for that room afterwards fails at once with the sender's own error."""
    p, d = sides
    with _prefill(p) as pa, _decode(d) as da:
        send = pa.sender(61, 1)
        send.abort("the prefill gave up first")
        assert send.state is S.FAILED
        wait_until("the sender kept as a tombstone", lambda: type(pa.senders().get(61)) is EndedSender, 5)
        tombstone = pa.senders()[61]
        assert tombstone.record.state is S.FAILED and tombstone.request is None
        recv = da.receiver(pa.address, 61)
        recv.init([3], [[1], [0], [1]])
        assert recv.wait(10) is S.FAILED
        exc = recv.failure_exception()
        assert type(exc).__name__ == "TransferAborted"
        assert str(exc) == "aborted by prefill: the prefill gave up first"
