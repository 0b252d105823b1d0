"""``RequestRecord.wait``: a thread waiting for the end is woken at the end only; one waiting for a
step of its own is woken at that step."""

from __future__ import annotations

import threading
import time

from pdstate.agent.common import RequestRecord
from pdstate.protocol.lifecycle import RequestState
from tests.support.bounds import within

S = RequestState


def _waiter(record: RequestRecord, until, out: list) -> threading.Thread:
    def run() -> None:
        state = record.wait(30, until)
        out.append((state, time.monotonic()))

    t = threading.Thread(target=run)
    t.start()
    return t


def _until_waiting(record: RequestRecord, watchers: int) -> None:
    deadline = time.monotonic() + 10
    while record.watchers != watchers:  # the waiter thread has entered ``wait``
        assert time.monotonic() < deadline
        time.sleep(0.001)


def _waited_for(record: RequestRecord, out: list) -> threading.Thread:
    """A thread waiting for ``record``'s end, once it is inside ``wait``."""
    t = _waiter(record, None, out)
    deadline = time.monotonic() + 10
    while record.waiters != 1:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    return t


def test_a_waiter_with_a_predicate_wakes_at_its_step_and_one_without_at_the_end():
    r = RequestRecord(1)
    step, end = [], []
    t_step = _waiter(r, lambda s: s is S.TRANSFERRING, step)
    _until_waiting(r, 1)
    t_end = _waiter(r, None, end)
    r.move(S.WAITING_FOR_INPUT)
    r.move(S.TRANSFERRING)
    t_step.join(5)
    assert [s for s, _ in step] == [S.TRANSFERRING] and end == []
    assert r.watchers == 0
    r.move(S.SUCCESS)
    t_end.join(5)
    assert [s for s, _ in end] == [S.SUCCESS]


def test_a_wait_that_times_out_returns_the_state_and_leaves_no_watcher():
    r = RequestRecord(2)
    r.move(S.WAITING_FOR_INPUT)
    t0 = time.monotonic()
    assert r.wait(0.05, lambda s: s is S.SUCCESS) is S.WAITING_FOR_INPUT
    assert 0.04 < time.monotonic() - t0 < 5 and r.watchers == 0


def test_an_ended_record_drops_its_condition_once_nobody_waits_and_waits_again_at_once():
    r = RequestRecord(3)
    r.move(S.WAITING_FOR_INPUT)
    assert r.changed is None  # nobody waited: none was made
    out: list = []
    t = _waited_for(r, out)
    r.release()
    assert r.changed is not None  # not ended, and waited on: kept
    r.move(S.FAILED)
    t.join(5)
    assert [s for s, _ in out] == [S.FAILED] and r.waiters == 0
    r.release()
    assert r.changed is None
    t0 = time.monotonic()
    assert r.wait(30) is S.FAILED
    within("a wait on an ended record", time.monotonic() - t0, 10.0, 0.01)  # not its 30 s


def test_a_failure_nobody_waits_for_makes_no_condition_and_one_waited_for_wakes_its_waiter():
    from pdstate.errors import TransferFailed

    r = RequestRecord(4)
    assert r.fail(TransferFailed("first")) is True
    assert r.changed is None and r.state is S.FAILED and str(r.error) == "first"
    assert r.fail(TransferFailed("second")) is False and str(r.error) == "first"  # terminal: kept
    assert "failed_at_s" in r.metrics
    waited = RequestRecord(5)
    out: list = []
    t = _waited_for(waited, out)
    assert waited.fail(TransferFailed("seen")) is True
    t.join(5)
    assert [s for s, _ in out] == [S.FAILED] and str(waited.error) == "seen"


def test_done_callbacks_run_once_at_the_end_on_the_ending_thread_or_at_once_when_ended():
    from pdstate.errors import TransferFailed

    r = RequestRecord(6)
    seen: list = []
    r.add_done_callback(lambda rec: seen.append(("first", rec.state, threading.get_ident())))
    r.move(S.WAITING_FOR_INPUT)
    r.move(S.TRANSFERRING)
    assert seen == []  # steps are not the end
    ender = threading.Thread(target=lambda: r.fail(TransferFailed("gone")))
    ender.start()
    ender.join(5)
    assert seen == [("first", S.FAILED, ender.ident)]
    assert r.fail(TransferFailed("again")) is False and len(seen) == 1  # once
    r.add_done_callback(lambda rec: seen.append(("late", rec.state, threading.get_ident())))
    assert seen[-1] == ("late", S.FAILED, threading.get_ident())  # already ended: at once, here


def test_a_failing_done_callback_is_logged_and_the_others_still_run(caplog):
    r = RequestRecord(7)
    seen: list = []
    r.add_done_callback(lambda rec: 1 / 0)
    r.add_done_callback(lambda rec: seen.append(rec.state))
    r.move(S.WAITING_FOR_INPUT)
    r.move(S.TRANSFERRING)
    r.move(S.SUCCESS)
    assert seen == [S.SUCCESS]
    assert any("room 7: a done callback failed" in m for m in caplog.messages)


def test_records_share_no_lock():
    """Each record has its own lock: one held does not stop another record's move."""
    a, b = RequestRecord(8), RequestRecord(9)
    with a.lock:
        done = threading.Event()
        t = threading.Thread(target=lambda: (b.move(S.WAITING_FOR_INPUT), done.set()))
        t.start()
        assert done.wait(5)
    t.join(5)
    assert b.state is S.WAITING_FOR_INPUT
