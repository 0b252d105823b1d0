"""``pdstate serve``'s prefill: a ``PrefillAgent`` over this worker's pools, computing a request
(``worker.synth``'s content, the stand-in for the model) only once a decode asks for it.

A decode's ``AgentRequest`` for a room this worker has no sender for reaches ``_on_request`` (the
agent's I/O thread): it refuses at once when the worker drains (``prefill shutting down``), when
the decode named no token count, or when ``max_inflight`` requests are in flight (``PrefillBusy``:
the decode asks again); otherwise it hands the request to a request thread, which allocates the
source pages (waiting, up to the request deadline, for pages that finishing requests free; a
request that cannot fit fails with ``AllocationError``), fills them, sends them through a ``KVSender`` (in
``chunks`` chunks, the state with the last) and frees them once the sender is terminal (the agent
fences a failed one first: nothing reads the pages after).

Stopping (``stop()``, SIGTERM through ``pdstate serve``): new requests are refused; with
``drain_s`` the requests in flight get that long to finish; then the agent fails the rest with
``prefill shutting down`` and says ``Goodbye`` to every decode, the request threads end, and the
pools (shared memory included) are released.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from pdstate import logs
from pdstate.errors import (
    AgentClosed,
    EngineError,
    PdStateError,
    PeerGone,
    PrefillBusy,
    ProtocolError,
    RoomInFlight,
    error_from_wire,
)
from pdstate.protocol.lifecycle import PeerState, RequestState
from pdstate.protocol.report import ErrorInfo
from pdstate.worker import synth
from pdstate.worker.base import AgentWorker, now
from pdstate.worker.options import NO_HOOKS, WorkerHooks, WorkerOptions
from pdstate.worker.status import PeerStatus, RequestStatus, WorkerSnapshot

log = logging.getLogger("pdstate.worker.prefill")

SHUTTING_DOWN = "prefill shutting down"
REQUEST_THREADS = 16  # at most this many requests are filled and sent at once (the rest wait their turn)


AUTH_RECENT_S = 60.0  # a frame refused for its auth tag, a decode dropped: named on /readyz this long


class AgentPrefillWorker(AgentWorker):
    """The prefill of ``pdstate serve``. ``start()`` builds pools and agent; ``stop()`` drains."""

    role = "prefill"

    def __init__(self, opts: WorkerOptions, chunks: int = 1, hooks: WorkerHooks | None = None) -> None:
        super().__init__(opts)
        self.hooks = hooks or NO_HOOKS  # test seams; swapped whole (one reference) by ``set_hooks``
        self.worker_id = opts.worker_id or "prefill"
        self.chunks = max(1, chunks)
        self.endpoint = ""
        self._draining = threading.Event()
        self._drain_end = float("inf")  # set (before ``_draining``) by ``stop``
        self._threads = ThreadPoolExecutor(
            max_workers=max(1, min(opts.max_inflight, REQUEST_THREADS)), thread_name_prefix="pdstate-prefill-request"
        )

    def start(self) -> AgentPrefillWorker:
        """Raises ``LocalCheckFailed`` (own pair refused, with ``local_checks``), ``EngineError``
        or ``zmq.ZMQError`` (bind); what was built before is released first."""
        from pdstate.agent import PrefillAgent

        o = self.opts
        self._open_agent(
            PrefillAgent,
            bind=o.bind,
            check_local=o.local_checks,
            bootstrap_timeout_s=o.request_deadline_s,
            on_request=self._on_request,
            verdict_timeout_s=o.verdict_timeout_s,
            advertise=tuple(o.advertise),
        )
        self.endpoint = self.agent.address
        log.info("prefill %s listening on %s (engine %s, agent)", self.worker_id, self.endpoint, o.engine)
        return self

    def stop(self) -> None:
        """Refuse new requests, let those in flight finish for up to ``drain_s``, then end the
        rest (``prefill shutting down``), say goodbye and release everything. Idempotent."""
        self._drain_end = time.monotonic() + self.opts.drain_s
        self._draining.set()
        while self.in_flight() and time.monotonic() < self._drain_end:
            time.sleep(0.01)
        self.close_side()

    def close_side(self) -> None:
        if self._closed:
            return
        try:
            if self.agent is not None:
                told, ended = self._audience()
                self.agent.close(SHUTTING_DOWN)
                log.info("prefill %s stopping: told %d decode(s), ended %d request(s)", self.worker_id, told, ended)
        finally:
            self._threads.shutdown(wait=True)  # no request thread touches the pools after this
            super().close_side()

    def _audience(self) -> tuple[int, int]:
        """The decodes a goodbye reaches now, and the requests it ends."""
        return len(self._ask_agent(lambda a: a.decodes(), [])), self.in_flight()

    # -- the agent's I/O thread ---------------------------------------------------------------
    def _on_request(self, room: int, seq_len: int | None, decode: str) -> None:
        if self._draining.is_set():
            raise AgentClosed(SHUTTING_DOWN)
        if seq_len is None:
            raise ProtocolError(
                f"room {room}: this prefill computes a request when asked and needs its token count "
                "(KVReceiver.init(seq_len=...))"
            )
        n = self.in_flight()
        if n >= self.opts.max_inflight:
            self.stats.busy()
            raise PrefillBusy(f"prefill busy: {n} requests in flight (max_inflight {self.opts.max_inflight})")
        status = RequestStatus(room, RequestState.BOOTSTRAPPING, seq_len, now(), peer=decode)
        if not self._enter(status):
            raise RoomInFlight(f"room {room} is already in flight on this prefill")
        try:
            self._threads.submit(self._serve, status)
        except RuntimeError as exc:  # shutting down: the executor takes no more
            self._done(status, None, AgentClosed(SHUTTING_DOWN))
            raise AgentClosed(SHUTTING_DOWN) from exc

    # -- a request thread ---------------------------------------------------------------------
    def _serve(self, status: RequestStatus) -> None:
        sender, error, compute_s = None, None, 0.0
        t0 = time.perf_counter()
        try:  # pages other requests still hold are waited for (their senders end soon)
            alloc = self.page_pool.allocate(
                self.names, status.seq_len, wait_s=self.opts.request_deadline_s, owner=status.peer, share=self._share()
            )
        except PdStateError as exc:
            self._refuse(status.room, exc)
            self._done(status, None, exc, time.perf_counter() - t0)
            return
        try:
            synth.fill_source(self.kv_args, status.room, alloc.lists)  # the stand-in for the model
            compute_s = time.perf_counter() - t0
            self._moved(status, RequestState.TRANSFERRING)
            self._hold(status)
            # its decode aborted, or went, while this one waited or computed; or this worker stops
            given_up = self._given_up(status) or self._past_drain()
            if given_up is not None:
                self._refuse(status.room, given_up)  # (a gone decode's request still waits at the agent)
                raise given_up
            pages = alloc.lists[0]
            sender = self.agent.sender(status.room, int(pages.size))
            parts = np.array_split(pages, min(self.chunks, max(1, pages.size)))
            for part in parts[:-1]:
                sender.send(part)
            sender.send(parts[-1], alloc.lists[1:])
            state = sender.wait(self.opts.request_deadline_s + self.opts.peer_timeout_s)
            if not state.terminal:
                sender.abort(f"prefill: no verdict within {self.opts.request_deadline_s:g} s")
            error = sender.failure_exception()
        except Exception as exc:  # AgentClosed at shutdown, a refused chunk, a timed-out fence
            error = AgentClosed(SHUTTING_DOWN) if isinstance(exc, AgentClosed) and self._draining.is_set() else exc
        if sender is None or sender.state.terminal:
            self.page_pool.free(alloc, owner=status.peer)  # terminal: fenced, nothing reads these pages any more
        else:  # pragma: no cover - a wedged engine: keep the pages out of use rather than reuse them
            log.error(
                "room %d: the sender is still %s after its abort; its pages stay allocated",
                status.room,
                sender.state.value,
            )
        self._done(status, sender, error, time.perf_counter() - t0, compute_s)

    def _share(self) -> float:
        """The most of the pools one decode may hold now: ``decode_share`` while another decode
        is registered, else all of them."""
        others = len(self._ask_agent(lambda a: a.decodes(), [])) > 1
        return self.opts.decode_share if others else 1.0

    def set_hooks(self, hooks: WorkerHooks) -> None:
        """Swap the fault-injection hooks (tests); requests computed later see the new ones."""
        self.hooks = hooks

    def _hold(self, status: RequestStatus) -> None:
        """The test seam ``delay_before_copy_s``: wait before sending, ending early once the decode
        gave the request up (or is gone) or this worker stops."""
        end = time.monotonic() + self.hooks.delay_before_copy_s
        while (left := end - time.monotonic()) > 0 and self.hooks.delay_before_copy_s > 0:
            if self._given_up(status) is not None or self._draining.wait(min(left, 0.02)):
                return

    def _past_drain(self) -> PdStateError | None:
        """A request not sent yet when the drain's time is up is not sent at all: it ends with
        ``prefill shutting down`` (with ``drain_s = 0``, every request not yet sending)."""
        if self._draining.is_set() and time.monotonic() >= self._drain_end:
            return AgentClosed(SHUTTING_DOWN)
        return None

    def _given_up(self, status: RequestStatus) -> PdStateError | None:
        """Why the request is not to be sent after all: its decode's abort or refusal, or the
        decode gone (silent past ``peer_timeout_s``, or said goodbye) since it asked."""
        refused = self.agent.refusal(status.room)
        if refused is not None:
            return refused
        for d in self._ask_agent(lambda a: a.peers(), []):
            if d["id"] == status.peer and d["state"] == "gone":
                err = d.get("error") or {"type": "PeerGone", "message": f"decode {status.peer} is gone"}
                return error_from_wire(err["type"], err["message"])
        if self.agent.alive and not self.agent.requested(status.room):  # dropped: its decode registered again
            return PeerGone(f"decode {status.peer} registered again or went before room {status.room} was sent")
        return None

    def _moved(self, status: RequestStatus, state: RequestState) -> None:
        with self._lock:
            if status.room in self._live:
                self._live[status.room] = replace(self._live[status.room], state=state)

    def _refuse(self, room: int, error: PdStateError) -> None:
        try:
            self.agent.refuse(room, error)
        except (AgentClosed, TimeoutError):
            pass  # closed meanwhile: the decode was told "prefill shutting down"

    def _done(
        self, status: RequestStatus, sender, error: BaseException | None, seconds: float = 0.0, compute_s: float = 0.0
    ) -> None:
        metrics = {} if sender is None else sender.metrics
        ok = error is None and sender is not None and sender.state is RequestState.SUCCESS
        if ok:
            self.stats.success(int(metrics.get("bytes", 0)), seconds)
        else:
            reason = str(error) if error is not None else f"ended {sender.state.value if sender else 'unsent'}"
            self.stats.fail(reason)
            if isinstance(error, EngineError):  # counted by class (``TransferTimedOut`` is one)
                self.stats.engine_error()
        logs.request_end(
            log,
            room=status.room,
            peer=status.peer,
            nbytes=int(metrics.get("bytes", 0)),
            ms=seconds * 1e3,
            outcome="ok" if ok else f"failed: {type(error).__name__}" if error is not None else reason,
            verification=str(metrics.get("verify", "off")),
        )
        self._leave(
            status.room,
            {
                "room": status.room,
                "decode": status.peer,
                "seq_len": status.seq_len,
                "status": "success" if ok else "failed",
                "error": None if ok or error is None else ErrorInfo.of(error).model_dump(),
                "bytes": int(metrics.get("bytes", 0)),
                "seconds": round(seconds, 6),
                "compute_s": round(compute_s, 6),
            },
        )

    # -- status (any thread) ------------------------------------------------------------------
    def status(self) -> WorkerSnapshot:
        peers = tuple(_peer(d) for d in self._ask_agent(lambda a: a.peers(), []))
        return WorkerSnapshot(
            role=self.role,
            worker_id=self.worker_id,
            incarnation=self.incarnation,
            endpoint="" if self._closed else self.endpoint,
            peers=peers,
            requests=self._requests(),
            dead_threads=self._dead_threads(),
            peak_in_flight=self.peak_in_flight,
            auth_error=self._ask_agent(lambda a: a.auth_failures.recent(AUTH_RECENT_S), None),
            dropped=self._ask_agent(lambda a: a.withheld.recent(AUTH_RECENT_S), None),
        )

    def finished_records(self) -> list[dict]:
        with self._lock:
            return list(self.finished.values())


def _peer(d: dict) -> PeerStatus:
    err = d.get("error")
    return PeerStatus(
        d["id"], PeerState(d["state"]), None if err is None else ErrorInfo(**err), d["incarnation"], d["fingerprint"]
    )


__all__ = ["AgentPrefillWorker"]
