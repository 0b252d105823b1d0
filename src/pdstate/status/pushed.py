"""A worker's HTTP app served from a process of its own, fed with snapshots of the worker's status.

The worker (an SGLang rank: ``integrations.sglang.endpoint``) starts this module as a child
(``python -I -c CHILD_BOOT``, from ``/``, with a bare environment: ``Child``), with the listening socket it bound as ``--fd`` and a pipe
as the child's stdin. Over that pipe it sends (``multiprocessing.connection`` frames, pickled:
the pipe is private to the two processes) first ``facts`` (what never changes: identity, engine,
transport, layout report, local check, the rank, the token), then ``status`` whenever its status
changed (readiness, peers, counters, requests in flight, the latencies added since the last one).
The child serves ``status.api.create_app`` over ``PushedStatus`` (``api.StatusSource`` over the
latest snapshot), so its documents are the ones the worker's own source would render, byte for
byte, as of the latest snapshot. It writes one line on its stdout: ``ready`` once it serves, or
``error: <why>`` when it cannot; then its stdout is its stderr. It exits when the pipe closes
(the worker closed it, or ended).

A scrape therefore costs the worker nothing: rendering, HTTP parsing and the event loop run in
the child, and the worker's cost is one snapshot per change (``Publisher``, rate-limited).
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import threading
import weakref
from dataclasses import fields

from pdstate.errors import ConfigError

__all__ = ["Child", "Publisher", "PushedStatus", "facts_of", "stats_fields", "status_of"]

FACTS = ("role", "worker_id", "incarnation", "engine", "control", "transport", "verify", "rank", "report")


def facts_of(source) -> dict:
    """What ``source`` says once: its attributes, its local check and whether it serves transfers."""
    facts = {k: getattr(source, k) for k in FACTS if hasattr(source, k)}
    facts.update(
        local_check=source.local_check(),
        serves_transfers=getattr(source, "serves_transfers", True),
        free_counts=source.free_counts(),
        result_timeout_s=source.result_timeout_s(),
    )
    return facts


def stats_fields(stats) -> dict:
    """A ``worker.stats.Stats``' counters (everything but its lock and its latency window)."""
    return {f.name: getattr(stats, f.name) for f in fields(stats) if f.init and f.name != "latencies_s"}


def status_of(readiness, peers: list[dict], stats, in_flight: int, latencies: tuple[list[float], int]) -> dict:
    """One snapshot; ``latencies``: the values added since the previous snapshot, and the total."""
    return {
        "readiness": readiness,
        "peers": peers,
        "stats": stats_fields(stats),
        "in_flight": in_flight,
        "latencies": latencies,
    }


class PushedStatus:
    """``api.StatusSource`` over the latest snapshot (``apply``) of another process's status."""

    def __init__(self, facts: dict) -> None:
        from pdstate.worker.stats import RecentLatencies

        self._local_check = facts.pop("local_check")
        self._free_counts = facts.pop("free_counts")
        self._result_timeout_s = facts.pop("result_timeout_s")
        for k, v in facts.items():
            setattr(self, k, v)
        self._latencies = RecentLatencies()
        self._status: dict = {}

    def apply(self, status: dict) -> None:
        """Take ``status`` (``status_of``) as the latest snapshot (one reader thread calls this)."""
        from pdstate.worker.stats import Stats

        new, total = status["latencies"]
        for v in new:
            self._latencies.append(v)
        self._latencies.total = total
        stats = Stats(**status["stats"], latencies_s=self._latencies.snapshot())
        self._status = {**status, "stats": stats}  # one assignment: a reader sees one snapshot or the next

    @property
    def stats(self):
        return self._status["stats"]

    def readiness(self):
        return self._status["readiness"]

    def peers(self) -> list[dict]:
        return self._status["peers"]

    def in_flight(self) -> int:
        return self._status["in_flight"]

    def local_check(self):
        return self._local_check

    def free_counts(self) -> dict[str, int]:
        return self._free_counts

    def result_timeout_s(self) -> float:
        return self._result_timeout_s


# --- the worker's side ------------------------------------------------------------------------

START_S = 60.0  # how long the child may take to serve (its imports, on a loaded host)
STOP_S = 5.0
PUSH_S = 0.1  # at most one snapshot per PUSH_S
POLL_S = 0.25  # how often the worker's key is compared
FULL_S = 1.0  # a snapshot at least this often: what neither an event nor the key shows (a peer gone)


# The child runs isolated from the rank's working directory and environment: ``python -I`` (no
# current directory or script directory on sys.path, no PYTHON* variables, no user site), from
# ``/``, with sys.path = pdstate's own root and the absolute entries of the rank's PYTHONPATH, then
# the interpreter's own; its environment holds only CHILD_ENV (no PDSTATE_*, no HF_TOKEN...). The
# token it needs for its routes comes over the pipe, never in argv or the environment.
CHILD_BOOT = (
    "import os, sys; sys.path[:0] = [p for p in sys.argv[1].split(os.pathsep) if p]; "
    "from pdstate.status.pushed import main; sys.exit(main(sys.argv[2:]))"
)
CHILD_ENV = frozenset(
    {"PATH", "LD_LIBRARY_PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "LC_MESSAGES", "TZ", "TMPDIR"}
)


class Child:
    """The child process serving the app on ``sock`` (bound by the worker; the worker may close
    its copy once this returns): started with ``facts`` (``facts_of``, plus ``token``) and a
    first ``status``; raises ``ConfigError`` saying why when it does not serve within ``START_S``."""

    def __init__(self, sock, facts: dict, status: dict, token: bytes | None, start_s: float | None = None) -> None:
        import subprocess
        from multiprocessing.connection import Connection

        import pdstate

        root = os.path.dirname(os.path.dirname(os.path.abspath(pdstate.__file__)))  # the same pdstate there
        given = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if os.path.isabs(p)]
        path = os.pathsep.join([root, *given])
        argv = [sys.executable, "-I", "-c", CHILD_BOOT, path, "--fd", str(sock.fileno())]
        env = {k: v for k, v in os.environ.items() if k in CHILD_ENV}
        start_s = START_S if start_s is None else start_s
        r, w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                argv, stdin=r, stdout=subprocess.PIPE, pass_fds=(sock.fileno(),), env=env, cwd="/"
            )
        except OSError as exc:
            os.close(w)
            raise ConfigError(f"{argv[0]} cannot be started: {exc}") from None
        finally:
            os.close(r)
        self.conn = Connection(w, readable=False)
        try:
            self.conn.send_bytes(pickle.dumps({**facts, "token": token}))
            self.send(pickle.dumps(status))
        except OSError:
            pass  # it ended: its line (or its exit code) says why
        line = self._first_line(start_s)
        if line != "ready":
            self.close()
            if line is None:
                line = f"it did not serve within {start_s:g} s"
            elif not line:
                line = f"it exited with code {self.proc.returncode} (its stderr is above)"
            raise ConfigError(line.removeprefix("error: "))

    def _first_line(self, start_s: float) -> str | None:
        import select
        import time

        fd, buf, deadline = self.proc.stdout.fileno(), b"", time.monotonic() + start_s
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            buf += chunk
        self.proc.stdout.close()
        return buf.split(b"\n", 1)[0].decode(errors="replace").strip()

    def send(self, blob: bytes) -> None:
        self.conn.send_bytes(blob)

    def close(self) -> None:
        """Close the pipe (the child stops serving and exits); killed after ``STOP_S``."""
        import subprocess

        self.conn.close()
        if not self.proc.stdout.closed:  # a child that never said its line
            self.proc.stdout.close()
        try:
            self.proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Publisher:
    """Sends ``source.status()`` to ``child`` when it changed: when ``source.changed`` is set, when
    ``source.status_key()`` moved (compared every ``POLL_S``) and every ``FULL_S``; at most one per
    ``PUSH_S``. Runs on a daemon thread of its own; the worker's cost is one snapshot per change,
    none per scrape. It holds ``source`` weakly: a source dropped without ``close`` (its manager
    gone) ends the thread and the child too."""

    def __init__(self, child: Child, source, first: dict, name: str) -> None:
        self.child, self._source, self._changed = child, weakref.ref(source), source.changed
        self._stop = threading.Event()
        self._last = pickle.dumps(first)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            if self._source() is None:
                self.child.close()

    def _key(self):
        source = self._source()
        return None if source is None else source.status_key()

    def _loop(self) -> None:
        import logging
        import time

        key, full = self._key(), time.monotonic()
        pushed = full
        while not self._stop.is_set():
            event = self._changed.wait(POLL_S)
            if self._stop.is_set() or self._source() is None:
                return
            now = time.monotonic()
            if not (event or now - full >= FULL_S or self._key() != key):
                continue
            if now < pushed + PUSH_S and self._stop.wait(pushed + PUSH_S - now):
                return
            self._changed.clear()  # before the snapshot: a later count sets it again
            source = self._source()
            if source is None:
                return
            key, full = source.status_key(), time.monotonic()
            blob = pickle.dumps(source.status())
            del source  # not held while waiting
            if blob == self._last:
                continue
            try:
                self.child.send(blob)
            except (OSError, ValueError) as exc:  # the child ended (or is closed): nothing serves any more
                if not self._stop.is_set():
                    logging.getLogger("pdstate.service").error("pdstate: the HTTP endpoint's process ended: %s", exc)
                return
            self._last, pushed = blob, time.monotonic()

    def close(self) -> None:
        self._stop.set()
        self._changed.set()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(STOP_S)


# --- the child -----------------------------------------------------------------------------------


def _read(conn, source: PushedStatus, server) -> None:
    """Apply every snapshot the worker sends; when its pipe closes, stop the server."""
    try:
        while True:
            source.apply(pickle.loads(conn.recv_bytes()))
    except (EOFError, OSError):
        pass
    server.should_exit = True


def _say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdstate.status.pushed")
    parser.add_argument("--fd", type=int, required=True, help="the listening socket, bound by the worker")
    args = parser.parse_args(argv)
    try:
        import asyncio
        import socket
        from multiprocessing.connection import Connection

        import uvicorn

        from pdstate.status.api import create_app
        from pdstate.status.connections import bounded_h11, http_connection_cap, raise_open_files_limit

        conn = Connection(0, writable=False)
        facts = pickle.loads(conn.recv_bytes())
        token = facts.pop("token")
        source = PushedStatus(facts)
        source.apply(pickle.loads(conn.recv_bytes()))
        sock = socket.socket(fileno=args.fd)
        cap = http_connection_cap(raise_open_files_limit())  # bounded as serve's HTTP (status.connections)
        config = uvicorn.Config(
            create_app(source, token=token),
            http=bounded_h11(cap),
            limit_concurrency=cap,
            log_config=None,
            access_log=False,
            lifespan="off",
            log_level="warning",
        )
        server = uvicorn.Server(config)
    except BaseException as exc:  # the worker reports it and refuses to start
        _say(f"error: {type(exc).__name__}: {exc}".replace("\n", " "))
        return 1
    threading.Thread(target=_read, args=(conn, source, server), name="pdstate-pushed", daemon=True).start()

    async def serve() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        _say("ready" if server.started else "error: the HTTP server stopped before it served")
        os.dup2(2, 1)  # from here on, a stray print goes where the worker's log goes
        await task

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
