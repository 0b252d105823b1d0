"""The HTTP app over a fake status source (no worker, no sockets): shapes, status codes, auth, metrics."""

from __future__ import annotations

import warnings

import pytest

with warnings.catch_warnings():  # starlette nags about httpx vs httpx2 on import; not our concern
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from pdstate.protocol.report import ErrorInfo
from pdstate.protocol.wire import PROTOCOL_VERSION
from pdstate.status.api import Readiness, create_app, route_paths
from tests.support.api_source import API_PATHS, SHM_TRANSPORT, FakeSource
from tests.support.pools import tiny
from tests.support.upstream import MAPPING_ERROR, MAPPING_FIX


@pytest.fixture(scope="module")
def good_report():
    return tiny()


@pytest.fixture(scope="module")
def own_report():
    return tiny(draft_mapping="own")


def client(source, token=None):
    return TestClient(create_app(source, token=token))


def test_health_and_ready(good_report):
    src = FakeSource("prefill", good_report)
    c = client(src)
    assert c.get("/healthz").json() == {"status": "ok"}
    assert c.get("/readyz").json() == {
        "ready": True,
        "reason": None,
        "check": None,
        "error": None,
        "transport": SHM_TRANSPORT,
    }
    err = ErrorInfo(type="SWAIndexMappingNotShared", message=MAPPING_ERROR)
    src.ready = Readiness(False, MAPPING_ERROR, "handshake", err)
    r = c.get("/readyz")
    assert r.status_code == 503
    assert r.json() == {
        "ready": False,
        "reason": MAPPING_ERROR,
        "check": "handshake",
        "error": {**err.model_dump(), "fix": MAPPING_FIX},
        "transport": SHM_TRANSPORT,
    }


def test_compat_document(own_report):
    src = FakeSource(
        "decode",
        own_report,
        peer_list=[
            {
                "id": "tcp://p:5601",
                "state": "rejected",
                "error": {"type": "SWAIndexMappingNotShared", "message": MAPPING_ERROR, "fix": MAPPING_FIX},
            }
        ],
    )
    doc = client(src).get("/v1/compat").json()
    assert doc["role"] == "decode" and doc["protocol_version"] == PROTOCOL_VERSION
    assert doc["fingerprint"] == own_report.fingerprint
    assert doc["transport"] == SHM_TRANSPORT
    assert doc["layout"]["page_size"] == 256 and doc["layout"]["kv_dtype"] == "float8_e4m3fn"
    assert list(doc["layout"])[2:] == [n for n, _ in own_report.factors]
    assert doc["local_check"] == {
        "ok": False,
        "error": {"type": "SWAIndexMappingNotShared", "message": MAPPING_ERROR, "fix": MAPPING_FIX},
    }
    assert doc["peers"][0]["state"] == "rejected" and doc["peers"][0]["error"]["message"] == MAPPING_ERROR
    assert doc["report"]["fingerprint"] == own_report.fingerprint


def test_compat_check(good_report, own_report):
    prefill = client(FakeSource("prefill", good_report))
    good = client(FakeSource("decode", good_report)).get("/v1/compat").json()
    own = client(FakeSource("decode", own_report)).get("/v1/compat").json()
    assert prefill.post("/v1/compat/check", json=good).json()["compatible"] is True
    v = prefill.post("/v1/compat/check", json=own).json()
    assert v["compatible"] is False and v["errors"][0] == {
        "type": "SWAIndexMappingNotShared",
        "message": MAPPING_ERROR,
        "fix": MAPPING_FIX,
    }
    other = dict(good, engine="mooncake", protocol_version=PROTOCOL_VERSION + 1)
    types = [e["type"] for e in prefill.post("/v1/compat/check", json=other).json()["errors"]]
    assert types == ["VersionMismatch", "EngineError"]
    msgs = [e["message"] for e in prefill.post("/v1/compat/check", json=other).json()["errors"]]
    assert msgs[1] == "transfer engine mismatch: prefill server uses 'shm', but decode server uses 'mooncake'"
    unified = client(FakeSource("decode", tiny(unified_kv=True))).get("/v1/compat").json()
    e = prefill.post("/v1/compat/check", json=unified).json()["errors"][0]
    assert e["type"] == "LayoutMismatch" and e["message"].startswith(
        "DSV4 layout mismatch on layout: prefill server has layout='paged', but decode server has layout='unified'."
    )


def test_transfers_and_auth(good_report):
    src = FakeSource("decode", good_report)
    c = client(src, token=b"tok")
    assert c.post("/v1/transfers", json={"tokens": 5}).status_code == 401
    assert c.post("/v1/transfers", json={"tokens": 5}, headers={"Authorization": "Bearer tok2"}).status_code == 401
    assert c.post("/v1/transfers", json={"tokens": 5}, headers={"Authorization": "Basic tok"}).status_code == 401
    assert c.post("/v1/handshake").status_code == 401
    h = {"Authorization": "Bearer tok"}
    r = c.post("/v1/transfers", json={"tokens": 5, "room": 11}, headers=h)
    assert r.status_code == 200 and r.json()["room"] == 11 and r.json()["status"] == "success"
    assert c.get("/v1/transfers/11").json() == r.json()
    assert c.get("/v1/transfers/12").status_code == 404
    assert c.post("/v1/transfers", json={"tokens": 5, "room": 11}, headers=h).status_code == 409
    assert c.post("/v1/transfers", json={"tokens": 5, "room": -1}, headers=h).status_code == 422
    assert c.post("/v1/transfers", json={"tokens": 5, "extra": 1}, headers=h).status_code == 422
    assert c.post("/v1/handshake", headers=h).status_code == 202 and src.reregistered == 1
    src.ready = Readiness(False, "waiting", "peer")
    r = c.post("/v1/transfers", json={"tokens": 5}, headers=h)
    assert r.status_code == 503 and r.json()["detail"] == "waiting"
    # without a configured token the endpoints are open
    src.ready = Readiness(True)
    assert client(src).post("/v1/transfers", json={"tokens": 5}).status_code == 200


def test_transfers_name_their_prefill(good_report):
    src = FakeSource("decode", good_report)
    c = client(src)
    other = "tcp://10.0.0.2:5601"
    assert c.post("/v1/transfers", json={"tokens": 5}).status_code == 200
    assert c.post("/v1/transfers", json={"tokens": 5, "prefill": other}).status_code == 200
    assert src.named == [{}, {"prefill": other}]  # a source is asked for a prefill only when one is named
    for bad in ("tcp://10.0.0.2", "ipc:///tmp/x", "tcp://10.0.0.2:5601/x", "", 1):
        assert c.post("/v1/transfers", json={"tokens": 5, "prefill": bad}).status_code == 422, bad
    # the default prefill not (yet) accepting this decode: its requests wait, another's go on
    src.ready = Readiness(False, "waiting for the prefill", "peer")
    for body in ({"tokens": 5}, {"tokens": 5, "prefill": src.control}):
        r = c.post("/v1/transfers", json=body)
        assert r.status_code == 503 and r.json()["detail"] == "waiting for the prefill"
    assert c.post("/v1/transfers", json={"tokens": 5, "prefill": other}).status_code == 200
    # a decode that cannot serve at all refuses every request
    for check in ("local_check", "threads", "shutdown"):
        src.ready = Readiness(False, f"not ready: {check}", check)
        r = c.post("/v1/transfers", json={"tokens": 5, "prefill": other})
        assert r.status_code == 503 and r.json()["detail"] == f"not ready: {check}"
    assert len(src.named) == 3


def test_prefill_has_no_transfers(good_report):
    c = client(FakeSource("prefill", good_report))
    assert c.post("/v1/transfers", json={"tokens": 5}).status_code == 409
    assert c.get("/v1/transfers/1").status_code == 409
    assert c.post("/v1/handshake").status_code == 409


def test_metrics_are_per_app(good_report):
    a, b = FakeSource("decode", good_report), FakeSource("decode", good_report)
    ca, cb = client(a), client(b)
    a.stats.waiting_refused = 2  # a prefill's count (``PrefillAgent.waiting_refused``)
    for _ in range(3):
        ca.post("/v1/transfers", json={"tokens": 4, "room": _})
    ta, tb = ca.get("/metrics").text, cb.get("/metrics").text
    assert 'pdstate_transfers_total{outcome="success"} 3.0' in ta
    assert 'pdstate_transfers_total{outcome="success"} 0.0' in tb
    assert "pdstate_transfer_bytes_total 120.0" in ta
    assert 'pdstate_transfer_latency_seconds_bucket{le="0.01"} 3.0' in ta
    assert "pdstate_transfer_latency_seconds_count 3.0" in ta
    # histogram stays cumulative across scrapes
    ca.post("/v1/transfers", json={"tokens": 4, "room": 99})
    assert "pdstate_transfer_latency_seconds_count 4.0" in ca.get("/metrics").text
    for name in (
        "pdstate_handshakes_total",
        "pdstate_transfers_in_flight",
        "pdstate_engine_errors_total",
        "pdstate_protocol_errors_total",
        "pdstate_ready 1.0",
        "pdstate_worker_info",
        "pdstate_waiting_refused_total 2.0",
    ):
        assert name in ta


def test_openapi(good_report):
    c = client(FakeSource("decode", good_report))
    assert c.get("/docs").status_code == 200
    schema = c.get("/openapi.json").json()
    assert API_PATHS <= set(schema["paths"])
    assert "CompatDocument" in schema["components"]["schemas"]
    assert route_paths(create_app(None)) >= {"/healthz", "/readyz"}
