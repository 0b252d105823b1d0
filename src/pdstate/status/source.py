"""``WorkerStatus``: the read-only status source (``api.StatusSource``) over a live worker, and
the one way to stop it (``drain``)."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

from pdstate.protocol.hosts import is_loopback_host
from pdstate.protocol.lifecycle import PeerState
from pdstate.status.models import peer_transport

log = logging.getLogger("pdstate.status.source")


class WorkerStatus:
    """``api.StatusSource`` over a started ``AgentPrefillWorker`` or ``AgentDecodeWorker``.

    ``drain()`` is the one way to stop the worker: idempotent, thread-safe; it marks the source
    as shutting down (so no new transfer is accepted), stops the worker, and completes any future
    the worker did not get to with a failed result.
    """

    def __init__(self, worker, cfg) -> None:
        self.worker = worker
        self.cfg = cfg
        self.role: str = cfg.role
        self.worker_id: str = worker.worker_id
        self.incarnation: str = worker.incarnation
        self.engine: str = cfg.transfer.engine
        self.verify: str = cfg.transfer.verify  # the level asked (``/metrics``: pdstate_verify_level)
        self.transport: dict = worker.transport  # fixed once the engine started
        self.control: str = worker.status().endpoint if cfg.role == "prefill" else cfg.control.peer
        self.report = worker.report
        self.draining = False
        self._lock = threading.Lock()
        self._stopped = False

    # read side: everything that changes comes from the worker's ``status()`` snapshot
    @property
    def stats(self):
        """A consistent copy of the worker's counters (``worker.stats.Stats``)."""
        return self.worker.stats.snapshot()

    def local_check(self):
        r = self.report.local_check
        return r.ok, r.error

    def readiness(self):
        from pdstate.protocol.report import ErrorInfo
        from pdstate.status.api import Readiness

        if self.draining:
            return Readiness(False, "shutting down", "shutdown")
        ok, err = self.local_check()
        if not ok:
            return Readiness(False, err.message, "local_check", err)
        s = self.worker.status()
        problem = self.transport.get("problem")
        if problem:  # e.g. RDMA configured, TCP in use: never serve on a silent fallback
            return Readiness(False, problem, "transport", ErrorInfo(type="EngineError", message=problem))
        if s.dead_threads:  # a worker thread died: nothing would answer (see the worker's log for why)
            return Readiness(False, f"worker thread stopped: {', '.join(s.dead_threads)}", "threads")
        if self.role == "prefill":
            if not s.endpoint:
                return Readiness(False, "control socket not listening", "peer")
            if s.auth_error is not None and not any(p.state.value == "accepted" for p in s.peers):
                # ready (a decode with the right token is served), but say why none is
                return Readiness(True, f"decodes fail auth: {s.auth_error.message}", "auth", s.auth_error)
            if s.dropped is not None:  # ready for the others; one decode starved them and was dropped
                return Readiness(True, f"a decode was dropped: {s.dropped.message}", "fair_share", s.dropped)
            return Readiness(True)
        state = s.peer.state.value
        if state == "accepted":
            return Readiness(True)
        if state == "rejected":
            e = s.peer.error or ErrorInfo(type="RuntimeError", message="handshake refused")
            return Readiness(False, e.message, "handshake", e)
        if state == "gone":  # why: its goodbye's reason, its silence, a restart (the link's error)
            why = s.peer.error.message if s.peer.error is not None else "no heartbeat"
            return Readiness(
                False, f"prefill at {self.control} is gone ({why}); registering again", "peer", s.peer.error
            )
        return Readiness(False, f"waiting for the prefill at {self.control} to answer the handshake", "peer")

    def peers(self) -> list[dict]:
        """Every peer: a prefill's decodes (by worker id), a decode's prefills (by the control
        address it dials, ``control.peer`` first), each with state, error, incarnation,
        layout fingerprint and, once accepted, the transport."""
        accepted = peer_transport(self.transport)
        return [
            {**p.as_dict(), "transport": accepted if p.state is PeerState.ACCEPTED else None}
            for p in self.worker.status().peers
        ]

    def in_flight(self) -> int:
        return self.worker.status().in_flight

    def quarantined(self) -> int:
        """Decode: requests whose pages wait for their prefill's fence (it may still write them)."""
        return self.worker.status().quarantined

    def quarantined_pages(self) -> int:
        """Decode: those requests' main-KV pages."""
        return self.worker.status().quarantined_pages

    def free_counts(self) -> dict[str, int]:
        if self._stopped:
            return {}
        return self.worker.free_counts()

    def result_timeout_s(self) -> float:
        o = self.worker.opts
        return o.request_deadline_s + o.peer_timeout_s + 5

    # decode actions
    def prefill_refused(self, prefill: str) -> str | None:
        """Why ``POST /v1/transfers`` may not name ``prefill`` (None: it may): it must be
        ``control.peer`` or an entry of ``control.prefills``, the exact address. The decode dials
        what a client names and shows it its memory: never an address nobody configured (a
        loopback alias or another port of this host included)."""
        allowed = [self.cfg.control.peer, *(p for p in self.cfg.control.prefills if p != self.cfg.control.peer)]
        if prefill in allowed:
            return None
        return (
            f"prefill {prefill!r} is not one this decode may dial for a transfer "
            f"(control.peer and control.prefills, exact addresses: {allowed})"
        )

    def migration_source_refused(self, address: str) -> str | None:
        """Why ``POST /v1/migrations/incoming`` may not name the listener ``address`` (None: it
        may): a loopback address, or an entry of ``migration.sources`` (the exact address). The
        target dials it and shows it its memory; who it is, the handshake says, never the address."""
        host = address[len("tcp://") :].rsplit(":", 1)[0] if address.startswith("tcp://") else ""
        if is_loopback_host(host) or address in self.cfg.migration.sources:
            return None
        shown = repr(address) if len(repr(address)) <= 200 else repr(address)[:197] + "..."
        return (
            f"migration source {shown} is not a listener this decode may dial: a loopback address, or "
            "an exact entry of migration.sources (list the migrating decode's migration.advertise there)"
        )

    def submit(self, tokens: int, room: int | None, prefill: str | None = None, **running) -> Future:
        """The worker's own future (its map room -> future is the only one): its result is a
        ``TransferResult``; the worker settles it when it ends, at ``drain`` too. ``running``:
        ``hold``, ``steps`` (a request kept running), ``step`` and ``migrated`` (one migrated here)."""
        with self._lock:
            if self.draining:
                fut: Future = Future()
                fut.set_result(self._failed(room or 0, tokens, "decode shutting down"))
                return fut
            return self.worker.submit(tokens, room, prefill=prefill, **running)

    # decode: running requests and their migration (``worker.migrate``)
    def running(self) -> list[dict]:
        return [] if self._stopped else self.worker.running()

    def row(self, room: int) -> Future:
        """A running request's record with the digest of what it holds."""
        return self.worker.row_digest(room)

    def advance(self, room: int, steps: int) -> Future:
        return self.worker.advance(room, steps)

    def release(self, room: int) -> Future:
        return self.worker.release(room)

    def migrate(self, room: int, to: str):
        """``(record, future)``: ``room`` paused and moving to ``to``; ``UnknownRoom`` /
        ``RoomInFlight`` at once."""
        return self.worker.migrations_of().start(room, to)

    def drain_to(self, to: str) -> list:
        return self.worker.migrations_of().drain(to)

    def migration(self, mid: str):
        m = self.worker.migrations
        return None if m is None else m.get(mid)

    def migration_stats(self):
        """``worker.migrate.MigrationStats`` (``None`` before the first migration)."""
        m = getattr(self.worker, "migrations", None)
        return None if m is None else m.stats()

    def lookup(self, room: int) -> dict | None:
        from pdstate.worker.base import now
        from pdstate.worker.status import RequestStatus

        got = self.worker.lookup(room)
        if isinstance(got, RequestStatus):
            return {
                "room": room,
                "status": "in_flight",
                "seq_len": got.seq_len,
                "seconds": now() - got.started,
                "prefill": got.peer or None,
            }
        return None if got is None else got.as_dict()

    def reregister(self) -> None:
        self.worker.reregister()

    @staticmethod
    def _failed(room: int, tokens: int, reason: str) -> dict:
        return {
            "room": room,
            "status": "failed",
            "seq_len": tokens,
            "bytes": 0,
            "descriptors": 0,
            "seconds": 0.0,
            "verified": False,
            "error": {"type": "TransferFailed", "message": reason},
        }

    def drain(self) -> None:
        with self._lock:
            self.draining = True
            if self._stopped:
                return
            self._stopped = True
        self.worker.stop()  # settles every future it returned (``decode shutting down``)


def release_partial(worker) -> None:
    """Free what a worker built before its ``start()`` raised (its shm segments above all); the
    worker's ``start()`` releases it already, so this is the belt to those braces."""
    try:
        worker.close_side()
    except Exception:  # best effort on the way out
        log.debug("releasing a worker after a failed start", exc_info=True)
