"""Engine listeners: who can write into a worker's memory without a handshake, where each
engine's native side really listens, and the transport it really uses (``pdstate serve``
processes; ``/readyz``, ``/v1/compat``, ``pdstate probe``).

* shm has no port: a decode's memory is its ``/dev/shm`` segment files, mode 0600. A process of
  another uid that never shook hands cannot open them for writing (run as ``nobody`` where the
  tests run as root; otherwise the single-uid variant checks the mode and owner only: a process
  of the decode's own uid is inside the trust boundary, docs/security.md).
* Mooncake 0.3.13 cannot be restricted: both its listeners are on every interface whatever
  ``transfer.mooncake.host`` says, and it authenticates nobody. So a worker refuses to start with
  it unless acknowledged (``test_fail_closed.py``), and reports the listeners as they are, open
  beyond loopback. Configured for RDMA on a host without an RDMA device it silently falls back
  to TCP: the worker is then not ready, and says why.
* NIXL's UCX listens on one socket per network device; ``transfer.nixl.net_devices = "lo"``
  keeps it on loopback, and the worker shows that it did.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from pdstate.transfer.engines.listeners import beyond_loopback, tcp_listeners
from tests.sglang import runner
from tests.support.api_source import SHM_TRANSPORT
from tests.support.hostile import NOBODY, segment_paths
from tests.support.services import Services, ready, wait_for
from tests.support.workers import pdstate_command

ACK = "transfer.{}.allow_open_listener=true"
FALLBACK = (
    "mooncake was configured with protocol 'rdma' (device '') but found no RDMA device (0 HCAs in its "
    'topology) and fell back to TCP; fix the RDMA set-up, or set transfer.mooncake.protocol = "tcp"'
)

_OPEN_AS_NOBODY = """
import json, os, sys
paths, uid = json.loads(sys.argv[1]), int(sys.argv[2])
os.setgroups([]); os.setgid(uid); os.setuid(uid)
out = {}
for p in paths:
    try:
        with open(p, "r+b") as f:
            f.write(b"x")
        out[p] = "written"
    except OSError as exc:
        out[p] = type(exc).__name__
print(json.dumps(out))
"""


def _native(module: str) -> None:
    pytest.importorskip(module, reason=f"{module} is not installed (pdstate[mooncake] / pdstate[nixl])")


def _no_rdma_device() -> None:
    try:
        devices = os.listdir("/sys/class/infiniband")
    except OSError:
        devices = []
    if devices:
        pytest.skip(f"this host has RDMA devices ({devices}): Mooncake does not fall back here")


def _compat(url: str) -> dict:
    r = httpx.get(f"{url}/v1/compat", timeout=5)
    assert r.status_code == 200, r.text
    return r.json()


def _listening_for_real(pid: int, reported: list[str]) -> None:
    """Every reported listener is a listening socket of that process (``/proc``)."""
    assert reported, "the engine reported no listener"
    assert set(reported) <= tcp_listeners(str(pid)), (reported, tcp_listeners(str(pid)))


def test_shm_a_process_that_never_shook_hands_cannot_write_the_decodes_segments():
    with Services() as s:
        _, control = s.prefill()
        decode = s.start("decode", ["http.port=0", f"control.peer={control}"])
        url = decode.url
        body = wait_for(lambda: ready(httpx.Client(timeout=5), url), 60, "the decode ready")
        assert body["transport"] == SHM_TRANSPORT  # no port to write through
        assert _compat(url)["transport"] == SHM_TRANSPORT
        paths = segment_paths(decode.pid)
        assert paths, "the decode has no shm segments"
        for p in paths:
            st = os.stat(p)
            assert (st.st_mode & 0o777, st.st_uid) == (0o600, os.getuid()), p
        if os.getuid() != 0:
            return  # single-uid variant: the mode and owner above are what keeps other uids out
        before = {p: open(p, "rb").read(4096) for p in paths}
        r = subprocess.run(
            [sys.executable, "-c", _OPEN_AS_NOBODY, json.dumps(paths), str(NOBODY)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout) == dict.fromkeys(paths, "PermissionError")
        assert {p: open(p, "rb").read(4096) for p in paths} == before


def test_mooncake_shows_its_listeners_as_they_are_open_beyond_loopback():
    _native("mooncake.engine")
    with Services() as s:
        prefill, _ = s.prefill("transfer.engine=mooncake", "transfer.mooncake.host=127.0.0.1", ACK.format("mooncake"))
        body = wait_for(lambda: ready(httpx.Client(timeout=5), prefill.url), 60, "the prefill ready")
        t = body["transport"]
        assert (t["engine"], t["configured"], t["in_use"], t["open"], t["problem"]) == (
            "mooncake",
            "tcp",
            "tcp",
            True,
            None,
        )
        # host=127.0.0.1, yet every listener is on all interfaces (the native bind; nothing narrows it)
        assert all(beyond_loopback(a) for a in t["listening"]), t
        assert sorted({a.rpartition(":")[0] for a in t["listening"]}) == ["tcp://0.0.0.0", "tcp://[::]"], t
        _listening_for_real(prefill.pid, t["listening"])
        listening = prefill.wait_listening()
        assert not {listening["control"], listening["http"].replace("http://", "tcp://")} & set(t["listening"])
        assert _compat(prefill.url)["transport"] == t


def test_mooncake_configured_for_rdma_that_fell_back_to_tcp_is_not_ready_with_the_reason():
    _native("mooncake.engine")
    _no_rdma_device()
    with Services() as s:
        prefill, _ = s.prefill("transfer.engine=mooncake", "transfer.mooncake.protocol=rdma", ACK.format("mooncake"))
        url = prefill.url
        r = wait_for(lambda: httpx.get(f"{url}/readyz", timeout=5), 60, "the prefill's /readyz")
        assert r.status_code == 503, r.text
        body = r.json()
        assert (body["ready"], body["check"], body["reason"]) == (False, "transport", FALLBACK)
        assert body["error"] == {
            "type": "EngineError",
            "message": FALLBACK,
            "fix": 'fix: make the RDMA devices visible (ibv_devices lists them), or set transfer.mooncake.protocol = "tcp"',
        }
        t = body["transport"]
        assert (t["configured"], t["in_use"], t["problem"]) == ("rdma", "tcp", FALLBACK)
        _listening_for_real(prefill.pid, t["listening"])
        assert _compat(url)["transport"] == t
        probe = subprocess.run(pdstate_command() + ["probe", url], capture_output=True, text=True, timeout=60)
        assert probe.returncode == 1, probe.stdout + probe.stderr
        lines = probe.stdout.splitlines()
        assert lines[0] == f"prefill  {url}  NOT READY: {FALLBACK}"
        assert (
            f"  transport    tcp (configured rdma), listening on {', '.join(t['listening'])} (beyond loopback)" in lines
        )
        assert f"  transport    PROBLEM: {FALLBACK}" in lines


def test_an_sglang_rank_configured_for_rdma_that_fell_back_to_tcp_refuses_to_start():
    _native("mooncake.engine")
    _no_rdma_device()
    try:
        env = runner.ensure_env()
    except runner.EnvUnavailable as exc:
        runner.skip(exc)
    extra = {"PDSTATE_TRANSFER__ENGINE": "loopback", "SGLANG_HOST_IP": "127.0.0.1"}
    got = runner.run_probe(env, extra, ["rdma_fallback_refused"], 300, "adapter_probe.py")
    assert "setup" not in got, got["setup"].get("error")
    assert got["rdma_fallback_refused"]["ok"], got["rdma_fallback_refused"].get("error")
    assert got["rdma_fallback_refused"]["refused"] == f"EngineError: {FALLBACK}"


def test_nixl_net_devices_lo_keeps_its_listener_on_loopback():
    _native("nixl_cu12._api")
    env = {"UCX_MODULES": "^ib"}  # no IB modules: the exit-segfault trap (transfer/engines/nixl.py)
    with Services() as s:
        kept, _ = s.prefill("transfer.engine=nixl", "transfer.nixl.net_devices=lo", ACK.format("nixl"), env=env)
        body = wait_for(lambda: ready(httpx.Client(timeout=5), kept.url), 60, "the nixl prefill ready")
        t = body["transport"]
        assert (t["engine"], t["open"], t["problem"]) == ("nixl", False, None), t
        assert all(a.startswith("tcp://127.0.0.1:") for a in t["listening"]), t
        _listening_for_real(kept.pid, t["listening"])
        if not any(beyond_loopback(f"tcp://{ip}:0") for ip in _host_ipv4()):
            return  # a host with loopback only: nothing wider to compare with
        wide, _ = s.prefill("transfer.engine=nixl", ACK.format("nixl"), env=env)
        body = wait_for(lambda: ready(httpx.Client(timeout=5), wide.url), 60, "the second nixl prefill ready")
        assert body["transport"]["open"] is True, body["transport"]  # UCX's default: every device
        _listening_for_real(wide.pid, body["transport"]["listening"])


def _host_ipv4() -> list[str]:
    """This host's IPv4 addresses (``hostname -I`` or the loopback alone)."""
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return ["127.0.0.1"]
    return [a for a in out.split() if "." in a] or ["127.0.0.1"]
