"""``WorkerSnapshot``: a worker's ``status()``, a frozen copy taken under its lock.

Everything another thread (the HTTP API, a status command, a test) may want to know about a
running worker, so nothing outside the worker reads its records while its threads change them.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdstate.protocol.lifecycle import PeerState, RequestState
from pdstate.protocol.report import ErrorInfo


@dataclass(frozen=True)
class PeerStatus:
    """A prefill's record of one decode, or a decode's view of one prefill (``id``: its control
    endpoint). ``fingerprint``: the peer's layout fingerprint, once its handshake message came."""

    id: str
    state: PeerState
    error: ErrorInfo | None = None
    incarnation: str | None = None
    fingerprint: str | None = None

    def as_dict(self) -> dict:
        return {
            "id": self.id,
            "incarnation": self.incarnation,
            "state": self.state.value,
            "error": None if self.error is None else self.error.model_dump(),
            "fingerprint": self.fingerprint,
        }


@dataclass(frozen=True)
class RequestStatus:
    """A request in flight."""

    room: int
    state: RequestState
    seq_len: int
    started: float  # ``runtime.worker.now()`` when it entered
    peer: str = ""  # prefill: the decode's worker id; decode: the prefill's control address
    cancelled: str | None = None  # prefill: why, once given up (its copy may still be running)

    def as_dict(self) -> dict:
        """The prefill's ``requests`` record of a job."""
        return {"room": self.room, "peer": self.peer, "state": self.state.value, "cancelled": self.cancelled}


@dataclass(frozen=True)
class WorkerSnapshot:
    role: str  # "prefill" | "decode"
    worker_id: str
    incarnation: str
    endpoint: str  # prefill: its bound control endpoint ("" when not listening); decode: the prefill's
    peers: tuple[PeerStatus, ...]  # prefill: every decode it keeps a record of; decode: every prefill
    # it dialled, its ``peer`` first
    requests: tuple[RequestStatus, ...]  # in flight, oldest first
    dead_threads: tuple[str, ...]  # names of the worker's threads that ended (none while it serves)
    peak_in_flight: int  # most requests in flight at once
    jobs_inline: int = 0  # prefill: requests run on its control thread
    waiting: int = 0  # decode: requests waiting for pages
    quarantined: int = 0  # decode: pages of failed requests held until the prefill is done with them
    handshake_s: float | None = None  # decode: the latest accepted handshake's duration (its ``peer``)

    @property
    def in_flight(self) -> int:
        return len(self.requests)

    @property
    def peer(self) -> PeerStatus:
        """A decode's default prefill (its ``peer``)."""
        return self.peers[0]
