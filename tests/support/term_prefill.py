"""A prefill worker process that stops on SIGTERM through ``AgentPrefillWorker.stop()``, the call
``pdstate serve`` makes on SIGTERM (``status.source.WorkerStatus.drain``), with the test seams
(``WorkerHooks``) a served worker cannot take.

``python -m tests.support.term_prefill`` reads one JSON line (``devtools.processes.options_to_json``),
prints ``{"event": "listening", "endpoint"}``, and on SIGTERM stops the worker and prints
``{"event": "stopped", "finished": [...], "stop_s"}`` (its request records, the seconds ``stop`` took);
a line on stdin before that asks for ``{"event": "requests", "in_flight": [...]}``.
``TermPrefill`` is the test's side of it.

``Served`` is a real ``pdstate serve`` process (``services/<role>/config.toml`` with ``--set``
overrides), for the shutdown test that goes through the command itself: its stdout events and
stderr are pumped by threads.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

from tests.support.paths import REPO, SERVICES, SRC_DIR

PREFILL_START_TIMEOUT_S = 90.0


def main() -> None:
    from pdstate.devtools.processes import hooks_from_json, options_from_json
    from pdstate.worker.prefill import AgentPrefillWorker

    line = sys.stdin.readline()
    worker = AgentPrefillWorker(options_from_json(line), hooks=hooks_from_json(line)).start()
    term = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: term.set())
    print(json.dumps({"event": "listening", "endpoint": worker.endpoint}), flush=True)

    def commands() -> None:  # {"cmd": "requests"}: the requests in flight
        for _ in sys.stdin:
            in_flight = [r.as_dict() for r in worker.status().requests]
            print(json.dumps({"event": "requests", "in_flight": in_flight}), flush=True)

    threading.Thread(target=commands, daemon=True).start()
    while not term.wait(0.02):
        pass
    t0 = time.monotonic()
    worker.stop()
    stop_s = time.monotonic() - t0
    finished = [{**r, "peer": r["decode"]} for r in worker.finished_records()]
    print(json.dumps({"event": "stopped", "finished": finished, "stop_s": stop_s}), flush=True)


class _Signalled:
    """A child process (``self.proc``) a test stops with SIGTERM."""

    proc: subprocess.Popen

    def term(self) -> float:
        """SIGTERM; returns the monotonic time it was sent."""
        t = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        return t


class TermPrefill(_Signalled):
    """The process above, started with ``opts`` (and ``hooks``)."""

    def __init__(self, opts, hooks=None) -> None:
        from pdstate.devtools.processes import options_to_json

        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC_DIR), str(REPO)])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.term_prefill"],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.proc.stdin.write(options_to_json(opts, hooks) + "\n")
        self.proc.stdin.flush()
        ev = self.read_event(PREFILL_START_TIMEOUT_S)
        assert ev["event"] == "listening", ev
        self.endpoint = ev["endpoint"]

    def read_event(self, timeout_s: float) -> dict:
        out: list[str] = []
        reader = threading.Thread(target=lambda: out.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not out or not out[0]:
            raise AssertionError(f"no event from the prefill process within {timeout_s:g} s (exit {self.proc.poll()})")
        return json.loads(out[0])

    def wait_in_flight(self, n: int, timeout_s: float = 20.0) -> None:
        """Until ``n`` requests are in flight here and one of them is TRANSFERRING."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.proc.stdin.write('{"cmd": "requests"}\n')
            self.proc.stdin.flush()
            jobs = self.read_event(10)["in_flight"]
            if len(jobs) >= n and any(j["state"] == "transferring" for j in jobs):
                return
            time.sleep(0.02)
        raise AssertionError(f"{n} requests not in flight on the prefill within {timeout_s:g} s")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


class Served(_Signalled):
    """``pdstate serve --config services/<role>/config.toml --set ...`` (log level info)."""

    def __init__(self, role: str, overrides: list[str], start_timeout_s: float = PREFILL_START_TIMEOUT_S) -> None:
        from tests.support.workers import pdstate_command

        cmd = [*pdstate_command(), "serve", "--config", str(SERVICES / role / "config.toml"), "--log-level", "info"]
        for o in overrides:
            cmd += ["--set", o]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDSTATE_") or k == "PDSTATE_SHARED"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
        self.events: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, False), daemon=True).start()
        try:
            ev = self.events.get(timeout=start_timeout_s)
        except queue.Empty:
            ev = None
        assert ev and ev.get("event") == "listening", (ev, self.err()[-2000:])
        self.listening = ev

    def _pump(self, stream, events: bool) -> None:
        for line in stream:
            if events and line.startswith("{"):
                self.events.put(json.loads(line))
            elif not events:
                self.stderr.append(line)

    @property
    def url(self) -> str:
        return self.listening["http"]

    def err(self) -> str:
        return "".join(self.stderr)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait(10)


if __name__ == "__main__":
    main()
