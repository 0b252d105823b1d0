"""Before authentication, a worker stays serviceable under 1,500 slow HTTP connections and 1,500
idle TCP connections to its control port.

Real ``pdstate serve`` processes on 127.0.0.1, started with the descriptor soft limit many
containers and units give (1,024) under a higher hard limit. Each used to be exhausted by about
1,000 such connections: ``/healthz`` and transfers timed out for as long as they were held (an
HTTP connection that never finishes its headers was held forever; one to the control port 30 s).
"""

from __future__ import annotations

import errno
import resource
import selectors
import socket
import time

import httpx
import pytest

from pdstate.agent.admission import HANDSHAKE_IVL_MS
from pdstate.status.connections import REQUEST_TIMEOUT_S
from tests.support.bounds import within
from tests.support.services import Services, ready, wait_for
from tests.support.waiting import wait_until

CONNECTIONS = 1500
SOFT_NOFILE = 1024  # the soft default of many containers and systemd units
NEEDED_NOFILE = 2 * CONNECTIONS + 512  # this process's sockets, the workers' after raising
# Opening the connections and one transfer beside them took this long on a quiet machine; the
# workers' own bounds (they drop such connections then) must be far longer (tests.support.bounds)
SERVED_QUIET_S = 0.6

pytestmark = pytest.mark.skipif(
    resource.getrlimit(resource.RLIMIT_NOFILE)[1] < NEEDED_NOFILE,
    reason=f"needs a hard open-files limit of {NEEDED_NOFILE}",
)


def _low_soft_limit() -> None:  # in the worker's child, before exec
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (SOFT_NOFILE, hard))


@pytest.fixture(scope="module")
def pair():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * NEEDED_NOFILE)), hard))
    try:
        with httpx.Client(timeout=30.0) as http, Services() as services:
            prefill, ctl = services.prefill(preexec_fn=_low_soft_limit)
            decode = services.start("decode", ["http.port=0", f"control.peer={ctl}"], preexec_fn=_low_soft_limit)
            wait_for(lambda: ready(http, decode.url), 60, "the decode ready")
            yield prefill, ctl, decode
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _soft_nofile(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as f:
        line = next(line for line in f if line.startswith("Max open files"))
    return int(line.split()[3])


def _open(host: str, port: int, n: int, first: bytes) -> list[socket.socket]:
    """``n`` connections to ``host:port`` (non-blocking connects, all at once); each sends
    ``first`` and nothing more."""
    socks, sel = [], selectors.DefaultSelector()
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            socks.append(s)
            assert s.connect_ex((host, port)) in (0, errno.EINPROGRESS)
            sel.register(s, selectors.EVENT_WRITE)
        pending, deadline = set(socks), time.monotonic() + 20
        while pending and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=0.5):
                s = key.fileobj
                sel.unregister(s)
                pending.discard(s)
                assert s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
                if first:
                    s.send(first)
        assert not pending, f"{len(pending)} of {n} connections to {host}:{port} not established in 20 s"
        return socks
    except BaseException:
        for s in socks:
            s.close()
        raise
    finally:
        sel.close()


def _closed_by_peer(s: socket.socket) -> bool:
    try:
        while True:
            data = s.recv(65536, socket.MSG_DONTWAIT)
            if not data:
                return True
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def _serviceable(http: httpx.Client, prefill, decode) -> None:
    for url in (prefill.url, decode.url):
        r = http.get(f"{url}/healthz", timeout=5.0)
        assert r.status_code == 200, r.text
    r = http.post(f"{decode.url}/v1/transfers", json={"tokens": 300}, timeout=15.0)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success" and body["verified"], r.text


def test_slow_http_connections_neither_starve_the_worker_nor_stay(pair):
    prefill, _, decode = pair
    host, port = decode.url.removeprefix("http://").rsplit(":", 1)
    assert _soft_nofile(decode.pid) > SOFT_NOFILE  # raised to the hard limit at start
    with httpx.Client() as http:
        t0 = time.monotonic()
        slow = _open(host, int(port), CONNECTIONS, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        try:
            _serviceable(http, prefill, decode)  # while every one of them is held
            # else too slow to tell: the connections may be gone
            within(
                "served beside 1,500 slow HTTP connections", time.monotonic() - t0, REQUEST_TIMEOUT_S, SERVED_QUIET_S
            )
            # a connection that never finishes its request head is dropped (was: held forever)
            wait_until(
                "the slow connections dropped",
                lambda: sum(map(_closed_by_peer, slow)) == CONNECTIONS,
                REQUEST_TIMEOUT_S * 3,
                pause_s=0.5,
            )
        finally:
            for s in slow:
                s.close()
        _serviceable(http, prefill, decode)


def test_idle_tcp_connections_to_the_control_port_neither_starve_the_worker_nor_stay(pair):
    prefill, ctl, decode = pair
    host, port = ctl.removeprefix("tcp://").rsplit(":", 1)
    assert _soft_nofile(prefill.pid) > SOFT_NOFILE
    with httpx.Client() as http:
        t0 = time.monotonic()
        idle = _open(host, int(port), CONNECTIONS, b"")  # never a ZMTP greeting
        try:
            _serviceable(http, prefill, decode)
            # else too slow to tell: the connections may be gone
            ivl_s = HANDSHAKE_IVL_MS / 1000
            within("served beside 1,500 idle control connections", time.monotonic() - t0, ivl_s, SERVED_QUIET_S)
            # closed once ZeroMQ's handshake interval passes (was: its default, 30 s)
            wait_until(
                "the idle control connections closed",
                lambda: sum(map(_closed_by_peer, idle)) == CONNECTIONS,
                HANDSHAKE_IVL_MS / 1000 * 4,
                pause_s=0.5,
            )
        finally:
            for s in idle:
                s.close()
        _serviceable(http, prefill, decode)
