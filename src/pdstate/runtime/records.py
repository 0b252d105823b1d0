"""The workers' records. Prefill: decode peers and jobs. Decode: its prefill, its requests and
their results.

A record is born in its lifecycle's first state (``state`` is not a constructor argument) and
moves only through ``protocol.lifecycle.move``."""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from pdstate.protocol import wire
from pdstate.protocol.lifecycle import PeerState, RequestState
from pdstate.protocol.report import ErrorInfo
from pdstate.runtime import requests as rq
from pdstate.runtime.worker import now
from pdstate.transfer.plan import TransferPlan
from pdstate.transfer.planner import PairPlanner


@dataclass
class Peer:
    identity: bytes
    worker_id: str
    incarnation: str
    error: ErrorInfo | None = None
    fingerprint: str | None = None  # the decode's layout fingerprint, from its Register
    engine_peer: str | None = None
    last_seen: float = 0.0
    planner: PairPlanner | None = None  # (this prefill's layout, the peer's), once accepted
    state: PeerState = field(default=PeerState.PENDING, init=False)


@dataclass
class Job:
    peer: bytes
    room: int
    seq_len: int
    alloc: rq.Allocation
    plan: TransferPlan
    deadline: float
    worker_id: str = ""
    engine_peer: str | None = None  # the engine peer its copy targets (kept until the job ends)
    state: RequestState = field(default=RequestState.BOOTSTRAPPING, init=False)
    cancelled: ErrorInfo | None = None  # why, once cancelled
    cancel_event: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=now)
    digest: bytes | None = None  # the TransferDone's layout digest, once worked out (control thread)


# -- decode -------------------------------------------------------------------------------------
@dataclass
class PrefillLink:
    """The decode's view of one prefill (by control address): the handshake's outcome and who
    answered it. ``endpoint``, ``state``, ``error``, ``incarnation``, ``fingerprint`` and
    ``handshake_s`` are written under the worker's lock (other threads read them); the rest is the
    control thread's alone."""

    endpoint: str
    error: ErrorInfo | None = None
    incarnation: str | None = None  # the prefill's, from its Accept
    fingerprint: str | None = None  # the prefill's layout fingerprint, from its Accept
    handshake_s: float | None = None  # the latest accepted handshake's duration
    state: PeerState = field(default=PeerState.PENDING, init=False)
    client: Any = None  # its ControlClient (a DEALER socket), once connected
    last_heard: float = 0.0
    register_sent: float = 0.0
    answered_at: float | None = None  # the latest handshake answer (accept or refusal)
    parked: deque = field(default_factory=deque)  # requests waiting for the first answer


@dataclass
class TransferResult:
    room: int
    status: str  # "success" | "failed"
    seq_len: int
    bytes: int = 0
    descriptors: int = 0
    seconds: float = 0.0
    verified: bool = False
    error: ErrorInfo | None = None
    compute_s: float = 0.0  # the prefill's (synthesised) compute, from its TransferDone
    copy_s: float = 0.0  # the prefill's engine copy, from its TransferDone
    transfer_s: float = 0.0  # TransferRequest sent -> TransferDone received and verified
    verify_s: float = 0.0  # this decode's check of the bytes that landed
    prefill: str = ""  # the control address of the prefill asked

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
        }


@dataclass
class Request:
    room: int
    seq_len: int
    future: Future
    deadline: float
    started: float = field(default_factory=now)
    state: RequestState = field(default=RequestState.BOOTSTRAPPING, init=False)
    alloc: rq.Allocation | None = None
    resend_at: float | None = None  # set while the prefill answered Busy: it holds nothing of ours
    busy_count: int = 0
    message: wire.TransferRequest | None = None
    sent_at: float | None = None  # first send of the TransferRequest
    verify: str = "full"
    result: TransferResult | None = None
    prefill: str = ""  # the control address of the prefill asked
    expected: tuple | None = None  # (sampled check, layout digest) once sent (``decode_verify``)
