"""The decode agent's frames from its prefills, on its I/O thread: handshake answers, heartbeats,
goodbyes, ``TransferDone`` (the landed bytes' digest compared before the verdict) and errors."""

from __future__ import annotations

import logging
import secrets
import time

import numpy as np
import zmq

from pdstate import logs
from pdstate.agent import curve
from pdstate.agent.digest import RequestDigest
from pdstate.agent.receiver import PrefillPeer, Receiving
from pdstate.agent.verify import level_of, request_digest
from pdstate.errors import AuthError, DigestMismatch, PdStateError, PeerGone, TransferAborted, error_from_wire
from pdstate.protocol import wire
from pdstate.protocol.lifecycle import PeerState, RequestState, move
from pdstate.protocol.report import ErrorInfo

__all__ = ["DecodeFrames"]

log = logging.getLogger("pdstate.agent")

_S = RequestState
# a DEALER's events ``_on_session`` takes: its sessions, and failed CURVE handshakes
SESSION_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | curve.HANDSHAKE_EVENTS
NO_DETAIL_WINDOW_S = 2.0  # two handshakes cut short within this long: the prefill's key differs
RETRY_MAX_S = 30.0  # the longest wait between two registers with a prefill that refused this decode
# refusals that pass (another live incarnation holds the worker id, a challenge evicted or
# expired, a prefill busy): registered again with backoff (``_retry``); any other is final
PASSING_REFUSALS = frozenset({"WorkerIdInUse", "InvalidEndpoint", "PrefillBusy", "NotRegistered", "PeerGone"})


class DecodeFrames:
    """Mixed into ``DecodeAgent`` (its ``_prefills``, ``_recvs``, ``_handshake``, ``_engine``,
    ``_layout``, ``_devices``, ``digest``, ``token``, ``_keys``, ``auth_failures`` and the helpers ``_send``, ``_register``, ``_fail_prefill``,
    ``_restarted``, ``_live``, ``_maybe_send``, ``_confirm``, ``_landing`` and ``_loop``); every method runs on its I/O thread."""

    def _on_frame(self, address: str, sock: zmq.Socket) -> None:
        frame = sock.recv()
        p = self._prefills.get(address)
        if p is None or p.sock is not sock:
            return
        try:
            msg = wire.decode(frame, self.token)
        except AuthError as exc:
            if p.state is PeerState.PENDING or p.redial:  # its answer to this register: a token on one side only
                self._auth_refused(p, exc)
            return
        except PdStateError:
            return
        p.last_seen = time.monotonic()
        if isinstance(msg, (wire.Accept, wire.Reject)):
            self._on_handshake(p, msg)
        elif isinstance(msg, wire.Challenge):
            if p.state is PeerState.PENDING or p.redial:  # prove the memory this decode named is its own
                # ... to the prefill at the address it dialled (``audience``): a proof relayed
                # through another address is worthless to the prefill (``agent.admission``)
                proof = self._engine.prove(msg.nonce, f"{self.worker_id}/{self.incarnation}@{p.address}")
                self._send(p, self._handshake.register_message({**proof, "audience": p.address}))
        elif isinstance(msg, wire.Heartbeat):
            if p.state is PeerState.ACCEPTED and msg.incarnation != p.incarnation:
                self._register(p)  # a new process at that address: what the old one had fails at its Accept
        elif isinstance(msg, wire.TransferDone):
            self._on_done(p, msg)
        elif isinstance(msg, wire.Landed):
            self._on_landed(p, msg)
        elif isinstance(msg, wire.Goodbye):
            if p.state is PeerState.ACCEPTED and msg.incarnation == p.incarnation:
                # its requests have ended and nothing of them lands any more: fail them now
                self._fail_prefill(p, PeerGone(msg.reason), PeerState.GONE)
                self._confirm(p.address, lambda r: r.sent_to is not None and r.sent_to[0] == msg.incarnation)
        elif isinstance(msg, wire.Error):
            if msg.error.type == "NotRegistered":
                # a new incarnation got this request, so the old one never did: send it again
                # once the new one accepted this decode
                recv = self._recvs.get((address, msg.room)) if msg.room is not None else None
                if recv is not None and not recv.record.state.terminal:
                    recv.sent_to = None
                if p.state is PeerState.ACCEPTED:
                    self._register(p)
            elif msg.room is not None:
                recv = self._recvs.get((address, msg.room))
                if recv is not None:
                    recv.record.fail(error_from_wire(msg.error.type, msg.error.message))

    def _dealer(self, address: str) -> zmq.Socket:
        """A new DEALER to the prefill at ``address`` (not connected yet): this incarnation's
        identity, the domain's CURVE keys (``agent.curve``), its frames and its session events
        watched (``unwatch`` ends both)."""
        sock = self._loop.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"{self.worker_id}/{self.incarnation}/{secrets.token_hex(4)}".encode())
        sock.setsockopt(zmq.SNDHWM, 10000)
        curve.dial(sock, self._keys)
        self._loop.watch(sock, lambda s, a=address: self._on_frame(a, s))
        self._loop.monitor(sock, SESSION_EVENTS, lambda event, a=address, s=sock: self._on_session(a, s, event))
        return sock

    def _on_session(self, address: str, sock: zmq.Socket, event: dict) -> None:
        """A session event of the socket to ``address``. With a synchronous engine (shm: a copy
        ends within its submit, on the prefill's own thread), a session that completed its
        handshake and then closed means the prefill process exited (the kernel closes its sockets
        after its memory is gone) or closed its control socket (after its fences held): nothing
        it was told lands any more. A session that never completed (a frozen process) proves
        nothing, nor does a closed one with an engine whose copies outlive the writer's process
        (bytes in flight on the network)."""
        p = self._prefills.get(address)
        if p is None or p.sock is not sock:
            return
        if event["event"] & curve.HANDSHAKE_EVENTS:
            self._on_handshake_failed(p, event)
            return
        if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            p.session_up = True
            return
        if not (p.session_up and self._engine.synchronous and p.last_incarnation):
            return
        p.session_up = False
        inc = p.last_incarnation
        self._confirm(address, lambda r: r.sent_to is not None and r.sent_to[0] == inc)

    def _on_handshake_failed(self, p: PrefillPeer, event: dict) -> None:
        """The CURVE handshake with the prefill ``p`` failed (``agent.curve``): nothing
        of this decode's reached it. Its register waits in the socket, which ZeroMQ dials again
        (every ``RECONNECT_IVL``): the prefill is refused once, and its answer is still awaited
        (``redial``), so a handshake that succeeds later (a prefill fixed, a failure in passing)
        is taken as usual."""
        if not (p.state is PeerState.PENDING or p.redial):
            return
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            # a connection closed mid-handshake: a key that differs (the prefill drops it at
            # once, again at each redial, every 100 ms), or a prefill that died or froze during
            # it (once); only the second within NO_DETAIL_WINDOW_S is taken for the key
            now, last = time.monotonic(), p.no_detail_at
            p.no_detail_at = now
            if now - last > NO_DETAIL_WINDOW_S:
                return
        if not (p.state is PeerState.REJECTED and isinstance(p.error, AuthError)):  # told once per register
            self._auth_refused(p, curve.handshake_error(event, p.address), quoted=False)
        p.redial = True

    def _auth_refused(self, p: PrefillPeer, exc: AuthError, quoted: bool = True) -> None:
        p.redial = False
        err = AuthError(f"prefill {p.address} answered: {exc}") if quoted else exc
        err = self.auth_failures.note(err, p.address)
        self.handshakes["rejected"] += 1
        self._fail_prefill(p, err, PeerState.REJECTED)

    def _on_handshake(self, p: PrefillPeer, msg) -> None:
        if p.state is not PeerState.PENDING and not p.redial:
            return
        p.redial = False
        try:
            accept = self._handshake.receive(msg)
        except (PdStateError, RuntimeError, ValueError) as exc:
            err = exc if isinstance(exc, PdStateError) else error_from_wire(type(exc).__name__, str(exc))
            self.handshakes["rejected"] += 1
            logs.refusal(log, what="handshake", peer=p.address, error_type=type(err).__name__, message=str(err))
            self._fail_prefill(p, err, PeerState.REJECTED)
            p.retry_s = (p.retry_s or self._redial_s) if type(err).__name__ in PASSING_REFUSALS else 0.0
            return
        self.handshakes["accepted"] += 1
        p.retry_s = 0.0
        if p.incarnation and accept.incarnation != p.incarnation:
            self._restarted(p, accept.incarnation)
        if p.state is not PeerState.ACCEPTED:
            move(p, PeerState.ACCEPTED)
        p.epoch += 1  # a registration of its own: a late TransferDone names the ones before
        p.incarnation, p.worker_id, p.error = accept.incarnation, accept.worker_id, None
        p.last_incarnation = accept.incarnation
        p.fingerprint = accept.report.fingerprint
        p.last_seen = time.monotonic()
        p.handshake_s = round(p.last_seen - p.registered_at, 6)
        logs.handshake(log, peer=p.address, fingerprint=p.fingerprint, seconds=p.handshake_s)
        for recv in list(self._live(p.address)):
            if recv.record.state is _S.BOOTSTRAPPING:
                recv.record.move(_S.WAITING_FOR_INPUT)
            self._maybe_send(recv)
        # what an earlier registration with this process asked and has no confirmation of: ask
        # again here; the prefill answers each once nothing of it can land
        for recv in self._landing.earlier(p.address, p.epoch):
            self._send(p, wire.Abort(room=recv.record.room, reason="confirm the fence of an earlier registration"))

    def _on_done(self, p: PrefillPeer, msg: wire.TransferDone) -> None:
        recv = self._recvs.get((p.address, msg.room))
        if recv is None or recv.record.state.terminal or not recv.sent:
            # the confirmation of a request that ended here first (an abort, a silent prefill)
            self._confirm(p.address, lambda r: r.record.state.terminal and r.sent_to is not None, msg.room)
            return
        recv.acked = True  # the prefill sends TransferDone once no copy of the room is in flight
        rec = recv.record
        rec.metrics.update(bytes=msg.bytes, descriptors=msg.descriptors, copy_s=msg.copy_s)
        if recv.sent_at is not None:
            rec.metrics["transfer_s"] = round(time.monotonic() - recv.sent_at, 6)
        if recv.aborting is not None:
            # the prefill sends TransferDone only once its writes of this room are finished
            rec.fail(TransferAborted(f"aborted by decode: {recv.aborting}"))
            return
        if msg.status == "failed":
            err = msg.error or ErrorInfo(type="TransferFailed", message="prefill reported failure")
            rec.fail(error_from_wire(err.type, err.message))
            return
        verdict_error: PdStateError | None = None
        rec.metrics["verify"] = level_of(recv.request.digest, recv.request.verify)
        if self.digest:
            t0 = time.perf_counter()
            form = msg.digest_form or "host"  # the prefill's; hashed again in it if the early hashing was not
            if recv.digest is not None and getattr(recv.digest, "form", "host") != form:
                recv.digest.cancel()
                recv.digest, recv.hashed = None, (0, False)
            d = self._hash_landed(recv, len(recv.request.dst_kv_pages), True, wait=True, form=form)
            mine = d.digest()
            rec.metrics["digest_s"] = round(time.perf_counter() - t0, 6)  # after TransferDone: the part not hidden
            rec.metrics["digest_hashing_s"] = round(d.seconds, 6)  # all of it, early parts included
            if msg.digest is None:
                verdict_error = DigestMismatch(f"room {msg.room}: the prefill sent no digest")
            elif msg.digest != mine:
                verdict_error = DigestMismatch(
                    f"room {msg.room}: digest of the {msg.bytes} bytes that landed ({mine.hex()}) differs "
                    f"from the prefill's digest of the bytes it sent ({msg.digest.hex()})"
                )
        if verdict_error is None:
            rec.move(_S.SUCCESS)  # the outcome is known here: the prefill is told after
            self._send(p, wire.AgentVerdict(room=msg.room, status="success"))
        else:
            rec.fail(verdict_error)
            self._send(p, wire.AgentVerdict(room=msg.room, status="failed", error=ErrorInfo.of(verdict_error)))

    def _on_landed(self, p: PrefillPeer, msg: wire.Landed) -> None:
        """Hash what the prefill says has landed, in the background, while the rest copies."""
        recv = self._recvs.get((p.address, msg.room))
        if not self.digest or recv is None or recv.record.state.terminal or recv.request is None or not recv.sent:
            return
        if recv.aborting is None:
            recv.record.metrics["landed"] = recv.record.metrics.get("landed", 0) + 1
            self._hash_landed(recv, msg.pages, msg.state_landed, wait=False)

    def _hash_landed(
        self, recv: Receiving, pages: int, state: bool, wait: bool, form: str | None = None
    ) -> RequestDigest:
        """Hash this request's destination bytes up to ``pages`` main-KV pages (and, with ``state``,
        its state and aux) beyond what is hashed already: in the background (``wait=False``), or
        here, spread over the host's cores, after the background work (``wait=True``)."""
        req = recv.request
        n = 1 + len(req.dst_state_indices)
        if recv.digest is None:
            level = level_of(req.digest, req.verify)
            recv.digest = request_digest(self._layout, self._devices, req, n, level, form)
        done_pages, done_state = recv.hashed
        pages = min(pages, len(req.dst_kv_pages))
        updates = []
        if pages > done_pages:
            updates.append((0, req.dst_kv_pages.unpack()[done_pages:pages]))
        if state and not done_state:
            updates += [(c, lst.unpack()) for c, lst in enumerate(req.dst_state_indices, start=1)]
            if req.dst_aux is not None:
                updates.append((n, np.array([req.dst_aux.index])))
        recv.hashed = (max(pages, done_pages), state or done_state)
        if wait:
            recv.digest.update_many(updates)  # waits for the background work first
        elif updates:
            recv.digest.update_async(updates)
        return recv.digest
