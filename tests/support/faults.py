"""Fault injection: short timers, and the workers' knob that holds a prefill's copies.

This is the one place the tests name the knob (``WorkerHooks.delay_before_copy_s``, passed beside a
worker's options, and the worker process's ``fault`` command): a test holds copies with
``**hold_copies()`` in ``Workers.prefill(...)`` (a worker process) or ``holding_hooks()`` as an in-process
``AgentPrefillWorker``'s hooks, and lets them go with ``release_copies(worker)``.
"""

from __future__ import annotations

from typing import Any

from pdstate.devtools.processes import WorkerProcess
from pdstate.worker.options import WorkerHooks
from pdstate.worker.prefill import AgentPrefillWorker

HEARTBEAT_S = 0.2
PEER_TIMEOUT_S = 1.0
# Short timers: a dead or frozen peer is declared gone after PEER_TIMEOUT_S of silence.
FAULT = dict(heartbeat_interval_s=HEARTBEAT_S, peer_timeout_s=PEER_TIMEOUT_S, request_deadline_s=20.0)
# How late after the timeout a detection may come (a bound of ``tests.support.bounds``): one
# heartbeat/timer tick and a status poll, DETECT_LATE_QUIET_S on a quiet machine, and scheduling
# noise on a small, busy one.
DETECT_SLACK_S, DETECT_LATE_QUIET_S = 2.0, 0.4
# The prefill's copy waits this long (fault injection) so a test can act while requests are
# TRANSFERRING; cancellation (peer gone, abort, re-registration) ends the wait early.
LONG_DELAY_S = 30.0


def holding_hooks(delay_s: float = LONG_DELAY_S) -> WorkerHooks:
    """Hooks that make a prefill wait ``delay_s`` before each copy."""
    return WorkerHooks(delay_before_copy_s=delay_s)


def hold_copies(delay_s: float = LONG_DELAY_S) -> dict[str, Any]:
    """``Workers.prefill`` keywords that make the prefill process wait ``delay_s`` before each copy."""
    return {"hooks": holding_hooks(delay_s)}


def release_copies(prefill: AgentPrefillWorker | WorkerProcess) -> None:
    """Later copies of ``prefill`` (in this process, or a worker process) start without a wait."""
    if isinstance(prefill, WorkerProcess):
        prefill.command({"cmd": "fault", "delay_before_copy_s": 0.0}, "fault")
    else:
        prefill.set_hooks(WorkerHooks())
