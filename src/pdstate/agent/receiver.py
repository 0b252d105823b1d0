"""The decode side of one request: ``KVReceiver`` (the caller's handle) and the records the
``DecodeAgent``'s I/O thread keeps per prefill and per request."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import zmq

from pdstate.agent.common import RequestRecord
from pdstate.agent.digest import RequestDigest
from pdstate.errors import (
    PdStateError,
    TransferTimedOut,
)
from pdstate.protocol import wire
from pdstate.protocol.lifecycle import PeerState, RequestState

__all__ = ["KVReceiver"]

_S = RequestState


@dataclass(slots=True)
class PrefillPeer:
    address: str
    sock: zmq.Socket
    state: PeerState = PeerState.PENDING
    incarnation: str = ""
    worker_id: str = ""
    error: PdStateError | None = None
    fingerprint: str | None = None  # the prefill's layout fingerprint, from its Accept
    handshake_s: float | None = None  # the latest accepted handshake's round trip
    redial: bool = False  # GONE, dialled again by ``connect``: its answer is awaited all the same
    retry_s: float = 0.0  # REJECTED for a passing reason: registers again after this long (doubling)
    registered_at: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)
    last_heartbeat: float = 0.0
    seq: int = 0
    handshakes: int = 0
    rooms: set[int] = field(default_factory=set)


@dataclass(slots=True)
class Receiving:
    record: RequestRecord
    prefill: str
    request: wire.AgentRequest | None = None
    sent: bool = False
    aborting: str | None = None
    sent_at: float | None = None
    # digest on: what landed so far is hashed early (``wire.Landed``): the digest, and how far it
    # got (main-KV pages of ``request.dst_kv_pages``, state and aux)
    digest: RequestDigest | None = None
    hashed: tuple[int, bool] = (0, False)


class KVReceiver:
    """One request on the decode side (upstream's ``KVReceiver``), fed by the prefill at
    ``prefill`` under ``room``.

    Lifecycle: BOOTSTRAPPING until that prefill accepted this agent's handshake,
    WAITING_FOR_INPUT until ``init``, TRANSFERRING once the request went out, SUCCESS after the
    prefill's ``TransferDone`` and (digests on) the landed bytes hash to the sent ones; FAILED
    otherwise, with ``failure_exception()``.
    """

    def __init__(
        self,
        recv: Receiving,
        *,
        call: Callable[..., object],
        init: Callable[[Receiving, np.ndarray, list[np.ndarray], int | None, int | None], None],
        abort: Callable[[Receiving, str], None],
    ) -> None:
        """``call(fn)``: run ``fn`` on the agent's I/O thread and return its result; ``init`` and
        ``abort``: the agent's handlers of this request, run there."""
        self._recv, self._call, self._init, self._abort = recv, call, init, abort
        self.room, self.prefill = recv.record.room, recv.prefill

    def poll(self) -> RequestState:
        return self._recv.record.state

    @property
    def state(self) -> RequestState:
        return self._recv.record.state

    def init(self, page_indices, state_indices, aux_index: int | None = None, *, seq_len: int | None = None) -> None:
        """Name the destination: main-KV page ids, one index list per state component (in
        ``KVArgs.state_types`` order), and the aux slot (when this agent has aux buffers).
        ``seq_len``: the request's token count, for a prefill that computes the state only once
        asked (``pdstate serve``'s); an engine's prefill knows it and needs none."""
        pages = np.asarray(page_indices, dtype=np.int64).reshape(-1)
        st = [np.asarray(x, dtype=np.int64).reshape(-1) for x in state_indices]
        self._call(lambda: self._init(self._recv, pages, st, aux_index, seq_len))

    def abort(self, reason: str = "aborted by decode", timeout_s: float = 30.0) -> None:
        """Abort the request; returns once FAILED and fenced: the prefill confirmed that nothing
        of this room can land any more (or the prefill is dead: heartbeats missed). Raises
        ``TransferTimedOut`` if neither happened within ``timeout_s`` (the request then stays
        TRANSFERRING until one does)."""
        self._call(lambda: self._abort(self._recv, reason))
        rec = self._recv.record
        if rec.wait(timeout_s) is not _S.FAILED and not rec.state.terminal:
            raise TransferTimedOut(f"room {self.room}: the prefill did not confirm the abort within {timeout_s:g} s")

    def failure_exception(self) -> PdStateError | None:
        return self._recv.record.error

    def wait(self, timeout_s: float, until=None) -> RequestState:
        """Block until terminal (or ``until(state)`` is true) or ``timeout_s``; returns the state."""
        return self._recv.record.wait(timeout_s, until)

    def add_done_callback(self, fn: Callable[[KVReceiver], None]) -> None:
        """Call ``fn(receiver)`` once the request is terminal, with no thread waiting for it: on
        the agent's I/O thread (``fn`` must be quick and must not block), or at once if it has
        ended (``concurrent.futures`` or asyncio: set a future's result from ``fn``)."""
        self._recv.record.add_done_callback(lambda _record: fn(self))

    @property
    def metrics(self) -> dict:
        return dict(self._recv.record.metrics)
