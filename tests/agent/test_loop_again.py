"""``AgentLoop.again``: work that ends off the I/O thread is looked at within milliseconds, not at the next tick."""

from __future__ import annotations

import threading
import time

from pdstate.agent.common import AgentLoop


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
