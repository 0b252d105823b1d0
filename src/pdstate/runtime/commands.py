"""What a worker's threads hand each other through their ``Mailbox``: frozen, typed messages.

Decode: callers' threads -> control thread: ``Submit``, ``Reregister``.
Prefill: control thread -> transfer thread: ``RunJob``; transfer thread -> control thread:
``JobOutcome``. ``Stop()`` (from ``stop()``) wakes either kind of thread to end.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdstate.protocol.report import ErrorInfo

if TYPE_CHECKING:
    from pdstate.runtime.records import Job


@dataclass(frozen=True)
class Submit:
    """Ask the prefill for one request's state; ``future`` gets its ``TransferResult``."""

    room: int
    seq_len: int
    deadline_s: float
    future: Future
    verify: str  # "full" | "sample"
    prefill: str = ""  # the prefill's control address ("": the worker's ``peer``)


@dataclass(frozen=True)
class Reregister:
    """Register again (an operator fixed the prefill, or the benchmark re-handshakes)."""


@dataclass(frozen=True)
class RunJob:
    """Compute and copy ``job``. From here the transfer thread reads the job's plan and
    allocation; its state and cancellation stay under the prefill's lock."""

    job: Job


@dataclass(frozen=True)
class Stop:
    """Wake the mailbox's owner to end its thread (the worker's stop flag is set; a transfer
    thread runs none of the jobs still queued)."""


@dataclass(frozen=True)
class JobOutcome:
    """What the transfer thread reports for a job."""

    peer: bytes
    room: int
    error: ErrorInfo | None
    engine_failed: bool  # the error came from the transfer engine (any ``EngineError``)
    compute_s: float
    copy_s: float
