"""HTTP bodies are bounded on every route (413), and ``POST /v1/compat/check`` validates its
input and echoes nothing arbitrary of it.

The app runs over a small fake status source, through Starlette's TestClient and through a real
uvicorn server on a loopback socket (raw sockets there: a client that announces 50 MB, and one
that streams a chunked body without announcing its length).
"""

from __future__ import annotations

import copy
import json
import socket
import threading
import time
import warnings

import pytest

from pdstate.pools.presets import build_worker_pools, preset
from pdstate.pools.reporting import build_report
from pdstate.status.api import MAX_BODY_BYTES, MAX_COMPAT_BODY_BYTES, create_app
from tests.support.api_source import FakeSource
from tests.support.bounds import within

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

TOKEN = b"limits-token-5e2b"
MARK = "<<pdstate-echo-7c1f>>"  # not a word: must never come back
# An answer that does not wait for a body (a 413, /healthz beside a cut stream) comes within ANSWER_S
# (tests.support.bounds; ANSWER_QUIET_S measured on a quiet machine); one that waited would take
# the client's 5 s socket timeout
ANSWER_S, ANSWER_QUIET_S = 2.0, 0.05


def _report(**changes):
    pools = build_worker_pools(preset("tiny").with_(**changes))
    try:
        return build_report(pools.target, pools.draft)[0]
    finally:
        pools.close()


@pytest.fixture(scope="module")
def report():
    return _report()


@pytest.fixture(scope="module")
def prefill(report):
    return TestClient(create_app(FakeSource("prefill", report), token=TOKEN), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def decode_doc(report):
    peers = [{"id": "tcp://127.0.0.1:5601", "state": "accepted", "error": None, "incarnation": "ab" * 8}]
    c = TestClient(create_app(FakeSource("decode", report, peer_list=peers)))
    return c.get("/v1/compat").json()


ROUTES = [
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/v1/compat"),
    ("POST", "/v1/compat/check"),
    ("POST", "/v1/transfers"),
    ("GET", "/v1/transfers/1"),
    ("POST", "/v1/handshake"),
    ("GET", "/v1/requests"),
    ("GET", "/v1/requests/1"),
    ("POST", "/v1/requests/1/steps"),
    ("DELETE", "/v1/requests/1"),
    ("POST", "/v1/migrations"),
    ("GET", "/v1/migrations/1"),
    ("POST", "/v1/migrations/incoming"),
    ("POST", "/v1/drain"),
    ("GET", "/metrics"),
    ("GET", "/no/such/route"),
]


def _limit(path: str) -> int:
    return MAX_COMPAT_BODY_BYTES if path == "/v1/compat/check" else MAX_BODY_BYTES


def test_limits_are_what_the_documents_need(decode_doc, report):
    # a real document is a few KiB (dsv4-flash ~4 KiB, +~100 bytes per listed peer): the compat
    # limit leaves room for thousands of peers, the others for any request this API takes
    assert len(json.dumps(decode_doc)) < 8 << 10
    assert MAX_BODY_BYTES == 64 << 10 and MAX_COMPAT_BODY_BYTES == 1 << 20


def test_every_route_refuses_a_body_over_its_limit(prefill):
    app_routes = {(m, r.path) for r in prefill.app.routes for m in getattr(r, "methods", None) or ()}
    templated = {
        (m, p.replace("/transfers/1", "/transfers/{room}").replace("/requests/1", "/requests/{room}"))
        for m, p in ROUTES
    } | {("GET", "/v1/migrations/{mid}")}
    assert {(m, p) for m, p in app_routes if m != "HEAD" and not p.startswith(("/docs", "/openapi", "/redoc"))} <= (
        templated
    ), "a new route: add it to ROUTES"
    for method, path in ROUTES:
        limit = _limit(path)
        r = prefill.request(method, path, content=b"{" + b" " * limit, headers={"Content-Type": "application/json"})
        assert r.status_code == 413, (method, path, r.status_code)
        assert r.json() == {"detail": f"request body larger than {limit} bytes"}
        # at the limit: the route's usual answer (never 413)
        r = prefill.request(method, path, content=b" " * limit, headers={"Content-Type": "application/json"})
        assert r.status_code != 413, (method, path)


def test_a_chunked_body_is_counted_while_it_streams(prefill):
    def chunks(total: int, size: int = 8192):
        sent = 0
        while sent < total:
            n = min(size, total - sent)
            sent += n
            yield b" " * n

    for method, path in (("POST", "/v1/transfers"), ("POST", "/v1/compat/check"), ("GET", "/healthz")):
        limit = _limit(path)
        r = prefill.request(method, path, content=chunks(limit + 1))
        assert "content-length" not in r.request.headers  # chunked: no length announced
        assert r.status_code == 413, (method, path, r.status_code)
    ok = prefill.request(
        "POST", "/v1/transfers", content=chunks(20), headers={"Authorization": f"Bearer {TOKEN.decode()}"}
    )
    assert ok.status_code == 422  # 20 spaces: read in full, then refused as invalid JSON, not as too large


def test_a_real_document_fits_even_with_thousands_of_peers(prefill, decode_doc):
    doc = copy.deepcopy(decode_doc)
    doc["peers"] = [{"id": f"decode-{i:05d}", "state": "accepted", "incarnation": "cd" * 8} for i in range(8000)]
    body = json.dumps(doc).encode()
    assert MAX_BODY_BYTES < len(body) < MAX_COMPAT_BODY_BYTES
    r = prefill.post("/v1/compat/check", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["compatible"] is True, r.text


# --- /v1/compat/check: bounded, validated, no echo -------------------------------------------


def _leaves(node, path=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _leaves(v, (*path, i))
    else:
        yield path


def _replace(doc, path, value):
    out = copy.deepcopy(doc)
    node = out
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return out


def test_no_posted_text_comes_back(prefill, decode_doc):
    """Every leaf of a real document, replaced by a marker, a long word, a huge number and a deep
    structure: the answer is 200 or 422 and never contains what was posted."""
    hostile = [MARK, "A" * 5000, 10**40, [[[[[[[["deep"]]]]]]]], {MARK: 1}, 1.5e308]
    paths = list(_leaves(decode_doc))
    assert len(paths) > 40
    statuses: dict[int, int] = {}
    for path in paths:
        for value in hostile:
            r = prefill.post("/v1/compat/check", json=_replace(decode_doc, path, value))
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code in (200, 422), (path, value, r.status_code, r.text[:300])
            assert MARK not in r.text and "A" * 100 not in r.text and "1" * 40 not in r.text, (path, r.text[:500])
    assert statuses.get(422, 0) > len(paths)  # most of them are refused outright
    # a layout key is input too: a 422 names it as <key>, not by its text
    r = prefill.post("/v1/compat/check", json=_replace(decode_doc, ("layout",), {MARK: 1}))
    assert r.status_code == 422 and MARK not in r.text


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("engine",), "<script>"),
        (("fingerprint",), "not-a-fingerprint"),
        (("report", "fingerprint"), "f" * 31),
        (("report", "kv_dtype"), "float8\nX-Injected: 1"),
        (("report", "page_size"), 1 << 70),
        (("report", "factors", 0, 0), "not_a_factor"),
        (("protocol_version",), -1),
        (("worker_id",), "w" * 257),
        (("local_check", "error"), {"type": "X", "message": "m" * 5000}),
    ],
)
def test_out_of_bounds_fields_are_422(prefill, decode_doc, path, value):
    r = prefill.post("/v1/compat/check", json=_replace(decode_doc, path, value))
    assert r.status_code == 422, r.text
    posted = value if isinstance(value, str) else json.dumps(value)
    assert posted[:20] not in r.text, r.text  # named by location, never quoted


def test_duplicate_factor_is_422(prefill, decode_doc):
    doc = copy.deepcopy(decode_doc)
    doc["report"]["factors"].append(doc["report"]["factors"][0])
    assert prefill.post("/v1/compat/check", json=doc).status_code == 422


def test_a_real_difference_is_still_explained(prefill, decode_doc):
    # values that look like a worker's are quoted, as the handshake would
    doc = copy.deepcopy(decode_doc)
    doc["report"]["kv_dtype"] = "bfloat16"
    doc["engine"] = "mooncake"
    v = prefill.post("/v1/compat/check", json=doc).json()
    assert v["compatible"] is False
    assert [e["type"] for e in v["errors"]] == ["EngineError", "KVCacheDtypeMismatch"]
    assert "'bfloat16'" in v["errors"][1]["message"] or "bfloat16" in v["errors"][1]["message"]
    assert v["theirs"] == decode_doc["fingerprint"]


# --- a real server --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(report):
    import uvicorn

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    app = create_app(FakeSource("decode", report), token=TOKEN)
    srv = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="off"))
    t = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.started
    yield sock.getsockname()[:2]
    srv.should_exit = True
    t.join(10)
    sock.close()


def _response(s: socket.socket, timeout_s: float = 5.0) -> bytes:
    s.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next(
        (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0
    )
    while len(rest) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        rest += chunk
    return head + b"\r\n\r\n" + rest


def _healthz_s(addr) -> float:
    t0 = time.perf_counter()
    with socket.create_connection(addr, timeout=5) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert _response(s).startswith(b"HTTP/1.1 200")
    return time.perf_counter() - t0


def test_a_50_mb_announcement_is_refused_before_the_body(server):
    with socket.create_connection(server, timeout=5) as s:
        t0 = time.perf_counter()
        s.sendall(
            b"POST /v1/compat/check HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 52428800\r\n\r\n"
        )
        resp = _response(s)  # not one byte of the body was sent
        took = time.perf_counter() - t0
        assert resp.startswith(b"HTTP/1.1 413"), resp[:200]
        assert b"connection: close" in resp.lower()
        assert json.loads(resp.split(b"\r\n\r\n", 1)[1]) == {"detail": f"request body larger than {1 << 20} bytes"}
        within("a 413 for a 50 MB announcement", took, ANSWER_S, ANSWER_QUIET_S)
        s.settimeout(5)
        assert s.recv(1) == b""  # the server closed the connection: the body is never read
    within("/healthz after a refused body", _healthz_s(server), ANSWER_S, ANSWER_QUIET_S)


def test_a_chunked_stream_is_cut_at_the_limit_and_healthz_stays_fast(server):
    with socket.create_connection(server, timeout=5) as s:
        s.sendall(b"POST /v1/transfers HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"2000\r\n" + b" " * 0x2000 + b"\r\n"  # 8 KiB chunks, up to 50 MB
        sent, resp = 0, b""
        s.setblocking(False)
        deadline = time.monotonic() + 10
        while sent < 50 << 20 and time.monotonic() < deadline:
            try:
                resp += s.recv(65536)
                if resp:
                    break
            except BlockingIOError:
                pass
            try:
                s.send(chunk)
                sent += 0x2000
            except BlockingIOError:
                time.sleep(0.001)
            except (BrokenPipeError, ConnectionResetError):
                break
        s.setblocking(True)
        if not resp:
            resp = _response(s)
        assert resp.startswith(b"HTTP/1.1 413"), resp[:200]
        assert sent < 50 << 20  # answered long before the stream ended
        within("/healthz after a cut stream", _healthz_s(server), ANSWER_S, ANSWER_QUIET_S)
