"""``WorkerHooks``: fault-injection seams of a worker, for tests. The defaults do nothing.

A worker takes them beside its options (``PrefillWorker(opts, hooks=...)``) and a test may swap
them while it runs (``set_hooks``); production never passes any. Worker processes started by
``pdstate.devtools.processes`` receive them as the ``hooks`` field of their JSON description.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerHooks:
    # prefill: the transfer thread waits this long after computing a request's state and before
    # the engine copy, so a test can kill or freeze a process while requests are TRANSFERRING. The
    # wait ends early when the request is cancelled (peer gone, abort, re-registration, shutdown).
    # While it is set no request runs on the control thread (the wait is the transfer thread's).
    delay_before_copy_s: float = 0.0

    @property
    def delays_copies(self) -> bool:
        return self.delay_before_copy_s > 0

    def before_copy(self, cancelled: threading.Event) -> None:
        """Called by the transfer thread between a job's compute and its copy."""
        if self.delay_before_copy_s > 0:
            cancelled.wait(self.delay_before_copy_s)


NO_HOOKS = WorkerHooks()
