"""The prefill's data path: each job's (synthesised) compute and engine copy, one job at a time.

``TransferRunner`` owns the transfer thread and its mailbox. The control thread hands it jobs
(``RunJob``) with ``submit``; the thread reports each ``JobOutcome`` to the control thread's
mailbox. ``can_inline()`` (no fault delay, nothing queued or copying) lets the control thread run
a small job itself (``run``) without breaking the one-copy-at-a-time order: only the control
thread hands out jobs, so while it runs one, the thread cannot start another.
"""

from __future__ import annotations

import threading

from pdstate.errors import EngineError, PeerGone
from pdstate.protocol.lifecycle import RequestState, move
from pdstate.protocol.report import ErrorInfo
from pdstate.runtime import synth
from pdstate.runtime.commands import JobOutcome, RunJob, Stop
from pdstate.runtime.mailbox import Mailbox
from pdstate.runtime.records import Job
from pdstate.runtime.worker import now


class TransferRunner:
    """The transfer thread owns its mailbox and, from ``RunJob`` on, the job's compute and copy.

    ``worker`` supplies ``engine`` and ``kv_args`` (set before the thread starts) and ``hooks``.
    Under ``lock`` (the worker's) this thread and the control thread share each job's ``state``
    and ``cancelled`` ("not cancelled? then TRANSFERRING" here and "cancel; still queued?" there
    are atomic) and the count of queued jobs.
    """

    def __init__(self, worker, lock: threading.Lock, outbox: Mailbox) -> None:
        self.worker = worker
        self._lock = lock
        self._inbox = Mailbox()
        self._outbox = outbox
        self._queued = 0  # jobs submitted and not yet reported (under the lock)
        self._stopping = threading.Event()

    def submit(self, job: Job) -> None:
        with self._lock:
            self._queued += 1
        self._inbox.put(RunJob(job))

    def can_inline(self) -> bool:
        """No fault delay to sit out on this thread, and nothing queued or copying."""
        if self.worker.hooks.delays_copies:
            return False
        with self._lock:
            return self._queued == 0

    def stop(self) -> None:
        self._stopping.set()
        self._inbox.put(Stop())

    def close(self) -> None:
        """Release the mailbox once the thread has ended."""
        self._inbox.close()

    def thread_main(self) -> None:
        while True:
            for msg in self._inbox.get():
                if isinstance(msg, Stop) or self._stopping.is_set():
                    return
                out = self.run(msg.job)
                with self._lock:
                    self._queued -= 1
                self._outbox.put(out)

    def run(self, job: Job) -> JobOutcome:
        """Compute the request's state and copy it; never raises (every failure is reported)."""
        w = self.worker
        compute_s = copy_s = 0.0
        error, engine_failed = None, False
        with self._lock:
            if job.cancelled is None:
                move(job, RequestState.TRANSFERRING)
            else:
                error = job.cancelled  # failed already by the control thread (or failing now)
        if error is None:
            try:
                t0 = now()
                synth.fill_source(w.kv_args, job.room, job.alloc.lists)
                compute_s = now() - t0
                w.hooks.before_copy(job.cancel_event)
                with self._lock:
                    cancelled = job.cancelled
                if cancelled is not None:
                    return JobOutcome(job.peer, job.room, cancelled, False, compute_s, 0.0)
                # A peer that is dropped cancels its jobs first (above), and its engine peer stays
                # connected while any of its jobs is in flight.
                if job.engine_peer is None:
                    raise PeerGone("peer gone before the transfer started")
                if len(job.plan):  # (an empty transfer moves nothing: no engine call)
                    t1 = now()
                    handle = w.engine.submit(job.engine_peer, job.plan)
                    w.engine.wait(handle, max(0.001, job.deadline - now()))
                    copy_s = now() - t1
            except Exception as exc:  # engine failures of every kind end the request
                error, engine_failed = ErrorInfo.of(exc), isinstance(exc, EngineError)
        return JobOutcome(job.peer, job.room, error, engine_failed, compute_s, copy_s)
