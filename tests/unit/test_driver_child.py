"""A driver's child (``devtools.sglang_pair.child.serve``): it answers each command and ends as soon
as its stdin closes, even with a thread left running that is not a daemon (SGLang's own Mooncake
backend leaves two: without the end, every close of a pair waited out its grace, then killed it);
and it ends when its driver dies while it is busy in a command (a test worker killed by the
kernel's OOM killer left an SGLang child of 1.2 GB running for the host's life)."""

from __future__ import annotations

import json
import os
import select
import signal
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
    f"serve({{'echo': lambda **kw: kw, 'fail': lambda: 1 / 0, 'hang': lambda: time.sleep(3600)}}, {REPLY!r}, 40)\n"
)
# a driver (``Child``, as the SGLang drivers start theirs): the child answers once, is told to hang
# in a command, and the driver prints its pid and waits to be killed
DRIVER = (
    "import sys, time\n"
    "from pdstate.devtools.sglang_pair.child import Child\n"
    f"child = Child('prefill', dict(__import__('os').environ), 'busy_child', {REPLY!r})\n"
    "assert child.call('echo', 60, room=1) == {'ok': True, 'room': 1}\n"
    "child.tell('hang')\n"
    "print(child.proc.pid, flush=True)\n"
    "time.sleep(3600)\n"
)
GONE_S = 5.0  # from the driver's death to the child's end: PARENT_CHECK_S (0.5 s) and its exit
GONE_QUIET_S = 0.5
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


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie (ended, not reaped yet) counts as ended
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_child_busy_in_a_command_ends_when_its_driver_is_killed(tmp_path):
    (tmp_path / "busy_child.py").write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC_DIR), str(tmp_path)])}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True, env=env)
    child = None
    try:
        ready, _, _ = select.select([driver.stdout], [], [], START_S * 2)
        assert ready, f"the driver named no child within {START_S * 2} s"
        child = int(driver.stdout.readline())
        assert _alive(child)
        t0 = time.monotonic()
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        deadline = t0 + GONE_S * 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), f"the child {child} outlived its killed driver by {GONE_S * 5} s"
        within("a driver's child ended after its driver was killed", time.monotonic() - t0, GONE_S, GONE_QUIET_S)
    finally:
        for pid in (child,) if child else ():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if driver.poll() is None:
            driver.kill()
            driver.wait()
