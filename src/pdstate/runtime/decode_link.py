"""The decode's link to its prefill: the handshake and its answers, heartbeats, the prefill
declared gone, and the views of that state other threads read.

``PrefillLinkMixin`` is a part of ``DecodeWorker`` (runtime.decode): its ``_``-methods run on the
worker's control thread, which changes ``_link`` (the prefill's state, error and incarnation) and
``_handshake_s`` under the worker's ``_lock``; the public ones read them under it from any thread.
"""

from __future__ import annotations

from pdstate.errors import error_from_wire
from pdstate.protocol import wire
from pdstate.protocol.lifecycle import PeerState, move
from pdstate.protocol.report import ErrorInfo
from pdstate.runtime.records import PrefillLink
from pdstate.runtime.worker import log, now


class PrefillLinkMixin:
    """Register, answers, heartbeats and the prefill's departure, for ``DecodeWorker``."""

    _link: PrefillLink
    _handshake_s: float | None

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Block until the handshake is answered; raises the refusal, or ``TimeoutError``."""
        if not self._answered.wait(timeout_s):
            raise TimeoutError(f"no handshake answer from {self.opts.peer} within {timeout_s:.1f} s")
        with self._lock:
            state, error = self._link.state, self._link.error
        if state != PeerState.ACCEPTED:
            raise error_from_wire(error.type, error.message)

    @property
    def ready(self) -> bool:
        with self._lock:
            return self._link.state == PeerState.ACCEPTED

    def rehandshake(self, timeout_s: float = 30.0) -> float:
        """Register again and wait for the answer; returns the handshake's seconds (or raises the
        refusal). Used by operators after fixing a prefill, and by the benchmark."""
        self._answered.clear()
        self.reregister()
        self.wait_ready(timeout_s)
        return self.handshake_s

    @property
    def peer_error(self) -> ErrorInfo | None:
        """Why the prefill refused this decode (or could not be reached), if it did."""
        with self._lock:
            return self._link.error

    @property
    def handshake_s(self) -> float | None:
        with self._lock:
            return self._handshake_s

    def _send_register(self) -> None:
        self._register_sent = now()
        self.client.send(self.handshake.register_message())

    def _on_challenge(self, msg: wire.Challenge) -> None:
        """The prefill asks this decode to prove it owns the memory its register names: register
        again with the answer. Only while a register is outstanding (a late challenge to a register
        sent twice must not re-register an accepted decode)."""
        if self._link.state not in (PeerState.PENDING, PeerState.GONE):
            return
        proof = self.engine.prove(msg.nonce, f"{self.worker_id}/{self.incarnation}")
        self.client.send(self.handshake.register_message(proof))

    def _heartbeat(self, t: float) -> None:
        if self._link.state == PeerState.ACCEPTED:
            self.client.send(wire.Heartbeat(worker_id=self.worker_id, incarnation=self.incarnation, seq=int(t * 1000)))
            if t - self._last_heard > self.opts.peer_timeout_s:
                self._peer_gone(f"prefill gone: no heartbeat for {self.opts.peer_timeout_s:.1f} s")
        elif self._link.state in (PeerState.PENDING, PeerState.GONE):
            self._send_register()  # (re)register until answered; a rejected decode waits to be asked

    def _resumed(self, gap_s: float) -> None:
        """The control loop did not run for ``gap_s`` (SIGSTOP, a starved host): the prefill's
        silence meanwhile says nothing about the prefill. Give it a fresh timeout and ask at once;
        if it dropped this decode meanwhile it answers ``NotRegistered`` and we register again."""
        log.warning("this decode did not run for %.1f s (stopped or starved); asking the prefill", gap_s)
        self._last_heard = now()
        self._heartbeat(self._last_heard)

    def _on_goodbye(self, msg: wire.Goodbye) -> None:
        """The prefill is stopping: its requests end now with its reason, this decode is unready
        for it and registers again (every heartbeat interval) until it is back."""
        if self._link.state != PeerState.ACCEPTED:
            return
        log.warning("prefill %s said goodbye: %s", msg.worker_id, msg.reason)
        self._move_link(PeerState.GONE, ErrorInfo(type="PeerGone", message=msg.reason))
        self._peer_gone(msg.reason)

    def _move_link(self, state: PeerState, error: ErrorInfo | None) -> None:
        """The prefill's new state (and error); the same state again only updates the error."""
        with self._lock:
            self._link.error = error
            if self._link.state != state:
                move(self._link, state)

    def _peer_gone(self, reason: str) -> None:
        log.warning("%s", reason)
        self._move_link(PeerState.GONE, self._link.error)
        with self._lock:
            quarantined = list(self.quarantine.values())
            self.quarantine.clear()
        for alloc in quarantined:  # the old prefill can no longer write into them
            self._free(alloc)
        for req in list(self.requests.values()):
            self._finish(req, "failed", error=ErrorInfo(type="PeerGone", message=reason))

    def _refused(self, error: ErrorInfo) -> None:
        self._move_link(PeerState.REJECTED, error)
        self.stats.handshake("rejected")
        log.error("handshake refused: %s: %s", error.type, error.message)
        self._answered.set()

    def _on_handshake(self, msg) -> None:
        if isinstance(msg, wire.Reject) and self._link.state == PeerState.REJECTED:
            return  # the second answer to a register sent twice (resent while pending): one refusal
        try:
            accept = self.handshake.receive(msg)
        except Exception as exc:  # any refusal: upstream RuntimeErrors, VersionMismatch, EngineError, ...
            error = ErrorInfo.of(exc)
            self._move_link(PeerState.REJECTED, error)
            self.stats.handshake("rejected")
            log.error("handshake refused: %s: %s", type(exc).__name__, exc)
            if isinstance(msg, wire.Accept):  # we refuse the prefill: it records the same error
                self.client.send(wire.Reject(worker_id=self.worker_id, error=error))
            self._answered.set()
            return
        with self._lock:
            self._link.incarnation = accept.incarnation
            self._handshake_s = now() - self._register_sent
            self._link.error = None
            if self._link.state != PeerState.ACCEPTED:  # (a second answer to a register sent twice)
                move(self._link, PeerState.ACCEPTED)
        self.stats.handshake("accepted")
        self._answered.set()
        log.info("accepted by prefill %s in %.2f ms", accept.worker_id, self._handshake_s * 1e3)
