"""The one step a request of backend ``pdstate`` runs on its agent's I/O thread: SGLang's ``init``
hands the making of the request's agent senders (receivers) there instead of making them on the
scheduler thread (``integrations.sglang.sender`` and ``receiver``).

``post`` runs on SGLang's scheduler thread; the step runs once on the agent's thread unless it was
given up first (the agent closed, or a waiter stopped waiting). ``running`` is True from the post
until the step ran or was given up, and the agent's thread clears it last, under the lock, after
the step wrote what it makes: a poll that reads it False reads those too. ``error`` is what
refused the step (or a later step handed over after it, which sets it), else ``None``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from pdstate.errors import AgentClosed

__all__ = ["PostedStep"]


class PostedStep:
    __slots__ = ("_done", "_lock", "error", "running")

    def __init__(self) -> None:
        self.running = False
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._done: threading.Event | None = None  # made by a waiter (``wait``), set once the step ran

    def post(self, agent, make: Callable[[], BaseException | None]) -> None:
        """Hand ``make`` (it returns what refused it, else ``None``) to ``agent``'s I/O thread.
        Raises ``AgentClosed`` when the agent closed (the step is not running then)."""
        self.running = True
        try:
            agent.post(lambda: self._run(make))
        except AgentClosed:
            self.running = False
            raise

    def _run(self, make: Callable[[], BaseException | None]) -> None:
        with self._lock:
            if not self.running:  # given up: never made now
                return
            try:
                self.error = make()
            finally:
                self.running = False
                done = self._done
        if done is not None:
            done.set()

    def give_up(self) -> bool:
        """Keep the step from running; True when it had not run (it never will now)."""
        with self._lock:
            if not self.running:
                return False
            self.running = False
            return True

    def wait(self, timeout_s: float) -> bool:
        """Wait for the step, at most ``timeout_s`` (no wait when none is running); False when it
        had not run by then (given up: it never runs)."""
        with self._lock:
            done = self._done = threading.Event() if self.running else None
        return done is None or done.wait(timeout_s) or not self.give_up()
