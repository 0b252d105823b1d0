"""The prefill's sans-I/O core alone (``agent.prefill_core.PrefillCore``): decoded frames, ticks,
the caller's commands and engine outcomes in; exact actions and messages out. No process, thread,
socket or sleep: the engine is an in-memory fake whose handles finish when the test says, the
clock is the ``now`` each input carries."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import pytest

from pdstate.agent import refusals
from pdstate.agent.common import RequestRecord
from pdstate.agent.fairness import MAX_WITHHELD
from pdstate.agent.fence import FENCE_TIMEOUT_S
from pdstate.agent.prefill_core import ANSWERED, Again, AskCaller, PrefillCore, Release, Send, Watch
from pdstate.agent.sender import EndedSender, Sending
from pdstate.errors import (
    AgentClosed,
    DescriptorMismatch,
    EngineError,
    IndexCountMismatch,
    PeerGone,
    ProtocolError,
    TransferAborted,
    TransferFailed,
    VerifyLevelRefused,
    WorkerIdInUse,
)
from pdstate.pools.reporting import build_report
from pdstate.protocol import handshake as h
from pdstate.protocol import wire
from pdstate.protocol.lifecycle import RequestState as S
from pdstate.protocol.peers import DecodeSnapshot
from pdstate.protocol.report import ErrorInfo
from tests.support.pools import TINY, kept_pools

D1, D2 = b"decode-1-conn", b"decode-2-conn"
PEER_ID = "shm:decode-engine"
HB, TIMEOUT = 0.5, 3.0
N_STATE = 3  # the tiny layout's state components


@functools.cache
def _layout():
    pools = kept_pools(TINY)
    return build_report(pools.target, pools.draft)


@dataclass(eq=False)
class Handle:
    peer_id: str
    done: bool = False
    fails: bool = False


class FakeEngine:
    """The engine port in memory: handles finish when the test sets ``done`` (or fail with ``fails``)."""

    name = "shm"

    def __init__(self, proves_ownership: bool = False) -> None:
        self.proves_ownership = proves_ownership
        self.plans: list[tuple[str, int]] = []  # (peer id, descriptors) per submit
        self.handles: list[Handle] = []
        self.connected: list[tuple[dict, str | None]] = []
        self.disconnected: list[str] = []
        self.outside = False  # the decode's buffers lie outside the regions its endpoint published

    def submit(self, peer_id, plan, **kw):
        handle = Handle(peer_id)
        self.plans.append((peer_id, len(plan)))
        self.handles.append(handle)
        return handle

    def poll(self, handle: Handle) -> bool:
        if handle.fails:
            raise EngineError("copy failed")
        return handle.done

    def connect(self, endpoint, owner=None) -> str:
        self.connected.append((dict(endpoint), owner))
        return PEER_ID

    def disconnect(self, peer_id) -> bool:  # only a register refused past its connect; else a Release
        self.disconnected.append(peer_id)
        return True

    def peer_regions(self, peer_id):
        return self

    def check_inside(self, ranges, label) -> None:
        if self.outside:
            raise DescriptorMismatch(f"{label}: main KV[0] lies outside the regions it published")

    def challenge(self, claimant, holder=""):
        return b"nonce-" + claimant.encode()


class Harness:
    """A core over the tiny layout, a fake engine and a probe that says each connection is open."""

    def __init__(self, *, wakes: bool = False, ask_caller: bool = False, proves_ownership: bool = False, **kw):
        self.report, self.kv = _layout()
        self.engine = FakeEngine(proves_ownership)
        self.open: set[bytes] = {D1, D2}
        self.probes: list[bytes] = []
        local = h.LocalSide(
            worker_id="prefill-0",
            incarnation="p-inc",
            report=self.report,
            kv=wire.KVDesc.of(self.kv),
            engine=wire.EngineDesc(name="shm", endpoint={}),
            heartbeat_interval_s=HB,
            peer_timeout_s=TIMEOUT,
        )
        self.core = PrefillCore(
            self.kv,
            h.PrefillHandshake(local),
            self.engine,
            worker_id="prefill-0",
            incarnation="p-inc",
            address="tcp://127.0.0.1:5601",
            now=0.0,
            probe=self._probe,
            stopwatch=lambda: 0.0,
            wakes=wakes,
            ask_caller=ask_caller,
            heartbeat_interval_s=HB,
            peer_timeout_s=TIMEOUT,
            **kw,
        )

    def _probe(self, identity: bytes, msg: wire.Message) -> bool:
        self.probes.append(identity)
        return identity in self.open

    def register(self, identity: bytes = D1, worker_id: str = "decode-0", incarnation: str = "d-inc", now=0.0, **kw):
        local = h.LocalSide(
            worker_id=worker_id,
            incarnation=incarnation,
            report=self.report,
            kv=wire.KVDesc.of(self.kv),
            engine=wire.EngineDesc(name=kw.pop("engine", "shm"), endpoint={"segment": "seg-" + worker_id}),
        )
        self.core.on_frame(identity, h.DecodeHandshake(local).register_message(**kw), now)
        return self.core.drain()

    def sender(self, room: int, pages: int = 2, now: float = 0.0) -> Sending:
        send = Sending(RequestRecord(room, created=now), pages, None)
        self.core.add_sender(send, now)
        return send

    def request(self, room: int, pages=(3, 4), identity: bytes = D1, now: float = 0.0):
        msg = wire.AgentRequest(
            room=room,
            dst_kv_pages=wire.PackedIndices.pack(list(pages)),
            dst_state_indices=[wire.PackedIndices.pack([1])] * N_STATE,
            digest=False,
            deadline_s=30.0,
        )
        self.core.on_frame(identity, msg, now)
        return self.core.drain()

    def chunk(self, send: Sending, pages=(1, 2), now: float = 0.0):
        state = [np.array([2], dtype=np.int64)] * N_STATE
        self.core.queue_chunk(send, np.array(pages, dtype=np.int64), state, now)
        self.core.pump(send, now)
        return self.core.drain()

    def copying(self, room: int = 5) -> Sending:
        """An accepted decode's request whose one chunk is submitted and still copying."""
        self.register()
        send = self.sender(room)
        assert self.request(room) == []
        (look,) = self.chunk(send)  # not landed yet: told when it does, or looked at again soon
        if self.core.wakes:
            assert isinstance(look, Watch) and (look.send, look.handles) == (send, (self.engine.handles[-1],))
        else:
            assert isinstance(look, Again) and (look.key, look.send) == (send, send)
        assert send.record.state is S.TRANSFERRING
        return send


def failed(room: int, error, landed: int = 0) -> wire.TransferDone:
    return wire.TransferDone(room=room, status="failed", error=ErrorInfo.of(error), bytes=landed)


def same(error, expected) -> bool:
    """Whether ``error`` is ``expected``'s class with its message."""
    return type(error) is type(expected) and str(error) == str(expected)


def sends(actions) -> list[tuple[bytes, wire.Message]]:
    assert all(isinstance(a, Send) for a in actions), actions
    return [(a.peer, a.msg) for a in actions]


# --- handshakes ---------------------------------------------------------------------------------


def test_a_compatible_register_is_accepted_and_its_engine_connected():
    t = Harness()
    (answer,) = sends(t.register())
    assert answer[0] == D1 and isinstance(answer[1], wire.Accept)
    assert (answer[1].worker_id, answer[1].incarnation, answer[1].peer_timeout_s) == ("prefill-0", "p-inc", TIMEOUT)
    assert t.engine.connected == [({"segment": "seg-decode-0"}, "decode-0/d-inc")]
    assert t.core.handshakes == {"accepted": 1, "rejected": 0}
    assert t.core.decode_list(2.5) == [DecodeSnapshot("decode-0", "d-inc", 2.5)]
    assert [(p.id, p.state, p.error) for p in t.core.peer_log.records()] == [("decode-0", "accepted", None)]


def test_a_decode_registering_again_with_the_same_buffers_keeps_its_planner():
    t = Harness()
    t.register()
    first = t.core.decodes[D1].planner
    (answer,) = sends(t.register(now=1.0))
    assert isinstance(answer[1], wire.Accept) and t.core.handshakes == {"accepted": 2, "rejected": 0}
    assert t.core.decodes[D1].planner is first and first.dst_desc == wire.KVDesc.of(t.kv)


def test_an_incompatible_register_is_refused_with_the_reason_and_nothing_connected():
    t = Harness()
    (answer,) = sends(t.register(engine="mooncake"))
    assert isinstance(answer[1], wire.Reject)
    assert answer[1].error == ErrorInfo(
        type="EngineError",
        message="transfer engine mismatch: prefill server uses 'shm', but decode server uses 'mooncake'",
    )
    assert t.engine.connected == [] and t.core.decodes == {}
    assert t.core.handshakes == {"accepted": 0, "rejected": 1}
    assert t.core.peer_log.records()[0].state == "rejected"


def test_a_register_whose_buffers_lie_outside_its_published_regions_is_refused_and_unmapped():
    t = Harness()
    t.engine.outside = True
    (answer,) = sends(t.register())
    err = DescriptorMismatch("decode decode-0: main KV[0] lies outside the regions it published")
    assert answer == (D1, wire.Reject(worker_id="prefill-0", error=ErrorInfo.of(err)))
    assert t.engine.disconnected == [PEER_ID] and t.core.decodes == {}


def test_an_engine_that_proves_ownership_challenges_first_and_accepts_the_answer():
    t = Harness(proves_ownership=True)
    (answer,) = sends(t.register())
    assert answer[1] == wire.Challenge(worker_id="prefill-0", incarnation="p-inc", nonce=b"nonce-decode-0/d-inc")
    assert t.core.decodes == {}
    proof = {"challenge": "x", "audience": "tcp://127.0.0.1:5601"}
    (answer,) = sends(t.register(proof=proof))
    assert isinstance(answer[1], wire.Accept) and D1 in t.core.decodes


def test_a_proof_given_to_another_address_is_refused():
    t = Harness(proves_ownership=True)
    (answer,) = sends(t.register(proof={"challenge": "x", "audience": "tcp://10.0.0.9:5601"}))
    assert isinstance(answer[1], wire.Reject) and answer[1].error.type == "InvalidEndpoint"
    assert answer[1].error.message.startswith("shm proof of ownership was given to 'tcp://10.0.0.9:5601'")


def test_a_worker_id_held_by_a_live_connection_is_refused_and_the_holder_kept():
    t = Harness()
    t.register(D1)
    (answer,) = sends(t.register(D2, incarnation="d-inc-2", now=1.0))
    assert t.probes == [D1]
    assert answer == (
        D2,
        wire.Reject(
            worker_id="prefill-0",
            error=ErrorInfo.of(
                WorkerIdInUse(
                    "worker_id 'decode-0' is held by another live decode (this register's incarnation is "
                    "d-inc-2); a new incarnation is accepted once that one is gone"
                )
            ),
        ),
    )
    assert list(t.core.decodes) == [D1]


def test_a_restart_on_a_new_connection_replaces_a_closed_one_and_fails_its_requests():
    t = Harness()
    send = t.copying(5)
    t.open.discard(D1)  # the old connection closed: the probe cannot queue to it
    actions = t.register(D2, incarnation="d-inc-2", now=1.0)
    again, accept = actions  # the old request fails, fenced (its copy in flight); then the answer
    assert isinstance(again, Again) and again.send is send and isinstance(accept.msg, wire.Accept)
    assert accept.peer == D2 and list(t.core.decodes) == [D2]
    assert send.fence is not None and same(
        send.fence.error, PeerGone("decode decode-0 registered again (new incarnation)")
    )
    t.engine.handles[0].done = True
    t.core.landed(send, 1.5)
    (done,) = sends(t.core.drain())  # confirmed on the connection the request came on
    assert done == (D1, failed(5, send.record.error, send.bytes)) and send.record.state is S.FAILED


# --- frames -------------------------------------------------------------------------------------


def test_a_heartbeat_is_echoed_to_an_accepted_decode_and_an_unknown_one_is_told_it_is_not_registered():
    t = Harness()
    t.core.on_frame(D1, wire.Heartbeat(worker_id="decode-0", incarnation="d-inc", seq=9), 0.1)
    not_registered = ErrorInfo(type="NotRegistered", message="decode is not registered with this prefill")
    assert sends(t.core.drain()) == [(D1, wire.Error(error=not_registered, room=None))]
    t.register()
    t.core.on_frame(D1, wire.Heartbeat(worker_id="decode-0", incarnation="d-inc", seq=9), 0.2)
    assert sends(t.core.drain()) == [(D1, wire.Heartbeat(worker_id="prefill-0", incarnation="p-inc", seq=9))]
    assert t.core.decodes[D1].last_seen == 0.2


def test_a_frame_that_did_not_decode_is_answered_unless_it_is_an_error_frame():
    t = Harness()
    exc = ProtocolError("bad frame")
    t.core.on_bad_frame(D1, b"\x00garbage", exc, 0.0)
    assert sends(t.core.drain()) == [(D1, wire.Error(error=ErrorInfo.of(exc)))]
    t.core.on_bad_parts([D1, b"a", b"b"], 0.0)
    err = ProtocolError("a message is one frame (one ZeroMQ part); this one has 2")
    assert sends(t.core.drain()) == [(D1, wire.Error(error=ErrorInfo.of(err)))]


# --- requests and chunks ------------------------------------------------------------------------


def test_a_request_copies_once_and_succeeds_on_the_verdict():
    t = Harness()
    t.register()
    send = t.sender(5)
    assert t.request(5) == [] and send.record.state is S.WAITING_FOR_INPUT
    assert [type(a) for a in t.chunk(send)] == [Again]
    assert t.engine.plans and {p for p, _ in t.engine.plans} == {PEER_ID}
    assert send.record.state is S.TRANSFERRING and not send.done_sent
    t.core.on_tick(0.1)
    assert [type(a) for a in t.core.drain()] == [Again]  # still copying: no TransferDone
    t.engine.handles[0].done = True
    t.core.landed(send, 0.2)
    ((peer, done),) = sends(t.core.drain())
    assert peer == D1 and (done.room, done.status, done.bytes) == (5, "success", send.bytes) and send.bytes > 0
    assert done.descriptors == send.descriptors and send.done_at == 0.2
    t.core.on_frame(D1, wire.AgentVerdict(room=5, status="success"), 0.3)
    assert t.core.drain() == [] and send.record.state is S.SUCCESS


def test_a_request_before_its_sender_waits_and_is_handed_to_the_caller():
    t = Harness(ask_caller=True)
    t.register()
    msg_actions = t.request(6, pages=(3, 4, 5))
    assert [type(a) for a in msg_actions] == [AskCaller]
    assert (msg_actions[0].peer, msg_actions[0].worker_id, msg_actions[0].request.room) == (D1, "decode-0", 6)
    assert t.core.refusals.requested(6) and t.core.refusals.pending_pages(6) == 3
    assert t.core.refusals.pending_state_lengths(6) == [1, 1, 1]
    send = t.sender(6, pages=3)
    assert send.record.state is S.WAITING_FOR_INPUT and not t.core.refusals.requested(6)


def test_a_flood_of_rooms_waiting_for_their_senders_is_refused_past_the_bound(monkeypatch):
    """A hostile or buggy decode asking for rooms no sender exists for: past
    ``MAX_WAITING_REQUESTS`` waiting, each new room is refused with a failed ``TransferDone``
    (nothing of it copied: its pages are the decode's again at once) and counted; a waiting room
    asked again, or a room with a sender, is still taken."""
    monkeypatch.setattr(refusals, "MAX_WAITING_REQUESTS", 3)
    t = Harness()
    t.register()
    for room in (1, 2, 3):
        assert t.request(room) == []
    err = TransferFailed("room 4: refused: 3 requests already wait for their sender on this prefill")
    assert sends(t.request(4)) == [(D1, failed(4, err))]
    assert sends(t.request(5, identity=D1)) == [(D1, failed(5, TransferFailed(str(err).replace("4", "5", 1))))]
    assert t.core.refusals.overflowed == 2 and len(t.core.pending) == 3 and not t.core.refusals.requested(4)
    assert t.request(2) == [] and t.core.refusals.overflowed == 2  # asked again: not a new one
    send = t.sender(9)  # a room with its sender is not waiting: taken
    assert t.request(9) == [] and send.record.state is S.WAITING_FOR_INPUT
    t.sender(1)  # one waiting room handed to its sender: a new room fits again
    assert t.request(6) == [] and t.core.refusals.requested(6)


def test_the_callers_refusal_fails_the_waiting_request_on_the_decode():
    t = Harness(ask_caller=True)
    t.register()
    (ask,) = t.request(6)
    err = TransferFailed("no room for it")
    t.core.caller_refused(ask.peer, ask.request, err, 0.1)
    assert sends(t.core.drain()) == [(D1, failed(6, err))] and not t.core.refusals.requested(6)
    t.request(7)
    assert t.core.refuse(7, err, 0.2) is True and sends(t.core.drain()) == [(D1, failed(7, err))]
    assert t.core.refuse(7, err, 0.3) is False


def test_a_page_count_mismatch_fails_both_sides_with_the_counts():
    t = Harness()
    t.register()
    send = t.sender(5, pages=3)
    err = IndexCountMismatch("main KV: index count mismatch: prefill=3, decode=2")
    assert sends(t.request(5)) == [(D1, failed(5, err))]
    assert send.record.state is S.FAILED and same(send.record.error, err)


def test_a_chunk_past_the_declared_pages_is_refused_to_the_caller():
    t = Harness()
    send = t.sender(5, pages=2)
    with pytest.raises(ValueError) as raised:
        t.core.queue_chunk(send, np.array([1, 2, 3]), None, 0.0)
    assert str(raised.value) == "room 5: chunk of 3 pages brings the request to 3 pages, more than the 2 declared"
    with pytest.raises(ValueError, match=r"^room 5: state indices go with the last chunk only$"):
        t.core.queue_chunk(send, np.array([1]), [np.array([1])] * N_STATE, 0.0)


def test_a_second_live_sender_for_a_room_is_refused():
    t = Harness()
    t.sender(5)
    with pytest.raises(ProtocolError, match=r"^room 5 already has a live sender$"):
        t.sender(5)


def test_a_room_requested_by_two_decodes_is_refused_to_the_second():
    t = Harness()
    t.register(D1)
    t.register(D2, worker_id="decode-1")
    t.sender(5)
    t.request(5, identity=D1)
    err = ProtocolError("room 5 was already requested by decode decode-0")
    assert sends(t.request(5, identity=D2)) == [(D2, wire.Error(error=ErrorInfo.of(err), room=5))]


def test_an_engine_that_wakes_is_watched_and_one_that_cannot_is_asked_again():
    t = Harness(wakes=True)
    t.copying(5)  # a Watch of its one handle
    t.core.on_tick(0.1)
    assert t.core.drain() == []  # asked once per handle
    u = Harness(wakes=False)
    send = u.copying(5)  # an Again
    u.core.on_tick(0.1)
    (again,) = u.core.drain()  # and again at each tick, until it landed
    assert isinstance(again, Again) and again.send is send


# --- aborts and fences (#35: no byte after release) -----------------------------------------------


def test_a_decodes_abort_with_a_copy_in_flight_waits_for_its_fence():
    t = Harness()
    send = t.copying(5)
    t.core.on_frame(D1, wire.Abort(room=5, reason="client went away"), 1.0)
    (again,) = t.core.drain()  # looked at again soon (this engine cannot say when a copy lands)
    assert isinstance(again, Again) and (again.key, again.send) == (send.fence, send)
    assert send.record.state is S.TRANSFERRING and send.fence is not None  # not released: a copy may land
    t.core.on_tick(1.1)
    assert not [a for a in t.core.drain() if isinstance(a, Send)]  # still in flight: nothing confirmed
    t.engine.handles[0].done = True
    t.core.landed(send, 1.2)
    err = TransferAborted("aborted by decode: client went away")
    assert sends(t.core.drain()) == [(D1, failed(5, err, send.bytes))]
    assert send.record.state is S.FAILED and same(send.record.error, err) and send.record.metrics["bytes"] == send.bytes


def test_a_failed_copy_counts_as_finished_for_the_fence():
    t = Harness()
    send = t.copying(5)
    t.engine.handles[0].fails = True
    t.core.abort(send, "aborted by prefill: stop", 1.0)
    err = TransferAborted("aborted by prefill: stop")
    assert sends(t.core.drain()) == [(D1, failed(5, err, send.bytes))] and send.record.state is S.FAILED


def test_an_abort_with_nothing_in_flight_fails_at_once():
    t = Harness()
    send = t.sender(5)
    t.core.abort(send, "aborted by prefill: gave up", 0.5)
    assert t.core.drain() == []  # no decode asked for it yet: nobody to tell
    assert send.record.state is S.FAILED and same(send.record.error, TransferAborted("aborted by prefill: gave up"))
    t.register()
    assert sends(t.request(5)) == [(D1, failed(5, send.record.error))]  # the decode learns it gets nothing


def test_a_wedged_copy_ends_at_the_fence_deadline_unconfirmed():
    t = Harness()
    send = t.copying(5)
    t.core.on_frame(D1, wire.Abort(room=5, reason="stop"), 1.0)
    t.core.drain()
    assert send.fence.deadline == 1.0 + FENCE_TIMEOUT_S
    t.core.on_frame(D1, wire.Heartbeat(worker_id="decode-0", incarnation="d-inc", seq=1), 1.0 + FENCE_TIMEOUT_S - 0.1)
    t.core.on_tick(1.0 + FENCE_TIMEOUT_S - 0.1)
    assert send.record.state is S.TRANSFERRING
    t.core.drain()
    t.core.on_frame(D1, wire.Heartbeat(worker_id="decode-0", incarnation="d-inc", seq=2), 1.0 + FENCE_TIMEOUT_S)
    t.core.on_tick(1.0 + FENCE_TIMEOUT_S)
    out = t.core.drain()
    assert send.record.state is S.FAILED
    assert not [a for a in out if isinstance(a, Send) and isinstance(a.msg, wire.TransferDone)]  # never confirmed


def test_an_abort_for_an_unknown_room_is_confirmed_at_once():
    t = Harness()
    t.register()
    t.core.on_frame(D1, wire.Abort(room=77, reason="late"), 0.1)
    assert sends(t.core.drain()) == [(D1, failed(77, TransferAborted("aborted by decode: late")))]


def test_a_decode_back_on_a_new_connection_gets_its_failing_requests_confirmed_there():
    t = Harness()
    send = t.copying(5)
    t.open.discard(D1)
    t.register(D2, now=1.0)  # the same incarnation, another connection: the old one's requests fail
    t.core.on_frame(D2, wire.Abort(room=5, reason="no confirmation"), 1.1)
    assert t.core.drain() == [] and send.identity == D2  # still in flight: answered once the fence holds
    t.engine.handles[0].done = True
    t.core.landed(send, 1.2)
    why = PeerGone("decode decode-0 registered again (new incarnation)")
    assert sends(t.core.drain()) == [(D2, failed(5, why, send.bytes))]  # its first error, on the new connection


def test_an_abort_from_another_decode_is_not_confirmed_to_it():
    t = Harness()
    send = t.copying(5)
    t.register(D2, worker_id="decode-1")
    t.core.on_frame(D2, wire.Abort(room=5, reason="not mine"), 0.5)
    assert t.core.drain() == [] and send.fence is None and send.record.state is S.TRANSFERRING


def test_a_failed_verdict_fails_the_request_with_the_decodes_error():
    t = Harness()
    send = t.copying(5)
    t.engine.handles[0].done = True
    t.core.landed(send, 0.1)
    t.core.drain()
    info = ErrorInfo(type="DigestMismatch", message="room 5: digests differ")
    t.core.on_frame(D1, wire.AgentVerdict(room=5, status="failed", error=info), 0.2)
    assert type(send.record.error).__name__ == "DigestMismatch" and str(send.record.error) == "room 5: digests differ"


def test_a_request_asking_less_verification_than_this_prefill_takes_fails_both_sides():
    t = Harness(verify="sampled")
    t.register()
    send = t.sender(5)
    err = VerifyLevelRefused(
        "room 5: the decode asks verification 'off', below this prefill's transfer.verify 'sampled'"
    )
    assert sends(t.request(5)) == [(D1, failed(5, err))] and same(send.record.error, err)


# --- heartbeats, timeouts -------------------------------------------------------------------------


def test_a_silent_decode_is_dropped_and_its_mapping_released_only_after_the_fence():
    t = Harness()
    send = t.copying(5)
    t.core.on_tick(0.4)
    t.core.on_tick(0.8)
    t.core.on_tick(1.2)
    t.core.on_tick(1.6)
    t.core.on_tick(2.0)
    t.core.on_tick(2.4)
    t.core.on_tick(2.8)
    t.core.drain()
    assert D1 in t.core.decodes
    t.core.on_tick(3.2)
    out = t.core.drain()
    assert D1 not in t.core.decodes and not [a for a in out if isinstance(a, Release)]  # a copy into it in flight
    why = "decode decode-0 missed heartbeats for 3 s"
    assert same(send.fence.error, PeerGone(why)) and t.core.peer_log.records()[0].state == "gone"
    t.engine.handles[0].done = True
    t.core.landed(send, 3.3)
    assert t.core.drain() == [Send(D1, failed(5, PeerGone(why), send.bytes)), Release(PEER_ID)]
    assert send.record.state is S.FAILED


def test_a_late_tick_does_not_blame_the_decodes_for_the_time_this_process_did_not_run():
    t = Harness()
    t.register()
    t.core.on_tick(0.4)
    t.core.on_tick(10.0)  # frozen for 9.6 s
    assert D1 in t.core.decodes


def test_a_sender_no_decode_asks_for_fails_at_the_bootstrap_timeout():
    t = Harness(bootstrap_timeout_s=30.0)
    send = t.sender(5, now=1.0)
    t.core.on_tick(31.0)
    assert send.record.state is S.BOOTSTRAPPING
    t.core.on_tick(31.1)
    assert same(send.record.error, TransferFailed("room 5: no decode asked for it within 30 s"))


def test_verdicts_withheld_fail_their_requests_and_then_drop_the_decode():
    t = Harness(verdict_timeout_s=5.0)
    t.register()
    rooms = list(range(10, 10 + MAX_WITHHELD))
    for room in rooms:
        send = t.sender(room)
        t.request(room)
        t.chunk(send)
        t.engine.handles[-1].done = True
        t.core.landed(send, 0.0)
    t.core.drain()
    t.core.on_frame(D1, wire.Heartbeat(worker_id="decode-0", incarnation="d-inc", seq=1), 5.0)
    t.core.on_tick(5.0)
    t.core.drain()
    assert all(t.core.sends[r].record.state is S.TRANSFERRING for r in rooms)
    t.core.on_tick(5.1)
    out = t.core.drain()
    assert out[-1] == Release(PEER_ID)  # dropped: nothing of it in flight
    msgs = [a.msg for a in out if isinstance(a, Send) and isinstance(a.msg, wire.TransferDone)]
    assert [m.error.message for m in msgs] == [
        f"room {r}: decode decode-0 sent no verdict within 5 s (verdict_timeout_s)" for r in rooms
    ]
    assert D1 not in t.core.decodes and t.core.withheld.count == 1
    assert t.core.withheld.latest.message == (
        f"decode decode-0 withheld its verdict on {MAX_WITHHELD} requests in a row (verdict_timeout_s 5 s): dropped"
    )


def test_ended_senders_become_tombstones_then_are_forgotten():
    t = Harness(keep_ended_s=100.0, max_ended=2)
    ended = []
    for room in (1, 2, 3):
        send = t.sender(room)
        t.core.abort(send, "stop", 0.0)
        ended.append(send)
    t.core.on_tick(1.0)
    assert sorted(t.core.sends) == [2, 3] and all(type(t.core.sends[r]) is EndedSender for r in (2, 3))
    assert t.core.sends[3].request is None and ended[2].handles == []
    t.register()
    t.sender(4)
    t.request(4)
    t.core.abort(t.core.sends[4], "stop", 2.0)
    t.core.drain()
    t.core.on_tick(3.0)
    assert t.core.sends[4].request is ANSWERED  # requested once: a late request is not served twice
    t.core.on_tick(101.0)
    assert t.core.sends == {}


# --- refusals -------------------------------------------------------------------------------------


def test_a_refused_decodes_abort_fails_the_room_with_the_refusal():
    t = Harness()
    t.register(engine="mooncake")
    waiting = t.sender(5)
    t.core.on_frame(D1, wire.Abort(room=5, reason="refused"), 0.1)
    t.core.on_frame(D1, wire.Abort(room=6, reason="refused"), 0.1)
    assert t.core.drain() == []
    refusal = "transfer engine mismatch: prefill server uses 'shm', but decode server uses 'mooncake'"
    assert type(waiting.record.error) is EngineError and str(waiting.record.error) == refusal
    later = t.core.refusals.take_refusal(6)
    assert type(later) is EngineError and str(later) == refusal and t.core.refusals.refusal(6) is None


def test_a_decodes_error_for_a_waiting_request_gives_it_up():
    t = Harness()
    t.register()
    t.request(8)
    t.core.on_frame(D1, wire.Error(error=ErrorInfo(type="OutOfPages", message="full"), room=8), 0.1)
    err = TransferFailed("decode reported: OutOfPages: full")
    assert sends(t.core.drain()) == [(D1, failed(8, err))]
    assert same(t.core.refusals.refusal(8), err) and not t.core.refusals.requested(8)


# --- close ----------------------------------------------------------------------------------------


def test_close_fails_live_requests_confirms_their_fences_then_says_goodbye():
    t = Harness()
    send = t.copying(5)
    idle = t.sender(6)
    t.core.close("maintenance", 2.0)
    assert [type(a) for a in t.core.drain()] == [Again]  # room 5 still copying; room 6 had no decode
    assert same(idle.record.error, AgentClosed("maintenance")) and t.core.fencing() == [send]
    t.engine.handles[0].done = True  # the shell waited for it
    t.core.end("maintenance", 2.5)
    assert sends(t.core.drain()) == [
        (D1, failed(5, AgentClosed("maintenance"), send.bytes)),
        (D1, wire.Goodbye(worker_id="prefill-0", incarnation="p-inc", reason="maintenance")),
    ]
    assert send.record.state is S.FAILED and t.core.fencing() == []


# --- no I/O inside ----------------------------------------------------------------------------------

CORE_MODULES = ("prefill_core", "prefill_copy", "fence", "refusals", "fairness")
IO_MODULES = {"zmq", "socket", "threading", "time", "selectors", "asyncio"}


def test_the_core_and_its_objects_import_no_socket_thread_or_clock():
    import ast

    from tests.support.paths import SRC_DIR

    found = {}
    for name in CORE_MODULES:
        tree = ast.parse((SRC_DIR / "pdstate" / "agent" / f"{name}.py").read_text())
        roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        roots |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        found[name] = sorted(roots & IO_MODULES)
    assert found == {name: [] for name in CORE_MODULES}
