"""The prefill worker's records: decode peers, queued jobs and what the transfer thread reports."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from pdstate import wire
from pdstate.handshake import PeerState, RequestState
from pdstate.layout import ErrorInfo
from pdstate.planner import TransferPlan
from pdstate.runtime import requests as rq
from pdstate.runtime.common import now


@dataclass
class Peer:
    identity: bytes
    worker_id: str
    incarnation: str
    state: PeerState
    error: ErrorInfo | None = None
    kv: wire.KVDesc | None = None
    engine_peer: str | None = None
    last_seen: float = 0.0
    planner: Any = None  # ``planner.PairPlanner`` for (this prefill, the peer's layout), once accepted


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
    state: RequestState = RequestState.BOOTSTRAPPING
    cancelled: ErrorInfo | None = None  # why, once cancelled
    cancel_event: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=now)


@dataclass(frozen=True)
class JobOutcome:
    """What the transfer thread reports for a job (through the inproc socket)."""

    peer: bytes
    room: int
    error: ErrorInfo | None
    engine_failed: bool  # the error came from the transfer engine (any ``EngineError``)
    compute_s: float
    copy_s: float
