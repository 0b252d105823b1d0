"""Which registrations a prefill takes further: one live decode per ``worker_id``, and the
decode's memory proven to be its own before anything is checked, mapped or recorded.

The prefill's ROUTER (``agent.prefill.bind_router``) binds a ZeroMQ identity to its first connection (no ``ROUTER_HANDOVER``): a second
connection copying a decode's identity is refused by ZeroMQ and cannot take over its pipe.
``ROUTER_MANDATORY`` makes a send to an identity with no connection fail (the liveness probe).

Run on the prefill agent's I/O thread (``Gate``, over what its core hands it):

* a register whose ``worker_id`` an accepted decode on another connection still holds (heard
  from within the peer timeout, its connection open: a probe heartbeat can be queued to it) is
  refused with ``WorkerIdInUse`` (naming the register's own incarnation, never the holder's: a
  refusal tells an unauthenticated asker nothing it did not send) and that decode is left as it
  was; a killed decode's connection
  closes at once, so its restart is accepted without waiting for the timeout;
* with an engine that proves ownership (shm), a compatible register whose endpoint does not
  answer a challenge yet gets a ``Challenge``; the engine's ``connect`` checks the answer; a
  register of the incarnation accepted on the same connection, with the same endpoint, is
  taken without one (``Gate.proven_already``: proven there, mapped already);
* every buffer a register's ``KVDesc`` names must lie inside the regions its engine endpoint
  published (and, with shm, proved its own): the planner's destination addresses are then the
  decode's own memory before any request is planned (``Gate.connect``);
* a frame that does not decode is answered with ``Error`` naming why, unless it is itself an
  ``error`` frame (never answered: two peers must not bounce errors); an ``AuthError`` (a token
  on one side only, or two different tokens) is counted, kept as the latest (``Incidents``)
  and logged, at most once a second.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from pdstate import logs
from pdstate.agent import curve
from pdstate.errors import AuthError, InvalidEndpoint, PdStateError, ProtocolError, WorkerIdInUse
from pdstate.protocol import wire
from pdstate.protocol.report import ErrorInfo
from pdstate.transfer.engines.shm import PROOF_KEYS

log = logging.getLogger("pdstate.agent")


class Incidents:
    """Refusals of one kind (``what``: frames refused for their auth tag, decodes dropped for
    withheld verdicts): how many, the latest (``ErrorInfo``) and when (``time.monotonic()``);
    written by one I/O thread, read by any (a snapshot of plain values)."""

    def __init__(self, what: str = "frame") -> None:
        self.what, self.count, self.latest, self.at, self._logged = what, 0, None, 0.0, -1.0

    def note(self, err: PdStateError, peer: str, now: float | None = None) -> PdStateError:
        """Count ``err`` from ``peer`` (at ``now``, ``time.monotonic()``'s clock: that time when
        not given) and log it (the line carries the fix); returns it."""
        now = time.monotonic() if now is None else now
        self.count, self.latest, self.at = self.count + 1, ErrorInfo.of(err), now
        if now - self._logged >= 1.0:  # a flood is one line a second
            self._logged = now
            logs.refusal(log, what=self.what, peer=peer, error_type=type(err).__name__, message=str(err))
        return err

    def recent(self, within_s: float) -> ErrorInfo | None:
        """The latest refusal when it is at most ``within_s`` old."""
        return self.latest if self.latest is not None and time.monotonic() - self.at <= within_s else None


def audience_error(audience: object, address: str, advertise: tuple[str, ...]) -> InvalidEndpoint | None:
    """Why a proof bound to ``audience`` (the address the decode dialled) was not given to this
    prefill (bound at ``address``, also reached at ``advertise``); None when it was: exactly the
    address itself or an advertised one. No other name is taken, a loopback alias or another
    interface of this host on the same port included: any local process can stand at those. A
    wildcard bind (``tcp://*:P``, ``0.0.0.0``, ``[::]``) is dialled by no decode at its own
    address: the names decodes dial must be advertised."""
    if isinstance(audience, str) and (audience == address or audience in advertise):
        return None
    names = ", ".join([address, *advertise])
    if _wildcard(address) and not advertise:
        fix = "this prefill binds a wildcard address: list every address its decodes dial in control.advertise"
    else:
        fix = "if decodes reach this prefill by another name, list it in control.advertise"
    shown = repr(audience)
    shown = shown if len(shown) <= 256 else shown[:256] + "..."
    return InvalidEndpoint(
        f"shm proof of ownership was given to {shown}, not to this prefill ({names}): a register relayed "
        f"through another address; {fix}"
    )


def _wildcard(address: str) -> bool:
    scheme, _, rest = address.partition("://")
    return scheme == "tcp" and rest.rpartition(":")[0] in ("*", "0.0.0.0", "[::]", "::", "[::0]")


HANDSHAKE_IVL_MS = 3000  # a connection that has not completed ZeroMQ's handshake by then is closed
BACKLOG = 2048  # connections the kernel queues for accept (libzmq's default: 100), as serve's HTTP
# (both set on the prefill's ROUTER by ``agent.prefill.bind_router``)


class Gate:
    """The admission rules of one prefill, over what its core hands it at start: its decodes
    (``identity -> DecodePeer``, the I/O thread's own map), its engine port and handshake,
    ``probe(identity, msg) -> bool`` (queue ``msg`` to that connection now, without blocking:
    False when no connection has that identity any more, or it is full) and
    ``reply(identity, msg)``. The core's public values (``worker_id``, ``incarnation``,
    ``peer_timeout_s``, ``address``, ``advertise``, ``auth_failures``) are read from ``agent``.
    Run on the agent's I/O thread; the clock comes in as ``now``."""

    def __init__(
        self,
        agent: Any,
        decodes: dict[bytes, Any],
        engine: Any,
        handshake: Any,
        probe: Callable[[bytes, wire.Message], bool],
        reply: Callable[[bytes, wire.Message], None],
    ) -> None:
        self.agent, self.decodes, self.engine, self.handshake = agent, decodes, engine, handshake
        self.probe, self.reply = probe, reply

    def refuse_frame(self, identity: bytes, frame: bytes, exc: PdStateError, now: float) -> None:
        """A frame from ``identity`` that did not decode (``exc``): answered with ``Error`` unless
        it is an ``error`` frame itself (PROTOCOL §7)."""
        if isinstance(exc, AuthError):
            exc = self.agent.auth_failures.note(exc, identity.decode("utf-8", "replace")[:64], now)
        if wire.envelope_kind(frame) != "error":
            self.reply(identity, wire.Error(error=ErrorInfo.of(exc)))

    def refuse_handshake(self, event: dict, now: float) -> None:
        """A connection that failed the CURVE handshake (a monitor event of the ROUTER): it sent
        nothing this prefill reads; counted and logged as an ``AuthError``."""
        err = curve.handshake_error(event, None)
        self.agent.auth_failures.note(err, "a connection to " + self.agent.address, now)

    def refuse_parts(self, parts: list[bytes]) -> None:
        """A message of other than one frame (PROTOCOL §1): answered with ``Error`` unless its
        first frame is an ``error`` frame."""
        if len(parts) < 2 or wire.envelope_kind(parts[1]) == "error":
            return
        err = ProtocolError(f"a message is one frame (one ZeroMQ part); this one has {len(parts) - 1}")
        self.reply(parts[0], wire.Error(error=ErrorInfo.of(err)))

    def live_holder(self, identity: bytes, worker_id: str, now: float):
        """The accepted decode (``DecodePeer``) holding ``worker_id`` on another live connection."""
        agent = self.agent
        for key, d in self.decodes.items():
            if d.worker_id != worker_id or key == identity or now - d.last_seen > agent.peer_timeout_s:
                continue
            probe = wire.Heartbeat(worker_id=agent.worker_id, incarnation=agent.incarnation, seq=int(now * 1000))
            if self.probe(key, probe):  # else no connection with that identity any more, or full
                return d
        return None

    def gatekeep(self, identity: bytes, msg: wire.Register, now: float) -> bool:
        """Answer ``msg`` here if it ends here (a ``Reject`` or a ``Challenge``; True), else
        False: go on to the handshake's checks and the engine's ``connect``."""
        answer = self._early_answer(identity, msg, now)
        if answer is not None:
            self.reply(identity, answer)
        return answer is not None

    def proven_already(self, identity: bytes, msg: wire.Register) -> str | None:
        """The engine peer id of the decode accepted on this very connection when ``msg``
        registers the same incarnation again with the same endpoint and no proof: its memory was
        proven on this connection (ZeroMQ binds an identity to its first connection, so nobody
        else sends on it) and is mapped, so no new challenge is due and nothing is mapped again."""
        known = self.decodes.get(identity)
        if (
            known is None
            or not self.engine.proves_ownership
            or (known.worker_id, known.incarnation) != (msg.worker_id, msg.incarnation)
            or "challenge" in msg.engine.endpoint
            or known.endpoint != msg.engine.endpoint
        ):
            return None
        return known.peer_id

    def connect(self, msg: wire.Register, identity: bytes = b"") -> tuple[str, dict]:
        """Connect the decode's engine endpoint for this registrant only (or keep the peer of
        ``proven_already``), then check that every buffer its ``KVDesc`` names lies inside the
        regions that endpoint published (``DescriptorMismatch`` otherwise; the engine peer is
        disconnected again unless an accepted decode shares it). Returns the peer id and the
        endpoint without a challenge's answer (``DecodePeer.endpoint``)."""
        owner = f"{msg.worker_id}/{msg.incarnation}"
        peer_id = self.proven_already(identity, msg) or self.engine.connect(msg.engine.endpoint, owner=owner)
        try:
            self.engine.peer_regions(peer_id).check_inside(registered_ranges(msg.kv), f"decode {msg.worker_id}")
        except PdStateError:
            if all(d.peer_id != peer_id for d in self.decodes.values()):
                self.engine.disconnect(peer_id)
            raise
        return peer_id, plain_endpoint(msg.engine.endpoint)

    def _early_answer(self, identity: bytes, msg: wire.Register, now: float) -> wire.Message | None:
        agent, engine = self.agent, self.engine
        holder = self.live_holder(identity, msg.worker_id, now)
        if holder is not None:
            # naming only what the register gave: the holder's incarnation is not the asker's to learn
            err = WorkerIdInUse(
                f"worker_id {msg.worker_id!r} is held by another live decode (this register's incarnation is "
                f"{msg.incarnation}); a new incarnation is accepted once that one is gone"
            )
            return wire.Reject(worker_id=agent.worker_id, error=ErrorInfo.of(err))
        if self.proven_already(identity, msg) is not None:
            return None  # the same incarnation on the same connection, the same memory: proven and mapped
        if engine.proves_ownership and "challenge" in msg.engine.endpoint:
            refused = audience_error(msg.engine.endpoint.get("audience"), agent.address, agent.advertise)
            if refused is not None:
                return wire.Reject(worker_id=agent.worker_id, error=ErrorInfo.of(refused))
        if (
            engine.proves_ownership
            and msg.engine.name == engine.name
            and "challenge" not in msg.engine.endpoint
            and isinstance(self.handshake.receive(msg), wire.Accept)  # (an incompatible one: refused as ever)
        ):
            try:
                nonce = engine.challenge(f"{msg.worker_id}/{msg.incarnation}", identity.hex())
            except PdStateError as exc:  # too many outstanding: the decode registers again (backoff)
                return wire.Reject(worker_id=agent.worker_id, error=ErrorInfo.of(exc))
            return wire.Challenge(worker_id=agent.worker_id, incarnation=agent.incarnation, nonce=nonce)
        return None


def plain_endpoint(endpoint: dict) -> dict:
    """An engine endpoint without the fields answering a challenge."""
    return {k: v for k, v in endpoint.items() if k not in PROOF_KEYS}


def registered_ranges(kv: wire.KVDesc | None) -> list[tuple[str, int, int]]:
    """``(label, ptr, nbytes)`` of every buffer a decode registered (main KV, then components)."""
    if kv is None:
        return []
    out = [(f"main KV[{i}]", p, n) for i, (p, n) in enumerate(zip(kv.kv_data_ptrs, kv.kv_data_lens))]
    for c, comp in enumerate(kv.components):
        out += [(f"component {c} ({comp.state_type})[{i}]", p, n) for i, (p, n) in enumerate(zip(comp.ptrs, comp.lens))]
    return out
