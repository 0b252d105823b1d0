"""One node of ``pdstate demo --prefills N --decodes M``: a ``PrefillAgent`` or a ``DecodeAgent`` in a
child process (``python -m pdstate.devtools.cluster_node``), driven by JSON lines.

The first stdin line describes the node: ``{"role": "prefill"|"decode", "name", "pool": PoolSettings
as a dict, "engine", "engine_options", "segment_dir"?, "digest", "verify"?, "chunks", "heartbeat_interval_s",
"peer_timeout_s"}``. The node builds its pools with pdstate's presets (a decode's on
``SharedMemory`` for the shm engine), its agent over them, and prints ``{"event": "ready", "name",
"address"?, "pid", "free"}``. Then one command per line, answered by events on stdout (one JSON
object a line, from any of the node's threads):

* prefill ``{"op": "send", "room", "seq_len", "hold"?}``: allocate the request, fill its source
  items with ``worker.synth``'s content for the room, and send the pages in ``chunks`` chunks
  (state indices with the last). ``hold`` sends all but the last chunk, prints ``{"event":
  "holding", "room"}`` once the sender is TRANSFERRING, and waits for ``{"op": "release", "room"}``.
  ``announce`` prints ``{"event": "queued", "room"}`` once every chunk is handed to the sender
  (the benchmark tells the decode only then, so its timing holds no synthetic compute).
  When the sender is terminal (it frees the allocation then): ``{"event": "sent", "room",
  "status", "error", "metrics"}``.
* decode ``{"op": "connect", "prefill": address}``: shake hands with that prefill (a receiver that
  is aborted once accepted); ``{"event": "connected", "prefill", "state", "handshake_ms", "error"}``.
* decode ``{"op": "recv", "room", "seq_len", "prefill": address, "announce"?}``: allocate,
  ``post_init`` a receiver for the room from that prefill (as SGLang's backend does: no thread of
  this process wakes when the request has gone out; then, with ``announce``, ``{"event": "allocated",
  "room"}``: the router tells the prefill only now, so a prefill's pages never wait on a decode's;
  the benchmark, which tells the prefill first, asks for none: that line would wake the benchmark
  process while the request it times is in flight) and, once it succeeded
  (digests compared by the agent), check every landed item with ``synth.verify_destination``;
  then ``{"event": "result", "room", "seq_len", "status", "verified", "error", "bytes",
  "descriptors", "seconds", "metrics"}`` (``metrics``: the receiver's own).

Each request runs on a thread of its own; an allocation waits (up to ``ALLOC_WAIT_S``) for
pages that other requests free.
* either ``{"op": "stats"}``: ``{"event": "stats", "free", "peers"}``.

EOF closes the agent and the pools and exits 0; a bad first line exits ``ExitCode.CONFIG``.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import threading
import time
from dataclasses import asdict

from pdstate.errors import ExitCode

WAIT_S = 600.0
ALLOC_WAIT_S = 120.0


POSTED_CHECK_S = 0.25  # how often a wait for a posted request looks whether its init failed


def _wait_posted(recv):
    """``recv.wait(WAIT_S)`` for a request whose ``post_init`` may have failed (``posted_error``:
    its state then stays as it was): the state once terminal, its init failed, or ``WAIT_S``."""
    deadline = time.monotonic() + WAIT_S
    while True:
        state = recv.wait(max(0.0, min(POSTED_CHECK_S, deadline - time.monotonic())))
        if state.terminal or recv.posted_error is not None or time.monotonic() >= deadline:
            return state


def settings_to_dict(settings) -> dict:
    return asdict(settings)


def settings_from_dict(d: dict):
    from pdstate.pools.presets import PoolSettings

    return PoolSettings(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def _error(exc: BaseException | None) -> dict | None:
    return None if exc is None else {"type": type(exc).__name__, "message": str(exc)}


class Node:
    """The agent over this node's pools, and the requests it has in flight."""

    def __init__(self, spec: dict, emit) -> None:
        import numpy as np

        from pdstate.pools.kvargs import fill_kv_args
        from pdstate.pools.memory import SharedMemory
        from pdstate.pools.presets import build_worker_pools
        from pdstate.worker.base import PagePool
        from pdstate.worker.requests import channel_names

        self.np, self.emit, self.spec = np, emit, spec
        self.role, self.name = spec["role"], spec["name"]
        self.chunks = max(1, int(spec.get("chunks", 2)))
        engine = spec.get("engine", "shm")
        options = dict(spec.get("engine_options") or {})
        seg_dir = spec.get("segment_dir")
        if engine == "shm" and seg_dir:
            options.setdefault("segment_dir", seg_dir)
        memory = None
        if self.role == "decode" and engine == "shm":
            memory = SharedMemory(seg_dir) if seg_dir else SharedMemory()
        self.pools = build_worker_pools(settings_from_dict(spec["pool"]), memory=memory)
        self.kv = fill_kv_args(self.pools.target, self.pools.draft)
        self.names = channel_names(self.kv)
        self.page_pool = PagePool(self.pools)  # the allocator, waited on by the request threads
        self.held: dict[int, threading.Event] = {}  # rooms whose last chunk waits for "release"
        common = dict(
            engine=engine,
            engine_options=options,
            worker_id=self.name,
            heartbeat_interval_s=float(spec.get("heartbeat_interval_s", 0.5)),
            peer_timeout_s=float(spec.get("peer_timeout_s", 3.0)),
        )
        pair = (self.pools.target, self.pools.draft)
        if self.role == "prefill":
            from pdstate.agent import PrefillAgent

            self.agent = PrefillAgent(self.kv, pair, **common)
            self.address = self.agent.address
        else:
            from pdstate.agent import DecodeAgent

            digest, verify = bool(spec.get("digest", True)), spec.get("verify", "sampled")
            self.agent = DecodeAgent(self.kv, pair, digest=digest, verify=verify, **common)
            self.address = None

    def free(self) -> dict:
        return self.page_pool.counts()

    def _allocate(self, seq_len: int):
        """Allocate, waiting up to ``ALLOC_WAIT_S`` for other requests to free what it needs."""
        return self.page_pool.allocate(self.names, seq_len, wait_s=ALLOC_WAIT_S)

    def _release(self, alloc) -> None:
        self.page_pool.free(alloc)

    def _spawn(self, fn, *args) -> None:
        threading.Thread(target=fn, args=args, daemon=True).start()

    # --- prefill ----------------------------------------------------------------------------------

    def send(self, room: int, seq_len: int, hold: threading.Event | None, announce: bool = False) -> None:
        from pdstate.agent import RequestState
        from pdstate.worker import synth

        try:
            alloc = self._allocate(seq_len)
        except Exception as exc:
            try:  # a sender failed before the decode's request is served: the decode is told
                self.agent.sender(room, 0).abort(f"prefill could not allocate: {exc}")
            except Exception:
                pass
            self.emit({"event": "sent", "room": room, "status": "failed", "error": _error(exc), "metrics": {}})
            return
        try:
            synth.fill_source(self.kv, room, alloc.lists)  # the stand-in for prefill compute
            pages, state = alloc.lists[0], [x.tolist() for x in alloc.lists[1:]]
            parts = self.np.array_split(pages, min(self.chunks, max(1, pages.size)))
            sender = self.agent.sender(room, int(pages.size))
            for part in parts[:-1]:
                sender.send(part.tolist())
            if hold is not None:
                st = sender.wait(WAIT_S, until=lambda s: s is RequestState.TRANSFERRING or s.terminal)
                self.emit({"event": "holding", "room": room, "state": st.value})
                hold.wait()
            if not sender.state.terminal:
                sender.send(parts[-1].tolist(), state)
            if announce:
                self.emit({"event": "queued", "room": room})
        except Exception as exc:
            self._release(alloc)
            self.emit({"event": "sent", "room": room, "status": "failed", "error": _error(exc), "metrics": {}})
            return
        state_now = sender.wait(WAIT_S)
        self._release(alloc)
        self.emit(
            {
                "event": "sent",
                "room": room,
                "status": state_now.value,
                "error": _error(sender.failure_exception()),
                "metrics": sender.metrics,
            }
        )

    # --- decode -----------------------------------------------------------------------------------

    def connect(self, prefill: str) -> None:
        from pdstate.agent import RequestState

        t0 = time.perf_counter()
        recv = self.agent.receiver(prefill, secrets.randbits(63))
        state = recv.wait(30, until=lambda s: s is not RequestState.BOOTSTRAPPING)
        ms = (time.perf_counter() - t0) * 1e3
        err = recv.failure_exception()
        if not state.terminal:
            recv.abort("handshake only")  # never init'ed: fails at once, nothing was asked for
        ev = {"event": "connected", "prefill": prefill, "state": state.value, "handshake_ms": ms, "error": _error(err)}
        self.emit(ev)

    def recv(self, room: int, seq_len: int, prefill: str, announce: bool = False) -> None:
        """Allocate (the router tells the prefill only after ``allocated``), receive, verify."""
        from pdstate.agent import RequestState
        from pdstate.worker import synth

        t0 = time.perf_counter()
        try:
            alloc = self._allocate(seq_len)
        except Exception as exc:
            self._result(room, seq_len, "failed", False, exc, {}, t0)
            return
        try:
            recv = self.agent.receiver(prefill, room)
            # posted, as SGLang's backend names a destination: this thread is not woken once the
            # I/O thread has sent the request (``init``'s return), while the request is in flight
            recv.post_init(alloc.lists[0], alloc.lists[1:])
        except Exception as exc:
            self._release(alloc)
            self._result(room, seq_len, "failed", False, exc, {}, t0)
            return
        if announce:
            self.emit({"event": "allocated", "room": room})
        state = _wait_posted(recv)
        if recv.posted_error is not None:  # what ``init`` would have raised
            self._release(alloc)
            self._result(room, seq_len, "failed", False, recv.posted_error, {}, t0)
            return
        error, verified = recv.failure_exception(), False
        if state is RequestState.SUCCESS:
            problem = synth.verify_destination(self.kv, room, alloc.lists)
            verified = problem is None
            if problem is not None:
                error = ValueError(problem)
        elif error is None:
            error = TimeoutError(f"room {room}: still {state.value} after {WAIT_S:g} s")
        self._release(alloc)
        self._result(room, seq_len, state.value, verified, error, recv.metrics, t0)

    def _result(self, room, seq_len, status, verified, error, metrics, t0) -> None:
        self.emit(
            {
                "event": "result",
                "room": room,
                "seq_len": seq_len,
                "status": status,
                "verified": verified,
                "error": _error(error),
                "bytes": int(metrics.get("bytes", 0)),
                "descriptors": int(metrics.get("descriptors", 0)),
                "seconds": time.perf_counter() - t0,
                "metrics": dict(metrics),
            }
        )

    # --- both -------------------------------------------------------------------------------------

    def stats(self) -> dict:
        if self.role == "prefill":  # the accepted decodes, as JSON
            peers: object = [asdict(d) for d in self.agent.decodes()]
        else:  # the prefills by address: state, worker id, incarnation, why refused or gone
            peers = {
                a: {"state": p.state.value, "worker_id": p.worker_id, "incarnation": p.incarnation, "error": p.reason}
                for a, p in self.agent.prefills().items()
            }
        return {"event": "stats", "free": self.free(), "peers": peers}

    def handle(self, cmd: dict) -> None:
        op = cmd.get("op")
        if op == "send" and self.role == "prefill":
            hold = self.held.setdefault(int(cmd["room"]), threading.Event()) if cmd.get("hold") else None
            self._spawn(self.send, int(cmd["room"]), int(cmd["seq_len"]), hold, bool(cmd.get("announce")))
        elif op == "release" and self.role == "prefill":
            self.held.pop(int(cmd["room"]), threading.Event()).set()
        elif op == "connect" and self.role == "decode":
            self._spawn(self.connect, str(cmd["prefill"]))
        elif op == "recv" and self.role == "decode":
            self._spawn(
                self.recv, int(cmd["room"]), int(cmd["seq_len"]), str(cmd["prefill"]), bool(cmd.get("announce"))
            )
        elif op == "stats":
            self.emit(self.stats())
        else:
            self.emit({"event": "error", "message": f"{self.role} {self.name}: unknown command {op!r}"})

    def close(self) -> None:
        try:
            self.agent.close()
        finally:
            self.pools.close()


def main() -> ExitCode:
    out_lock = threading.Lock()

    def emit(obj: dict) -> None:
        with out_lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    line = sys.stdin.readline()
    try:
        spec = json.loads(line)
        if spec.get("role") not in ("prefill", "decode") or "pool" not in spec:
            raise ValueError("needs role (prefill|decode) and pool")
    except ValueError as exc:
        print(f"pdstate cluster node: bad description line {line.strip()[:80]!r}: {exc}", file=sys.stderr)
        return ExitCode.CONFIG
    node = Node(spec, emit)
    try:
        emit({"event": "ready", "name": node.name, "address": node.address, "pid": os.getpid(), "free": node.free()})
        for raw in sys.stdin:
            if not raw.strip():
                continue
            try:
                node.handle(json.loads(raw))
            except Exception as exc:
                emit({"event": "error", "message": f"{type(exc).__name__}: {exc}"})
    finally:
        node.close()
    return ExitCode.OK


if __name__ == "__main__":
    raise SystemExit(main())
