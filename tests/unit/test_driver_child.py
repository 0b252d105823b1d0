"""A driver's child (``devtools.sglang_pair.child.serve``): it answers each command and ends as soon
as its stdin closes, even with a thread left running that is not a daemon (SGLang's own Mooncake
backend leaves two: without the end, every close of a pair waited out its grace, then killed it)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

from tests.support.bounds import within
from tests.support.paths import SRC_DIR

REPLY = "@@child "
CHILD = (
    "import threading, time\n"
    "from pdstate.devtools.sglang_pair.child import serve\n"
    "threading.Thread(target=time.sleep, args=(3600,)).start()  # not a daemon\n"
    f"serve({{'echo': lambda **kw: kw, 'fail': lambda: 1 / 0}}, {REPLY!r}, 40)\n"
)
# from its stdin's close to its end (bounded; what it measured on a quiet machine beside it)
ENDS_S, ENDS_QUIET_S = 2.0, 0.01
START_S = 60.0  # the child's interpreter and its imports: a deadline, not a bound


def _ask(proc: subprocess.Popen, lines: str) -> str:
    """Its one answer to ``lines`` (one command at a time: nothing else is read into the pipe's buffer)."""
    proc.stdin.write(lines)
    proc.stdin.flush()
    ready, _, _ = select.select([proc.stdout], [], [], START_S)
    assert ready, f"no answer within {START_S} s"
    return proc.stdout.readline()


def test_a_child_answers_then_ends_when_its_stdin_closes_though_a_thread_runs_on():
    env = {**os.environ, "PYTHONPATH": str(SRC_DIR)}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert _ask(proc, json.dumps({"op": "echo", "room": 7}) + "\n\n") == REPLY + '{"ok": true, "room": 7}\n'
        failed = json.loads(_ask(proc, json.dumps({"op": "fail"}) + "\n").removeprefix(REPLY))
        assert (failed["ok"], failed["error"]) == (False, "ZeroDivisionError: division by zero")
        assert failed["trace"].endswith("ZeroDivisionError: division by zero\n") and len(failed["trace"]) == 40
        t0 = time.monotonic()
        proc.stdin.close()
        proc.wait(timeout=ENDS_S * 5)
        within("a driver's child ended after its stdin closed", time.monotonic() - t0, ENDS_S, ENDS_QUIET_S)
        assert proc.returncode == 0
        assert proc.stdout.read() == ""  # nothing after the answers
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
