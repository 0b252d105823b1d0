"""``AgentLoop.again``: work that ends off the I/O thread is looked at within milliseconds, not at the next tick."""

from __future__ import annotations

import threading
import time

from pdstate.agent.common import AgentLoop
from tests.support.bounds import within


def test_a_check_runs_long_before_the_next_tick_and_can_re_arm():
    ticks: list[float] = []
    loop = AgentLoop("again-test", 30.0, lambda: ticks.append(time.monotonic()))
    loop.start()
    try:
        calls: list[float] = []
        done = threading.Event()

        def check() -> None:
            calls.append(time.monotonic())
            if len(calls) < 3:
                loop.again("k", check)  # not there yet: look again
            else:
                done.set()

        t0 = time.monotonic()
        loop.call(lambda: loop.again("k", check))
        assert done.wait(5.0), "the checks did not run before the 30 s tick"
        assert len(calls) == 3 and calls[-1] - t0 < 5.0
        assert len(ticks) <= 1  # the tick (at start) is not what ran them
    finally:
        loop.stop(lambda: None)


def test_one_check_per_key_the_last_given():
    loop = AgentLoop("again-key", 30.0, lambda: None)
    loop.start()
    try:
        seen: list[str] = []
        done = threading.Event()

        def arm() -> None:
            loop.again("same", lambda: seen.append("first"))
            loop.again("same", lambda: (seen.append("second"), done.set()))

        loop.call(arm)
        assert done.wait(5.0)
        assert seen == ["second"]
    finally:
        loop.stop(lambda: None)


def test_a_call_the_ended_loop_never_runs_raises_agent_closed_at_once():
    """A call queued while the loop ends (an agent closing under a caller's thread) is answered
    ``AgentClosed`` as soon as the loop has ended, not after the call's 30 s timeout."""
    import pytest

    from pdstate.errors import AgentClosed

    loop = AgentLoop("ended-test", 0.05, lambda: None)
    loop.start()
    try:
        loop.end()  # the loop ends at its next turn, as in ``stop`` after ``final``
        deadline = time.monotonic() + 5.0
        while loop.alive:  # ended, not closed: a call still queues its work
            assert time.monotonic() < deadline, "the loop's thread did not end"
            time.sleep(0.01)
        assert not loop.closed
        t0 = time.monotonic()
        with pytest.raises(AgentClosed, match="the agent is closed"):
            loop.call(lambda: 1, timeout_s=30.0)
        within("a call on an ended loop", time.monotonic() - t0, 10.0, 0.01)  # not its 30 s timeout
    finally:
        loop.stop(lambda: None)
