"""``pdstate.logs``: text and JSON lines with fixed fields, the request-end, handshake and refusal
lines, and native engines' glog lines captured from descriptor 2 and re-logged at their level."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys

import pytest

from pdstate import logs


@pytest.fixture
def lines():
    stream = io.StringIO()
    root = logging.getLogger()
    level, saved = root.level, list(root.handlers)

    def read(fmt: str = "text") -> io.StringIO:
        logs.configure("info", fmt, stream)
        return stream

    yield read
    for h in list(root.handlers):
        if getattr(h, "_pdstate_handler", False):
            root.removeHandler(h)
    root.handlers[:] = saved
    root.setLevel(level)


def test_request_end_is_one_info_line_with_every_field(lines):
    out = lines("json")
    log = logging.getLogger("pdstate.worker.prefill")
    logs.request_end(log, room=7, peer="decode-0", nbytes=4096, ms=1.23456, outcome="ok", verification="full")
    [line] = out.getvalue().splitlines()
    obj = json.loads(line)
    assert obj["level"] == "info" and obj["logger"] == "pdstate.worker.prefill" and obj["event"] == "request_end"
    assert {k: obj[k] for k in ("room", "peer", "bytes", "ms", "outcome", "verification")} == {
        "room": 7,
        "peer": "decode-0",
        "bytes": 4096,
        "ms": 1.235,
        "outcome": "ok",
        "verification": "full",
    }
    assert obj["msg"] == "request end room=7 peer=decode-0 bytes=4096 ms=1.235 outcome=ok verification=full"


def test_text_lines_carry_the_fields_once(lines):
    out = lines("text")
    logs.request_end(logging.getLogger("x"), room=1, peer="p", nbytes=0, ms=2, outcome="aborted", verification="off")
    logs.handshake(logging.getLogger("x"), peer="tcp://127.0.0.1:5601", fingerprint="ab12", seconds=0.01)
    first, second = out.getvalue().splitlines()
    assert first.endswith("INFO x: request end room=1 peer=p bytes=0 ms=2.0 outcome=aborted verification=off")
    assert "handshake accepted peer=tcp://127.0.0.1:5601 fingerprint=ab12" in second and second.count("peer=") == 1


def test_a_refusal_is_a_warning_with_the_factor_and_the_fix(lines):
    out = lines("json")
    message = (
        "KV layout mismatch: prefill server has page_size=256, but decode server has page_size=64. "
        "Ensure both servers use the same KV cache layout."
    )
    logs.refusal(
        logging.getLogger("x"), what="handshake", peer="prefill-0", error_type="KVLayoutMismatch", message=message
    )
    obj = json.loads(out.getvalue())
    assert obj["level"] == "warning" and obj["what"] == "handshake" and obj["peer"] == "prefill-0"
    assert obj["error"] == "KVLayoutMismatch" and obj["message"] == message
    assert obj["factor"] and obj["factor"] in obj["msg"]
    from pdstate.protocol.fixes import fix_line

    assert obj["fix"] == fix_line("KVLayoutMismatch", message)
    if obj["fix"]:
        assert obj["msg"].endswith(obj["fix"])


@pytest.mark.parametrize("words", ["sglang", "serve"])
def test_a_refusal_uses_the_words_of_the_process_that_logs_it(lines, words):
    """An SGLang rank's process (its manager calls ``use_fix_words("sglang")``) names SGLang's flags;
    every other process pdstate serve's config keys."""
    from pdstate.errors import LayoutMismatch
    from pdstate.protocol import factors

    out = lines("json")
    err = LayoutMismatch.build("sliding_window", 128, 64)
    logs.use_fix_words(words)
    try:
        logs.refusal(logging.getLogger("x"), what="handshake", peer="p", error_type="LayoutMismatch", message=str(err))
    finally:
        logs.use_fix_words("serve")
    entry = factors.FACTORS["sliding_window"]
    want = entry.sglang_line(128, 64) if words == "sglang" else entry.fix_line(128, 64)
    obj = json.loads(out.getvalue())
    assert obj["fix"] == want and obj["msg"].endswith(want)
    assert ("--json-model-override-args" in want) == (words == "sglang")
    assert ("pool.sliding_window" in want) == (words == "serve")
    with pytest.raises(ValueError, match="neither"):
        logs.use_fix_words("pdstate")


def test_configure_replaces_its_own_handler_and_refuses_an_unknown_format(lines):
    lines("text")
    lines("json")
    assert sum(getattr(h, "_pdstate_handler", False) for h in logging.getLogger().handlers) == 1
    with pytest.raises(ValueError, match="log format 'xml'"):
        logs.configure("info", "xml")


NATIVE = r"""
import logging, os, sys
from pdstate import logs
logs.configure("info", sys.argv[1])
with logs.NativeLogs(sys.argv[2]):
    os.write(2, b"WARNING: Logging before InitGoogleLogging() is written to STDERR\n")
    os.write(2, b"W1201 21:46:09.613765 29959 topology.cpp:201] No RDMA devices found\nI1201 21:46:09.613921 ")
    os.write(2, b"29959 transfer_engine_impl.cpp:1046] Metrics reporting is disabled\n")
    os.write(2, b"E1201 21:46:09.614243 29959 transfer_metadata.cpp:1098] Local segment descriptor not found\n")
    os.write(2, b"E1201 21:46:09.700000 29959 tcp_transport.cpp:77] connect failed\n")
    os.write(2, b"not a glog line\n")
    logging.getLogger("pdstate.x").warning("python side")
print("done", file=sys.stderr)
"""


def _native(fmt: str, mode: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", NATIVE, fmt, mode], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stderr.splitlines()


def test_native_glog_lines_are_relogged_at_their_level():
    records = {}
    plain = []
    for line in _native("json", "levelled"):
        try:
            obj = json.loads(line)
        except ValueError:
            plain.append(line)
            continue
        records[obj["msg"]] = obj
    assert records["No RDMA devices found"]["level"] == "warning"
    assert records["No RDMA devices found"]["logger"] == "pdstate.native"
    assert records["No RDMA devices found"]["where"] == "topology.cpp:201"
    assert records["Metrics reporting is disabled"]["level"] == "info"  # a line split across two writes
    assert records["Local segment descriptor not found"]["level"] == "info"  # logged at E on every normal start
    assert records["connect failed"]["level"] == "error"
    assert records["python side"]["level"] == "warning"
    assert "Logging before InitGoogleLogging" not in "\n".join(records) + "\n".join(plain)  # debug only
    assert plain == ["not a glog line", "done"]


def test_native_lines_raw_pass_through_unchanged():
    out = _native("text", "raw")  # the pipe's lines and Python's own may interleave in any order
    assert "WARNING: Logging before InitGoogleLogging() is written to STDERR" in out
    assert "W1201 21:46:09.613765 29959 topology.cpp:201] No RDMA devices found" in out
    assert "not a glog line" in out and out[-1] == "done"
    assert any(line.endswith("WARNING pdstate.x: python side") for line in out)


FORGED = "decode-0\n2026-12-06 02:41:03,000 CRITICAL pdstate.agent: \x1b[31mprefill compromised\x1b[0m\r\x85\u2028"
ESCAPED = (
    "decode-0\\n2026-12-06 02:41:03,000 CRITICAL pdstate.agent: \\x1b[31mprefill compromised\\x1b[0m\\r\\x85\\u2028"
)


def test_a_peers_text_cannot_forge_a_text_line(lines):
    """A decode's worker id with a newline and ANSI escapes (the refusal line), the same text in a
    plain record's arguments and fields, and in an exception's message: each record stays one line
    (a traceback's further lines indented), every control character written visibly."""
    out = lines("text")
    log = logging.getLogger("pdstate.agent")
    logs.refusal(log, what="handshake", peer=FORGED, error_type="WorkerIdInUse", message=f"worker_id {FORGED}")
    log.warning("decode %s said %s", FORGED, "bye", extra={"fields": {"peer": FORGED}})
    try:
        raise ValueError(FORGED)
    except ValueError:
        log.exception("a callback failed")
    text = out.getvalue()
    assert "\x1b" not in text and "\r" not in text and "\x85" not in text and "\u2028" not in text
    first, second, third, *traceback = text.split("\n")[:-1]
    assert first.endswith(
        f" WARNING pdstate.agent: handshake refused peer={ESCAPED} factor=WorkerIdInUse: WorkerIdInUse: "
        f"worker_id {ESCAPED}"
    )
    assert second.endswith(f" WARNING pdstate.agent: decode {ESCAPED} said bye peer={ESCAPED}")
    assert third.endswith(" ERROR pdstate.agent: a callback failed")
    assert traceback[0] == "  Traceback (most recent call last):"  # not at the start of a line
    assert traceback[-2:] == ["  ValueError: decode-0", "  " + ESCAPED.split("\\n", 1)[1]]
    assert all(line.startswith("  ") for line in traceback)


def test_json_lines_carry_a_peers_text_exactly(lines):
    out = lines("json")
    logs.refusal(logging.getLogger("x"), what="handshake", peer=FORGED, error_type="E", message="m")
    [line] = out.getvalue().splitlines()
    obj = json.loads(line)
    assert obj["peer"] == FORGED and obj["msg"] == f"handshake refused peer={ESCAPED} factor=E: E: m"
