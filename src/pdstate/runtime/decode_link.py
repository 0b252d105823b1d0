"""The decode's links to its prefills, one per control address: connecting on first use, the
handshake and its answers, heartbeats, a prefill declared gone, and the views other threads read.

``PrefillLinkMixin`` is a part of ``DecodeWorker`` (runtime.decode): its ``_``-methods run on the
worker's control thread, which changes each link's state, error, incarnation, fingerprint and
handshake time under the worker's ``_lock``; the public ones read them under it from any thread.
The link to ``opts.peer`` (``_link``) exists from the start and is what ``ready``, ``wait_ready``
and ``peer_error`` describe; a link to any other prefill is made when a request first names it.

Every link is on its own: a request aimed at a prefill waits for that prefill's first handshake
answer, fails at once with the refusal when it refused this decode (a refusal older than the peer
timeout is asked again first: the prefill may have been fixed), and fails with the reason when that
prefill is gone; a prefill that restarts is registered with again. Nothing that happens on one link
ends a request aimed at another.
"""

from __future__ import annotations

import zmq

from pdstate.errors import error_from_wire
from pdstate.protocol import wire
from pdstate.protocol.lifecycle import PeerState, RequestState, move
from pdstate.protocol.report import ErrorInfo
from pdstate.runtime.control import ControlClient
from pdstate.runtime.records import PrefillLink, Request
from pdstate.runtime.worker import log, now

MAX_PREFILLS = 64  # prefill links one decode keeps; an idle one is dropped to make room


class PrefillLinkMixin:
    """Links, registers, answers, heartbeats and prefills' departures, for ``DecodeWorker``."""

    _link: PrefillLink  # the link to ``opts.peer``
    _links: dict[str, PrefillLink]  # every link by control address, ``_link`` first

    # -- views for other threads (the default prefill) -----------------------------------------
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
            return self._link.handshake_s

    # -- links (control thread) ---------------------------------------------------------------
    def _connect(self, link: PrefillLink) -> None:
        """Open the link's DEALER socket, poll it, and register."""
        identity = f"{self.worker_id}/{self.incarnation}".encode()
        client = ControlClient(zmq.Context.instance(), link.endpoint, identity, self.opts.token)
        client.open()  # a malformed address raises here (zmq.ZMQError)
        link.client = client
        link.last_heard = now()
        self._by_socket[client.sock] = link
        self._poller.register(client.sock, zmq.POLLIN)
        self._send_register(link)

    def _link_for(self, endpoint: str) -> PrefillLink:
        """The link to ``endpoint``, connected now if this is its first use. Raises ``ValueError``
        (a bad address, or too many prefills in use)."""
        link = self._links.get(endpoint)
        if link is not None:
            return link
        if len(self._links) >= MAX_PREFILLS and not self._drop_idle_link():
            raise ValueError(f"this decode already uses {MAX_PREFILLS} prefills, each with requests in flight")
        link = PrefillLink(endpoint)
        try:
            self._connect(link)
        except zmq.ZMQError as exc:
            self._disconnect(link)
            raise ValueError(f"cannot dial prefill {endpoint!r}: {exc}") from None
        with self._lock:
            self._links[endpoint] = link
        return link

    def _drop_idle_link(self) -> bool:
        """Forget the oldest link (never ``_link``) with nothing in flight or quarantined."""
        busy = {r.prefill for r in self.requests.values()} | {ep for ep, _ in self.quarantine}
        for endpoint, link in self._links.items():
            if link is not self._link and endpoint not in busy:
                with self._lock:
                    del self._links[endpoint]
                self._disconnect(link)
                return True
        return False

    def _disconnect(self, link: PrefillLink) -> None:
        if link.client is not None and link.client.sock is not None:
            self._by_socket.pop(link.client.sock, None)
            self._poller.unregister(link.client.sock)
            link.client.close()

    def _close_links(self) -> None:
        for link in list(self._links.values()):
            self._disconnect(link)

    def _send_register(self, link: PrefillLink) -> None:
        link.register_sent = now()
        link.client.send(self.handshake.register_message())

    def _reregister(self, link: PrefillLink) -> None:
        self._move_link(link, PeerState.PENDING, link.error)
        self._send_register(link)

    def _on_challenge(self, link: PrefillLink, msg: wire.Challenge) -> None:
        """The prefill asks this decode to prove it owns the memory its register names: register
        again with the answer. Only while a register is outstanding (a late challenge to a register
        sent twice must not re-register an accepted decode)."""
        if link.state not in (PeerState.PENDING, PeerState.GONE):
            return
        proof = self.engine.prove(msg.nonce, f"{self.worker_id}/{self.incarnation}")
        link.client.send(self.handshake.register_message(proof))

    def _heartbeat(self, t: float) -> None:
        for link in list(self._links.values()):
            if link.state == PeerState.ACCEPTED:
                link.client.send(
                    wire.Heartbeat(worker_id=self.worker_id, incarnation=self.incarnation, seq=int(t * 1000))
                )
                if t - link.last_heard > self.opts.peer_timeout_s:
                    self._peer_gone(link, f"prefill gone: no heartbeat for {self.opts.peer_timeout_s:.1f} s")
            elif link.state in (PeerState.PENDING, PeerState.GONE):
                self._send_register(link)  # (re)register until answered; a rejected decode waits to be asked

    def _resumed(self, gap_s: float) -> None:
        """The control loop did not run for ``gap_s`` (SIGSTOP, a starved host): the prefills'
        silence meanwhile says nothing about them. Give each a fresh timeout and ask at once; one
        that dropped this decode meanwhile answers ``NotRegistered`` and we register again."""
        log.warning("this decode did not run for %.1f s (stopped or starved); asking the prefills", gap_s)
        t = now()
        for link in self._links.values():
            link.last_heard = t
        self._heartbeat(t)

    def _on_goodbye(self, link: PrefillLink, msg: wire.Goodbye) -> None:
        """The prefill is stopping: its requests end now with its reason, this decode is unready
        for it and registers again (every heartbeat interval) until it is back."""
        if link.state != PeerState.ACCEPTED:
            return
        log.warning("prefill %s said goodbye: %s", msg.worker_id, msg.reason)
        self._move_link(link, PeerState.GONE, ErrorInfo(type="PeerGone", message=msg.reason))
        self._peer_gone(link, msg.reason)

    def _move_link(self, link: PrefillLink, state: PeerState, error: ErrorInfo | None) -> None:
        """The prefill's new state (and error); the same state again only updates the error."""
        with self._lock:
            link.error = error
            if link.state != state:
                move(link, state)

    def _peer_gone(self, link: PrefillLink, reason: str) -> None:
        log.warning("%s (%s)", reason, link.endpoint)
        self._move_link(link, PeerState.GONE, ErrorInfo(type="PeerGone", message=reason))
        with self._lock:
            mine = [key for key in self.quarantine if key[0] == link.endpoint]
            quarantined = [self.quarantine.pop(key) for key in mine]
        for alloc in quarantined:  # the old prefill can no longer write into them
            self._free(alloc)
        for req in list(self.requests.values()):
            if req.prefill == link.endpoint:
                self._finish(req, "failed", error=ErrorInfo(type="PeerGone", message=reason))
        if quarantined:
            self._admit()

    def _refused(self, link: PrefillLink, error: ErrorInfo) -> None:
        self._move_link(link, PeerState.REJECTED, error)
        self.stats.handshake("rejected")
        log.error("handshake with %s refused: %s: %s", link.endpoint, error.type, error.message)
        self._answered_by(link)

    def _answered_by(self, link: PrefillLink) -> None:
        """A handshake answer came: requests parked on the link go on (accepted) or fail."""
        link.answered_at = now()
        if link is self._link:
            self._answered.set()
        parked = list(link.parked)
        link.parked.clear()
        for req in parked:
            if not req.state.terminal:
                self._enter(req, link)

    def _on_handshake(self, link: PrefillLink, msg) -> None:
        if isinstance(msg, wire.Reject) and link.state == PeerState.REJECTED:
            return  # the second answer to a register sent twice (resent while pending): one refusal
        try:
            accept = self.handshake.receive(msg)
        except Exception as exc:  # any refusal: upstream RuntimeErrors, VersionMismatch, EngineError, ...
            if isinstance(msg, wire.Accept):  # we refuse the prefill: it records the same error
                link.client.send(wire.Reject(worker_id=self.worker_id, error=ErrorInfo.of(exc)))
            self._refused(link, ErrorInfo.of(exc))
            return
        with self._lock:
            link.incarnation = accept.incarnation
            link.fingerprint = accept.report.fingerprint
            link.handshake_s = now() - link.register_sent
            link.error = None
            if link.state != PeerState.ACCEPTED:  # (a second answer to a register sent twice)
                move(link, PeerState.ACCEPTED)
        self.stats.handshake("accepted")
        log.info("accepted by prefill %s at %s in %.2f ms", accept.worker_id, link.endpoint, link.handshake_s * 1e3)
        self._answered_by(link)

    def _route(self, req: Request, link: PrefillLink) -> None:
        """A new request aimed at ``link``: go on, wait for the link's first answer, or fail."""
        if link.state == PeerState.REJECTED and now() - (link.answered_at or 0.0) > self.opts.peer_timeout_s:
            self._reregister(link)  # an old refusal: the prefill may have been fixed; ask again
        if link.state == PeerState.PENDING:
            link.parked.append(req)
            return
        self._enter(req, link)

    def _enter(self, req: Request, link: PrefillLink) -> None:
        if req.state.terminal:
            return
        if link.state == PeerState.ACCEPTED:
            self._queue(req)
            return
        error = link.error
        if link.state == PeerState.REJECTED and error is not None:
            reason = f"handshake refused: {error.message}"
        elif error is not None:
            reason = error.message
        else:
            reason = f"prefill at {link.endpoint} not connected"
        self._finish(req, "failed", error=ErrorInfo(type="PeerGone", message=reason))

    def _stale_wait(self, req: Request) -> str | None:
        """Why a request past its deadline never left the decode, if it waited for a handshake."""
        link = self._links.get(req.prefill)
        if req.state != RequestState.BOOTSTRAPPING or link is None or not any(r is req for r in link.parked):
            return None
        kept = [r for r in link.parked if r is not req]
        link.parked.clear()
        link.parked.extend(kept)
        return f"deadline exceeded: no handshake answer from the prefill at {req.prefill}"

    def _mine(self, link, room: int) -> Request | None:
        """The request in flight for ``room`` if it was sent to ``link``'s prefill (a prefill
        cannot answer for another's requests)."""
        req = self.requests.get(room)
        return req if req is not None and req.prefill == link.endpoint else None

    def _timers(self, t: float) -> None:
        for req in list(self.requests.values()):
            if t > req.deadline:
                # sent, and not bounced with Busy: the prefill may be writing into its pages
                in_flight = req.state == RequestState.WAITING_FOR_INPUT and req.resend_at is None
                if in_flight:
                    self._links[req.prefill].client.send(
                        wire.Abort(room=req.room, reason="deadline exceeded on decode")
                    )
                self._finish(
                    req,
                    "failed",
                    error=ErrorInfo(type="TransferFailed", message=self._stale_wait(req) or "deadline exceeded"),
                    quarantine=in_flight,
                )
            elif req.resend_at is not None and t >= req.resend_at and req.message is not None:
                req.resend_at = None
                req.message = req.message.model_copy(update={"deadline_s": max(0.001, req.deadline - t)})
                self._links[req.prefill].client.send(req.message)
