"""What an agent says of its peers: frozen snapshots, taken on the agent's I/O thread and read
anywhere after (a worker's status, readiness, the metrics, an SGLang rank's endpoint, the bench).

``PeerSnapshot``: a prefill's latest record of one decode that registered (``PrefillAgent.peers()``).
``DecodeSnapshot``: one decode a prefill has accepted (``PrefillAgent.decodes()``).
``PrefillSnapshot``: a decode's view of one prefill it dialled (``DecodeAgent.prefills()``, by address).

Each is built positionally (the lifecycle's rule: only ``lifecycle.move`` assigns a record's
state; a snapshot copies one). ``state`` is a ``PeerState``, a ``str`` enum: it compares equal
to its value (``"accepted"``). JSON is made at the edges that need it (``peer_doc``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdstate.protocol.lifecycle import PeerState
from pdstate.protocol.report import ErrorInfo


@dataclass(frozen=True, slots=True)
class PeerSnapshot:
    """A prefill's latest record of one decode, by its worker id: ``error`` is why it was refused
    or is gone; ``fingerprint`` its layout's, from its Register."""

    id: str
    state: PeerState
    incarnation: str
    fingerprint: str | None
    error: ErrorInfo | None = None


@dataclass(frozen=True, slots=True)
class DecodeSnapshot:
    """A decode a prefill has accepted: seconds since it was last heard (``last_seen_s``)."""

    worker_id: str
    incarnation: str
    last_seen_s: float


@dataclass(frozen=True, slots=True)
class PrefillSnapshot:
    """A decode's view of one prefill, by the address it dials: ``error`` why it refused this
    decode or is gone; ``fingerprint`` its layout's, from its Accept; ``handshake_s`` the latest
    accepted handshake's round trip; ``registered_s_ago`` seconds since the latest Register went
    out (how old a refusal is)."""

    address: str
    state: PeerState
    worker_id: str
    incarnation: str
    handshakes: int
    error: ErrorInfo | None
    fingerprint: str | None
    handshake_s: float | None
    registered_s_ago: float

    @property
    def reason(self) -> str | None:
        """``error`` as one line, ``"Type: message"`` (``None``: none)."""
        return None if self.error is None else f"{self.error.type}: {self.error.message}"


__all__ = ["DecodeSnapshot", "PeerSnapshot", "PrefillSnapshot"]
