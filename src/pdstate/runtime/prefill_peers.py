"""The prefill's records of its decodes: registration and the handshake's answer, heartbeats,
a decode's refusal of this prefill, timeouts, and the release of gone decodes' engine state.

``PrefillPeers`` is a part of ``PrefillWorker`` (runtime.prefill), run on its control thread; it
keeps the worker's ``peers`` table, whose entries and their state and error it changes under the
worker's ``_lock`` (``status()`` reads them from other threads).
"""

from __future__ import annotations

from pdstate.errors import NotRegistered, PdStateError, PeerGone, WorkerIdInUse
from pdstate.protocol import wire
from pdstate.protocol.lifecycle import PeerState, move
from pdstate.protocol.report import ErrorInfo
from pdstate.runtime.records import Peer
from pdstate.runtime.worker import log, now
from pdstate.transfer.engines.shm_owner import challenge_unknown, challenge_unknown_error
from pdstate.transfer.planner import PairPlanner

MAX_IDLE_PEERS = 256  # rejected/gone peer records kept (accepted ones are always kept)


def needs_challenge(engine, msg: wire.Register) -> bool:
    """A register to answer with ``Challenge``: its engine proves ownership and its endpoint does
    not answer a challenge yet."""
    return engine.proves_ownership and msg.engine.name == engine.name and "challenge" not in msg.engine.endpoint


class PrefillPeers:
    """Decode registrations, heartbeats and timeouts, for ``PrefillWorker``'s control thread."""

    peers: dict[bytes, Peer]

    def _on_register(self, identity: bytes, msg: wire.Register) -> None:
        holder = self._live_holder(identity, msg.worker_id)
        if holder is not None:
            # Another connection holds this worker_id and still answers: the newcomer is refused
            # and the accepted decode is not touched (its requests, engine peer and memory stay).
            err = WorkerIdInUse(
                f"worker_id {msg.worker_id!r} is held by a live decode (incarnation {holder.incarnation}); "
                "a new incarnation is accepted once that one is gone"
            )
            self.stats.handshake("rejected")
            log.error("refused a register for %s from %r: %s", msg.worker_id, identity[:64], err)
            self.server.send(identity, wire.Reject(worker_id=self.worker_id, error=ErrorInfo.of(err)))
            return
        if needs_challenge(self.engine, msg) and isinstance(self.handshake.receive(msg), wire.Accept):
            # A compatible register that has not yet proved it owns the memory it names gets a
            # nonce to answer (PROTOCOL §4); nothing is recorded, cancelled or mapped for it. (An
            # incompatible one is refused below, as ever, without a round trip.)
            nonce = self.engine.challenge(f"{msg.worker_id}/{msg.incarnation}")
            self.server.send(
                identity, wire.Challenge(worker_id=self.worker_id, incarnation=self.incarnation, nonce=nonce)
            )
            return
        # The same incarnation registering again (it declared us gone, or was asked to) has
        # forgotten what it sent before: end those requests now rather than copy into its pages.
        for (ident, _), job in list(self.jobs.items()):
            if ident == identity:
                self._cancel(job, f"decode {msg.worker_id} registered again; its earlier requests were abandoned")
        answer = self.handshake.receive(msg)
        peer = Peer(identity, msg.worker_id, msg.incarnation, fingerprint=msg.report.fingerprint, last_seen=now())
        if isinstance(answer, wire.Accept):
            try:
                peer.engine_peer = self._connect_engine(msg)
            except PdStateError as exc:
                answer = wire.Reject(worker_id=self.worker_id, error=ErrorInfo.of(exc))
        if isinstance(answer, wire.Accept):
            peer.planner = PairPlanner(self.kv_args, msg.kv)
            move(peer, PeerState.ACCEPTED)  # not yet in the table: no other thread can see it
            self.stats.handshake("accepted")
            log.info("accepted decode %s (%s)", msg.worker_id, msg.incarnation)
        else:
            peer.error = answer.error
            move(peer, PeerState.REJECTED)
            self.stats.handshake("rejected")
            log.error("rejected decode %s: %s: %s", msg.worker_id, answer.error.type, answer.error.message)
        if isinstance(answer, wire.Accept):
            # Only an accepted newcomer replaces the earlier incarnations of its worker_id (gone:
            # ``_live_holder`` found none that answers).
            for other in [p for p in self.peers.values() if p.worker_id == msg.worker_id and p.identity != identity]:
                self._drop_peer(other, f"decode {msg.worker_id} re-registered with incarnation {msg.incarnation}")
                with self._lock:
                    del self.peers[other.identity]
        old = self.peers.get(identity)
        if old is not None and old.incarnation != msg.incarnation:
            self._drop_peer(old, "decode re-registered")
        elif old is not None and old.engine_peer not in (None, peer.engine_peer):
            self._detached.add(old.engine_peer)  # replaced (e.g. by a refused register): release it
        with self._lock:
            self.peers.pop(identity, None)
            self.peers[identity] = peer  # (re)inserted last: the pruning below drops the oldest
            self._prune_peers()
        self.server.send(identity, answer)

    def _live_holder(self, identity: bytes, worker_id: str) -> Peer | None:
        """An accepted decode with this ``worker_id`` on another connection that is still live:
        heard from within the peer timeout and its connection still open (a probe heartbeat can
        be queued to it). A killed decode's connection closes at once, so its restart is accepted
        without waiting for the timeout; a frozen one holds its id until the timeout."""
        t = now()
        for p in self.peers.values():
            if p.worker_id != worker_id or p.identity == identity or p.state != PeerState.ACCEPTED:
                continue
            if t - p.last_seen > self.opts.peer_timeout_s:
                continue
            probe = wire.Heartbeat(worker_id=self.worker_id, incarnation=self.incarnation, seq=int(t * 1000))
            if self.server.send(p.identity, probe):
                return p
        return None

    def _connect_engine(self, msg: wire.Register) -> str:
        """Connect the decode's engine endpoint for this registrant only, then check that every
        buffer its ``KVDesc`` names lies inside the regions that endpoint published (so the
        planner's addresses are the decode's own memory before any request is planned)."""
        eid = self.engine.connect(msg.engine.endpoint, owner=f"{msg.worker_id}/{msg.incarnation}")
        try:
            self.engine.peer_regions(eid).check_inside(registered_ranges(msg.kv), f"decode {msg.worker_id}")
        except PdStateError:
            if not any(p.engine_peer == eid for p in self.peers.values() if p.state == PeerState.ACCEPTED):
                self.engine.disconnect(eid)
            raise
        return eid

    def _prune_peers(self) -> None:
        """Keep every accepted peer and the latest ``MAX_IDLE_PEERS`` others (rejected, gone):
        a stream of bad registrations must not grow the table without bound. Under ``_lock``."""
        idle = [ident for ident, p in self.peers.items() if p.state != PeerState.ACCEPTED]
        for ident in idle[: max(0, len(idle) - MAX_IDLE_PEERS)]:
            if not any(k[0] == ident for k in self.jobs):
                del self.peers[ident]

    def _on_peer_reject(self, identity: bytes, msg: wire.Reject) -> None:
        """The decode refused our own report (e.g. this prefill's draft has its own mapping)."""
        peer = self.peers.get(identity)
        if peer is not None:
            with self._lock:
                peer.error = msg.error
                if peer.state != PeerState.REJECTED:
                    move(peer, PeerState.REJECTED)
            self.stats.handshake("accepted", -1)
            self.stats.handshake("rejected")
            log.error("decode %s refused this prefill: %s: %s", peer.worker_id, msg.error.type, msg.error.message)

    def _on_peer_error(self, identity: bytes, msg: wire.Error) -> None:
        """An ``error`` from a decode (PROTOCOL §7): with a room in flight, that request ends with
        the decode's error; otherwise it is logged. Never answered with an ``error``."""
        job = self.jobs.get((identity, msg.room)) if msg.room is not None else None
        if job is not None:
            self._cancel(job, f"decode reported: {msg.error.type}: {msg.error.message[:512]}")
            return
        if challenge_unknown(msg.error.message):
            # a decode of a version before ``challenge``: a reject (not an error, §7) tells it why
            self.server.send(
                identity, wire.Reject(worker_id=self.worker_id, error=ErrorInfo.of(challenge_unknown_error()))
            )
            return
        log.warning("decode %r reported: %s: %s", identity[:64], msg.error.type, msg.error.message[:512])

    def _on_heartbeat(self, identity: bytes, msg: wire.Heartbeat) -> None:
        peer = self.peers.get(identity)
        if peer is None or peer.state != PeerState.ACCEPTED or peer.incarnation != msg.incarnation:
            err = NotRegistered()
            self.server.send(identity, wire.Error(error=ErrorInfo.of(err)))
            return
        self.server.send(identity, wire.Heartbeat(worker_id=self.worker_id, incarnation=self.incarnation, seq=msg.seq))

    def _drop_peer(self, peer: Peer, reason: str) -> None:
        with self._lock:
            if peer.state != PeerState.GONE:
                move(peer, PeerState.GONE)
        if peer.engine_peer is not None:
            self._detached.add(peer.engine_peer)
        for (ident, _), job in list(self.jobs.items()):
            if ident == peer.identity:
                self._cancel(job, f"peer gone: {reason}", PeerGone.__name__)

    def _detach_engine_peers(self) -> None:
        """Release the engine state (shm mappings, remote agents) of gone peers once no job can
        still use it and no accepted peer reconnected to the same engine."""
        if not self._detached:
            return
        in_use = {p.engine_peer for p in self.peers.values() if p.state == PeerState.ACCEPTED}
        busy = {job.engine_peer for job in self.jobs.values()}
        for eid in list(self._detached):
            if eid in in_use:
                self._detached.discard(eid)  # the same decode engine came back: keep it
            elif eid not in busy:
                self._detached.discard(eid)
                try:
                    self.engine.disconnect(eid)
                except Exception:
                    log.warning("releasing engine peer %s failed", eid, exc_info=True)

    def _peer_timers(self, t: float) -> None:
        for peer in list(self.peers.values()):
            if peer.state == PeerState.ACCEPTED and t - peer.last_seen > self.opts.peer_timeout_s:
                log.warning("decode %s gone: no message for %.1f s", peer.worker_id, t - peer.last_seen)
                self._drop_peer(peer, f"decode {peer.worker_id} sent nothing for {self.opts.peer_timeout_s:.1f} s")


def registered_ranges(kv: wire.KVDesc | None) -> list[tuple[str, int, int]]:
    """``(label, ptr, nbytes)`` of every buffer a decode registered (main KV, then components)."""
    if kv is None:
        return []
    out = [(f"main KV[{i}]", p, n) for i, (p, n) in enumerate(zip(kv.kv_data_ptrs, kv.kv_data_lens))]
    for c, comp in enumerate(kv.components):
        out += [(f"component {c} ({comp.state_type})[{i}]", p, n) for i, (p, n) in enumerate(zip(comp.ptrs, comp.lens))]
    return out
