"""End to end: both workers started as ``services/*/config.toml`` describe them, with ``pdstate serve``.

The only departures from the service files are ``--set`` overrides for ports (``http.port=0``, a
port-0 control bind whose real endpoint the prefill prints, and the decode's ``control.peer``
pointing at it) and the auth token, passed the way docker-compose and k8s pass it
(``PDSTATE_AUTH__TOKEN``). Every wait polls with a deadline; nothing sleeps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import httpx
import pytest

from pdstate.errors import ExitCode
from pdstate.protocol.wire import PROTOCOL_VERSION
from tests.support.api_source import API_PATHS, SHM_TRANSPORT
from tests.support.services import START_TIMEOUT_S, Service, ready, wait_for
from tests.support.services import serve_env as _env
from tests.support.upstream import MAPPING_ERROR, MAPPING_FIX
from tests.support.workers import pdstate_command, segments

TOKEN = "integration-token-7f3a"


@pytest.fixture(scope="module")
def cluster():
    """A prefill, a decode, a decode whose draft has its own mapping (checks.local=false), and a
    decode with that mapping and checks.local=true (it must exit)."""
    auth = {"PDSTATE_AUTH__TOKEN": TOKEN}
    started: list[Service] = []
    try:
        prefill = Service("prefill", ["http.port=0", "control.bind=tcp://127.0.0.1:0"], auth)
        started.append(prefill)
        control = prefill.wait_listening()["control"]
        assert control.startswith("tcp://127.0.0.1:") and not control.endswith(":0")
        peer = f"control.peer={control}"
        decode = Service("decode", ["http.port=0", peer], auth)
        own = Service("decode", ["http.port=0", peer, "draft.mapping=own", "checks.local=false"], auth)
        own_strict = Service("decode", ["http.port=0", peer, "draft.mapping=own"], auth)
        started += [decode, own, own_strict]
        for s in (decode, own):
            s.wait_listening()
        yield {"prefill": prefill, "decode": decode, "own": own, "own_strict": own_strict}
    finally:
        for s in reversed(started):
            s.stop()


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=30.0) as c:
        yield c


def test_healthz(cluster, http):
    for name in ("prefill", "decode", "own"):
        r = http.get(f"{cluster[name].url}/healthz")
        assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_listening_line(cluster):
    ev = cluster["decode"].wait_listening()
    assert ev["role"] == "decode" and ev["http"].startswith("http://127.0.0.1:") and ev["pid"] == cluster["decode"].pid
    assert cluster["prefill"].wait_listening()["control"] == ev["control"]


def test_readyz_and_compat(cluster, http):
    p, d = cluster["prefill"].url, cluster["decode"].url
    assert wait_for(lambda: ready(http, p), 20, "prefill ready") == {
        "ready": True,
        "reason": None,
        "check": None,
        "error": None,
        "transport": SHM_TRANSPORT,  # no native listener: shm has no port
    }
    assert wait_for(lambda: ready(http, d), 20, "decode ready")["ready"] is True
    bearer = {"Authorization": f"Bearer {TOKEN}"}  # incarnations only to a holder of the token
    pd, dd = http.get(f"{p}/v1/compat", headers=bearer).json(), http.get(f"{d}/v1/compat", headers=bearer).json()
    for url in (p, d):
        anonymous = http.get(f"{url}/v1/compat").json()
        assert anonymous["incarnation"] == "" and {x["incarnation"] for x in anonymous["peers"]} == {None}
    assert pd["role"] == "prefill" and dd["role"] == "decode"
    assert pd["protocol_version"] == dd["protocol_version"] == PROTOCOL_VERSION
    assert pd["fingerprint"] == dd["fingerprint"] == dd["report"]["fingerprint"]
    assert dd["layout"]["page_size"] == 256 and dd["layout"]["kv_dtype"] == "float8_e4m3fn"
    assert dd["layout"]["compression_ratios"] == [0, 4, 128] and dd["layout"]["layout"] == "paged"
    assert pd["local_check"] == dd["local_check"] == {"ok": True, "error": None}
    assert pd["engine"] == dd["engine"] == "shm" and pd["transport"] == dd["transport"] == SHM_TRANSPORT
    assert dd["peers"] == [
        {
            "id": cluster["prefill"].wait_listening()["control"],
            "state": "accepted",
            "error": None,
            "incarnation": pd["incarnation"],
            "fingerprint": pd["fingerprint"],
        }
    ]
    mine = [x for x in pd["peers"] if x["id"] == dd["worker_id"]]
    assert mine and mine[0]["state"] == "accepted" and mine[0]["incarnation"] == dd["incarnation"]
    assert mine[0]["fingerprint"] == dd["fingerprint"]


def test_compat_check(cluster, http):
    p, d, o = cluster["prefill"].url, cluster["decode"].url, cluster["own"].url
    pd, dd, od = (http.get(f"{u}/v1/compat").json() for u in (p, d, o))
    # compatible both ways
    for url, doc in ((p, dd), (d, pd)):
        v = http.post(f"{url}/v1/compat/check", json=doc).json()
        assert v == {"compatible": True, "errors": [], "ours": pd["fingerprint"], "theirs": pd["fingerprint"]}
    # the own-mapping decode: refused with the upstream sentence, from either side
    v = http.post(f"{p}/v1/compat/check", json=od).json()
    assert v["compatible"] is False
    assert v["errors"][0] == {"type": "SWAIndexMappingNotShared", "message": MAPPING_ERROR, "fix": MAPPING_FIX}
    v = http.post(f"{o}/v1/compat/check", json=pd).json()
    assert {"type": "SWAIndexMappingNotShared", "message": MAPPING_ERROR, "fix": MAPPING_FIX} in v["errors"]
    # a different page size: the upstream cross-side sentence, prefill's value first
    bad = json.loads(json.dumps(dd))
    bad["report"]["page_size"] = 64
    v = http.post(f"{p}/v1/compat/check", json=bad).json()
    assert v["compatible"] is False and v["errors"][0] == {
        "type": "PageSizeMismatch",
        "message": (
            "Page size mismatch: prefill server has page_size=256, but decode server has page_size=64. "
            "Both servers must use the same --page-size value."
        ),
        "fix": (
            "fix: Both servers must use the same --page-size value: in pdstate, set pool.page_size to one value "
            "in both workers' configs (prefill 256, decode 64)"
        ),
    }
    # two prefills do not pair; a malformed document is a 422
    v = http.post(f"{p}/v1/compat/check", json=pd).json()
    assert v["compatible"] is False and v["errors"][0]["type"] == "RoleMismatch"
    assert http.post(f"{p}/v1/compat/check", json={"role": "decode"}).status_code == 422


def test_transfers(cluster, http):
    p, d = cluster["prefill"].url, cluster["decode"].url
    wait_for(lambda: ready(http, d), 20, "decode ready")
    body = {"tokens": 300, "room": 4242}
    assert http.post(f"{d}/v1/transfers", json=body).status_code == 401
    assert http.post(f"{d}/v1/transfers", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
    auth = {"Authorization": f"Bearer {TOKEN}"}
    t0 = time.perf_counter()
    r = http.post(f"{d}/v1/transfers", json=body, headers=auth)
    http_s = time.perf_counter() - t0
    assert r.status_code == 200, r.text
    res = r.json()
    assert res["room"] == 4242 and res["status"] == "success" and res["verified"] is True and res["error"] is None
    assert res["seq_len"] == 300 and res["bytes"] > 0 and res["seconds"] > 0
    print(
        f"\ntransfer of 300 tokens via HTTP: {res['bytes']} B, worker {res['seconds'] * 1e3:.1f} ms, "
        f"HTTP round trip {http_s * 1e3:.1f} ms"
    )
    assert http.get(f"{d}/v1/transfers/4242").json() == res
    assert http.get(f"{d}/v1/transfers/4243").status_code == 404
    assert http.post(f"{d}/v1/transfers", json=body, headers=auth).status_code == 409  # room used
    r2 = http.post(f"{d}/v1/transfers", json={"tokens": 1000}, headers=auth).json()  # random room
    assert r2["status"] == "success" and r2["verified"] and r2["room"] != 4242
    r0 = http.post(f"{d}/v1/transfers", json={"tokens": 0}, headers=auth).json()  # an empty transfer
    assert r0["status"] == "success" and r0["verified"] and r0["bytes"] == 0 and r0["descriptors"] == 0
    assert r0["transfer_s"] > 0 and r0["copy_s"] >= 0
    assert http.post(f"{d}/v1/transfers", json={"tokens": -1}, headers=auth).status_code == 422
    assert http.post(f"{p}/v1/transfers", json=body, headers=auth).status_code == 409  # not on a prefill
    assert http.get(f"{p}/v1/transfers/4242").status_code == 409

    def metric(url: str, line: str) -> float | None:
        for row in http.get(f"{url}/metrics").text.splitlines():
            if row.startswith(line + " "):
                return float(row.split()[-1])
        return None

    # the prefill counts a transfer when the engine finished; the decode after verifying it
    for url in (d, p):
        wait_for(lambda: metric(url, 'pdstate_transfers_total{outcome="success"}') == 3, 10, f"{url} success count")
        assert metric(url, "pdstate_transfer_bytes_total") == res["bytes"] + r2["bytes"]  # (+0: the empty one)
        assert metric(url, "pdstate_transfer_latency_seconds_count") == 3
        assert metric(url, 'pdstate_transfers_total{outcome="failed"}') == 0
        assert metric(url, "pdstate_transfers_in_flight") == 0
        assert metric(url, "pdstate_engine_errors_total") == 0
        assert metric(url, 'pdstate_handshakes_total{outcome="accepted"}') >= 1
    assert metric(p, 'pdstate_handshakes_total{outcome="rejected"}') >= 1  # the own-mapping decode
    assert "text/plain" in http.get(f"{d}/metrics").headers["content-type"]


def test_own_mapping_decode_is_not_ready(cluster, http):
    o, p = cluster["own"].url, cluster["prefill"].url

    def refused():
        r = http.get(f"{o}/readyz")
        return r.status_code == 503 and r.json()

    body = wait_for(refused, 10, "own-mapping decode 503")
    assert body["ready"] is False and body["reason"] == MAPPING_ERROR
    assert body["error"] == {"type": "SWAIndexMappingNotShared", "message": MAPPING_ERROR, "fix": MAPPING_FIX}
    doc = http.get(f"{o}/v1/compat").json()
    assert doc["local_check"] == {
        "ok": False,
        "error": {"type": "SWAIndexMappingNotShared", "message": MAPPING_ERROR, "fix": MAPPING_FIX},
    }
    # the prefill refused it with the same class and text, and the decode recorded that refusal
    peer = wait_for(
        lambda: [x for x in http.get(f"{o}/v1/compat").json()["peers"] if x["state"] == "rejected"],
        10,
        "own-mapping decode rejected",
    )[0]
    assert peer["error"] == {"type": "SWAIndexMappingNotShared", "message": MAPPING_ERROR, "fix": MAPPING_FIX}
    theirs = [x for x in http.get(f"{p}/v1/compat").json()["peers"] if x["id"] == doc["worker_id"]]
    assert theirs and theirs[0]["state"] == "rejected" and theirs[0]["error"]["message"] == MAPPING_ERROR
    r = http.post(f"{o}/v1/transfers", json={"tokens": 10}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 503 and r.json()["detail"] == MAPPING_ERROR
    # asked to register again, it is refused again (and stays up, not ready)
    assert http.post(f"{o}/v1/handshake").status_code == 401
    assert http.post(f"{o}/v1/handshake", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 202
    wait_for(
        lambda: 'pdstate_handshakes_total{outcome="rejected"} 2.0' in http.get(f"{o}/metrics").text,
        10,
        "a second refusal",
    )
    assert http.get(f"{o}/readyz").json()["reason"] == MAPPING_ERROR


def test_own_mapping_with_local_check_exits(cluster):
    s = cluster["own_strict"]
    rc = s.wait(START_TIMEOUT_S)
    assert rc == ExitCode.LOCAL_CHECK
    assert MAPPING_ERROR in s.err()
    assert s.listening is None and s.events.get(timeout=5) is None  # never said "listening"
    assert segments(s.pid) == []  # what it built before the check failed was released


def test_probe_cli(cluster):
    d, p, o = cluster["decode"].url, cluster["prefill"].url, cluster["own"].url
    r = subprocess.run(pdstate_command() + ["probe", d, p], capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "pair: compatible" in r.stdout and "decode " in r.stdout and "prefill " in r.stdout
    r = subprocess.run(pdstate_command() + ["probe", o, p], capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode == ExitCode.FAILED
    assert f"NOT READY: {MAPPING_ERROR}" in r.stdout
    assert f"SWAIndexMappingNotShared: {MAPPING_ERROR}" in r.stdout and "pair: INCOMPATIBLE" in r.stdout
    r = subprocess.run(
        pdstate_command() + ["probe", "--json", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )
    assert r.returncode == ExitCode.FAILED and "unreachable" in json.loads(r.stdout)["workers"][0]


def test_openapi_docs(cluster, http):
    d = cluster["decode"].url
    assert http.get(f"{d}/docs").status_code == 200
    paths = http.get(f"{d}/openapi.json").json()["paths"]
    assert API_PATHS <= set(paths)


def test_sigterm_fails_in_flight_and_releases_shared_memory(cluster, http):
    prefill, decode, own = cluster["prefill"], cluster["decode"], cluster["own"]
    d = decode.url
    wait_for(lambda: ready(http, d), 20, "decode ready")
    assert segments(decode.pid), "the shm decode owns /dev/shm segments while it runs"
    os.kill(prefill.pid, signal.SIGSTOP)  # the prefill cannot answer: the next request stays in flight
    try:
        out: dict = {}

        def post():
            out["r"] = http.post(
                f"{d}/v1/transfers", json={"tokens": 200}, headers={"Authorization": f"Bearer {TOKEN}"}
            )

        t = threading.Thread(target=post)
        t.start()

        def in_flight():
            text = http.get(f"{d}/metrics").text
            return "pdstate_transfers_in_flight 1.0" in text

        wait_for(in_flight, 3, "a transfer in flight")
        decode.proc.send_signal(signal.SIGTERM)
        t.join(20)
        assert not t.is_alive()
        res = out["r"].json()
        assert out["r"].status_code == 200 and res["status"] == "failed"
        assert res["error"]["message"] == "decode shutting down"
        assert decode.wait(20) == 0, decode.err()[-2000:]
        assert decode.event("stopped", 5)["role"] == "decode"
        assert segments(decode.pid) == []
    finally:
        os.kill(prefill.pid, signal.SIGCONT)
    own.proc.send_signal(signal.SIGTERM)
    assert own.wait(20) == 0 and segments(own.pid) == []
    prefill.proc.send_signal(signal.SIGTERM)
    assert prefill.wait(20) == 0, prefill.err()[-2000:]
    print(
        f"\nserve startup to 'listening': prefill {prefill.startup_s:.2f} s "
        f"(self-reported {prefill.listening['startup_s']:.2f} s), decode {decode.startup_s:.2f} s"
    )
