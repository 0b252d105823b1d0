"""How a prefill stops: an optional drain, then every request ended and every decode told.

``PrefillShutdown`` is a part of ``PrefillWorker`` (runtime.prefill). ``stop()`` (SIGTERM in
``pdstate serve``) first drains when ``drain_s`` > 0: new requests are refused with
"prefill shutting down: draining" while those in flight may finish, for at most ``drain_s``.
Then the control thread, leaving its loop (``_end_all``): cancels every request still held, waits
for the transfer thread to finish the copy it may be running (so no byte of a request can land
after its decode was told it failed), sends ``goodbye`` to every accepted decode, fails the
requests with "prefill shutting down" on this side, and closes the socket letting the queued
frames flush. A decode that hears the goodbye fails its requests with the same reason and turns
unready for this prefill at once (PROTOCOL.md §5).
"""

from __future__ import annotations

import threading
import time

from pdstate.protocol import wire
from pdstate.protocol.lifecycle import PeerState
from pdstate.runtime.commands import Stop
from pdstate.runtime.worker import log, now

SHUTTING_DOWN = "prefill shutting down"
DRAINING = "prefill shutting down: draining, not taking new requests"
FLUSH_MS = 1000  # how long the closed control socket keeps flushing the goodbyes
TRANSFER_JOIN_S = 10.0


class PrefillShutdown:
    """``stop`` and the control thread's last steps, for ``PrefillWorker``."""

    def stop(self, drain_s: float | None = None) -> None:
        """Stop the worker; ``drain_s`` (default ``opts.drain_s``) lets requests in flight
        finish first. Idempotent; returns once the threads have ended."""
        drain_s = self.opts.drain_s if drain_s is None else drain_s
        if drain_s > 0 and self._threads and not self._stop.is_set():
            self._draining.set()
            deadline = now() + drain_s
            while now() < deadline:
                with self._lock:
                    if not self.jobs:
                        break
                time.sleep(0.01)
        self._stop.set()
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.stop()
            self._inbox.put(Stop())  # wake the control loop
        # The control thread, leaving its loop, cancels every request and then wakes a transfer
        # thread waiting in a fault delay (``_end_all``). Waking it here first let the request it
        # held be copied before its cancellation was written: it ended in Success after SIGTERM.
        for t in self._threads:
            if not t.name.endswith("-transfer"):
                t.join(timeout=10)
        with self._lock:
            jobs = list(self.jobs.values())
        for job in jobs:  # a control thread that did not end in time: wake the delay anyway
            job.cancel_event.set()
        for t in self._threads:
            t.join(timeout=10)
        if runner is not None and not any(t.is_alive() for t in self._threads):
            runner.close()
        self.close_side()

    def _end_all(self) -> None:
        """Control thread, leaving its loop: end every request, tell every decode, close."""
        jobs = list(self.jobs.values())
        for job in jobs:
            self._cancel(job, SHUTTING_DOWN)
        transfer = next((t for t in self._threads if t.name.endswith("-transfer")), None)
        if transfer is not None and transfer is not threading.current_thread():
            transfer.join(timeout=TRANSFER_JOIN_S)  # the copy it may be running lands first
        goodbye = wire.Goodbye(worker_id=self.worker_id, incarnation=self.incarnation, reason=SHUTTING_DOWN)
        told = [
            p for p in self.peers.values() if p.state == PeerState.ACCEPTED and self.server.send(p.identity, goodbye)
        ]
        for job in jobs:
            self._fail(job, job.cancelled)
        log.info("prefill %s stopping: told %d decode(s), ended %d request(s)", self.worker_id, len(told), len(jobs))
        self.server.close(FLUSH_MS)
        self._inbox.close()
