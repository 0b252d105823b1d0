"""Logging for pdstate's commands: one set-up, text or JSON lines, and the lines operators read.

I/O at the edge only: ``configure`` is called once by ``pdstate.cli`` (``--log-level``,
``--log-format``); the rest of the package logs through ``logging`` as usual and calls the three
helpers below where an operator needs one line with fixed fields:

- ``request_end``: one INFO line per request end: room, peer, bytes, ms, outcome, verification;
- ``handshake``: an accepted handshake at INFO (peer, fingerprint, seconds);
- ``refusal``: a refused handshake or request at WARNING, with the differing factor and the
  ``fix:`` line of ``pdstate.protocol.fixes``, in the words of the process that logs it
  (``use_fix_words``: an SGLang rank's process names SGLang's flags and variables, set by its
  manager; any other ``pdstate serve``'s config keys).

Their fields travel on the record as ``record.fields``: the text format appends them as
``key=value``, the JSON format as keys of the line's object.

A record is one line whatever it quotes (a peer's worker id, error or reason): the text format
renders every control character of its message and fields visibly (``escape_controls``: ``\\n``,
``\\r``, ``\\t``, ``\\x1b``, the other C0 and C1 controls and DEL as ``\\xNN``, the Unicode line
and paragraph separators as ``\\u2028`` / ``\\u2029``), and the lines of a traceback
are indented, so no text can start a line that reads as a record of its own; the JSON format escapes
them as JSON does.

Native engines (Mooncake's glog) write to file descriptor 2 from C++, beyond ``logging``.
``NativeLogs`` puts a pipe on descriptor 2 and re-logs each glog line under ``pdstate.native`` at
its own level (``I`` info, ``W`` warning, ``E`` error, ``F`` critical; ``NATIVE_LEVELS`` lowers the
few lines logged above their weight on a normal start), so ``--log-level`` and ``--log-format``
apply to them too; ``mode="raw"`` passes them through unchanged. Lines that are
not glog's (a traceback, a child's output) always pass through unchanged.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
from typing import Any, TextIO

__all__ = [
    "FORMATS",
    "LEVELS",
    "NATIVE_MODES",
    "NativeLogs",
    "configure",
    "escape_controls",
    "handshake",
    "refusal",
    "request_end",
    "use_fix_words",
]

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
NATIVE_MODES = ("levelled", "raw")

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_CONTROLS.update({0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r", 0x2028: "\\u2028", 0x2029: "\\u2029"})
_CONTROLS_BUT_NEWLINE = {c: v for c, v in _CONTROLS.items() if c != 0x0A}


def escape_controls(text: str) -> str:
    """``text`` with every C0 and C1 control character, DEL and the Unicode line and paragraph
    separators written visibly (``\\n``, ``\\r``, ``\\t``, ``\\xNN``, ``\\u2028``): one line."""
    return text.translate(_CONTROLS)


def _indented(text: str) -> str:
    """A traceback's text: controls escaped but its newlines, every line not indented yet
    indented (it follows the record's line: none of its lines starts a record)."""
    lines = text.translate(_CONTROLS_BUT_NEWLINE).split("\n")
    return "\n".join(line if line[:1] in (" ", "") else "  " + line for line in lines)


class TextFormatter(logging.Formatter):
    """The usual one-line text, with a record's ``fields`` appended as ``key=value``; control
    characters in the message and the fields escaped (``escape_controls``), a traceback's lines
    indented."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        # ``logging.Formatter.format``'s steps, the traceback not cached on the record (another
        # handler's formatter renders its own)
        record.message = record.getMessage()
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        text = self.formatMessage(record)
        fields = getattr(record, "fields", None)
        if fields and not getattr(record, "fields_in_message", False):
            text += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        text = text.translate(_CONTROLS)
        if record.exc_info:
            text += "\n" + _indented(self.formatException(record.exc_info))
        elif record.exc_text:
            text += "\n" + _indented(record.exc_text)
        if record.stack_info:
            text += "\n" + _indented(self.formatStack(record.stack_info))
        return text


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts`` (seconds since the epoch), ``level``, ``logger``, ``msg``,
    then the record's ``fields`` and, for an exception, ``exc``."""

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        obj.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, default=str)


_HANDLER_FLAG = "_pdstate_handler"


def configure(level: str = "warning", fmt: str = "text", stream: TextIO | None = None) -> logging.Handler:
    """Set the root logger to ``level`` with one handler writing ``fmt`` lines to ``stream``
    (default ``sys.stderr``); calling it again replaces the handler it added before."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: choose one of {', '.join(FORMATS)}")
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _HANDLER_FLAG, False)]:
        root.removeHandler(old)
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    setattr(handler, _HANDLER_FLAG, True)
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler


def _emit(log: logging.Logger, level: int, text: str, fields: dict[str, Any]) -> None:
    # escaped here too: a handler with a formatter of its own (an SGLang rank's) gets one line
    log.log(level, "%s", escape_controls(text), extra={"fields": fields, "fields_in_message": True})


def request_end(
    log: logging.Logger,
    *,
    room: int | str,
    peer: str,
    nbytes: int,
    ms: float,
    outcome: str,
    verification: str,
) -> None:
    """One INFO line for a request that ended, however it ended.

    Args:
        room: the request's room id.
        peer: the other side (its worker id or endpoint).
        nbytes: bytes moved for the request (0 when none were).
        ms: milliseconds from the request's start to its end.
        outcome: ``"ok"``, or what ended it (``"failed"``, ``"aborted"``, ``"timeout"``, ...).
        verification: what checked the bytes (``"full"``, ``"sample"``, ``"digest"``, ``"off"``).
    """
    fields = {
        "event": "request_end",
        "room": room,
        "peer": peer,
        "bytes": int(nbytes),
        "ms": round(float(ms), 3),
        "outcome": outcome,
        "verification": verification,
    }
    text = " ".join(f"{k}={v}" for k, v in fields.items() if k != "event")
    _emit(log, logging.INFO, f"request end {text}", fields)


def handshake(log: logging.Logger, *, peer: str, fingerprint: str, seconds: float) -> None:
    """One INFO line for an accepted handshake."""
    fields = {"event": "handshake", "peer": peer, "fingerprint": fingerprint, "s": round(float(seconds), 4)}
    _emit(log, logging.INFO, f"handshake accepted peer={peer} fingerprint={fingerprint} s={fields['s']}", fields)


def refusal_factor(error_type: str, message: str) -> str:
    """The factor a refusal is about: a layout mismatch's factor name, else the error's class."""
    from pdstate.protocol.fixes import parse_layout_mismatch

    parsed = parse_layout_mismatch(message)
    return parsed[0] if parsed else error_type


# Whose words this process's refusal lines use (``protocol.fixes.Words``): "sglang" in an SGLang
# rank's process (its manager says so at start), else "serve".
_FIX_WORDS = {"words": "serve"}


def use_fix_words(words: str) -> None:
    """The words of this process's refusal lines: ``"sglang"`` (an SGLang rank) or ``"serve"``."""
    if words not in ("serve", "sglang"):
        raise ValueError(f"fix words: {words!r} is neither 'serve' nor 'sglang'")
    _FIX_WORDS["words"] = words


def refusal(log: logging.Logger, *, what: str, peer: str, error_type: str, message: str, layouts=None) -> None:
    """One WARNING line for a refused handshake or request (``what``), with the factor and the
    ``fix:`` line of ``pdstate.protocol.fixes`` (none when it has nothing to add), in this
    process's words (``use_fix_words``)."""
    from pdstate.protocol.fixes import fix_line

    factor = refusal_factor(error_type, message)
    fix = fix_line(error_type, message, layouts, words=_FIX_WORDS["words"])
    fields = {
        "event": "refusal",
        "what": what,
        "peer": peer,
        "factor": factor,
        "error": error_type,
        "message": message,
        "fix": fix,
    }
    text = f"{what} refused peer={peer} factor={factor}: {error_type}: {message}"
    _emit(log, logging.WARNING, text + (f"; {fix}" if fix else ""), fields)


# --- native engines' lines on descriptor 2 -------------------------------------------------------

# glog's prefix: Lmmdd hh:mm:ss.uuuuuu threadid file:line] message
GLOG_LINE = re.compile(
    r"^(?P<level>[IWEF])\d{4} \d\d:\d\d:\d\d\.\d+\s+(?P<tid>\d+) (?P<where>[^\]\s]+)\] ?(?P<msg>.*)$"
)
GLOG_LEVELS = {"I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}
# Lines a native engine writes above their weight on every normal start: (file, message start) -> level.
# Mooncake 0.3.13 logs "Local segment descriptor not found" at E while it publishes its own segment,
# and its TCP protocol's default allocator at W.
NATIVE_LEVELS = {
    ("transfer_metadata.cpp", "Local segment descriptor not found"): logging.INFO,
    ("transfer_engine_py.cpp", "Using default malloc/free for protocol: tcp"): logging.INFO,
}
GLOG_PREAMBLE = "WARNING: Logging before InitGoogleLogging() is written to STDERR"


class NativeLogs:
    """Capture what native code writes to descriptor ``fd`` (2) and re-log its glog lines.

    ``start()`` moves the real stderr to a new descriptor, points ``sys.stderr`` and the root
    logger's stream handlers at it, and puts a pipe on ``fd`` read by one daemon thread. ``close()``
    restores ``fd`` and drains the pipe. Constructing does nothing.
    """

    def __init__(self, mode: str = "levelled", fd: int = 2, logger: str = "pdstate.native") -> None:
        if mode not in NATIVE_MODES:
            raise ValueError(f"native log mode {mode!r}: choose one of {', '.join(NATIVE_MODES)}")
        self.mode = mode
        self.fd = fd
        self.log = logging.getLogger(logger)
        self._saved: int | None = None
        self._out: TextIO | None = None
        self._old_stderr: TextIO | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> NativeLogs:
        sys.stderr.flush()
        self._saved = os.dup(self.fd)
        self._out = open(self._saved, "w", buffering=1, closefd=False)
        self._old_stderr = sys.stderr
        if _writes_to(sys.stderr, self.fd):  # not when a test harness has replaced sys.stderr
            for handler in logging.getLogger().handlers:
                if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stderr:
                    handler.setStream(self._out)
            sys.stderr = self._out
        read, write = os.pipe()
        os.dup2(write, self.fd)
        os.close(write)
        self._thread = threading.Thread(target=self._pump, args=(read,), name="pdstate-native-logs", daemon=True)
        self._thread.start()
        return self

    def __enter__(self) -> NativeLogs:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _pump(self, read: int) -> None:
        with open(read, "rb", buffering=0) as pipe:
            pending = b""
            while chunk := pipe.read(65536):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self.line(line.decode("utf-8", "replace"))
            if pending:
                self.line(pending.decode("utf-8", "replace"))

    def line(self, text: str) -> None:
        """Handle one line read from the native side."""
        if self.mode == "levelled" and text == GLOG_PREAMBLE:
            self.log.debug("%s", text)
            return
        m = GLOG_LINE.match(text) if self.mode == "levelled" else None
        if m is None:
            out = self._out or sys.stderr
            out.write(text + "\n")
            out.flush()
            return
        fields = {"event": "native", "where": m["where"], "tid": int(m["tid"])}
        level = GLOG_LEVELS[m["level"]]
        source = m["where"].rsplit(":", 1)[0]
        for (file, start), known in NATIVE_LEVELS.items():
            if source == file and m["msg"].startswith(start):
                level = known
        self.log.log(level, "%s", m["msg"], extra={"fields": fields})

    def close(self) -> None:
        if self._saved is None:
            return
        try:
            sys.stdout.flush()
        except Exception:  # a closed stdout must not keep stderr captured
            pass
        os.dup2(self._saved, self.fd)  # closes the pipe's write end: the pump sees EOF
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is self._out:
                handler.setStream(self._old_stderr)
        sys.stderr = self._old_stderr
        self._out.close()
        os.close(self._saved)
        self._saved = None


def _writes_to(stream: TextIO, fd: int) -> bool:
    try:
        return stream.fileno() == fd
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return False


def elapsed_ms(t0: float) -> float:
    """Milliseconds since ``t0`` (a ``time.perf_counter()`` reading), for ``request_end``."""
    return (time.perf_counter() - t0) * 1e3
