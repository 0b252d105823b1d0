"""Worker processes for the tests: ``pdstate serve``'s workers (``pdstate.worker``, over the
agent), each in a child process driven by JSON command lines instead of HTTP.

``python -m pdstate.devtools.processes`` runs one worker from a JSON description on stdin's first line.
A prefill prints ``{"event": "listening", "endpoint": ...}`` and serves until stdin closes; it
answers ``stats`` / ``{"cmd": "stats"}`` with ``{"event": "stats", ...}``, ``peers`` /
``{"cmd": "peers"}`` with ``{"event": "peers", "peers": [...]}`` (what it recorded about every
decode that registered: id, incarnation, state, error) and ``{"cmd": "requests"}`` with
``{"event": "requests", "in_flight": [...], "finished": [...]}`` (its request records);
``{"cmd": "fault", "delay_before_copy_s": S}`` sets the test seam ``WorkerHooks``;
``{"cmd": "raw_prepare", "register": hex, "src": [[...]], "dst": [[...]]}`` (``pdstate bench``'s
``raw_nixl_prefill`` row: NIXL's own write from this process's pools into the decode whose register
message that is, ``baselines.WorkerRawNixl``) answers ``{"event": "raw_prepared", "bytes",
"descriptors"}``, then each ``{"cmd": "raw_write"}`` ``{"event": "raw", "seconds": S}`` (a failure:
``{"event": "raw_failed", "error": "Type: message"}``, and the worker serves on).
A decode prints ``{"event": "ready", "handshake_ms": ...}`` (or ``{"event": "refused", "type",
"message"}`` and exits ``ExitCode.REFUSED``, 4), then runs each ``{"cmd": "run", "lengths": [...], "concurrency": N,
"deadline_s": S?, "verify": "full"|"sample"?}`` line it reads, printing one ``{"event": "result", ...}`` per request and
``{"event": "batch_done"}``; ``{"cmd": "stats"}`` prints its peer state, stats, free counts and
request bookkeeping (in flight, waiting for pages); ``{"cmd": "describe"}`` prints ``{"event":
"describe", "register": hex}``, its encoded register message (layout, KVArgs, engine endpoint:
what a raw engine needs to write into it). EOF ends it.
A worker whose own target/draft pair fails ``setup_state_kv_args`` (with ``local_checks``) prints
``pdstate <role>: <ErrorType>: <upstream message>`` on stderr and exits ``ExitCode.LOCAL_CHECK`` (3);
an unreadable description line exits ``ExitCode.CONFIG`` (2), anything else that ends a worker
``ExitCode.FAILED`` (1).

``WorkerProcess(opts)`` spawns ``python -m pdstate.devtools.processes`` (``launcher="subprocess"``, the
default). ``launcher="fork"`` forks the worker from a ``multiprocessing`` fork server that has
already imported the workers (and torch), so a worker starts in milliseconds instead of seconds;
it is a separate process all the same (own pid, own memory, talks to its peer over TCP). Either
way the worker's stderr is drained continuously (a full pipe would block the worker) and kept for
``stderr_text()``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict
from typing import Any

from pdstate.errors import ExitCode, LocalCheckFailed
from pdstate.pools.presets import PoolSettings
from pdstate.worker.options import WorkerHooks, WorkerOptions

Emit = Callable[[dict], None]


def options_to_json(opts: WorkerOptions, hooks: WorkerHooks | None = None) -> str:
    d = asdict(opts)
    d["token"] = opts.token.decode() if opts.token else None
    if hooks is not None:
        d["hooks"] = asdict(hooks)  # test seams travel beside the options
    return json.dumps(d)


def hooks_from_json(text: str) -> WorkerHooks:
    return WorkerHooks(**json.loads(text).get("hooks", {}))


def options_from_json(text: str) -> WorkerOptions:
    d = json.loads(text)
    d.pop("hooks", None)
    pool = d.pop("pool")
    for key, value in pool.items():
        if isinstance(value, list):  # JSON arrays back to the tuples PoolSettings holds
            pool[key] = tuple(value)
    d["token"] = d["token"].encode() if d.get("token") else None
    return WorkerOptions(pool=PoolSettings(**pool), **d)


def _emit_stdout(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _commands(lines: Iterable[str], emit: Emit):
    """Yield each command line as a dict; plain ``stats``/``peers`` are accepted too."""
    for line in lines:
        line = line.strip()
        if not line:
            continue
        if line in ("stats", "peers"):
            yield {"cmd": line}
            continue
        try:
            cmd = json.loads(line)
            if not isinstance(cmd, dict):
                raise ValueError("a command is a JSON object")
        except ValueError as exc:
            emit({"event": "error", "message": f"bad command line {line[:80]!r}: {exc}"})
            continue
        yield cmd


def _run_prefill(opts: WorkerOptions, lines: Iterable[str], emit: Emit, hooks: WorkerHooks | None = None) -> ExitCode:
    from pdstate.devtools.baselines import WorkerRawNixl
    from pdstate.worker.prefill import AgentPrefillWorker

    w = AgentPrefillWorker(opts, hooks=hooks).start()
    emit({"event": "listening", "endpoint": w.endpoint, "pid": os.getpid()})
    raw: WorkerRawNixl | None = None  # the bench's raw NIXL row, made on its first command
    try:
        for cmd in _commands(lines, emit):
            if cmd.get("cmd") == "stats":
                emit({"event": "stats", "stats": w.stats.as_dict(), "free": w.free_counts()})
            elif cmd.get("cmd") == "peers":
                emit({"event": "peers", "peers": [p.as_dict() for p in w.status().peers]})
            elif cmd.get("cmd") == "fault":  # test knob: {"cmd": "fault", "delay_before_copy_s": S}
                w.set_hooks(WorkerHooks(delay_before_copy_s=float(cmd.get("delay_before_copy_s", 0.0))))
                emit({"event": "fault", "delay_before_copy_s": w.hooks.delay_before_copy_s})
            elif cmd.get("cmd") in ("raw_prepare", "raw_write"):  # the bench's raw NIXL row, from these pools
                try:
                    if cmd["cmd"] == "raw_prepare":
                        raw = raw or WorkerRawNixl(w.pools, w.kv_args)
                        emit({"event": "raw_prepared", **raw.prepare(cmd["register"], cmd["src"], cmd["dst"])})
                    else:
                        emit({"event": "raw", "seconds": (raw or WorkerRawNixl(w.pools, w.kv_args)).write()})
                except Exception as exc:  # the bench's phase records it; the worker serves on
                    emit({"event": "raw_failed", "error": f"{type(exc).__name__}: {exc}"})
            elif cmd.get("cmd") == "requests":
                s = w.status()
                emit(
                    {
                        "event": "requests",
                        "in_flight": [r.as_dict() for r in s.requests],
                        "finished": [{**r, "peer": r["decode"]} for r in w.finished_records()],
                        "free": w.free_counts(),
                        "peak_in_flight": s.peak_in_flight,
                    }
                )
            else:
                emit({"event": "error", "message": f"unknown prefill command {cmd.get('cmd')!r}"})
    finally:
        if raw is not None:
            raw.close()
        w.stop()
    return ExitCode.OK


def _wait_handshake(w, timeout_s: float):
    """The decode's default prefill once it answered the handshake: accepted (its snapshot), or
    refused (raises the refusal); ``TimeoutError`` when it did not answer within ``timeout_s``."""
    from pdstate.errors import error_from_wire

    deadline = time.monotonic() + timeout_s
    while True:
        p = w.agent.prefills().get(w.opts.peer)
        if p is not None and p.state == "accepted":
            return p
        if p is not None and p.state == "rejected" and p.error is not None:
            raise error_from_wire(p.error.type, p.error.message)
        if time.monotonic() > deadline:
            raise TimeoutError(f"no handshake answer from the prefill at {w.opts.peer} within {timeout_s:g} s")
        time.sleep(0.005)


def _decode_snapshot(w) -> dict:
    s = w.status()
    return {
        "peer_state": s.peer.state.value,
        "prefill_incarnation": s.peer.incarnation,
        "in_flight": s.in_flight,
        "waiting": s.waiting,
        "quarantined": s.quarantined,
        "quarantined_pages": s.quarantined_pages,
        "peak_in_flight": s.peak_in_flight,
        "peer_error": None if s.peer.error is None else s.peer.error.model_dump(),
    }


def _run_decode(opts: WorkerOptions, lines: Iterable[str], emit: Emit) -> ExitCode:
    from pdstate.worker.decode import AgentDecodeWorker

    w = AgentDecodeWorker(opts).start()
    try:
        try:
            accepted = _wait_handshake(w, opts.peer_timeout_s * 4)
        except Exception as exc:
            emit({"event": "refused", "type": type(exc).__name__, "message": str(exc)})
            return ExitCode.REFUSED
        handshake_ms = (accepted.handshake_s or 0.0) * 1e3
        emit({"event": "ready", "handshake_ms": handshake_ms, "free": w.free_counts(), "pid": os.getpid()})
        for cmd in _commands(lines, emit):
            if cmd.get("cmd") == "run":
                pending: deque = deque(cmd["lengths"])
                inflight = []
                deadline_s = cmd.get("deadline_s")
                while pending or inflight:
                    while pending and len(inflight) < cmd.get("concurrency", 1):
                        inflight.append(w.submit(pending.popleft(), deadline_s=deadline_s, verify=cmd.get("verify")))
                    fut = inflight.pop(0)
                    emit({"event": "result", **fut.result().as_dict()})
                emit({"event": "batch_done", "free": w.free_counts()})
            elif cmd.get("cmd") == "describe":  # this decode's register message: layout, KVArgs, endpoint
                from pdstate.protocol import wire

                register = w.agent.register_message()
                emit({"event": "describe", "register": wire.encode(register, w.opts.token).hex()})
            elif cmd.get("cmd") == "stats":
                emit({"event": "stats", **_decode_snapshot(w), "stats": w.stats.as_dict(), "free": w.free_counts()})
            else:
                emit({"event": "error", "message": f"unknown decode command {cmd.get('cmd')!r}"})
    finally:
        w.stop()
    return ExitCode.OK


def serve(opts: WorkerOptions, lines: Iterable[str], emit: Emit, hooks: WorkerHooks | None = None) -> ExitCode:
    """Run one worker until ``lines`` ends; returns the exit status."""
    try:
        return _run_prefill(opts, lines, emit, hooks) if opts.role == "prefill" else _run_decode(opts, lines, emit)
    except LocalCheckFailed as exc:
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        print(f"pdstate {opts.role}: {type(cause).__name__}: {cause}", file=sys.stderr, flush=True)
        return ExitCode.LOCAL_CHECK


def main() -> ExitCode:
    from pdstate.worker.base import tune_interpreter

    tune_interpreter()
    line = sys.stdin.readline()
    try:
        opts = options_from_json(line)
        hooks = hooks_from_json(line)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        print(
            f"pdstate worker: bad description line {line.strip()[:80]!r}: {type(exc).__name__}: {exc}", file=sys.stderr
        )
        return ExitCode.CONFIG
    return serve(opts, sys.stdin, _emit_stdout, hooks)


# --- fork-server launcher --------------------------------------------------------------------

_FORK_PRELOAD = ["pdstate.devtools.processes", "pdstate.worker.prefill", "pdstate.worker.decode", "pdstate.agent"]
_fork_ctx = None
_fork_lock = threading.Lock()


def _fork_context():
    global _fork_ctx
    with _fork_lock:
        if _fork_ctx is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(_FORK_PRELOAD)  # no effect if this process's server already runs
            _fork_ctx = ctx
        return _fork_ctx


def _forked_main(opts_json: str, cmd_conn, event_conn, log_path: str) -> None:
    """Child of the fork server: stdout/stderr go to ``log_path``; commands and events travel
    over two one-way pipes (closing the command pipe is the child's EOF)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    rc = ExitCode.FAILED
    try:
        from pdstate.worker.base import tune_interpreter

        tune_interpreter()  # as ``main`` does for a subprocess worker

        def lines():
            while True:
                try:
                    yield cmd_conn.recv_bytes().decode()
                except (EOFError, OSError):
                    return

        def emit(obj: dict) -> None:
            event_conn.send_bytes(json.dumps(obj).encode())

        rc = serve(options_from_json(opts_json), lines(), emit, hooks_from_json(opts_json))
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


class WorkerProcess:
    """A worker in a child process, driven by JSON command lines; its events are JSON objects."""

    def __init__(
        self,
        opts: WorkerOptions,
        env: dict[str, str] | None = None,
        launcher: str = "subprocess",
        hooks: WorkerHooks | None = None,
    ) -> None:
        self.opts = opts
        self.launcher = launcher
        self._lines: queue.Queue = queue.Queue()
        self._stderr: deque[str] = deque(maxlen=5000)
        self._stderr_final: str | None = None
        self._closed = False
        if launcher == "subprocess":
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pdstate.devtools.processes"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                bufsize=1,
                env={**os.environ, **(env or {})},
            )
            self._stderr_pump = threading.Thread(target=self._pump_stderr, daemon=True)
            self._stderr_pump.start()
            threading.Thread(target=self._pump_stdout, daemon=True).start()
            self.send(options_to_json(opts, hooks))
        elif launcher == "fork":
            if env:
                raise ValueError("launcher='fork' cannot change the environment; use launcher='subprocess'")
            ctx = _fork_context()
            fd, self._log_path = tempfile.mkstemp(prefix=f"pdstate-{opts.role}-", suffix=".log")
            os.close(fd)
            cmd_r, self._cmd_w = ctx.Pipe(duplex=False)
            self._event_r, event_w = ctx.Pipe(duplex=False)
            self.proc = ctx.Process(
                target=_forked_main,
                args=(options_to_json(opts, hooks), cmd_r, event_w, self._log_path),
                name=f"pdstate-{opts.role}",
                daemon=False,
            )
            self.proc.start()
            cmd_r.close()
            event_w.close()
            threading.Thread(target=self._pump_events, daemon=True).start()
        else:
            raise ValueError(f"launcher must be 'subprocess' or 'fork'; got {launcher!r}")

    # -- plumbing ------------------------------------------------------------------------------
    def _pump_stdout(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _pump_stderr(self) -> None:
        for line in self.proc.stderr:
            self._stderr.append(line)

    def _pump_events(self) -> None:
        while True:
            try:
                data = self._event_r.recv_bytes()
            except (EOFError, OSError):
                break
            self._lines.put(data.decode())
        self._lines.put(None)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.launcher == "subprocess" else self.proc.exitcode

    def send(self, line: str) -> None:
        if self.launcher == "subprocess":
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        else:
            self._cmd_w.send_bytes(line.encode())

    def command(self, cmd: dict, event: str, timeout_s: float = 30.0) -> dict[str, Any]:
        """Send ``cmd`` and return the next event named ``event`` (other events are skipped)."""
        self.send(json.dumps(cmd))
        deadline = time.monotonic() + timeout_s
        while True:
            ev = self.read_event(max(0.0, deadline - time.monotonic()))
            if ev.get("event") == event:
                return ev

    def stderr_text(self) -> str:
        if self._stderr_final is not None:
            return self._stderr_final
        if self.launcher == "subprocess":
            return "".join(self._stderr)
        try:
            with open(self._log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def wait(self, timeout_s: float) -> int:
        """The exit status once the worker exited; ``TimeoutError`` if it is still running."""
        if self.launcher == "subprocess":
            try:
                rc = self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"{self.opts.role} worker still running after {timeout_s:.0f} s") from None
            self._stderr_pump.join(timeout=5)
            return rc
        self.proc.join(timeout_s)
        if self.proc.exitcode is None:
            raise TimeoutError(f"{self.opts.role} worker still running after {timeout_s:.0f} s")
        return self.proc.exitcode

    def read_event(self, timeout_s: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{self.opts.role} worker said nothing for {timeout_s:.0f} s") from None
            if line is None:
                self._lines.put(None)  # every later read sees the exit too
                try:
                    rc: int | str = self.wait(10)
                except TimeoutError:
                    rc = "still running"
                raise RuntimeError(f"{self.opts.role} worker exited ({rc}): {self.stderr_text().strip()[-2000:]}")
            line = line.strip()
            if line.startswith("{"):
                return json.loads(line)

    def close(self, timeout_s: float = 20.0) -> int:
        """End the worker (EOF on its commands; killed after ``timeout_s``); returns its status."""
        if self.launcher == "subprocess":
            try:
                self.proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
            try:
                rc = self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                rc = self.proc.wait()
            self._stderr_pump.join(timeout=5)
            return rc
        if not self._closed:
            self._closed = True
            self._cmd_w.close()
            self.proc.join(timeout_s)
            if self.proc.exitcode is None:
                self.proc.kill()
                self.proc.join(10)
            self._stderr_final = self.stderr_text()
            try:
                os.unlink(self._log_path)
            except OSError:
                pass
        return self.proc.exitcode

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    raise SystemExit(main())
