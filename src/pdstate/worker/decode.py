"""``pdstate serve``'s decode: a ``DecodeAgent`` over this worker's pools (in shared memory on
the shm engine), receiving a request from the prefill its caller names (default ``control.peer``).

``submit(tokens, room, prefill=...)`` enters the request and returns a future; a request thread
waits for its pages (up to the request's deadline), asks the prefill through a ``KVReceiver``
(``seq_len`` included: the prefill computes on demand), waits for the verdict (the agent compares
the digests of the bytes sent and landed), then checks what landed against the room's synthetic
content (``checks.verify``: ``full`` or ``sample``) and frees the pages. A prefill that answers
``PrefillBusy`` is asked again once one of this decode's requests ended (a slot it held is free)
or, at the latest, after a backoff, until the deadline: no request thread sleeps through it. A
request past its deadline is aborted; the abort is fenced (the prefill confirms nothing more of
it lands) before its pages are freed; one the prefill never confirms fails with ``AgentTimeout``. A prefill that is gone (goodbye, missed heartbeats) fails its requests at once; the pages
are freed then (a gone prefill writes no more: it fenced before its goodbye, or it is dead or
frozen, and a frozen one that wakes has lost this decode's registration first). An abort the
prefill never confirms (this decode was frozen past the prefill's timeout, which forgot it) keeps
the pages quarantined until the prefill is gone or has accepted this decode again (a prefill
that accepts a decode again has failed, and fenced, everything of its former registration).

The default prefill is dialled at start and again whenever it is gone (``/readyz`` follows it);
any other is dialled on first use, at most ``MAX_PREFILLS`` at once (an idle one is closed to make
room).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from pdstate import logs
from pdstate.errors import (
    AgentClosed,
    AgentTimeout,
    PdStateError,
    PrefillBusy,
    RoomInFlight,
    TooManyPrefills,
    TransferFailed,
    TransferTimedOut,
    error_from_wire,
)
from pdstate.protocol.lifecycle import PeerState, RequestState
from pdstate.protocol.report import ErrorInfo
from pdstate.worker import requests as rq
from pdstate.worker import synth
from pdstate.worker.base import AgentWorker, now, settle
from pdstate.worker.options import WorkerOptions
from pdstate.worker.status import PeerStatus, RequestStatus, TransferResult, WorkerSnapshot

log = logging.getLogger("pdstate.worker.decode")

MAX_PREFILLS = 64
BUSY_BACKOFF_S = (0.002, 0.1)  # first and longest wait before asking a busy prefill again
SHUTTING_DOWN = "decode shutting down"


class AgentDecodeWorker(AgentWorker):
    """The decode of ``pdstate serve``. ``start()`` builds pools and agent and dials
    ``control.peer``; ``submit`` runs one request; ``stop()`` fails what is in flight."""

    role = "decode"

    def __init__(self, opts: WorkerOptions) -> None:
        super().__init__(opts)
        self.worker_id = opts.worker_id or f"decode-{secrets.token_hex(3)}"
        self._stop = threading.Event()
        self._threads = ThreadPoolExecutor(
            max_workers=max(1, opts.max_inflight), thread_name_prefix="pdstate-decode-request"
        )
        self._futures: dict[int, Future] = {}  # room -> its future, until it completes
        self._quarantine: list[tuple[str, float, object]] = []  # (prefill, since, allocation), under _lock
        self._ended = threading.Condition()  # notified when a request ends (``_ends`` counts them)
        self._ends = 0

    def start(self) -> AgentDecodeWorker:
        """Raises ``LocalCheckFailed`` (own pair refused, with ``local_checks``) or ``EngineError``;
        what was built before is released first (no segment outlives it)."""
        from pdstate.agent import DecodeAgent

        o = self.opts
        self._open_agent(
            DecodeAgent,
            handshake_timeout_s=max(10.0, o.peer_timeout_s),
            transfer_timeout_s=max(o.request_deadline_s, 1.0) + o.peer_timeout_s,
        )
        self.agent.connect(o.peer)
        watcher = threading.Thread(target=self._watch, name="pdstate-decode-watch", daemon=True)
        watcher.start()
        self._watcher = watcher
        return self

    def stop(self) -> None:
        """Fail the requests in flight (``decode shutting down``) and release everything. Idempotent."""
        self._stop.set()
        with self._ended:  # a request waiting out a busy prefill ends now
            self._ended.notify_all()
        self.close_side()

    def close_side(self) -> None:
        if self._closed:
            return
        self._stop.set()
        try:
            if self.agent is not None:
                self.agent.close()  # every live receiver fails: the request threads finish
        finally:
            self._threads.shutdown(wait=True)  # no request thread touches the pools after this
            with self._lock:
                left = list(self._futures.items())
            for room, fut in left:
                settle(fut, _failed(room, 0, SHUTTING_DOWN, self.opts.peer))
            super().close_side()

    def _watch(self) -> None:
        """Register again with every gone prefill, each pass, until it is back (or this stops)."""
        pause = max(0.02, self.opts.heartbeat_interval_s / 2)
        while not self._stop.wait(pause):
            try:
                known = self.agent.prefills()
                for address in [self.opts.peer, *known]:
                    p = known.get(address)
                    if p is None or p["state"] == "gone":
                        self.agent.connect(address)
                    elif _held_elsewhere(p, self.opts.peer_timeout_s):
                        self.agent.reregister(address)
                self._release_quarantine(known)
            except (AgentClosed, TimeoutError):
                return
            except Exception:  # keep watching: readiness depends on it
                log.exception("decode watcher")

    def _release_quarantine(self, known: dict[str, dict]) -> None:
        """Free the quarantined pages whose prefill is gone, or accepted this decode again after
        the request's abort went out."""
        now_s = time.monotonic()
        with self._lock:
            held, self._quarantine = self._quarantine, []
        keep = []
        for prefill, since, alloc in held:
            p = known.get(prefill)
            ago = None if p is None else p.get("registered_s_ago")
            again = p is not None and p["state"] == "accepted" and ago is not None and ago < now_s - since
            if p is None or p["state"] == "gone" or again:
                self.page_pool.free(alloc)
            else:
                keep.append((prefill, since, alloc))
        with self._lock:
            self._quarantine.extend(keep)

    def quarantined(self) -> int:
        """Requests whose pages wait for their prefill's fence (an abort it did not confirm)."""
        with self._lock:
            return len(self._quarantine)

    # -- API for other threads ----------------------------------------------------------------
    def submit(
        self,
        seq_len: int,
        room: int | None = None,
        deadline_s: float | None = None,
        verify: str | None = None,
        prefill: str | None = None,
    ) -> Future:
        """One request of ``seq_len`` tokens from ``prefill`` (a ``tcp://host:port`` control
        address; default ``control.peer``); the future's result is a ``TransferResult``."""
        rq.check_submit(seq_len, verify, prefill)
        fut: Future = Future()
        room = room if room is not None else secrets.randbits(63)
        prefill = prefill or self.opts.peer
        status = RequestStatus(room, RequestState.BOOTSTRAPPING, seq_len, now(), peer=prefill)
        if self._stop.is_set():
            settle(fut, _failed(room, seq_len, SHUTTING_DOWN, prefill))
            return fut
        if not self._enter(status):
            settle(fut, exc=RoomInFlight(f"room {room} is already in flight"))
            return fut
        with self._lock:
            self._futures[room] = fut
        deadline = deadline_s or self.opts.request_deadline_s
        try:
            self._threads.submit(self._run, status, fut, deadline, verify or self.opts.verify)
        except RuntimeError:  # stopped meanwhile
            self._finish(status, fut, _failed(room, seq_len, SHUTTING_DOWN, prefill))
        return fut

    def reregister(self) -> None:
        """Register again with every prefill this decode knows (the default one first)."""
        for address in [self.opts.peer, *(a for a in self.agent.prefills() if a != self.opts.peer)]:
            self.agent.reregister(address)

    def lookup(self, room: int) -> TransferResult | RequestStatus | None:
        with self._lock:
            res = self.finished.get(room)
            return res if res is not None else self._live.get(room)

    def status(self) -> WorkerSnapshot:
        known: dict[str, dict] = self._ask_agent(lambda a: a.prefills(), {})
        default = known.get(self.opts.peer)
        peers = [_peer(self.opts.peer, default)] + [_peer(a, d) for a, d in known.items() if a != self.opts.peer]
        return WorkerSnapshot(
            role=self.role,
            worker_id=self.worker_id,
            incarnation=self.incarnation,
            endpoint=self.opts.peer,
            peers=tuple(peers),
            requests=self._requests(),
            dead_threads=self._dead_threads(),
            peak_in_flight=self.peak_in_flight,
            waiting=0 if self._closed else self.page_pool.waiting,
            quarantined=self.quarantined(),
            handshake_s=None if default is None else default.get("handshake_s"),
        )

    # -- a request thread ---------------------------------------------------------------------
    def _run(self, status: RequestStatus, fut: Future, deadline_s: float, verify: str) -> None:
        room, seq_len, prefill = status.room, status.seq_len, status.peer
        t0 = time.perf_counter()
        end = time.monotonic() + deadline_s
        res = TransferResult(room, "failed", seq_len, prefill=prefill, verify_level=self.opts.transfer_verify)
        alloc, fenced = None, True
        try:
            if self._stop.is_set():
                raise AgentClosed(SHUTTING_DOWN)
            known = self.agent.prefills()  # one snapshot: room for a new prefill, and whether it is down
            self._make_room(prefill, known)
            self._refuse_if_down(prefill, known)
            # a prefill gone while this request waited for pages fails it in ``receiver`` (redial_gone=False)
            alloc = self.page_pool.allocate(self.names, seq_len, wait_s=deadline_s)
            try:
                recv = self._ask(room, seq_len, prefill, alloc, end)
            except AgentTimeout:  # the abort was not confirmed: the pages wait for the prefill's fence
                fenced = False
                raise
            m = recv.metrics
            res.verify_level = str(m.get("verify", self.opts.transfer_verify))
            res.bytes, res.descriptors = int(m.get("bytes", 0)), int(m.get("descriptors", 0))
            res.transfer_s, res.copy_s = float(m.get("transfer_s", 0.0)), float(m.get("copy_s", 0.0))
            if recv.state is not RequestState.SUCCESS:
                raise recv.failure_exception() or TransferFailed(f"room {room} ended {recv.state.value}")
            t1 = time.perf_counter()
            problem = self._check(room, alloc.lists, verify)
            res.verify_s = time.perf_counter() - t1
            if problem is not None:
                raise TransferFailed(problem)
            res.status, res.verified = "success", True
        except Exception as exc:
            res.error = (
                ErrorInfo.of(exc)
                if isinstance(exc, PdStateError)
                else ErrorInfo(type=type(exc).__name__, message=str(exc))
            )
        if alloc is not None:
            if fenced:
                self.page_pool.free(alloc)
            else:  # the prefill never confirmed the abort: out of use until it is gone or accepts us again
                log.warning("room %d: abort not confirmed by %s; its pages wait for its fence", room, prefill)
                with self._lock:  # (since its deadline: when its abort went out)
                    self._quarantine.append((prefill, end, alloc))
        res.seconds = time.perf_counter() - t0
        if res.status == "success":
            self.stats.success(res.bytes, res.seconds, res.verify_level)
        elif res.error is not None:
            kind = res.error.type
            self.stats.fail(res.error.message, kind, logs.refusal_factor(kind, res.error.message))
        else:
            self.stats.fail("failed")
        logs.request_end(
            log,
            room=room,
            peer=prefill,
            nbytes=res.bytes,
            ms=res.seconds * 1e3,
            outcome="ok" if res.error is None else f"failed: {res.error.type}",
            verification=f"{res.verify_level}+{verify if res.verified else 'none'}",
        )
        self._finish(status, fut, res)

    def _refuse_if_down(self, prefill: str, known: dict[str, dict]) -> None:
        """A gone prefill (until it accepts again), or one that refused this decode within the
        last ``peer_timeout_s``, fails the request at once with its reason (an older refusal is
        asked again: the prefill may have been fixed)."""
        p = known.get(prefill)
        if p is None:
            return
        recent = p["registered_s_ago"] < self.opts.peer_timeout_s
        if p["state"] == "gone" or (p["state"] == "rejected" and recent):
            info = p["error_info"] or {"type": "PeerGone", "message": f"prefill {prefill} is gone"}
            raise error_from_wire(info["type"], info["message"])

    def _ask(self, room, seq_len, prefill, alloc, end: float):
        """Receive ``room`` into ``alloc``, asking a busy prefill again until ``end``. Returns
        the terminal receiver (nothing of it can land any more); raises ``TransferFailed`` at the
        deadline (after the abort's fence), ``AgentTimeout`` when the prefill never confirmed
        the abort."""
        backoff = BUSY_BACKOFF_S[0]
        while True:
            recv = self.agent.receiver(prefill, room, redial_gone=False)  # the watcher redials
            recv.init(alloc.lists[0], alloc.lists[1:], seq_len=seq_len)
            state = recv.wait(max(0.0, end - time.monotonic()))
            if not state.terminal:
                why = "deadline exceeded"
                if state is RequestState.BOOTSTRAPPING:
                    why = f"deadline exceeded: no handshake answer from the prefill at {prefill}"
                try:
                    recv.abort("deadline exceeded on decode", timeout_s=self.opts.peer_timeout_s + 5)
                except TransferTimedOut:  # the pages wait for the prefill's fence (quarantine)
                    raise AgentTimeout(
                        f"{why}; the prefill at {prefill} did not confirm the abort within "
                        f"{self.opts.peer_timeout_s + 5:g} s"
                    ) from None
                if recv.state is RequestState.SUCCESS:  # the verdict came first
                    return recv
                raise TransferFailed(why)  # fenced: the pages are free to reuse
            if isinstance(recv.failure_exception(), PrefillBusy) and time.monotonic() + backoff < end:
                self.stats.busy()
                self._await_an_end(backoff)
                if self._stop.is_set():
                    raise AgentClosed(SHUTTING_DOWN)
                backoff = min(BUSY_BACKOFF_S[1], backoff * 2)
                continue
            return recv

    def _await_an_end(self, longest_s: float) -> None:
        """Wait, after a ``PrefillBusy``, until one of this decode's requests ends (a prefill slot it
        held is free again), this decode stops, or ``longest_s`` passed (slots other decodes free
        send no word here)."""
        with self._ended:
            seen = self._ends
            self._ended.wait_for(lambda: self._ends != seen or self._stop.is_set(), longest_s)

    def _check(self, room: int, lists, verify: str) -> str | None:
        if verify == "sample":
            spans = [(r.base_ptr, r.nbytes) for r in self.pools.memory.regions()]
            return synth.verify_sample(self.kv_args, room, lists, spans)
        return synth.verify_destination(self.kv_args, room, lists)

    def _make_room(self, prefill: str, known: dict[str, dict]) -> None:
        """At most ``MAX_PREFILLS`` prefills connected: close an idle one for a new address."""
        if prefill in known or len(known) < MAX_PREFILLS:
            return
        for address in known:
            if address != self.opts.peer and self.agent.forget(address):
                return
        raise TooManyPrefills(f"this decode already uses {MAX_PREFILLS} prefills, each with requests in flight")

    def _finish(self, status: RequestStatus, fut: Future, res: TransferResult) -> None:
        self._leave(status.room, res)
        with self._lock:
            self._futures.pop(status.room, None)
        with self._ended:
            self._ends += 1
            self._ended.notify_all()
        settle(fut, res)


def _held_elsewhere(p: dict, peer_timeout_s: float) -> bool:
    """A refusal that passes by itself: the prefill still holds this decode's former connection
    (``WorkerIdInUse``, after this decode was frozen or its socket renewed) until it times it out;
    asked again once that long went by."""
    info = p.get("error_info") or {}
    ago = p.get("registered_s_ago")
    return p["state"] == "rejected" and info.get("type") == "WorkerIdInUse" and ago is not None and ago > peer_timeout_s


def _failed(room: int, seq_len: int, reason: str, prefill: str) -> TransferResult:
    return TransferResult(
        room, "failed", seq_len, error=ErrorInfo(type="TransferFailed", message=reason), prefill=prefill
    )


def _peer(address: str, d: dict | None) -> PeerStatus:
    if d is None:
        return PeerStatus(address, PeerState.PENDING)
    err = d.get("error_info")
    return PeerStatus(
        address,
        PeerState(d["state"]),
        None if err is None else ErrorInfo(**err),
        d["incarnation"] or None,
        d["fingerprint"],
    )


__all__ = ["AgentDecodeWorker", "MAX_PREFILLS"]
