"""``pdstate demo --prefills N --decodes M``: N prefill and M decode processes on one host, each
hosting an agent (``devtools.cluster_node``), and a router in this process that picks the
(prefill, decode) pair of every request and tells both sides (room, prompt length) over each
child's stdin; results come back as JSON lines on the children's stdout.

``Cluster`` starts and drives the nodes (the fault tests use it directly); ``Router`` picks pairs
(least-loaded or round-robin over the live nodes, at most ``concurrency`` requests in flight per
node); ``run_cluster`` is the demo's batch and summary.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any

ROUTERS = ("least-loaded", "round-robin")


class NodeProcess:
    """One cluster node as a child process; its events go to the cluster's queue as ``(node, ev)``
    (``ev`` is ``None`` once the process has exited)."""

    def __init__(self, spec: dict, events: queue.Queue) -> None:
        self.name, self.role = spec["name"], spec["role"]
        self.address: str | None = None
        self.pid: int | None = None
        self.alive = True
        self.free_at_start: dict | None = None
        self.load = 0  # requests in flight on this node (the router's count)
        self._events = events
        self._stderr: deque[str] = deque(maxlen=200)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdstate.devtools.cluster_node"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        threading.Thread(target=self._pump_stdout, daemon=True).start()
        threading.Thread(target=self._pump_stderr, daemon=True).start()
        self.send(spec)

    def _pump_stdout(self) -> None:
        for line in self.proc.stdout:
            line = line.strip()
            if line.startswith("{"):
                self._events.put((self, json.loads(line)))
        self._events.put((self, None))

    def _pump_stderr(self) -> None:
        for line in self.proc.stderr:
            self._stderr.append(line)

    def stderr_text(self) -> str:
        return "".join(self._stderr)

    def send(self, cmd: dict) -> None:
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass  # exited: its end of stdout tells the cluster

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def hang_up(self) -> None:
        """Close its stdin: EOF tells the node to close its agent and pools and exit."""
        try:
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass

    def close(self, timeout_s: float = 20.0) -> int:
        self.hang_up()
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


# How long the nodes may take to close their agents and exit after EOF, all together: a ceiling
# (they exit in well under a second on a quiet machine); a busy host's teardown took over 20 s.
CLOSE_GRACE_S = 60.0


class Router:
    """Picks the pair of the next request among live nodes with fewer than ``concurrency``
    requests in flight: the least loaded pair (ties: round-robin order), or plain round-robin."""

    def __init__(self, prefills: list[NodeProcess], decodes: list[NodeProcess], concurrency: int, policy: str) -> None:
        if policy not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}; got {policy!r}")
        self.pairs = [(p, d) for d in decodes for p in prefills]  # p0->d0, p1->d0, ...: alternates prefills
        self.concurrency, self.policy = concurrency, policy
        self.used = [0] * len(self.pairs)
        self._next = 0

    def pick(self) -> tuple[NodeProcess, NodeProcess] | None:
        n = len(self.pairs)
        order = [(self._next + i) % n for i in range(n)]
        free = [
            i
            for i in order
            if all(x.alive and x.load < self.concurrency for x in self.pairs[i])  # both sides have room
        ]
        if not free:
            return None
        if self.policy == "round-robin":
            i = free[0]
        else:  # fewest in flight on the two nodes; then the pair used least; then round-robin order
            i = min(free, key=lambda k: (self.pairs[k][0].load + self.pairs[k][1].load, self.used[k]))
        self.used[i] += 1
        self._next = (i + 1) % n
        return self.pairs[i]


def pair_name(p: NodeProcess, d: NodeProcess) -> str:
    return f"{p.name}->{d.name}"


class Cluster:
    """N prefill and M decode nodes; ``dispatch`` tells both sides of a request, ``next_event``
    reads what any node reported."""

    def __init__(
        self,
        settings,
        prefills: int,
        decodes: int,
        engine: str = "shm",
        engine_options: dict | None = None,
        segment_dir: str | None = None,
        chunks: int = 2,
        digest: bool = True,
        heartbeat_interval_s: float = 0.5,
        peer_timeout_s: float = 3.0,
        start_timeout_s: float = 180.0,
    ) -> None:
        from pdstate.devtools.cluster_node import settings_to_dict

        self.events: queue.Queue = queue.Queue()
        base = dict(
            pool=settings_to_dict(settings),
            engine=engine,
            engine_options=engine_options or {},
            segment_dir=segment_dir,
            chunks=chunks,
            digest=digest,
            heartbeat_interval_s=heartbeat_interval_s,
            peer_timeout_s=peer_timeout_s,
        )
        self.prefills: list[NodeProcess] = []
        self.decodes: list[NodeProcess] = []
        self.handshake_ms: dict[str, float] = {}
        self.inflight: dict[int, tuple[NodeProcess, NodeProcess]] = {}  # until the decode's result
        self._to_prefill: dict[int, dict] = {}  # the prefill's command, sent once the decode allocated
        self._at_prefill: dict[int, NodeProcess] = {}  # until the prefill's "sent"
        self._backlog: deque = deque()
        try:
            for role, n, out in (("prefill", prefills, self.prefills), ("decode", decodes, self.decodes)):
                for i in range(n):
                    out.append(NodeProcess(dict(base, role=role, name=f"{role[0]}{i}"), self.events))
            self._await_ready(start_timeout_s)
            self._connect_all(start_timeout_s)
        except BaseException:
            self.close()
            raise

    @property
    def nodes(self) -> list[NodeProcess]:
        return self.prefills + self.decodes

    def _read(self, timeout_s: float) -> tuple[NodeProcess, dict | None]:
        try:
            return self.events.get(timeout=max(0.0, timeout_s))
        except queue.Empty:
            raise TimeoutError(f"no cluster node said anything for {timeout_s:.0f} s") from None

    def _await_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = set(self.nodes)
        while waiting:
            node, ev = self._read(deadline - time.monotonic())
            if ev is None:
                raise RuntimeError(f"{node.role} {node.name} exited at start: {node.stderr_text().strip()[-2000:]}")
            if ev.get("event") == "ready":
                node.address, node.pid, node.free_at_start = ev["address"], ev["pid"], ev["free"]
                waiting.discard(node)
            else:
                self._backlog.append((node, ev))

    def _connect_all(self, timeout_s: float) -> None:
        """Every decode shakes hands with every prefill before the batch (timed per pair)."""
        for d in self.decodes:
            for p in self.prefills:
                d.send({"op": "connect", "prefill": p.address})
        by_address = {p.address: p for p in self.prefills}
        deadline = time.monotonic() + timeout_s
        while len(self.handshake_ms) < len(self.decodes) * len(self.prefills):
            node, ev = self._read(deadline - time.monotonic())
            if ev is None:
                raise RuntimeError(f"{node.role} {node.name} exited: {node.stderr_text().strip()[-2000:]}")
            if ev.get("event") != "connected":
                self._backlog.append((node, ev))
                continue
            pair = pair_name(by_address[ev["prefill"]], node)
            if ev["error"] is not None:
                raise RuntimeError(f"handshake {pair} refused: {ev['error']['type']}: {ev['error']['message']}")
            self.handshake_ms[pair] = ev["handshake_ms"]

    def dispatch(self, room: int, seq_len: int, p: NodeProcess, d: NodeProcess, hold: bool = False) -> None:
        """Start request ``room``: the decode allocates first; once it reports ``allocated`` the
        prefill is told to send (see ``next_event``)."""
        p.load += 1
        d.load += 1
        self.inflight[room] = (p, d)
        self._to_prefill[room] = {"op": "send", "room": room, "seq_len": seq_len, "hold": hold}
        d.send({"op": "recv", "room": room, "seq_len": seq_len, "prefill": p.address, "announce": True})

    def busy(self) -> bool:
        """Whether a request awaits its decode's result or its prefill's end."""
        return bool(self.inflight or self._at_prefill)

    def next_event(self, timeout_s: float) -> tuple[NodeProcess, dict | None]:
        """The next event of any node, after the cluster's bookkeeping: ``allocated`` is passed on
        to the prefill, node loads follow ``result`` / ``sent``, a ``result`` gets its ``pair``.
        ``None``: the node exited (marked dead; a dead decode's requests get failed results)."""
        node, ev = self._backlog.popleft() if self._backlog else self._read(timeout_s)
        if ev is None:
            node.alive = False
            self._lost(node)
            return node, None
        kind, room = ev.get("event"), ev.get("room")
        if kind == "allocated" and room in self._to_prefill:
            p, _ = self.inflight[room]
            self._at_prefill[room] = p
            p.send(self._to_prefill.pop(room))
        elif kind == "result" and room in self.inflight:
            p, d = self.inflight.pop(room)
            ev["pair"] = pair_name(p, d)
            d.load -= 1
            if self._to_prefill.pop(room, None) is not None:  # the prefill was never told
                p.load -= 1
        elif kind == "sent" and room in self._at_prefill:
            self._at_prefill.pop(room).load -= 1
        return node, ev

    def _lost(self, node: NodeProcess) -> None:
        for room, p in list(self._at_prefill.items()):
            if p is node:
                del self._at_prefill[room]  # its decode reports the request (PeerGone)
        for room, (p, d) in list(self.inflight.items()):
            if d is node:
                err = {"type": "PeerGone", "message": f"decode {d.name} exited"}
                ev = {"event": "result", "room": room, "seq_len": 0, "status": "failed", "verified": False}
                self._backlog.append((d, dict(ev, error=err, bytes=0, descriptors=0, seconds=0.0)))
            elif p is node and room in self._to_prefill:
                del self._to_prefill[room]  # not told yet: the decode's request times out at bootstrap
                p.load -= 1

    def request(self, node: NodeProcess, cmd: dict, event: str, timeout_s: float = 30.0) -> dict:
        """Send ``cmd`` to ``node`` and return its next ``event`` (other events are kept for later)."""
        node.send(cmd)
        deadline = time.monotonic() + timeout_s
        kept = []
        try:
            while True:
                got, ev = self._read(deadline - time.monotonic())
                if got is node and ev is not None and ev.get("event") == event:
                    return ev
                kept.append((got, ev))
                if got is node and ev is None:
                    raise RuntimeError(f"{node.name} exited")
        finally:
            self._backlog.extend(kept)

    def close(self, grace_s: float = CLOSE_GRACE_S) -> list[int]:
        """Every node told at once (EOF), one deadline for all; one still running then is killed."""
        for n in self.nodes:
            n.hang_up()
        deadline = time.monotonic() + grace_s
        return [n.close(max(0.0, deadline - time.monotonic())) for n in self.nodes]


def run_cluster(
    settings,
    prefills: int,
    decodes: int,
    engine: str,
    engine_options: dict,
    batch: list[int],
    concurrency: int,
    policy: str,
    progress,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Run ``batch`` (prompt lengths) over an N x M cluster; returns the demo's summary."""
    cluster = Cluster(settings, prefills, decodes, engine, engine_options)
    router = Router(cluster.prefills, cluster.decodes, concurrency, policy)
    pending = deque(batch)
    results: list[dict] = []
    pairs = {pair_name(p, d): {"requests": 0, "verified": 0, "failed": 0} for p, d in router.pairs}
    rcs: list[int] = []
    try:
        t0 = time.perf_counter()
        while pending or cluster.busy():
            while pending and (pick := router.pick()) is not None:
                cluster.dispatch(secrets.randbits(63), pending.popleft(), *pick)
            if not pending and not cluster.busy():
                break
            node, ev = cluster.next_event(timeout_s)
            if ev is None and not (any(n.alive for n in cluster.prefills) and any(n.alive for n in cluster.decodes)):
                pending.clear()  # nothing left to route to
            elif ev is not None and ev.get("event") == "result" and "pair" in ev:
                results.append(ev)
                row = pairs[ev["pair"]]
                row["requests"] += 1
                row["verified" if ev["verified"] else "failed"] += 1
                progress(len(results), len(batch), ev)
        seconds = time.perf_counter() - t0
        finals = {n.name: cluster.request(n, {"op": "stats"}, "stats")["free"] for n in cluster.nodes if n.alive}
    finally:
        rcs = cluster.close()
    verified = sum(1 for r in results if r["verified"])
    nbytes = sum(r["bytes"] for r in results)
    hs = cluster.handshake_ms
    return {
        "prefills": prefills,
        "decodes": decodes,
        "router": policy,
        "requests": len(batch),
        "verified": verified,
        "failed": len(batch) - verified,
        "bytes": nbytes,
        "seconds": seconds,
        "gbps": nbytes / seconds / 1e9 if seconds > 0 else 0.0,
        "handshake_ms": max(hs.values()) if hs else 0.0,
        "handshake_ms_pairs": hs,
        "descriptors": sum(r["descriptors"] for r in results),
        "leaked": any(finals.get(n.name) != n.free_at_start for n in cluster.nodes),
        "worker_exit_codes": rcs,
        "errors": sorted({r["error"]["message"] for r in results if r.get("error")})[:5],
        "pairs": pairs,
    }
