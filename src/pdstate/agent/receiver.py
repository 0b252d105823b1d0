"""The decode side of one request: ``KVReceiver`` (the caller's handle) and the records the
decode's core (``agent.decode_core``) keeps per prefill and per request."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pdstate.agent.common import RequestRecord
from pdstate.agent.digest import RequestDigest
from pdstate.agent.posted import AS_IS, POSTED
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
    state: PeerState = PeerState.PENDING
    incarnation: str = ""
    worker_id: str = ""
    error: PdStateError | None = None
    fingerprint: str | None = None  # the prefill's layout fingerprint, from its Accept
    handshake_s: float | None = None  # the latest accepted handshake's round trip
    redial: bool = False  # GONE, dialled again by ``connect``: its answer is awaited all the same
    retry_s: float = 0.0  # REJECTED for a passing reason: registers again after this long (doubling)
    registered_at: float = 0.0  # the latest Register sent (the core's clock)
    last_seen: float = 0.0  # the latest frame from it
    last_heartbeat: float = 0.0
    seq: int = 0
    handshakes: int = 0
    rooms: set[int] = field(default_factory=set)
    epoch: int = 0  # Accepts received: registrations are told apart (what an earlier one asked)
    last_incarnation: str = ""  # the latest accepted, kept across a redial (``incarnation`` is not)
    no_detail_at: float = float("-inf")  # the latest handshake cut short (``DecodeCore.on_auth_failed``)
    session_up: bool = False  # a ZeroMQ session with a process at ``address`` completed its handshake


@dataclass(slots=True)
class Receiving:
    record: RequestRecord
    prefill: str
    request: wire.AgentRequest | None = None
    aborting: str | None = None
    sent_at: float | None = None
    # digest on: what landed so far is hashed early (``wire.Landed``): the digest, and how far it
    # got (main-KV pages of ``request.dst_kv_pages``, state and aux)
    digest: RequestDigest | None = None
    hashed: tuple[int, bool] = (0, False)
    # where the request (its destination) went: the prefill's incarnation and this decode's
    # registration with it (``PrefillPeer.epoch``); None while no prefill was told where to write
    sent_to: tuple[str, int] | None = None
    acked: bool = False  # that prefill confirmed nothing more of it lands, or was proven gone
    fence_callbacks: list[Callable[[], None]] = field(default_factory=list)

    @property
    def sent(self) -> bool:
        """Whether a prefill was told where to write (the request went out and was not refused
        unseen: ``NotRegistered``)."""
        return self.sent_to is not None

    @property
    def fenced(self) -> bool:
        """Whether nothing more of the request can land: no prefill was told where to write, or
        the one told confirmed (its ``TransferDone``, goodbye) or is proven gone (restarted)."""
        return self.sent_to is None or self.acked


class KVReceiver:
    """One request on the decode side (upstream's ``KVReceiver``), fed by the prefill at
    ``prefill`` under ``room``.

    Lifecycle: BOOTSTRAPPING until that prefill accepted this agent's handshake,
    WAITING_FOR_INPUT until ``init``, TRANSFERRING once the request went out, SUCCESS after the
    prefill's ``TransferDone`` and (digests on) the landed bytes hash to the sent ones; FAILED
    otherwise, with ``failure_exception()``. ``poll()`` and ``state`` read TRANSFERRING from
    ``post_init`` on, before the I/O thread took it (``wait``'s predicate sees the thread's state).
    A receiver made with ``posted=True`` whose agent closed before its thread added it ends FAILED
    (``AgentClosed``).
    """

    def __init__(
        self,
        recv: Receiving,
        *,
        call: Callable[..., object],
        init: Callable[[Receiving, np.ndarray, list[np.ndarray], int | None, int | None], None],
        abort: Callable[[Receiving, str], None],
        on_fence: Callable[[Receiving, Callable[[], None]], None],
        post: Callable[[Callable[[], None]], None],
    ) -> None:
        """``call(fn)``: run ``fn`` on the agent's I/O thread and return its result; ``post(fn)``:
        hand ``fn`` to that thread and return; ``init``, ``abort`` and ``on_fence``: the agent's
        handlers of this request, run there."""
        self._recv, self._call, self._init, self._abort, self._on_fence = recv, call, init, abort, on_fence
        self._post = post
        self.room, self.prefill = recv.record.room, recv.prefill
        # the request's record, moved by the I/O thread: its ``state`` is the agent's own (``poll``
        # shows it as the posted calls see it); a caller that polls on a hot path reads it directly
        self.record = recv.record
        # what a posted call (``post_init``, or the agent's ``receiver(..., posted=True)``) raised
        # on the I/O thread: written there once, read by any thread
        self.posted_error: BaseException | None = None
        self._shown = AS_IS  # what ``poll`` shows of the record's state (``POSTED`` once ``post_init`` ran)

    def poll(self) -> RequestState:
        return self._shown[self._recv.record.state]

    @property
    def state(self) -> RequestState:
        return self._shown[self._recv.record.state]

    def init(self, page_indices, state_indices, aux_index: int | None = None, *, seq_len: int | None = None) -> None:
        """Name the destination: main-KV page ids, one index list per state component (in
        ``KVArgs.state_types`` order), and the aux slot (when this agent has aux buffers).
        ``seq_len``: the request's token count, for a prefill that computes the state only once
        asked (``pdstate serve``'s); an engine's prefill knows it and needs none."""
        pages = np.asarray(page_indices, dtype=np.int64).reshape(-1)
        st = [np.asarray(x, dtype=np.int64).reshape(-1) for x in state_indices]
        self._call(lambda: self._init(self._recv, pages, st, aux_index, seq_len))

    def post_init(
        self, page_indices, state_indices, aux_index: int | None = None, *, seq_len: int | None = None
    ) -> None:
        """``init`` without waiting for the I/O thread: the destination is handed over (a queue
        and a wake-up) and this returns. What ``init`` would have raised is kept in
        ``posted_error`` instead (the request's state is left as it is); posted calls, ``init``
        and ``abort`` run on the I/O thread in the order called."""
        pages = np.asarray(page_indices, dtype=np.int64).reshape(-1)
        st = [np.asarray(x, dtype=np.int64).reshape(-1) for x in state_indices]
        self._post(lambda: self._init_posted(pages, st, aux_index, seq_len))
        self._shown = POSTED

    def _init_posted(self, pages: np.ndarray, st: list[np.ndarray], aux_index: int | None, seq_len) -> None:
        if self.posted_error is not None:
            return
        try:
            self._init(self._recv, pages, st, aux_index, seq_len)
        except Exception as exc:  # the caller's poll reports it (``posted_error``)
            self.posted_error = exc

    def abort(self, reason: str = "aborted by decode", timeout_s: float = 30.0) -> None:
        """Abort the request; returns once it is terminal and fenced (``fenced``): the prefill
        confirmed that nothing of this room can land any more, or it is proven gone (a new
        incarnation took its address). Raises ``TransferTimedOut`` if that did not happen within
        ``timeout_s``; the request may be FAILED by then (its prefill went silent), and its pages
        stay the prefill's to write until ``add_fence_callback`` says otherwise."""
        self._call(lambda: self._abort(self._recv, reason))
        held = threading.Event()
        self.add_fence_callback(lambda _r: held.set())
        if not held.wait(timeout_s):
            raise TransferTimedOut(f"room {self.room}: the prefill did not confirm the abort within {timeout_s:g} s")

    @property
    def fenced(self) -> bool:
        """Terminal, and nothing more of the request can land in its destination: the caller may
        reuse its pages. A request that failed because its prefill went silent (heartbeats missed,
        a handshake unanswered) is FAILED but not fenced until that prefill confirms (a late
        ``TransferDone`` once it accepts this decode again) or is proven gone (restarted)."""
        return self._recv.record.state.terminal and self._recv.fenced

    def add_fence_callback(self, fn: Callable[[KVReceiver], None]) -> None:
        """Call ``fn(receiver)`` once ``fenced``: on the agent's I/O thread (quick, never
        blocking), or at once on that thread if it is fenced already. Never called for a request
        whose prefill never confirms (an agent closed meanwhile)."""
        self._call(lambda: self._on_fence(self._recv, lambda: fn(self)))

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
