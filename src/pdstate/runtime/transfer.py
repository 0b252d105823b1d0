"""The prefill's data path: each job's (synthesised) compute and engine copy, one job at a time.

``TransferRunner`` owns the transfer thread and its queue. The control thread hands it jobs with
``submit``; the thread reports each ``JobOutcome`` back over an inproc PUSH socket the control
thread polls. ``idle()`` (nothing queued or copying) lets the control thread run a small job
itself (``run``) without breaking the one-copy-at-a-time order: only the control thread hands
out jobs, so while it runs one, the thread cannot start another.
"""

from __future__ import annotations

import queue
import threading

import zmq

from pdstate.errors import EngineError, PeerGone
from pdstate.protocol.lifecycle import RequestState, advance
from pdstate.protocol.report import ErrorInfo
from pdstate.runtime import synth
from pdstate.runtime.common import now
from pdstate.runtime.records import Job, JobOutcome


class TransferRunner:
    """``worker`` supplies ``engine``, ``peers``, ``kv_args``, ``ctx``, the live test knob
    ``fault_delay_before_copy_s`` and ``claim``: the lock that makes "not cancelled? then
    TRANSFERRING" here and "cancel; still queued?" on the control thread atomic."""

    def __init__(self, worker, results_addr: str) -> None:
        self.worker = worker
        self.results_addr = results_addr
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._queued = 0  # jobs submitted and not yet reported (under worker.claim)
        self._stopping = threading.Event()

    def submit(self, job: Job) -> None:
        with self.worker.claim:
            self._queued += 1
        self._queue.put(job)

    def idle(self) -> bool:
        with self.worker.claim:
            return self._queued == 0

    def stop(self) -> None:
        self._stopping.set()
        self._queue.put(None)

    def thread_main(self) -> None:
        push = self.worker.ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(self.results_addr)
        try:
            while True:
                job = self._queue.get()
                if job is None or self._stopping.is_set():
                    return
                out = self.run(job)
                with self.worker.claim:
                    self._queued -= 1
                push.send_pyobj(out)
        finally:
            push.close(0)

    def run(self, job: Job) -> JobOutcome:
        """Compute the request's state and copy it; never raises (every failure is reported)."""
        w = self.worker
        compute_s = copy_s = 0.0
        error, engine_failed = None, False
        with w.claim:
            if job.cancelled is None:
                job.state = advance(job.state, RequestState.TRANSFERRING)
            else:
                error = job.cancelled  # failed already by the control thread (or failing now)
        if error is None:
            try:
                t0 = now()
                synth.fill_source(w.kv_args, job.room, job.alloc.lists)
                compute_s = now() - t0
                delay_s = w.fault_delay_before_copy_s
                if delay_s > 0:
                    job.cancel_event.wait(delay_s)
                if job.cancelled is not None:
                    return JobOutcome(job.peer, job.room, job.cancelled, False, compute_s, 0.0)
                peer = w.peers.get(job.peer)
                if peer is None or peer.engine_peer is None:
                    raise PeerGone("peer gone before the transfer started")
                t1 = now()
                handle = w.engine.submit(peer.engine_peer, job.plan)
                w.engine.wait(handle, max(0.001, job.deadline - now()))
                copy_s = now() - t1
            except Exception as exc:  # engine failures of every kind end the request
                error, engine_failed = ErrorInfo.of(exc), isinstance(exc, EngineError)
        return JobOutcome(job.peer, job.room, error, engine_failed, compute_s, copy_s)
