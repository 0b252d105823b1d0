"""A rank's endpoint served by a child process fed with snapshots (``status.pushed``, as
``integrations.sglang.endpoint`` runs it): the child answers every route with the bytes the
worker's own source renders in process, follows the pushed changes, exits when its pipe closes,
and a child that cannot serve fails the start with one line naming why.

The source is ``tests.support.api_source.FakeSource`` (a prefill with a rejected peer, counters
and latencies), with the snapshot methods an SGLang rank's ``RankStatus`` has; real processes
and sockets on 127.0.0.1, port 0.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import warnings

import httpx
import pytest

with warnings.catch_warnings():  # starlette nags about httpx vs httpx2 on import; not our concern
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from pdstate.errors import ConfigError
from pdstate.integrations.sglang.endpoint import RankEndpoint
from pdstate.protocol.report import ErrorInfo
from pdstate.status import pushed
from pdstate.status.api import Readiness, create_app
from tests.support.api_source import FakeSource
from tests.support.pools import tiny

TOKEN = b"pushed-endpoint-token-5d1c9a77"
DEADLINE_S = 20.0
RANK = {"rank": 3, "tp_rank": 1, "tp_size": 2, "pp_rank": 1, "pp_size": 2, "dp_rank": 0, "dp_size": 1}
REFUSED = ErrorInfo(type="LayoutMismatch", message="DSV4 layout mismatch on compression_ratios: prefill server has x")


class RankLike(FakeSource):
    """``FakeSource`` with what ``RankEndpoint`` reads of a ``RankStatus``."""

    serves_transfers = False
    verify = "sampled"

    def __init__(self) -> None:
        super().__init__("prefill", tiny())
        self.rank = dict(RANK, sglang="0.5.19", http_port=0)
        self.changed = threading.Event()
        self.peer_list = [
            {"id": "dec-1", "state": "rejected", "error": REFUSED.model_dump(), "incarnation": "i-1",
             "fingerprint": "f" * 32, "transport": None},
        ]  # fmt: skip
        self.stats.success(1000, 0.004, "sampled")
        self.stats.fail("LayoutMismatch: x", "LayoutMismatch", "compression_ratios")
        self._seen = 0

    def status(self) -> dict:
        stats = self.stats.snapshot()
        new, self._seen = stats.latencies_s.since(self._seen)
        return pushed.status_of(self.readiness(), self.peers(), stats, self.in_flight(), (new, self._seen))

    def status_key(self) -> tuple:
        return ()


def _routes(get) -> dict:
    auth = {"Authorization": f"Bearer {TOKEN.decode()}"}
    out = {}
    for path, headers in (("/healthz", {}), ("/readyz", {}), ("/v1/compat", {}), ("/v1/compat", auth),
                          ("/metrics", {}), ("/v1/transfers/1", {}), ("/v1/handshake", {})):  # fmt: skip
        r = get(path, headers)
        out[(path, bool(headers))] = (r.status_code, r.headers.get("content-type"), r.content)
    return out


def _until(what, deadline_s: float = DEADLINE_S):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        time.sleep(0.05)
    return what()


@pytest.fixture
def served():
    source = RankLike()
    endpoint = RankEndpoint(source, "127.0.0.1", 0, TOKEN)
    yield source, endpoint
    endpoint.close()


def test_the_child_answers_every_route_with_the_in_process_bytes(served):
    source, endpoint = served
    in_process = TestClient(create_app(source, token=TOKEN))
    with httpx.Client(base_url=endpoint.url, timeout=10) as child:
        got = _routes(lambda p, h: child.get(p, headers=h))
    want = _routes(lambda p, h: in_process.get(p, headers=h))
    assert got == want
    assert got[("/v1/transfers/1", False)][0] == 404  # no transfer routes on a rank
    assert (
        b'pdstate_transfer_failures_total{factor="compression_ratios",kind="LayoutMismatch"} 1.0'
        in (got[("/metrics", False)][2])
    )
    assert b'"incarnation":"i-1"' in got[("/v1/compat", True)][2]
    assert b'"incarnation":"i-1"' not in got[("/v1/compat", False)][2]


def test_changes_reach_the_child_and_scrapes_cost_the_worker_no_snapshot(served):
    source, endpoint = served
    calls = []
    status = source.status
    source.status = lambda: calls.append(1) or status()
    with httpx.Client(base_url=endpoint.url, timeout=10) as child:
        for _ in range(20):  # scrapes alone: no snapshot (nothing changed, no event, within a second)
            child.get("/metrics").raise_for_status()
        assert len(calls) <= 1, calls  # at most the once-a-second one
        source.ready = Readiness(False, "the pdstate agent of this rank is closed", "shutdown")
        source.stats.success(2000, 0.02, "sampled")
        source.changed.set()  # as a request's end sets it
        assert _until(lambda: child.get("/readyz").status_code == 503)
        metrics = child.get("/metrics").text
        assert 'pdstate_transfers_total{outcome="success"} 2.0' in metrics
        assert "pdstate_transfer_latency_seconds_count 2.0" in metrics
        in_process = TestClient(create_app(source, token=TOKEN))
        assert child.get("/metrics").content == in_process.get("/metrics").content
        assert child.get("/readyz").content == in_process.get("/readyz").content


def test_the_child_exits_when_the_pipe_closes(served):
    _, endpoint = served
    proc = endpoint.child.proc
    endpoint.close()
    assert proc.returncode == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{endpoint.url}/healthz", timeout=5)


@pytest.mark.parametrize(
    ("executable", "why"),
    [
        ("/nonexistent/python3", "/nonexistent/python3 cannot be started: [Errno 2] No such file or directory: "
                                 "'/nonexistent/python3'"),
        ("/bin/false", "it exited with code 1 (its stderr is above)"),
    ],
)  # fmt: skip
def test_a_child_that_cannot_serve_fails_the_start_with_one_line(monkeypatch, executable, why):
    monkeypatch.setattr(sys, "executable", executable)
    with pytest.raises(ConfigError) as info:
        RankEndpoint(RankLike(), "127.0.0.1", 0, None)
    message = str(info.value)
    assert message.startswith("http.port: this SGLang prefill rank cannot serve its endpoint on http://127.0.0.1:")
    assert message.endswith(f": {why}") and "\n" not in message


def test_a_child_that_does_not_serve_in_time_fails_the_start(monkeypatch):
    monkeypatch.setattr(pushed, "START_S", 0.001)
    with pytest.raises(
        ConfigError, match=r"^http\.port: .* endpoint on http://127\.0\.0\.1:\d+: it did not serve within "
    ):
        RankEndpoint(RankLike(), "127.0.0.1", 0, None)


def test_a_child_that_fails_inside_names_the_error():
    from pdstate.status.connections import listen_socket

    with listen_socket("127.0.0.1", 0) as sock, pytest.raises(ConfigError) as info:
        pushed.Child(sock, {}, {}, None)  # facts without a local check: the child cannot build its source
    assert str(info.value) == "KeyError: 'local_check'"


def test_a_manager_dropped_without_close_ends_its_child():
    import gc

    endpoint = RankEndpoint(RankLike(), "127.0.0.1", 0, None)
    proc = endpoint.child.proc
    endpoint.source.mgr_endpoint = endpoint  # as a manager holds its endpoint: a cycle only the collector frees
    del endpoint
    gc.collect()
    assert _until(lambda: proc.poll() is not None, 10.0), "the child outlived its dropped manager"
    assert proc.returncode == 0


def test_the_child_runs_isolated_from_the_ranks_directory_and_secrets(tmp_path, monkeypatch):
    # a rank started from a directory holding a uvicorn.py (was: imported by the child, which ran
    # `python -m` there), with secrets in its environment (was: all handed to the child)
    marker = tmp_path / "imported"
    (tmp_path / "uvicorn.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PDSTATE_AUTH__TOKEN", TOKEN.decode())
    monkeypatch.setenv("HF_TOKEN", "hf-secret-of-the-rank")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([".", os.environ.get("PYTHONPATH", "")]))
    endpoint = None
    try:
        endpoint = RankEndpoint(RankLike(), "127.0.0.1", 0, TOKEN)
        pid = endpoint.child.proc.pid
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        cwd = os.readlink(f"/proc/{pid}/cwd")
        auth = {"Authorization": f"Bearer {TOKEN.decode()}"}
        with httpx.Client(base_url=endpoint.url, timeout=10) as child:
            assert child.get("/healthz").status_code == 200
            assert b'"incarnation":"i-1"' in child.get("/v1/compat", headers=auth).content  # it has the token
    finally:
        if endpoint is not None:
            endpoint.close()
    assert not marker.exists(), "the child imported the rank directory's uvicorn.py"
    assert cwd == "/"
    assert not {k for k in env if k.startswith(b"PDSTATE_") or k in (b"HF_TOKEN", b"PYTHONPATH")}, env
    assert TOKEN not in cmdline and b"hf-secret" not in cmdline and b"-I\0" in cmdline


def test_the_child_drops_a_request_head_that_never_ends(served):
    # bounded as serve's HTTP (tests/security/test_exhaustion.py): was held as long as the client liked
    from pdstate.status.connections import REQUEST_TIMEOUT_S

    _, endpoint = served
    host, port = endpoint.url.removeprefix("http://").rsplit(":", 1)
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=REQUEST_TIMEOUT_S * 3) as slow:
        slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        assert httpx.get(f"{endpoint.url}/healthz", timeout=10).status_code == 200
        try:
            assert slow.recv(1) == b""
        except ConnectionResetError:
            pass
    assert REQUEST_TIMEOUT_S - 1 < time.monotonic() - t0 < REQUEST_TIMEOUT_S * 3
