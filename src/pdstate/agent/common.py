"""What both agents share: the I/O thread, regions from a caller's ``KVArgs``, request records."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from pdstate.agent import curve
from pdstate.errors import AgentClosed, PdStateError
from pdstate.pools.memory import Region
from pdstate.protocol.lifecycle import RequestState
from pdstate.protocol.lifecycle import move as lifecycle_move
from pdstate.protocol.wire import MAX_FRAME_BYTES

if TYPE_CHECKING:  # typing.Self is 3.11+: annotations only, never evaluated
    from typing_extensions import Self

log = logging.getLogger("pdstate.agent")

__all__ = ["AgentLifetime", "AgentLoop", "RequestRecord", "channel_layout", "regions_of"]

AGAIN_MS = 1  # how soon ``AgentLoop.again`` checks run
_POLLIN, _EVENTS = int(zmq.POLLIN), int(zmq.EVENTS)  # plain ints: the I/O thread asks them every turn


def regions_of(kv_args, aux: bool = True) -> list[Region]:
    """One engine region per distinct buffer of ``kv_args`` (main KV, state, aux); buffers that
    overlap are merged. The memory stays the caller's: engines only register it."""
    spans = list(zip(kv_args.kv_data_ptrs, kv_args.kv_data_lens))
    for ptrs, lens in zip(kv_args.state_data_ptrs, kv_args.state_data_lens):
        spans += zip(ptrs, lens)
    if aux:
        spans += zip(kv_args.aux_data_ptrs, kv_args.aux_data_lens)
    merged: list[list[int]] = []
    for ptr, n in sorted((int(p), int(n)) for p, n in spans if n):
        if merged and ptr < merged[-1][0] + merged[-1][1]:
            end = max(merged[-1][0] + merged[-1][1], ptr + n)
            merged[-1][1] = end - merged[-1][0]
        else:
            merged.append([ptr, n])
    return [Region(f"buffer-{i}", p, n) for i, (p, n) in enumerate(merged)]


def channel_layout(desc, aux_ptrs=None, aux_items=None) -> list[tuple[list[int], list[int]]]:
    """``[(ptrs, item_lens)]`` for main KV, each state component, then aux (when given)."""
    out = [(list(desc.kv_data_ptrs), list(desc.kv_item_lens))]
    out += [(list(p), list(i)) for p, i in zip(desc.state_data_ptrs, desc.state_item_lens)]
    if aux_ptrs is not None:
        out.append((list(aux_ptrs), list(aux_items)))
    return out


_AT_KEY = {s: f"{s.value}_at_s" for s in RequestState}  # the metric each move stamps
_SUCCESS, _FAILED = RequestState.SUCCESS, RequestState.FAILED  # the terminal states


@dataclass(slots=True)
class RequestRecord:
    """A request's lifecycle on one side; written by the I/O thread, read by any thread.

    Each record has its own small lock; its condition (~1.5 KB) is made over that lock by the
    first thread that waits on it: most requests are never waited on by a thread of their own (an
    ended sender is kept a while). A caller that would rather not wait with a thread asks to be
    told at the end (``add_done_callback``)."""

    room: int
    state: RequestState = RequestState.BOOTSTRAPPING
    error: PdStateError | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    created: float = field(default_factory=time.monotonic)
    watchers: int = 0  # threads in ``wait`` with a predicate of their own (others wait for the end)
    waiters: int = 0  # threads in ``wait``
    changed: threading.Condition | None = None
    lock: Any = field(default_factory=threading.Lock, repr=False, compare=False)
    done_callbacks: list[Callable[[RequestRecord], None]] | None = field(default=None, repr=False, compare=False)

    def move(self, new: RequestState) -> None:
        self._change(new, None)

    def _change(self, new: RequestState, step: Callable[[], bool] | None) -> bool:
        """Run ``step`` (which moves to ``new`` or not, and says so; ``None``: the move itself)
        under the record's lock, wake the threads that wait for this move, then (at the end) run
        the done callbacks."""
        callbacks = None
        terminal = new is _SUCCESS or new is _FAILED  # ``new.terminal``, without a property call per move
        with self.lock:
            moved = self._apply(new) if step is None else step()
            cond = self.changed
            if moved and cond is not None and (terminal or self.watchers):  # a waiter for the end sleeps through steps
                cond.notify_all()
            if moved and terminal and self.done_callbacks:
                callbacks, self.done_callbacks = self.done_callbacks, None
        for fn in callbacks or ():
            self._run_callback(fn)
        return moved

    def _run_callback(self, fn: Callable[[RequestRecord], None]) -> None:
        try:
            fn(self)
        except Exception:  # a caller's callback must not break the thread that ended the request
            log.exception("room %d: a done callback failed", self.room)

    def add_done_callback(self, fn: Callable[[RequestRecord], None]) -> None:
        """Call ``fn(record)`` once the request is terminal (SUCCESS or FAILED): on the thread
        that ends it (the agent's I/O thread: ``fn`` must be quick and must not block), or at once
        on this thread if it has already ended. An exception in ``fn`` is logged, not raised."""
        with self.lock:
            if not self.state.terminal:
                if self.done_callbacks is None:
                    self.done_callbacks = []
                self.done_callbacks.append(fn)
                return
        self._run_callback(fn)

    def _apply(self, new: RequestState) -> bool:
        if self.state is new:
            return False
        lifecycle_move(self, new)
        self.metrics[_AT_KEY[new]] = round(time.monotonic() - self.created, 6)
        return True

    def fail(self, error: PdStateError) -> bool:
        """Move to FAILED with ``error`` unless already terminal; returns whether it moved."""

        def step() -> bool:
            if self.state.terminal:
                return False
            self.error = error
            return self._apply(RequestState.FAILED)

        return self._change(RequestState.FAILED, step)

    def release(self) -> None:
        """Drop the condition of an ended record no thread waits on (a later ``wait`` makes one)."""
        with self.lock:
            if self.state.terminal and not self.waiters:
                self.changed = None

    def wait(self, timeout_s: float, until: Callable[[RequestState], bool] | None = None) -> RequestState:
        deadline = time.monotonic() + timeout_s
        with self.lock:
            if self.changed is None:
                self.changed = threading.Condition(self.lock)
            cond = self.changed
            self.waiters += 1
            if until is not None:
                self.watchers += 1
            try:
                while not (self.state.terminal if until is None else until(self.state)):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    cond.wait(left)
                return self.state
            finally:
                if until is not None:
                    self.watchers -= 1
                self.waiters -= 1


CALL_CHECK_S = 0.05  # how often a waiting ``call`` looks whether the loop ended under it
CLOSE_LINGER_MS = 250  # at close, how long queued frames may take to leave before they are dropped


class AgentLoop:
    """One thread that owns the ZeroMQ sockets and the engine's submissions.

    Other threads hand it work with ``post(fn)`` (run soon, in order) or ``call(fn)`` (run and
    wait for the result, re-raising its exception). ``on_tick`` runs at least every ``tick_s``.
    """

    def __init__(self, name: str, tick_s: float, on_tick: Callable[[], None]) -> None:
        self.ctx = zmq.Context()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        # a wake-up written and not yet taken by the thread: posts meanwhile need none of their own
        # (a burst of posts, one scheduler iteration's, costs its thread one write, not one each)
        self._woken = False
        # from the poll's return to the end of the queue's run: the thread takes its queue before it
        # polls again, so its own posts meanwhile (a posted step's chunk pump, the again checks')
        # need no wake-up write (each cost a write and one more empty turn of the loop)
        self._draining = False
        self._sockets: dict[zmq.Socket, Callable[[zmq.Socket], None]] = {}
        self._monitors: dict[zmq.Socket, zmq.Socket] = {}  # a socket -> its monitor (``monitor``)
        self._zap: Any = None  # the CURVE servers' ZAP handler (``serve_curve``)
        self._poller: zmq.Poller | None = None  # the wake pipe and every socket; None: rebuild it
        self._tick_s, self._on_tick = tick_s, on_tick
        self._stopping = False
        self.closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._ident: int | None = None
        self._again: dict[int, Callable[[], Any]] = {}  # checks to run in about AGAIN_MS, by key
        self._ended = threading.Event()  # the thread returned: what is still queued never runs
        # started and not returned yet: ``alive`` reads this flag, not ``Thread.is_alive`` (a lock
        # taken per call; SGLang's backend asks on its scheduler thread, per request)
        self._live = False

    def start(self) -> None:
        self._live = True  # before the thread runs: it clears the flag as it returns
        try:
            self._thread.start()
        except BaseException:
            self._live = False
            raise

    def socket(self, kind: int) -> zmq.Socket:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + 1024)
        return s

    def watch(self, sock: zmq.Socket, handler: Callable[[zmq.Socket], None]) -> None:
        self._sockets[sock] = handler
        self._poller = None  # rebuilt with it at the next turn

    def unwatch(self, sock: zmq.Socket) -> None:
        mon = self._monitors.pop(sock, None)
        if mon is not None:
            self._sockets.pop(mon, None)
            sock.disable_monitor()
            mon.close(0)
        self._sockets.pop(sock, None)
        self._poller = None
        sock.close(0)

    def monitor(self, sock: zmq.Socket, events: int, handler: Callable[[dict], None]) -> None:
        """Call ``handler(event)`` (``zmq.utils.monitor``'s dict) on this thread for each of
        ``events`` on ``sock``; ``unwatch(sock)`` ends it."""
        mon = sock.get_monitor_socket(events)
        self._monitors[sock] = mon
        self.watch(mon, lambda m: handler(recv_monitor_message(m)))

    def serve_curve(self, sock: zmq.Socket, keys: curve.Keys) -> None:
        """Make ``sock`` (before it binds) a CURVE server of ``keys``' domain, with the ZAP
        handler of this loop's context letting in the domain's client key only."""
        if self._zap is None:
            self._zap = curve.start_zap(self.ctx, keys)
        curve.serve(sock, keys)

    def again(self, key: object, check: Callable[[], Any]) -> None:
        """Run ``check`` once in about ``AGAIN_MS`` ms (I/O thread only; one per ``key``, the last
        given): for work that finishes off this thread (an engine's native transfer), so that
        its end is seen in a millisecond, not at the next tick. ``check`` re-arms itself if needed."""
        self._again[id(key)] = check

    @property
    def alive(self) -> bool:
        """Whether the I/O thread runs (it ends only at ``stop``, or with the process)."""
        return self._live and not self.closed

    def in_loop(self) -> bool:
        return threading.get_ident() == self._ident

    def post(self, fn: Callable[[], None]) -> None:
        if self.closed:
            raise AgentClosed("the agent is closed")
        self._queue.put(fn)
        if self._woken:  # the thread clears it before it takes the queue: it will find ``fn``
            return
        if self._draining and self.in_loop():  # the thread's own, before it takes the queue
            return
        self._woken = True
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:  # pragma: no cover - the pipe is full: the loop is awake anyway
            pass

    def call(self, fn: Callable[[], Any], timeout_s: float = 30.0) -> Any:
        if self.in_loop():
            return fn()
        # a bare lock, held until ``run`` has run (an Event costs the caller about twice as much
        # CPU: SGLang's scheduler thread calls through here per request and per chunk)
        done = threading.Lock()
        done.acquire()
        box: list[Any] = [None, None]

        def run() -> None:
            try:
                box[0] = fn()
            except BaseException as exc:  # handed back to the calling thread
                box[1] = exc
            done.release()

        self.post(run)
        deadline = time.monotonic() + timeout_s
        while not done.acquire(True, min(CALL_CHECK_S, max(0.0, deadline - time.monotonic()))):
            if self._ended.is_set():  # stopped before it ran: it never will
                if done.acquire(False):
                    break
                raise AgentClosed("the agent is closed")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"agent I/O thread did not answer within {timeout_s:g} s")
        if box[1] is not None:
            raise box[1]
        return box[0]

    def stop(self, final: Callable[[], None]) -> None:
        """Run ``final`` in the loop, then end the thread and close every socket (idempotent)."""
        if self.closed:
            return
        if self._thread.is_alive():
            try:
                self.call(final)
            finally:
                self.end()
                self.closed = True
                self._thread.join(10)
        self.closed = True
        for s in list(self._sockets):
            s.close(CLOSE_LINGER_MS)  # what ``final`` sent (failed TransferDones, Goodbyes) still goes out
        self._sockets.clear()
        self._monitors.clear()
        if self._zap is not None:
            self._zap.stop()
        os.close(self._wake_r)
        os.close(self._wake_w)
        self.ctx.term()

    def end(self) -> None:
        """End the thread at its next turn (``stop``'s step after ``final``): what is queued after
        never runs, and a ``call`` waiting on it raises ``AgentClosed`` once the thread ended."""
        self._stopping = True
        self.post(lambda: None)

    @staticmethod
    def _guard(fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # a bug in one handler must not end the I/O thread
            log.exception("pdstate agent I/O thread: unhandled error")

    def _run(self) -> None:
        try:
            self._turns()
        finally:
            self._live = False
            self._ended.set()

    def _turns(self) -> None:
        self._ident = threading.get_ident()
        poller_timeout_ms = max(1, int(self._tick_s * 1000))
        next_tick = time.monotonic()
        while not self._stopping:
            poller = self._poller
            if poller is None:
                poller = self._poller = zmq.Poller()
                poller.register(self._wake_r, zmq.POLLIN)
                for s in self._sockets:
                    poller.register(s, zmq.POLLIN)
            polled = poller.poll(AGAIN_MS if self._again else poller_timeout_ms)
            self._draining = True
            if self._again:
                checks, self._again = self._again, {}
                for check in checks.values():
                    self._guard(check)
            readable = []  # the watched sockets the poll found readable, with their events
            for s, ev in polled:  # the poll's list as it is: no dict of it built per turn
                if type(s) is int:  # the wake pipe (the only plain descriptor polled)
                    try:
                        while os.read(s, 4096):
                            pass
                    except BlockingIOError:
                        pass
                else:
                    readable.append((s, ev))
            # after the pipe is read, before the queue is: a post from here on writes again, and one
            # before it (which skipped its write) has its work in the queue read below
            self._woken = False
            work = self._queue
            while not work.empty():  # one consumer (this thread): what it holds is there to take
                self._guard(work.get_nowait())
            self._draining = False  # the socket handlers' posts below wake the next poll
            sockets = self._sockets
            for s, ev in readable:
                # the first message without asking: the poll said so, and only this thread reads it;
                # then ZMQ_EVENTS (a getsockopt, ~1 us; ``Socket.poll(0)`` builds a poller, ~20 us),
                # plain ints (a PollEvent flag's ``&`` runs in Python)
                ready = s in sockets and ev & _POLLIN
                while ready:
                    handler = sockets.get(s)
                    if handler is None:  # unwatched by a handler meanwhile (or by the queue's work)
                        break
                    try:  # ``_guard`` inline: no closure made and called per message
                        handler(s)
                    except Exception:  # a bug in one handler must not end the I/O thread
                        log.exception("pdstate agent I/O thread: unhandled error")
                    ready = s in sockets and s.getsockopt(_EVENTS) & _POLLIN
            if time.monotonic() >= next_tick:
                self._guard(self._on_tick)
                next_tick = time.monotonic() + self._tick_s


class AgentLifetime:
    """What both agents share over their I/O thread (``_loop``) and engine (``_engine``): whether
    they run, ``with`` closing them, the last step of ``close``, and a tick's clock."""

    _loop: AgentLoop
    _engine: Any
    _last_tick: float
    heartbeat_interval_s: float

    def close(self) -> None:
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        """Whether the I/O thread runs (nothing is sent or received without it)."""
        return self._loop.alive

    def post(self, fn: Callable[[], None]) -> None:
        """Hand ``fn`` to the agent's I/O thread and return: it runs there soon, in order with the
        work posted before it (posted senders and receivers, ``KVSender.post``,
        ``KVReceiver.post_init``). For a caller's own quick step that makes or feeds its senders or
        receivers off its thread (SGLang's backend makes its agent senders and receivers so, out of
        its scheduler's ``init``); what ``fn`` raises is logged and dropped. Raises ``AgentClosed``
        once the agent closed (``fn`` never runs then)."""
        self._loop.post(fn)

    def transport(self) -> dict:
        """The engine's transport (``engines.listeners.Transport.as_dict``): configured, in use,
        the TCP addresses its native side listens on, and ``problem`` (a silent fallback)."""
        return self._engine.transport().as_dict()

    def _tick_time(self, peers: Iterable[Any]) -> float:
        """Now, for a tick: a tick more than two heartbeat intervals late means this process did
        not run for a while (frozen, swapped out), so ``peers`` (their ``last_seen``) are not
        blamed for that time."""
        now = time.monotonic()
        stalled = now - self._last_tick - 2 * self.heartbeat_interval_s
        self._last_tick = now
        if stalled > 0:
            for peer in peers:
                peer.last_seen += stalled
        return now

    def _stop(self, final: Callable[[], None]) -> None:
        """Run ``final`` on the I/O thread as it stops, then close the engine."""
        try:
            self._loop.stop(final)
        finally:
            self._engine.close()

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called (neither alive nor closed: the I/O thread died)."""
        return self._loop.closed

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def end_io_thread_as_a_crash(agent: AgentLifetime, timeout_s: float = 10.0) -> bool:
    """Fault injection for tests and probes, not for serving: end ``agent``'s I/O thread as a crash
    would, without the orderly close (``AgentLoop.end``: its next turn is its last; no final work
    runs, no Goodbye or failed ``TransferDone`` goes out, the sockets and engine stay open). Waits
    up to ``timeout_s`` for the thread to return; True once it has. From then on ``agent.alive``
    is False and ``agent.closed`` still False (the thread died), its requests fail as they do
    when the thread is gone, and ``close()`` still closes its sockets and engine."""
    loop = agent._loop
    loop.end()
    return loop._ended.wait(timeout_s)
