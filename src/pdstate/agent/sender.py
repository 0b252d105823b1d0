"""The prefill side of one request: ``KVSender`` (the caller's handle) and the records the
``PrefillAgent``'s I/O thread keeps per decode and per request."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pdstate.agent.common import RequestRecord
from pdstate.agent.digest import RequestDigest
from pdstate.agent.posted import AS_IS, POSTED
from pdstate.errors import (
    ItemLengthMismatch,
    PdStateError,
    TransferTimedOut,
)
from pdstate.protocol import wire
from pdstate.protocol.lifecycle import RequestState
from pdstate.transfer.engines.base import TransferHandle
from pdstate.transfer.plan import TransferPlan
from pdstate.transfer.planner import PairPlanner

__all__ = ["KVSender"]


_S = RequestState


@dataclass(slots=True)
class DecodePeer:
    identity: bytes
    worker_id: str
    incarnation: str
    peer_id: str
    planner: PairPlanner
    last_seen: float
    withheld: int = 0  # verdicts this decode let pass their deadline in a row (``agent.fairness``)
    endpoint: dict | None = None  # its engine endpoint, without a challenge's answer (``admission``)


@dataclass(slots=True)
class PendingRequest:
    """An ``AgentRequest`` (or its abort) that arrived before the caller made its sender."""

    identity: bytes
    msg: wire.AgentRequest


@dataclass(slots=True)
class Fence:
    """A failing request's fence, pending while its copies are in flight (``agent.fence``): the
    failure it ends with, whether the decode is told once it holds, and how long it may take."""

    error: PdStateError
    tell: bool
    deadline: float


@dataclass(slots=True)
class Sending:
    record: RequestRecord
    num_pages: int
    aux_index: int | None
    identity: bytes | None = None
    request: wire.AgentRequest | None = None
    queued: list[tuple[np.ndarray, list[np.ndarray] | None]] = field(default_factory=list)
    pages_sent: int = 0
    handles: list[TransferHandle] = field(default_factory=list)
    digest: RequestDigest | None = None
    bytes: int = 0
    descriptors: int = 0
    chunks: int = 0
    all_submitted: bool = False
    done_sent: bool = False
    done_at: float = 0.0  # when TransferDone went out: the verdict is awaited from then
    watched: int = 0  # handles[:watched] have a wake-up asked of the engine for when they finish
    started: float = 0.0
    # digest requests: (handle, main-KV pages landed once it finishes, state and aux landed then),
    # in submission order, not yet told to the decode; and what was told (``wire.Landed``)
    marks: list[tuple[TransferHandle | None, int, bool]] = field(default_factory=list)  # None: nothing to move
    told: tuple[int, bool] = (0, False)
    fence: Fence | None = None  # failing: ends FAILED once no copy of it is in flight (``agent.fence``)
    decode_key: str | None = None  # "worker_id/incarnation" of the decode that asked for it


@dataclass(slots=True, frozen=True)
class _EndedRecord:
    """An ended sender's record as its tombstone keeps it: the outcome (FAILED with ``error``,
    else SUCCESS) and when the request began."""

    room: int
    error: PdStateError | None
    created: float

    @property
    def state(self) -> RequestState:
        return _S.FAILED if self.error is not None else _S.SUCCESS


@dataclass(slots=True)
class EndedSender:
    """What the prefill keeps of an ended sender (a tombstone, ~200 bytes): enough to answer a
    late ``AgentRequest`` or ``Abort`` for its room. The caller's ``KVSender`` keeps the sender
    itself (its metrics) for as long as the caller wants it."""

    record: _EndedRecord
    identity: bytes | None
    request: wire.AgentRequest | None  # the sender's request once it had one (a stand-in), else None
    handles: tuple = ()
    digest: None = None
    fence: None = None

    @classmethod
    def of(cls, send: Sending, answered: wire.AgentRequest) -> EndedSender:
        r = send.record
        return cls(_EndedRecord(r.room, r.error, r.created), send.identity, None if send.request is None else answered)


class KVSender:
    """One request on the prefill side (upstream's ``KVSender``).

    Lifecycle: BOOTSTRAPPING until the decode's ``AgentRequest`` for this room arrives,
    WAITING_FOR_INPUT, TRANSFERRING from the first chunk, SUCCESS once every chunk has landed and
    the decode accepted the bytes (digests equal), FAILED otherwise (``failure_exception()``).
    ``poll()`` and ``state`` read TRANSFERRING from the first ``post`` on, before the I/O thread
    took the chunk (``wait``'s predicate sees the thread's state). A sender made with
    ``posted=True`` whose agent closed before its thread added it ends FAILED (``AgentClosed``).
    """

    def __init__(
        self,
        send: Sending,
        *,
        call: Callable[..., object],
        queue_chunk: Callable[[Sending, np.ndarray, list[np.ndarray] | None], None],
        abort: Callable[[Sending, str], None],
        post: Callable[[Callable[[], None]], None],
    ) -> None:
        """``call(fn, timeout_s)``: run ``fn`` on the agent's I/O thread and return its result;
        ``post(fn)``: hand ``fn`` to that thread and return; ``queue_chunk`` and ``abort``: the
        agent's handlers of this request, run there."""
        self._send, self._call, self._queue_chunk, self._abort = send, call, queue_chunk, abort
        self._post = post
        self.room = send.record.room
        # the request's record, moved by the I/O thread: its ``state`` is the agent's own (``poll``
        # shows it as the posted chunks see it); a caller that polls on a hot path reads it directly
        self.record = send.record
        # what a posted call (``post``, or the agent's ``sender(..., posted=True)``) raised on the
        # I/O thread: written there once, read by any thread
        self.posted_error: BaseException | None = None
        self._shown = AS_IS  # what ``poll`` shows of the record's state (``POSTED`` once a chunk was posted)

    def poll(self) -> RequestState:
        return self._shown[self._send.record.state]

    @property
    def state(self) -> RequestState:
        return self._shown[self._send.record.state]

    def send(self, page_indices, state_indices=None) -> None:
        """Queue one chunk: this chunk's source page ids; ``state_indices`` (one list per state
        component, in ``KVArgs.state_types`` order) only with the last chunk, the one that brings
        the pages sent to ``num_pages``. Returns at once; the I/O thread moves the bytes."""
        pages = np.asarray(page_indices, dtype=np.int64).reshape(-1)
        st = None if state_indices is None else [np.asarray(x, dtype=np.int64).reshape(-1) for x in state_indices]
        self._call(lambda: self._queue_chunk(self._send, pages, st))

    def post(self, page_indices, state_indices=None) -> None:
        """``send`` without waiting for the I/O thread: the chunk is handed over (a queue and a
        wake-up) and this returns. What ``send`` would have raised is kept in ``posted_error``
        instead (the request's state is left as it is), and the chunks posted after it are
        dropped; posted chunks, ``send`` and ``abort`` run on the I/O thread in the order called."""
        pages = np.asarray(page_indices, dtype=np.int64).reshape(-1)
        st = None if state_indices is None else [np.asarray(x, dtype=np.int64).reshape(-1) for x in state_indices]
        self._post(lambda: self._queue_posted(pages, st))
        self._shown = POSTED

    def _queue_posted(self, pages: np.ndarray, st: list[np.ndarray] | None) -> None:
        if self.posted_error is not None:
            return
        try:
            self._queue_chunk(self._send, pages, st)
        except Exception as exc:  # the caller's poll reports it (``posted_error``)
            self.posted_error = exc

    def abort(self, reason: str = "aborted by prefill", timeout_s: float = 30.0) -> None:
        """Stop sending; returns once no write of this request can land any more (in-flight
        engine handles finished: FAILED), the decode told with a failed ``TransferDone``. Raises
        ``TransferTimedOut`` if that did not happen within ``timeout_s`` (the I/O thread does
        not wait for the fence: ``agent.fence``)."""
        self._call(lambda: self._abort(self._send, f"aborted by prefill: {reason}"))
        if not self._send.record.wait(timeout_s).terminal:
            raise TransferTimedOut(f"room {self.room}: the abort's fence did not hold within {timeout_s:g} s")

    def failure_exception(self) -> PdStateError | None:
        return self._send.record.error

    def wait(self, timeout_s: float, until=None) -> RequestState:
        """Block until terminal (or ``until(state)`` is true) or ``timeout_s``; returns the state."""
        return self._send.record.wait(timeout_s, until)

    def add_done_callback(self, fn: Callable[[KVSender], None]) -> None:
        """Call ``fn(sender)`` once the request is terminal, with no thread waiting for it: on the
        agent's I/O thread (``fn`` must be quick and must not block), or at once if it has ended."""
        self._send.record.add_done_callback(lambda _record: fn(self))

    @property
    def landed(self) -> bool:
        """Whether every chunk was submitted and has finished on the engine."""
        return self._send.done_sent

    @property
    def metrics(self) -> dict:
        return dict(self._send.record.metrics)


def with_aux(plan: TransferPlan, kv_args, dst_aux: wire.AuxDest, aux_index: int) -> TransferPlan:
    src_items = list(kv_args.aux_item_lens)
    if len(src_items) != len(dst_aux.item_lens) or src_items != list(dst_aux.item_lens):
        raise ItemLengthMismatch(
            f"aux buffers differ: prefill item lengths {src_items}, decode {list(dst_aux.item_lens)}"
        )
    for n, item in zip(kv_args.aux_data_lens, src_items):
        if (aux_index + 1) * item > n:
            raise ItemLengthMismatch(f"aux index {aux_index} is past an aux buffer of {n} bytes")
    items = np.asarray(src_items, dtype=np.uint64)
    src = np.asarray(kv_args.aux_data_ptrs, dtype=np.uint64) + np.uint64(aux_index) * items
    dst = np.asarray(dst_aux.ptrs, dtype=np.uint64) + np.uint64(dst_aux.index) * items
    return TransferPlan.from_arrays(
        np.concatenate([plan.src, src]), np.concatenate([plan.dst, dst]), np.concatenate([plan.length, items])
    )
