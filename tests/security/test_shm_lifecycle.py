"""/dev/shm that survives containers: segment liveness by the owner's lock, not by PID, and a
/dev/shm too small for the pools refused with one line instead of a SIGBUS.

- A segment whose owner is alive is never swept, whatever PID its name carries (another PID
  namespace, a reused PID); a peer that maps it (the prefill's shm engine) takes no lock.
- A SIGKILLed owner's segments are swept by the next sweep, even when the PID in their names is
  alive here (a decode that was PID 1 in its container).
- Free space: a directory with less room than a segment is an ``AllocationError`` naming the bytes
  needed and free and how to raise it (statvfs faked, and a real small tmpfs in a private mount
  namespace, where ``pdstate serve`` of a decode refuses with that one line).
- Two decodes in different PID namespaces (``unshare --pid --fork``) sharing /dev/shm: neither
  loses its segments across a prefill restart; a killed one's segments go at the next start.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from pdstate.errors import AllocationError
from pdstate.pools import memory
from pdstate.pools.memory import (
    SHM_DIR,
    STAGED_GRACE_S,
    BufferSpec,
    SharedMemory,
    owner_alive,
    shm_space_error,
    sweep_stale_segments,
)
from pdstate.transfer.engines.shm import ShmEngine
from tests.support.paths import REPO, SERVICES
from tests.support.paths import SRC_DIR as SRC

SPECS = [BufferSpec("a", (3, 4096), torch.uint8)]
FIX = (
    "give {d} more room: docker run --shm-size=SIZE, compose shm_size: SIZE, "
    "k8s an emptyDir {{medium: Memory, sizeLimit: SIZE}} mounted at {d}"
)

OWNER = """
import sys, torch
from pdstate.pools.memory import BufferSpec, SharedMemory
mem = SharedMemory(directory=sys.argv[1])
for name in ("target", "draft"):
    mem.allocate(name, [BufferSpec("a", (3, 4096), torch.uint8)])
print(" ".join(s.path for s in mem.segments), flush=True)
sys.stdin.read()  # until the test closes stdin or kills this process
mem.close()
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSTATE_") or k == "PDSTATE_SHARED"}
    env["PYTHONPATH"] = str(SRC)
    return env


class Owner:
    """A process that owns two segments in ``directory`` until it is told to exit or killed."""

    def __init__(self, directory: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", OWNER, str(directory)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        line = self.proc.stdout.readline()
        assert line, f"owner exited with {self.proc.wait()}"
        self.paths = line.split()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(10)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _rename_pid(path: str, pid: int) -> str:
    name = os.path.basename(path)
    new = os.path.join(os.path.dirname(path), re.sub(r"^pdstate-\d+-", f"pdstate-{pid}-", name))
    os.rename(path, new)  # the inode, and so the owner's lock, goes with it
    return new


# --- liveness --------------------------------------------------------------------------------


def test_live_owner_is_never_swept_whatever_its_pid(tmp_path):
    owner = Owner(tmp_path)
    try:
        dead = _dead_pid()
        paths = [_rename_pid(p, dead) for p in owner.paths]  # as seen from another PID namespace
        assert all(owner_alive(p) for p in paths)
        assert sweep_stale_segments(tmp_path) == []
        # the prefill's engine maps the peer's segments: that takes no lock
        engine = ShmEngine(segment_dir=str(tmp_path))
        maps = [engine._map(p) for p in paths]
        assert sweep_stale_segments(tmp_path) == []
        assert all(os.path.exists(p) for p in paths)
        owner.kill()  # SIGKILL: no cleanup ran
        assert all(os.path.exists(p) for p in paths) and not any(owner_alive(p) for p in paths)
        assert sorted(sweep_stale_segments(tmp_path)) == sorted(os.path.basename(p) for p in paths)
        assert not any(os.path.exists(p) for p in paths)
        for mm, _addr in maps:  # a mapping outlives the name: the peer's writes land harmlessly
            mm[0] = 0x5A
            assert mm[0] == 0x5A
            mm.close()
    finally:
        owner.kill()


def test_crashed_owner_with_a_live_pid_in_its_name_is_swept(tmp_path):
    # a decode that was PID 1 (or any PID alive here) in its own container, then SIGKILLed
    owner = Owner(tmp_path)
    paths = [_rename_pid(p, 1) for p in owner.paths]
    assert sweep_stale_segments(tmp_path) == []
    owner.kill()
    assert sorted(sweep_stale_segments(tmp_path)) == sorted(os.path.basename(p) for p in paths)


def test_a_clean_exit_removes_its_segments(tmp_path):
    owner = Owner(tmp_path)
    owner.close()
    assert owner.proc.returncode == 0 and not any(os.path.exists(p) for p in owner.paths)
    assert sweep_stale_segments(tmp_path) == []


def test_segments_of_this_process_are_kept_and_names_carry_a_long_nonce(tmp_path):
    with SharedMemory(directory=tmp_path) as mem:
        mem.allocate("target", SPECS)
        (seg,) = mem.segments
        assert re.fullmatch(rf"pdstate-{os.getpid()}-[0-9a-f]{{16}}-target", seg.name)
        assert owner_alive(seg.path) and sweep_stale_segments(tmp_path) == []
        assert sorted(os.listdir(tmp_path)) == [seg.name]  # no staging name left behind


def test_legacy_segments_keep_the_pid_rule(tmp_path):
    # an 8-digit nonce: a segment of an older pdstate, whose owner holds no lock (rolling upgrade)
    alive = tmp_path / "pdstate-1-0123abcd-target"
    dead = tmp_path / f"pdstate-{_dead_pid()}-0123abcd-target"
    for p in (alive, dead):
        p.write_bytes(b"\0" * 64)
    assert sweep_stale_segments(tmp_path) == [dead.name]
    assert alive.exists()


def test_staged_segments_are_swept_after_a_grace_period(tmp_path):
    young = tmp_path / f".pdstate-{_dead_pid()}-{'ab' * 8}-target"
    old = tmp_path / f".pdstate-{_dead_pid()}-{'cd' * 8}-draft"
    for p in (young, old):
        p.write_bytes(b"\0" * 64)
    t = time.time() - STAGED_GRACE_S - 5
    os.utime(old, (t, t))
    assert sweep_stale_segments(tmp_path) == [old.name]
    assert young.exists()


def test_sweep_skips_links_other_files_and_other_users(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"x")
    (tmp_path / f"pdstate-{_dead_pid()}-{'ef' * 8}-target").symlink_to(target)
    (tmp_path / "pdstate-notasegment").write_bytes(b"x")
    other = tmp_path / f"pdstate-{_dead_pid()}-{'12' * 8}-draft"
    other.write_bytes(b"x")
    if os.geteuid() == 0:
        os.chown(other, 12345, 12345)
        assert sweep_stale_segments(tmp_path) == []
    assert target.exists() and (tmp_path / "pdstate-notasegment").exists()


# --- free space ------------------------------------------------------------------------------


def test_free_space_is_checked_before_allocating(tmp_path, monkeypatch):
    real = os.statvfs(tmp_path)

    class Small:
        f_frsize = 4096
        f_bavail = 2  # 8 KiB free
        f_bsize = real.f_bsize

    monkeypatch.setattr(memory.os, "statvfs", lambda d: Small)
    mem = SharedMemory(directory=tmp_path)
    with pytest.raises(AllocationError) as info:
        mem.allocate("target", SPECS)
    assert str(info.value) == (  # 8 KiB of buffers and the 4 KiB header
        f"{tmp_path} has 8192 bytes free (0.0 MiB) but the 'target' segment needs 16384 bytes (0.0 MiB); "
        + FIX.format(d=tmp_path)
    )
    assert os.listdir(tmp_path) == []  # nothing created
    monkeypatch.undo()
    mem.allocate("target", SPECS)
    mem.close()


def test_the_message_names_dev_shm_and_mib():
    e = shm_space_error(SHM_DIR, "draft", 838_860_800, 67_108_864)
    assert str(e) == (
        "/dev/shm has 67108864 bytes free (64.0 MiB) but the 'draft' segment needs 838860800 bytes (800.0 MiB); "
        + FIX.format(d="/dev/shm")
    )
    assert "\n" not in str(e)


def _can_mount_tmpfs() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    r = subprocess.run(
        ["unshare", "--mount", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt && umount /mnt"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return None if r.returncode == 0 else f"cannot mount a tmpfs in a private mount namespace: {r.stderr.strip()}"


def _in_small_tmpfs(where: str, size: str, argv: list[str]) -> subprocess.CompletedProcess:
    """Run ``argv`` in a private mount namespace where ``where`` is a fresh tmpfs of ``size``."""
    reason = _can_mount_tmpfs()
    if reason:
        pytest.skip(reason)
    script = f'mount -t tmpfs -o size={size} tmpfs {where} && exec "$@"'
    return subprocess.run(
        ["unshare", "--mount", "sh", "-c", script, "sh", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        cwd=REPO,
    )


RACE = """
import os, sys, torch
from pdstate.errors import AllocationError
from pdstate.pools import memory
from pdstate.pools.memory import BufferSpec, SharedMemory
d = sys.argv[1]
real = memory.shm_free_bytes
calls = []
def lying(directory):  # the check passes (as if another process freed room, then took it back)
    calls.append(directory)
    return (1 << 40) if len(calls) == 1 else real(directory)
memory.shm_free_bytes = lying
mem = SharedMemory(directory=d)
try:
    mem.allocate("target", [BufferSpec("a", (4 << 20,), torch.uint8)])
except AllocationError as exc:
    print(exc)
print(sorted(os.listdir(d)))
memory.shm_free_bytes = real
mem.allocate("draft", [BufferSpec("a", (512 << 10,), torch.uint8)])
print(len(mem.segments), real(d) < (1 << 20))
mem.close()
"""


def test_a_full_tmpfs_while_populating_is_an_error_not_sigbus():
    d = "/mnt"
    r = _in_small_tmpfs(d, "1m", [sys.executable, "-c", RACE, d])
    assert r.returncode == 0, r.stderr
    msg, listing, after = r.stdout.splitlines()
    assert re.fullmatch(
        r"/mnt has \d+ bytes free \(\d+\.\d MiB\) but the 'target' segment needs 4198400 bytes \(4\.0 MiB\); "
        + re.escape(FIX.format(d=d)),
        msg,
    ), msg
    assert listing == "[]"  # the half-populated segment was removed
    assert after == "1 True"  # the room came back: a segment that fits is allocated


def test_decode_with_a_small_dev_shm_refuses_to_start_with_one_line():
    cmd = [sys.executable, "-m", "pdstate.cli", "serve", "--config", str(SERVICES / "decode" / "config.toml")]
    r = _in_small_tmpfs("/dev/shm", "4m", [*cmd, "--set", "http.port=0"])
    lines = r.stderr.splitlines()
    assert r.returncode == 1 and len(lines) == 1, (r.returncode, r.stderr)
    assert lines[0].startswith("pdstate serve: decode worker failed to start: AllocationError: ")
    assert lines[0].endswith(
        "/dev/shm has 4194304 bytes free (4.0 MiB) but the 'target' segment needs 9633792 bytes (9.2 MiB); "
        + FIX.format(d="/dev/shm")
    ), lines[0]
    assert r.stdout == ""


# --- PID namespaces --------------------------------------------------------------------------


def _pid_namespaces() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    r = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, text=True, timeout=30
    )
    return None if r.returncode == 0 else f"cannot create PID namespaces here: {r.stderr.strip()}"


class Serve:
    """``pdstate serve``, optionally as a process of its own PID namespace (not its PID 1)."""

    def __init__(self, role: str, overrides: list[str], pid_namespace: bool = False, pid_offset: int = 0) -> None:
        cmd = [sys.executable, "-m", "pdstate.cli", "serve", "--config", str(SERVICES / role / "config.toml")]
        for o in overrides:
            cmd += ["--set", o]
        if pid_namespace:
            # sh is PID 1 there; each /bin/true takes the next PIDs, so the worker's PID differs per namespace
            script = "/bin/true; " * pid_offset + '"$@"; exit $?'
            cmd = ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", script, "sh", *cmd]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO, start_new_session=True
        )
        self.events: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, False), daemon=True).start()
        ev = self._event("listening")
        self.url, self.ns_pid = ev["http"], ev["pid"]

    def _pump(self, stream, out: bool) -> None:
        for line in stream:
            if out and line.startswith("{"):
                self.events.put(json.loads(line))
            elif not out:
                self.stderr.append(line)
        if out:
            self.events.put(None)

    def _event(self, name: str, timeout_s: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                ev = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {name!r} event; stderr: {''.join(self.stderr)[-2000:]}") from None
            if ev is None:
                raise AssertionError(f"exited ({self.proc.wait()}) before {name!r}: {''.join(self.stderr)[-2000:]}")
            if ev.get("event") == name:
                return ev

    def worker_pid(self) -> int:
        """The host PID of the pdstate process (the deepest descendant running python)."""
        pids, frontier = [], [self.proc.pid]
        while frontier:
            pid = frontier.pop()
            pids.append(pid)
            try:
                for task in os.listdir(f"/proc/{pid}/task"):
                    frontier += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
            except OSError:
                continue
        py = [p for p in pids if "pdstate.cli" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]
        return py[-1]

    def segments(self) -> list[str]:
        maps = Path(f"/proc/{self.worker_pid()}/maps").read_text()
        return sorted(set(re.findall(rf"({SHM_DIR}/pdstate-\S+)", maps)))

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(20)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.worker_pid(), signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(http: httpx.Client, url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = http.get(f"{url}/readyz")
            if last.status_code == 200:
                return
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.05)  # poll interval
    raise AssertionError(f"{url} not ready in {timeout_s} s: {last if not hasattr(last, 'text') else last.text}")


def _transfer(http: httpx.Client, url: str) -> dict:
    r = http.post(f"{url}/v1/transfers", json={"tokens": 300})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "success" and body["verified"], body
    return body


def test_decodes_in_different_pid_namespaces_share_dev_shm():
    reason = _pid_namespaces()
    if reason:
        pytest.skip(reason)
    ctl = f"tcp://127.0.0.1:{_free_port()}"
    timers = ["control.heartbeat_interval_s=0.2", "control.peer_timeout_s=2.0"]
    prefill_args = ["http.port=0", f"control.bind={ctl}", *timers]
    started: list[Serve] = []

    def decode(worker_id: str, pid_offset: int) -> Serve:
        d = Serve(
            "decode",
            ["http.port=0", f"control.peer={ctl}", f"worker_id={worker_id}", *timers],
            pid_namespace=True,
            pid_offset=pid_offset,
        )
        started.append(d)
        return d

    with httpx.Client(timeout=30) as http:
        try:
            prefill = Serve("prefill", prefill_args)
            started.append(prefill)
            a = decode("decode-ns-a", pid_offset=2)  # its own namespace, PID 4 there
            a_segs = a.segments()
            assert a_segs and all(os.path.exists(s) for s in a_segs)
            b = decode("decode-ns-b", pid_offset=0)  # another namespace, PID 2 there: A's PID is free
            assert a.ns_pid != b.ns_pid and a.ns_pid == 4
            b_segs = b.segments()
            assert all(os.path.exists(s) for s in a_segs), "B's start swept the live decode A's segments"
            for d in (a, b):
                _ready(http, d.url)
                _transfer(http, d.url)

            # the prefill restarts: it maps both decodes' segments again from their names
            prefill.stop()
            prefill = Serve("prefill", prefill_args)
            started.append(prefill)
            for d in (a, b):
                _ready(http, d.url)
                _transfer(http, d.url)
            peers = {p["id"]: p for p in http.get(f"{prefill.url}/v1/compat").json()["peers"]}
            assert peers["decode-ns-a"]["state"] == peers["decode-ns-b"]["state"] == "accepted", peers

            # A crashes (SIGKILL: no cleanup); its segments stay until the next decode starts
            a.kill()
            assert all(os.path.exists(s) for s in a_segs)
            c = decode("decode-ns-c", pid_offset=1)
            assert not [s for s in a_segs if os.path.exists(s)], "the killed decode's segments were not swept"
            assert all(os.path.exists(s) for s in b_segs) and all(os.path.exists(s) for s in c.segments())
            for d in (b, c):
                _ready(http, d.url)
                _transfer(http, d.url)
        finally:
            for s in reversed(started):
                s.stop()
