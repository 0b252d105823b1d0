"""The decode agent's sans-I/O core alone (``pdstate.agent.decode_core``): frames, session events,
ticks and the caller's commands in, exact actions and messages out. No process, thread, socket
or sleep: the clock is the ``now`` each input carries, the engine an in-memory port.

The fences are #35's invariant: a request failed because its prefill went silent is FAILED but
not fenced (no fence callback, counted by ``unfenced``) until that prefill confirms, says
goodbye, restarts or -- with a synchronous engine -- a session it completed closes.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from pdstate.agent.common import RequestRecord
from pdstate.agent.decode_core import (
    DecodeCore,
    DecodeTimers,
    Dial,
    Hangup,
    Notify,
    PickSample,
    Refused,
    RequestForm,
    Send,
)
from pdstate.agent.receiver import Receiving
from pdstate.errors import (
    AgentClosed,
    AuthError,
    DigestMismatch,
    LayoutMismatch,
    PeerGone,
    ProtocolError,
    TransferAborted,
    TransferFailed,
)
from pdstate.pools.reporting import build_report
from pdstate.protocol import handshake as h
from pdstate.protocol import wire
from pdstate.protocol.lifecycle import PeerState, RequestState
from pdstate.protocol.report import ErrorInfo
from tests.support.pools import TINY, kept_pools

PREFILL = "tcp://10.0.0.7:5600"
SHM = wire.EngineDesc(name="shm", endpoint={"segment": "pdstate-test"})
AUX = wire.AuxDest(ptrs=[4096], item_lens=[64], index=0)
STATE_TYPES = ("swa", "c4", "c128")
PAGES = np.array([5, 6, 7], dtype=np.int64)
STATE = [np.array([1], dtype=np.int64), np.array([0], dtype=np.int64), np.array([2], dtype=np.int64)]
GOOD = b"\x11" * 16  # what the fake port hashes the landed bytes to
NONCE = b"n" * 16
_S, _P = RequestState, PeerState


@functools.cache
def side(worker_id: str, incarnation: str) -> h.LocalSide:
    pools = kept_pools(TINY)
    report, kv_args = build_report(pools.target, pools.draft)
    return h.LocalSide(
        worker_id=worker_id, incarnation=incarnation, report=report, kv=wire.KVDesc.of(kv_args), engine=SHM
    )


def accept(incarnation: str = "prefill-inc-1") -> wire.Accept:
    return h.PrefillHandshake(side("prefill-0", incarnation)).receive(
        h.DecodeHandshake(side("decode-0", "d")).register_message()
    )


class FakeDigest:
    def __init__(self, form: str) -> None:
        self.form, self.seconds, self.updates, self.cancelled = form, 0.0, [], False

    def update_async(self, updates) -> None:
        self.updates.append([(c, list(map(int, idx))) for c, idx in updates])
        self.seconds += 0.25

    def cancel(self) -> None:
        self.cancelled = True


class FakePort:
    """The engine port in memory: proofs are a fixed field, digests record what they were fed."""

    def __init__(self) -> None:
        self.proved: list[tuple[bytes, str]] = []
        self.digests: list[FakeDigest] = []
        self.settled: list[list] = []

    def prove(self, nonce: bytes, audience: str) -> dict:
        self.proved.append((nonce, audience))
        return {"proof": "p"}

    def on_device(self) -> bool:
        return False

    def open_digest(self, request, level, form):
        self.digests.append(FakeDigest(form or "host"))
        return self.digests[-1]

    def settle(self, digest, updates):
        self.settled.append([(c, list(map(int, idx))) for c, idx in updates])
        digest.seconds += 0.5
        return GOOD, 0.125


def make(*, digest: bool = True, synchronous: bool = True, now: float = 100.0) -> tuple[DecodeCore, FakePort]:
    port = FakePort()
    core = DecodeCore(
        worker_id="decode-0",
        incarnation="d",
        handshake=h.DecodeHandshake(side("decode-0", "d")),
        form=RequestForm(digest=digest, verify="full" if digest else "off", aux=AUX, state_types=STATE_TYPES),
        port=port,
        synchronous=synchronous,
        timers=DecodeTimers(
            heartbeat_interval_s=0.5, peer_timeout_s=3.0, handshake_timeout_s=10.0, transfer_timeout_s=60.0
        ),
        now=now,
    )
    return core, port


def add(core: DecodeCore, room: int, now: float = 100.0, **kw) -> Receiving:
    return core.add(Receiving(RequestRecord(room), PREFILL), now, **kw)


def sent(core: DecodeCore) -> list[wire.Message]:
    """The messages of the drained actions (every action must be a ``Send`` to PREFILL)."""
    out = core.drain()
    assert all(isinstance(a, Send) and a.peer == PREFILL for a in out), out
    return [a.msg for a in out]


def accepted(room: int = 1, *, now: float = 100.0, init: bool = True, **kw):
    """A core whose prefill accepted it, with request ``room`` sent (``init``); outbox drained."""
    core, port = make(now=now, **kw)
    recv = add(core, room, now)
    core.on_frame(PREFILL, accept(), now + 0.01)
    if init:
        core.init(recv, PAGES, STATE, 3, None, now + 0.02)
    core.drain()
    return core, port, recv


def ticks(core: DecodeCore, start: float, end: float, step: float = 0.1) -> None:
    """Tick as the shell does, every ``step`` from ``start`` to ``end`` (both included): a
    process that runs all along (a late tick is a stall, ``on_tick``)."""
    n = round((end - start) / step)
    for i in range(n + 1):
        core.on_tick(round(start + i * step, 6))


def fences(core: DecodeCore, recv: Receiving) -> list[str]:
    """Register a fence callback; returns the list it appends to once the shell runs it."""
    seen: list[str] = []
    core.on_fence(recv, lambda: seen.append("fenced"))
    return seen


def run_notified(core: DecodeCore) -> list:
    """Run the ``Notify`` actions as the shell does; returns the other actions."""
    rest = []
    for action in core.drain():
        if isinstance(action, Notify):
            action.callback()
        else:
            rest.append(action)
    return rest


# --- handshake -------------------------------------------------------------------------------------


def test_a_new_prefill_is_dialled_then_registered_with():
    core, _ = make()
    recv = add(core, 1)
    assert core.drain() == [Dial(PREFILL), Send(PREFILL, core.register)]
    assert core.register == h.DecodeHandshake(side("decode-0", "d")).register_message()
    assert recv.record.state is _S.BOOTSTRAPPING
    assert core.peers[PREFILL].state is _P.PENDING and core.peers[PREFILL].handshakes == 1


def test_an_accept_sends_the_named_request_with_its_exact_destination():
    core, _ = make()
    recv = add(core, 9)
    core.init(recv, PAGES, STATE, 3, 700, 100.5)
    assert recv.record.state is _S.BOOTSTRAPPING and len(core.drain()) == 2  # not sent before the Accept
    core.on_frame(PREFILL, accept(), 101.0)
    (request,) = sent(core)
    assert request == wire.AgentRequest(
        room=9,
        dst_kv_pages=wire.PackedIndices.pack(PAGES),
        dst_state_indices=[wire.PackedIndices.pack(s) for s in STATE],
        dst_aux=AUX.model_copy(update={"index": 3}),
        digest=True,
        verify=None,
        digest_form=None,
        deadline_s=60.0,
        seq_len=700,
    )
    assert recv.record.state is _S.TRANSFERRING and recv.sent_to == ("prefill-inc-1", 1) and recv.sent_at == 101.0
    assert core.handshakes == {"accepted": 1, "rejected": 0}
    snap = core.snapshot(103.0)[PREFILL]
    assert (snap.state, snap.worker_id, snap.incarnation, snap.handshakes) == (
        "accepted",
        "prefill-0",
        "prefill-inc-1",
        1,
    )
    assert (snap.error, snap.handshake_s, snap.registered_s_ago) == (None, 1.0, 3.0)


def test_a_refusal_fails_the_prefills_requests_with_its_error_and_aborts_their_senders():
    core, _ = make()
    recv = add(core, 4)
    core.drain()
    reject = wire.Reject(worker_id="prefill-0", error=ErrorInfo(type="LayoutMismatch", message="layers differ"))
    core.on_frame(PREFILL, reject, 100.1)
    assert sent(core) == [wire.Abort(room=4, reason="refused: layers differ")]
    assert type(recv.record.error) is LayoutMismatch and str(recv.record.error) == "layers differ"
    p = core.peers[PREFILL]
    assert p.state is _P.REJECTED and p.retry_s == 0.0  # a final refusal: never asked again by itself
    assert core.snapshot(100.1)[PREFILL].reason == "LayoutMismatch: layers differ"
    assert core.handshakes == {"accepted": 0, "rejected": 1}
    core.on_tick(500.0)
    assert core.drain() == []


def test_a_passing_refusal_is_asked_again_with_a_doubling_wait():
    core, _ = make()
    add(core, 1)
    core.drain()
    core.on_frame(
        PREFILL, wire.Reject(worker_id="prefill-0", error=ErrorInfo(type="PrefillBusy", message="busy")), 100.0
    )
    assert sent(core) == [wire.Abort(room=1, reason="refused: busy")]
    assert core.peers[PREFILL].retry_s == 1.0
    ticks(core, 100.1, 100.9)
    assert core.drain() == []
    core.on_tick(101.0)
    assert core.drain() == [Send(PREFILL, core.register)]
    assert core.peers[PREFILL].state is _P.REJECTED and core.peers[PREFILL].retry_s == 2.0
    ticks(core, 101.1, 102.9)
    assert core.drain() == []
    core.on_frame(PREFILL, accept(), 103.0)  # the answer to the retry is taken
    assert core.peers[PREFILL].state is _P.ACCEPTED and core.peers[PREFILL].retry_s == 0.0


def test_a_challenge_is_answered_with_the_proof_bound_to_the_dialled_address():
    core, port = make()
    add(core, 1)
    core.drain()
    core.on_frame(PREFILL, wire.Challenge(worker_id="prefill-0", incarnation="prefill-inc-1", nonce=NONCE), 100.1)
    (register,) = sent(core)
    assert port.proved == [(NONCE, f"decode-0/d@{PREFILL}")]
    assert register.engine.endpoint == {**SHM.endpoint, "proof": "p", "audience": PREFILL}
    core.on_frame(PREFILL, accept(), 100.2)
    core.drain()
    core.on_frame(PREFILL, wire.Challenge(worker_id="prefill-0", incarnation="prefill-inc-1", nonce=NONCE), 100.3)
    assert core.drain() == [] and len(port.proved) == 1  # accepted: no register answers a challenge


def test_an_answer_refused_for_its_auth_tag_refuses_the_prefill_once():
    core, _ = make()
    recv = add(core, 1)
    core.drain()
    core.on_bad_tag(PREFILL, AuthError("frame has no auth tag"))
    err = AuthError(f"prefill {PREFILL} answered: frame has no auth tag")
    (refused, abort) = core.drain()
    assert refused == Refused(PREFILL, refused.error) and str(refused.error) == str(err)
    assert abort == Send(PREFILL, wire.Abort(room=1, reason=f"refused: {err}"))
    assert type(recv.record.error) is AuthError and str(recv.record.error) == str(err)
    assert core.peers[PREFILL].state is _P.REJECTED and core.handshakes["rejected"] == 1
    core.on_bad_tag(PREFILL, AuthError("frame has no auth tag"))  # not an answer awaited any more
    assert core.drain() == []


def test_a_handshake_cut_short_twice_within_the_window_is_a_key_that_differs():
    core, _ = make()
    add(core, 1)
    core.drain()
    cut = AuthError("the prefill closed the connection during the CURVE handshake")
    core.on_auth_failed(PREFILL, cut, True, 100.0)
    assert core.drain() == [] and core.peers[PREFILL].state is _P.PENDING  # once: a prefill that died
    core.on_auth_failed(PREFILL, cut, True, 101.5)
    assert isinstance(core.drain()[0], Refused)
    p = core.peers[PREFILL]
    assert p.state is _P.REJECTED and p.error is cut and p.redial  # its answer is still awaited
    core.on_auth_failed(PREFILL, cut, True, 102.0)
    assert core.drain() == []  # told once per register
    core.on_frame(PREFILL, accept(), 102.5)
    assert core.peers[PREFILL].state is _P.ACCEPTED


# --- requests ---------------------------------------------------------------------------------------


def test_the_callers_mistakes_are_refused_with_their_reason():
    core, _, recv = accepted(2)
    with pytest.raises(ProtocolError, match=f"^room 2 from {PREFILL} already has a live receiver$"):
        add(core, 2)
    with pytest.raises(ProtocolError, match="^room 2: init\\(\\) called twice$"):
        core.init(recv, PAGES, STATE, None, None, 101.0)
    other = add(core, 3)
    with pytest.raises(
        ValueError, match=r"^state_indices: 1 lists given, the layout has 3 components \['swa', 'c4', 'c128'\]$"
    ):
        core.init(other, PAGES, STATE[:1], None, None, 101.0)
    core.form = dataclasses.replace(core.form, aux=None)
    with pytest.raises(ValueError, match="^aux_index given, but this agent's KVArgs has no aux buffers$"):
        core.init(other, PAGES, STATE, 1, None, 101.0)


def test_a_transfer_done_whose_digest_matches_succeeds_and_is_fenced():
    core, port, recv = accepted(5)
    seen = fences(core, recv)
    core.on_frame(PREFILL, wire.TransferDone(room=5, status="success", bytes=4096, descriptors=7, digest=GOOD), 104.0)
    notify, verdict = core.drain()  # fenced as it ended: its callbacks first, then the verdict
    assert notify.room == 5 and verdict == Send(PREFILL, wire.AgentVerdict(room=5, status="success"))
    assert recv.record.state is _S.SUCCESS and recv.fenced and seen == []  # run by the shell, not in here
    notify.callback()
    assert seen == ["fenced"]
    assert port.settled == [[(0, [5, 6, 7]), (1, [1]), (2, [0]), (3, [2]), (4, [3])]]  # all of it, aux last
    m = recv.record.metrics
    assert (m["bytes"], m["descriptors"], m["transfer_s"], m["verify"]) == (4096, 7, 3.98, "full")
    assert (m["digest_s"], m["digest_hashing_s"]) == (0.125, 0.5)
    assert core.unfenced() == 0


@pytest.mark.parametrize("theirs", [b"\x22" * 16, None])
def test_a_digest_that_differs_or_is_missing_fails_both_sides(theirs):
    core, _, recv = accepted(5)
    core.on_frame(PREFILL, wire.TransferDone(room=5, status="success", bytes=4096, digest=theirs), 104.0)
    if theirs is None:
        message = "room 5: the prefill sent no digest"
    else:
        message = (
            f"room 5: digest of the 4096 bytes that landed ({GOOD.hex()}) differs "
            f"from the prefill's digest of the bytes it sent ({theirs.hex()})"
        )
    assert type(recv.record.error) is DigestMismatch and str(recv.record.error) == message
    (verdict,) = sent(core)
    assert verdict == wire.AgentVerdict(
        room=5, status="failed", error=ErrorInfo(type="DigestMismatch", message=message)
    )
    assert recv.fenced  # the prefill's TransferDone: nothing more of it lands


def test_without_digests_nothing_is_hashed_and_the_verdict_is_success():
    core, port, recv = accepted(5, digest=False)
    core.on_frame(PREFILL, wire.Landed(room=5, pages=2), 103.0)
    core.on_frame(PREFILL, wire.TransferDone(room=5, status="success", bytes=1), 104.0)
    assert sent(core) == [wire.AgentVerdict(room=5, status="success")]
    assert port.digests == [] and recv.record.metrics["verify"] == "off" and "landed" not in recv.record.metrics


def test_a_failed_transfer_done_fails_with_the_prefills_error():
    core, _, recv = accepted(5)
    err = ErrorInfo(type="TransferFailed", message="copy failed on the prefill")
    core.on_frame(PREFILL, wire.TransferDone(room=5, status="failed", error=err), 104.0)
    assert core.drain() == []  # the prefill reported it: no verdict goes back
    assert type(recv.record.error) is TransferFailed and str(recv.record.error) == "copy failed on the prefill"
    assert recv.fenced


def test_landed_pages_are_hashed_early_and_only_the_rest_at_transfer_done():
    core, port, recv = accepted(5)
    core.on_frame(PREFILL, wire.Landed(room=5, pages=2), 102.0)
    core.on_frame(PREFILL, wire.Landed(room=5, pages=3, state_landed=True), 102.5)
    (d,) = port.digests
    assert d.updates == [[(0, [5, 6])], [(0, [7]), (1, [1]), (2, [0]), (3, [2]), (4, [3])]]
    assert recv.hashed == (3, True) and recv.record.metrics["landed"] == 2
    core.on_frame(PREFILL, wire.TransferDone(room=5, status="success", digest=GOOD), 103.0)
    assert port.settled == [[]] and recv.record.state is _S.SUCCESS
    assert recv.record.metrics["digest_hashing_s"] == 1.0  # the early parts counted too


def test_a_device_form_digest_at_transfer_done_hashes_everything_again_in_that_form():
    core, port, recv = accepted(5)
    core.on_frame(PREFILL, wire.Landed(room=5, pages=2), 102.0)
    early = port.digests[0]
    core.on_frame(PREFILL, wire.TransferDone(room=5, status="success", digest=GOOD, digest_form="device"), 103.0)
    assert early.cancelled and port.digests[1].form == "device"
    assert port.settled == [[(0, [5, 6, 7]), (1, [1]), (2, [0]), (3, [2]), (4, [3])]]


def test_an_error_frame_fails_its_room_only():
    core, _, recv = accepted(5)
    other = add(core, 6)
    core.on_frame(PREFILL, wire.Error(error=ErrorInfo(type="IndexOutOfRange", message="page 9 of 8"), room=5), 102.0)
    assert str(recv.record.error) == "page 9 of 8" and type(recv.record.error).__name__ == "IndexOutOfRange"
    assert not other.record.state.terminal


# --- aborts and fences ----------------------------------------------------------------------------


def test_an_abort_before_the_request_went_out_fails_and_fences_at_once():
    core, _ = make()
    recv = add(core, 1)
    core.drain()
    core.abort(recv, "caller gave up")
    assert core.drain() == []
    assert type(recv.record.error) is TransferAborted and str(recv.record.error) == "aborted by decode: caller gave up"
    seen = fences(core, recv)
    run_notified(core)
    assert recv.fenced and seen == ["fenced"]


def test_an_abort_after_the_request_went_out_is_fenced_by_the_prefills_transfer_done():
    core, _, recv = accepted(5)
    core.abort(recv, "x" * 2000)
    assert sent(core) == [wire.Abort(room=5, reason="x" * 1024)]
    seen = fences(core, recv)
    assert recv.record.state is _S.TRANSFERRING and run_notified(core) == [] and seen == []
    core.on_frame(PREFILL, wire.TransferDone(room=5, status="failed"), 103.0)
    assert run_notified(core) == [] and seen == ["fenced"]
    assert str(recv.record.error) == "aborted by decode: " + "x" * 2000


def test_a_transfer_without_transfer_done_is_aborted_after_its_timeout():
    core, _, recv = accepted(5)
    core.on_tick(160.0)  # 59.98 s after it went out; heartbeats answered meanwhile
    core.on_frame(PREFILL, wire.Heartbeat(worker_id="prefill-0", incarnation="prefill-inc-1", seq=1), 160.0)
    core.drain()
    core.on_tick(160.03)
    assert wire.Abort(room=5, reason="no TransferDone within transfer_timeout_s=60 s") in sent(core)
    assert recv.aborting is not None and recv.record.state is _S.TRANSFERRING


def test_a_silent_prefills_request_fails_at_once_but_stays_unfenced_until_it_confirms():
    """#35: silence proves nothing; the prefill's late TransferDone, after this decode registered
    with it again, fences the request."""
    core, _, recv = accepted(5)
    seen = fences(core, recv)
    ticks(core, 100.1, 103.0)
    assert recv.record.state is _S.TRANSFERRING  # last seen at 100.01: 2.99 s
    core.on_tick(103.1)  # 3.09 s > peer_timeout_s
    assert all(isinstance(m, wire.Heartbeat) for m in sent(core))
    assert type(recv.record.error) is PeerGone
    assert str(recv.record.error) == f"prefill {PREFILL} missed heartbeats for 3 s"
    assert core.peers[PREFILL].state is _P.GONE
    for t in (110.0, 200.0, 10_000.0):  # nothing but the prefill releases it
        core.on_tick(t)
    assert run_notified(core) == [] and seen == [] and not recv.fenced and core.unfenced() == 1
    assert core.forget(PREFILL) is False  # held: its confirmation is still awaited
    later = add(core, 6, now=10_000.0)  # the prefill is dialled again on a fresh connection
    assert core.drain() == [Dial(PREFILL), Send(PREFILL, core.register)]
    core.on_frame(PREFILL, accept(), 10_000.1)  # the same process, back: asked to confirm
    assert sent(core) == [wire.Abort(room=5, reason="confirm the fence of an earlier registration")]
    assert later.record.state is _S.WAITING_FOR_INPUT and core.peers[PREFILL].epoch == 2
    core.on_frame(PREFILL, wire.TransferDone(room=5, status="failed"), 10_000.2)
    assert run_notified(core) == [] and seen == ["fenced"] and recv.fenced and core.unfenced() == 0


def test_a_goodbye_fails_and_fences_what_went_to_that_process():
    core, _, recv = accepted(5)
    seen = fences(core, recv)
    core.on_frame(
        PREFILL, wire.Goodbye(worker_id="prefill-0", incarnation="prefill-inc-1", reason="prefill shutting down"), 101.0
    )
    assert run_notified(core) == [] and seen == ["fenced"]
    assert type(recv.record.error) is PeerGone and str(recv.record.error) == "prefill shutting down"
    assert core.peers[PREFILL].state is _P.GONE


def test_a_goodbye_of_another_incarnation_changes_nothing():
    core, _, recv = accepted(5)
    core.on_frame(PREFILL, wire.Goodbye(worker_id="prefill-0", incarnation="old", reason="bye"), 101.0)
    assert core.drain() == [] and recv.record.state is _S.TRANSFERRING


def test_a_restarted_prefill_fails_and_fences_what_the_old_process_had():
    core, _, recv = accepted(5)
    seen = fences(core, recv)
    core.on_frame(PREFILL, wire.Heartbeat(worker_id="prefill-0", incarnation="prefill-inc-2", seq=1), 101.0)
    assert sent(core) == [core.register]  # a new process there: register with it
    assert core.peers[PREFILL].state is _P.PENDING
    core.on_frame(PREFILL, accept("prefill-inc-2"), 101.1)
    assert run_notified(core) == [] and seen == ["fenced"]
    assert str(recv.record.error) == f"prefill {PREFILL} restarted (incarnation prefill-inc-1 -> prefill-inc-2)"


def test_a_request_the_new_process_never_saw_is_sent_again_after_its_accept():
    core, _, recv = accepted(5)
    core.on_frame(PREFILL, wire.Error(error=ErrorInfo(type="NotRegistered", message="who?"), room=5), 101.0)
    assert sent(core) == [core.register] and recv.sent_to is None
    core.on_frame(PREFILL, accept("prefill-inc-2"), 101.1)
    (again,) = sent(core)
    assert again == recv.request and recv.record.state is _S.TRANSFERRING and recv.sent_to == ("prefill-inc-2", 2)


@pytest.mark.parametrize(
    ("synchronous", "session_up", "fenced"), [(True, True, True), (False, True, False), (True, False, False)]
)
def test_a_closed_session_fences_only_a_completed_one_with_a_synchronous_engine(synchronous, session_up, fenced):
    core, _, recv = accepted(5, synchronous=synchronous)
    if session_up:
        core.on_session_up(PREFILL)
    ticks(core, 100.1, 103.1)  # silent: failed, unfenced
    core.drain()
    assert recv.record.state is _S.FAILED and not recv.fenced
    core.on_session_closed(PREFILL, 103.2)
    assert recv.fenced is fenced and core.unfenced() == (0 if fenced else 1)


def _async_closed(horizon_s: float = 5.0):
    """An async engine's core (Mooncake, NIXL) whose completed session with the prefill closed at
    100.5, the prefill then silent: its request failed at 103.1, unfenced; a fence callback set."""
    core, _, recv = accepted(5, synchronous=False)
    core.timers = dataclasses.replace(core.timers, dead_prefill_release_s=horizon_s)
    seen = fences(core, recv)
    core.on_session_up(PREFILL)
    ticks(core, 100.1, 100.4)
    core.on_session_closed(PREFILL, 100.5)
    ticks(core, 100.5, 103.1)
    run_notified(core)
    assert recv.record.state is _S.FAILED and not recv.fenced and core.unfenced() == 1 and seen == []
    assert core.quarantined_pages() == len(PAGES)
    return core, recv, seen


def test_an_async_engines_closed_session_fences_its_requests_at_the_horizon_not_before():
    core, recv, seen = _async_closed()
    ticks(core, 103.2, 105.4)
    run_notified(core)
    assert not recv.fenced and seen == [] and core.unfenced() == 1  # 4.9 s after the close
    ticks(core, 105.5, 105.6)
    run_notified(core)
    assert recv.fenced and seen == ["fenced"] and core.unfenced() == 0 and core.quarantined_pages() == 0


def test_a_session_that_completes_again_ends_the_horizon():
    """A reconnection that completes (a blip; the same process alive): no release, ever."""
    core, recv, seen = _async_closed()
    core.on_session_up(PREFILL)
    ticks(core, 103.2, 120.0)
    run_notified(core)
    assert not recv.fenced and seen == [] and core.unfenced() == 1


def test_a_stall_of_this_decode_moves_the_horizon():
    """A decode that did not run for 3 s (a tick 3 s late: 2 s past two heartbeat intervals)
    waits as much longer: its own buffers may still hold bytes of the dead prefill."""
    core, recv, seen = _async_closed()
    core.on_tick(106.1)  # stalled 2.0 s: the horizon ends at 107.5
    ticks(core, 106.2, 107.4)
    run_notified(core)
    assert not recv.fenced and seen == []
    ticks(core, 107.5, 107.6)
    run_notified(core)
    assert recv.fenced and seen == ["fenced"]


# --- the clock ----------------------------------------------------------------------------------------


def test_heartbeats_go_out_every_interval_and_answers_keep_the_prefill():
    core, _, _ = accepted(5, init=False)
    hb = [wire.Heartbeat(worker_id="decode-0", incarnation="d", seq=n) for n in (1, 2)]
    core.on_tick(100.3)
    assert sent(core) == [hb[0]]
    core.on_tick(100.6)
    assert sent(core) == []
    core.on_tick(100.8)
    assert sent(core) == [hb[1]]
    core.on_frame(PREFILL, wire.Heartbeat(worker_id="prefill-0", incarnation="prefill-inc-1", seq=1), 102.0)
    ticks(core, 100.9, 104.9)
    assert core.peers[PREFILL].state is _P.ACCEPTED  # seen at 102.0
    core.on_tick(105.1)
    assert core.peers[PREFILL].state is _P.GONE


def test_a_tick_that_came_late_does_not_blame_the_prefill_for_the_stall():
    core, _, recv = accepted(5)
    core.on_tick(100.1)
    core.on_tick(110.0)  # this process did not run for 9.9 s: 8.9 of them are not the prefill's
    ticks(core, 110.1, 111.9)
    assert core.peers[PREFILL].state is _P.ACCEPTED and recv.record.state is _S.TRANSFERRING
    core.on_tick(112.0)  # 100.01 + 8.9 + 3 s of silence
    assert core.peers[PREFILL].state is _P.GONE


def test_an_unanswered_handshake_fails_the_prefills_requests():
    core, _ = make()
    recv = add(core, 1)
    core.on_tick(110.0)
    assert recv.record.state is _S.BOOTSTRAPPING
    core.on_tick(110.01)
    assert str(recv.record.error) == f"prefill {PREFILL} did not answer the handshake within 10 s"
    assert core.peers[PREFILL].state is _P.GONE and recv.fenced  # never told where to write


def test_ended_requests_are_forgotten_at_a_tick_and_their_hashing_dropped():
    core, port, recv = accepted(5)
    core.on_frame(PREFILL, wire.Landed(room=5, pages=1), 101.0)
    core.abort(recv, "stop")
    core.on_frame(PREFILL, wire.TransferDone(room=5, status="failed"), 101.1)
    assert (PREFILL, 5) in core.recvs
    core.on_tick(101.2)
    assert (PREFILL, 5) not in core.recvs and port.digests[0].cancelled and recv.digest is None


# --- peers ----------------------------------------------------------------------------------------


def test_a_gone_prefill_fails_a_new_request_with_its_reason_when_not_redialled():
    core, _, _ = accepted(5)
    ticks(core, 100.1, 103.1)
    core.drain()
    recv = add(core, 6, now=104.0, redial_gone=False)
    assert core.drain() == []
    assert (
        type(recv.record.error) is PeerGone and str(recv.record.error) == f"prefill {PREFILL} missed heartbeats for 3 s"
    )


def test_connect_redials_a_gone_prefill_at_most_every_redial_interval():
    core, _, _ = accepted(5, init=False)
    ticks(core, 100.1, 103.1)
    core.drain()
    core.connect(PREFILL, 104.0)
    assert core.drain() == [Dial(PREFILL), Send(PREFILL, core.register)]
    p = core.peers[PREFILL]
    assert p.state is _P.GONE and p.redial and str(p.error) == f"prefill {PREFILL} missed heartbeats for 3 s"
    core.connect(PREFILL, 104.5)
    assert core.drain() == []
    core.connect(PREFILL, 105.0)
    assert core.drain() == [Dial(PREFILL), Send(PREFILL, core.register)]
    core.on_frame(PREFILL, accept(), 105.1)
    assert core.peers[PREFILL].state is _P.ACCEPTED and core.peers[PREFILL].error is None


def test_forget_hangs_up_only_on_a_prefill_without_requests():
    core, _, recv = accepted(5)
    assert core.forget(PREFILL) is False
    core.on_frame(PREFILL, wire.TransferDone(room=5, status="success", digest=GOOD), 101.0)
    core.on_tick(101.1)
    core.drain()
    assert core.forget(PREFILL) is True and core.drain() == [Hangup(PREFILL)] and PREFILL not in core.peers


def test_reregister_asks_an_accepted_prefill_again_on_the_same_connection():
    core, _, _ = accepted(5, init=False)
    core.reregister(PREFILL, 101.0)
    assert sent(core) == [core.register]
    assert core.peers[PREFILL].state is _P.PENDING and core.peers[PREFILL].handshakes == 2


def test_close_fails_live_requests_and_drops_their_hashing():
    core, port, recv = accepted(5)
    core.on_frame(PREFILL, wire.Landed(room=5, pages=1), 101.0)
    core.close()
    assert type(recv.record.error) is AgentClosed and str(recv.record.error) == "decode shutting down"
    assert port.digests[0].cancelled and not recv.fenced  # the prefill was told where to write


def test_a_sampled_decode_on_a_device_asks_for_a_sampled_device_form_digest():
    core, port = make()
    core.form = dataclasses.replace(core.form, verify="sampled")
    port.on_device = lambda: True
    recv = add(core, 1)
    core.on_frame(PREFILL, accept(), 100.1)
    core.init(recv, PAGES, STATE, None, None, 100.2)
    *_, send, pick = core.drain()
    request = send.msg
    assert (request.digest, request.verify, request.digest_form, request.dst_aux) == (True, "sampled", "device", None)
    assert pick == PickSample(recv)


def test_a_sampled_request_opens_its_digest_only_after_its_frame_went_out():
    """The request's frame is the last ``Send`` before ``PickSample``; the digest is opened when
    the shell gives the core ``pick_sample`` back, and not for a request aborted meanwhile."""
    core, port = make()
    core.form = dataclasses.replace(core.form, verify="sampled")
    recv = add(core, 1)
    core.on_frame(PREFILL, accept(), 100.1)
    core.drain()
    core.init(recv, PAGES, STATE, None, None, 100.2)
    actions = core.drain()
    assert [type(a) for a in actions] == [Send, PickSample] and type(actions[0].msg) is wire.AgentRequest
    assert port.digests == []  # nothing opened before the frame went out
    core.pick_sample(recv)
    assert len(port.digests) == 1 and recv.digest is port.digests[0]
    ended = add(core, 2)
    core.init(ended, PAGES, STATE, None, None, 100.3)
    *_, pick = core.drain()
    core.abort(ended, "stop")
    core.pick_sample(pick.recv)
    assert len(port.digests) == 1 and ended.digest is None


def test_frames_of_an_unknown_prefill_or_an_aborting_room_change_nothing():
    core, port, recv = accepted(5)
    core.on_frame("tcp://10.0.0.8:5600", wire.TransferDone(room=5, status="success", digest=GOOD), 101.0)
    core.on_frame(PREFILL, wire.Heartbeat(worker_id="prefill-0", incarnation="prefill-inc-1", seq=9), 101.0)
    assert core.drain() == [] and recv.record.state is _S.TRANSFERRING
    core.abort(recv, "stop")
    core.drain()
    core.on_frame(PREFILL, wire.Landed(room=5, pages=3), 101.1)  # its pages may be the caller's again soon
    assert port.digests == [] and "landed" not in recv.record.metrics


def test_a_late_transfer_done_of_an_ended_room_confirms_it_only_when_it_was_sent():
    core, _ = make()
    never = add(core, 1)
    core.abort(never, "early")  # never told where to write: fenced already
    core.on_frame(PREFILL, accept(), 100.1)
    core.drain()
    core.on_frame(PREFILL, wire.TransferDone(room=1, status="failed"), 100.2)
    assert core.drain() == [] and never.fenced and not never.acked
