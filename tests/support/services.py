"""``pdstate serve`` processes for the tests: started with ``--set`` overrides and an environment
(``Service``), their stdout JSON events and stderr pumped by threads; HTTP waits with a deadline.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time

import httpx

from tests.support.paths import REPO, SERVICES
from tests.support.waiting import wait_until
from tests.support.workers import pdstate_command

START_TIMEOUT_S = 60.0


def serve_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without ``PDSTATE_*`` settings (but ``PDSTATE_SHARED``), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSTATE_") or k == "PDSTATE_SHARED"}
    env.update(extra or {})
    return env


def wait_for(predicate, timeout_s: float, what: str):
    """``wait_until`` for HTTP probes: a refused connection counts as not yet."""
    return wait_until(what, predicate, timeout_s, pause_s=0.05, ignore=(httpx.HTTPError, OSError))


def ready(http: httpx.Client, url: str) -> dict | None:
    """The ``/readyz`` body when it says ready, else ``None``."""
    r = http.get(f"{url}/readyz")
    return r.json() if r.status_code == 200 else None


class Service:
    """One ``pdstate serve`` process; stdout JSON events and stderr are pumped by threads."""

    def __init__(self, role: str, overrides: list[str], env: dict[str, str] | None = None, preexec_fn=None) -> None:
        self.role = role
        cmd = pdstate_command() + ["serve", "--config", str(SERVICES / role / "config.toml")]
        for o in overrides:
            cmd += ["--set", o]
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=serve_env(env),
            cwd=REPO,
            preexec_fn=preexec_fn,
        )
        self.events: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        self.listening: dict | None = None
        self.startup_s: float | None = None
        threading.Thread(target=self._pump_out, daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()

    def _pump_out(self) -> None:
        for line in self.proc.stdout:
            line = line.strip()
            if line.startswith("{"):
                self.events.put(json.loads(line))
        self.events.put(None)

    def _pump_err(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)

    def event(self, name: str, timeout_s: float = START_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                ev = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"{self.role}: no {name!r} event in {timeout_s:.0f} s; stderr: {self.err()[-2000:]}"
                ) from None
            if ev is None:
                raise AssertionError(f"{self.role} exited ({self.proc.wait()}) before {name!r}: {self.err()[-2000:]}")
            if ev.get("event") == name:
                return ev

    def wait_listening(self) -> dict:
        if self.listening is None:
            self.listening = self.event("listening")
            self.startup_s = time.monotonic() - self.t0
        return self.listening

    @property
    def url(self) -> str:
        return self.wait_listening()["http"]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def err(self) -> str:
        return "".join(self.stderr)

    def wait(self, timeout_s: float = 30.0) -> int:
        return self.proc.wait(timeout_s)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Services:
    """``pdstate serve`` processes started through it, stopped in reverse order on exit."""

    def __init__(self) -> None:
        self.started: list[Service] = []

    def start(self, role: str, overrides: list[str], env: dict[str, str] | None = None, preexec_fn=None) -> Service:
        service = Service(role, overrides, env, preexec_fn)
        self.started.append(service)
        return service

    def prefill(self, *overrides: str, env: dict[str, str] | None = None, preexec_fn=None) -> tuple[Service, str]:
        """A prefill on 127.0.0.1 (ports 0), once listening, and its control address."""
        service = self.start("prefill", ["http.port=0", "control.bind=tcp://127.0.0.1:0", *overrides], env, preexec_fn)
        return service, service.wait_listening()["control"]

    def __enter__(self) -> Services:
        return self

    def __exit__(self, *exc: object) -> None:
        for service in reversed(self.started):
            service.stop()
