"""``WorkerSnapshot``: a worker's ``status()``, a frozen copy taken under its lock; and
``TransferResult``, what a decode's request ended with.

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
    started: float  # ``worker.base.now()`` when it entered
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
    waiting: int = 0  # decode: requests waiting for pages
    quarantined: int = 0  # decode: requests whose pages wait for their prefill's fence
    quarantined_pages: int = 0  # decode: their main-KV pages
    handshake_s: float | None = None  # decode: the latest accepted handshake's duration (its ``peer``)
    auth_error: ErrorInfo | None = None  # prefill: the latest frame refused for its auth tag, if recent
    dropped: ErrorInfo | None = None  # prefill: the latest decode dropped for withholding verdicts, if recent

    @property
    def in_flight(self) -> int:
        return len(self.requests)

    @property
    def peer(self) -> PeerStatus:
        """A decode's default prefill (its ``peer``)."""
        return self.peers[0]


@dataclass
class TransferResult:
    """A decode request's outcome (the result of ``AgentDecodeWorker.submit``'s future)."""

    room: int
    status: str  # "success" | "failed"
    seq_len: int
    bytes: int = 0
    descriptors: int = 0
    seconds: float = 0.0
    verified: bool = False
    error: ErrorInfo | None = None
    compute_s: float = 0.0  # the prefill's (synthesised) compute
    copy_s: float = 0.0  # the prefill's engine copy
    transfer_s: float = 0.0  # asked -> verdict received
    verify_s: float = 0.0  # this decode's check of the bytes that landed
    prefill: str = ""  # the control address of the prefill asked
    verify_level: str = ""  # the agent's verification level that ran (``transfer.verify``)
    held: bool = False  # kept running on the decode once landed (``hold``)
    step: int = 0  # a held request's decode step once its ``steps`` ran

    def as_dict(self) -> dict:
        return {
            "room": self.room,
            "status": self.status,
            "seq_len": self.seq_len,
            "bytes": self.bytes,
            "descriptors": self.descriptors,
            "seconds": self.seconds,
            "verified": self.verified,
            "error": None if self.error is None else self.error.model_dump(),
            "compute_s": self.compute_s,
            "copy_s": self.copy_s,
            "transfer_s": self.transfer_s,
            "verify_s": self.verify_s,
            "prefill": self.prefill,
            "held": self.held,
            "step": self.step,
        }
