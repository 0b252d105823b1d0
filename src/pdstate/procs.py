"""Worker processes for ``pdstate demo`` and ``pdstate bench``: spawn, talk JSON lines, reap.

``python -m pdstate.procs`` runs one worker from a JSON description on stdin's first line.
A prefill prints ``{"event": "listening", "endpoint": ...}`` and serves until stdin closes.
A decode prints ``{"event": "ready", "handshake_ms": ...}`` (or ``{"event": "refused", ...}``),
then runs each ``{"cmd": "run", "lengths": [...], "concurrency": N}`` line it reads, printing one
``{"event": "result", ...}`` per request and ``{"event": "batch_done"}``; EOF ends it.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import subprocess
import sys
import time
from collections import deque
from dataclasses import asdict
from typing import Any

from pdstate.presets import PoolSettings
from pdstate.runtime.common import WorkerOptions


def options_to_json(opts: WorkerOptions) -> str:
    d = asdict(opts)
    d["token"] = opts.token.decode() if opts.token else None
    return json.dumps(d)


def options_from_json(text: str) -> WorkerOptions:
    d = json.loads(text)
    pool = d.pop("pool")
    pool["compression_ratios"] = tuple(pool["compression_ratios"])
    d["token"] = d["token"].encode() if d.get("token") else None
    return WorkerOptions(pool=PoolSettings(**pool), **d)


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _run_prefill(opts: WorkerOptions) -> int:
    from pdstate.runtime.prefill import PrefillWorker

    w = PrefillWorker(opts).start()
    _emit({"event": "listening", "endpoint": w.endpoint, "pid": os.getpid()})
    try:
        for line in sys.stdin:
            if line.strip() == "stats":
                _emit({"event": "stats", "stats": asdict(w.stats) | {"latencies_s": []}, "free": w.free_counts()})
    finally:
        w.stop()
    return 0


def _run_decode(opts: WorkerOptions) -> int:
    from pdstate.runtime.decode import DecodeWorker

    w = DecodeWorker(opts).start()
    try:
        try:
            w.wait_ready(timeout_s=opts.peer_timeout_s * 4)
        except Exception as exc:
            _emit({"event": "refused", "type": type(exc).__name__, "message": str(exc)})
            return 3
        _emit({"event": "ready", "handshake_ms": w.handshake_s * 1e3, "free": w.free_counts()})
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd.get("cmd") == "run":
                pending: deque = deque(cmd["lengths"])
                inflight = []
                while pending or inflight:
                    while pending and len(inflight) < cmd.get("concurrency", 1):
                        inflight.append(w.submit(pending.popleft()))
                    fut = inflight.pop(0)
                    _emit({"event": "result", **fut.result().as_dict()})
                _emit({"event": "batch_done", "free": w.free_counts()})
    finally:
        w.stop()
    return 0


def main() -> int:
    opts = options_from_json(sys.stdin.readline())
    return _run_prefill(opts) if opts.role == "prefill" else _run_decode(opts)


class WorkerProcess:
    """A worker in a child process, driven over its stdin/stdout JSON lines."""

    def __init__(self, opts: WorkerOptions, env: dict[str, str] | None = None) -> None:
        self.opts = opts
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdstate.procs"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
            env={**os.environ, **(env or {})},
        )
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.send(options_to_json(opts))

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def read_event(self, timeout_s: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{self.opts.role} worker said nothing for {timeout_s:.0f} s") from None
            if line is None:
                err = self.proc.stderr.read()
                raise RuntimeError(f"{self.opts.role} worker exited ({self.proc.wait()}): {err.strip()[-2000:]}")
            line = line.strip()
            if line.startswith("{"):
                return json.loads(line)

    def close(self, timeout_s: float = 20.0) -> int:
        try:
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


if __name__ == "__main__":
    raise SystemExit(main())
