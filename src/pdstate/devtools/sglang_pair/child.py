"""A driver's child process, from both ends: ``Child`` (the parent's handle; ``ChildPair``, a prefill
child and a decode child) and ``serve`` (the child's loop).

Both SGLang drivers (``sglang_pair``, ``sglang_queues``) talk to their children the same way: one
JSON command per stdin line (``{"op": ..., **arguments}``), one answer per command as a stdout line
``<reply prefix>{json}`` (anything else on stdout is SGLang's and ignored), stderr kept aside for
the error a child that stops answering leaves behind. Nothing here imports SGLang.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import TypeVar

_P = TypeVar("_P", bound="ChildPair")


def error_text(exc: BaseException) -> str:
    """An exception as one line: its type and message."""
    return f"{type(exc).__name__}: {exc}"


class Child:
    """The child ``python -m <module>`` playing ``role``, under ``env``; its answers are the stdout
    lines that start with ``reply``; ``tail_chars`` of its stderr go with a missing answer's error."""

    def __init__(self, role: str, env: dict[str, str], module: str, reply: str, tail_chars: int = 4000) -> None:
        self.role = role
        self.reply = reply
        self.tail_chars = tail_chars
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True,
            env={**env, DRIVER_PID_ENV: str(os.getpid())},
        )  # fmt: skip
        self.replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(self.reply):
                self.replies.put(json.loads(line[len(self.reply) :]))
        self.replies.put(None)

    def tell(self, op: str, **kw) -> None:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout: float) -> dict:
        try:
            reply = self.replies.get(timeout=timeout)
        except queue.Empty:
            reply = None
        if reply is None:
            raise RuntimeError(f"the {self.role} child did not answer in {timeout:.0f} s:\n{self.stderr_tail()}")
        return reply

    def call(self, op: str, timeout: float, **kw) -> dict:
        self.tell(op, **kw)
        return self.answer(timeout)

    def stderr_tail(self, n: int | None = None) -> str:
        self.err.seek(0)
        return self.err.read().decode(errors="replace")[-(self.tail_chars if n is None else n) :]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.err.close()


class ChildPair:
    """A prefill child and a decode child of ``module`` under ``env`` (``Child``), closed together."""

    def __init__(self, env: dict[str, str], module: str, reply: str, tail_chars: int = 4000) -> None:
        self.prefill = Child("prefill", env, module, reply, tail_chars)
        self.decode = Child("decode", env, module, reply, tail_chars)

    def __enter__(self: _P) -> _P:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


PARENT_CHECK_S = 0.5  # how often a child looks whether its parent is still there
DRIVER_PID_ENV = "PDSTATE_DRIVER_PID"  # the driver's pid, as ``Child`` starts a child (a driver gone before
# the child's ``serve`` began is seen gone too)


def _end_with_parent(parent: int) -> None:
    """End the process (status 1) once ``parent`` is no longer its parent: the driver died without
    closing its stdin (killed, by the kernel's OOM killer for one) while this child was busy in a
    command, or its answer's write failed: the interpreter would not end by itself (SGLang's
    threads), and the orphan would keep its pools' memory for the host's life."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os._exit(1)


def serve(ops: dict[str, Callable[..., dict]], reply: str, trace_chars: int) -> None:
    """The child's loop: each stdin command runs ``ops[op]`` and is answered on stdout, prefixed with
    ``reply``: ``{"ok": True, **result}``, or ``{"ok": False, "error", "trace"}`` (the trace's last
    ``trace_chars``) when it raised; the child keeps serving until stdin closes, and then ends at
    once: SGLang's own Mooncake backend leaves threads that are not daemons (its bootstrap and decode
    threads run for the process's life), so the interpreter would never end by itself (measured:
    both children still running 30 s after their stdin closed), and every close waited out its
    grace before killing them. For the same reason it ends when its parent goes
    (``_end_with_parent``) and when an answer cannot be written (its parent's end of the pipe
    gone)."""
    parent = int(os.environ.pop(DRIVER_PID_ENV, None) or os.getppid())  # (not handed on to its own children)
    threading.Thread(target=_end_with_parent, args=(parent,), name="end-with-parent", daemon=True).start()
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            answer = {"ok": True, **ops[op](**cmd)}
        except Exception as exc:  # reported to the parent, which decides; the child keeps serving
            answer = {"ok": False, "error": error_text(exc), "trace": traceback.format_exc()[-trace_chars:]}
        try:
            sys.stdout.write(reply + json.dumps(answer, default=str) + "\n")
            sys.stdout.flush()
        except OSError:  # the parent's end of the pipe is gone: nobody is left to answer
            os._exit(1)
    sys.stderr.flush()
    os._exit(0)
