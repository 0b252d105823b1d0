"""One decode, many prefills, chosen per request: ``POST /v1/transfers {"tokens", "prefill"}``.

Real ``pdstate serve`` processes on 127.0.0.1 (port 0): prefills A and B with the service file's
layout, prefill C with ``pool.page_size=512`` (the decode has 256, so C refuses it), and a decode
whose ``control.peer`` is A. The decode dials B and C on their first request; every request to A
and B is verified, every request to C fails with C's refusal, word for word, and nothing of C's
refusal or of B's freeze and death touches a request aimed at another prefill; B, restarted on its
address, and C, fixed and restarted, are shaken hands with again. ``/v1/compat`` lists every
prefill on the decode and the decode on each prefill. Every wait polls with a deadline.
"""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.services import Service, ready, wait_for

TOKEN = "many-prefills-token-1c9e"
SILENT = "tcp://127.0.0.1:1"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# b's silence is declared after GONE_S; a live prefill answers a heartbeat (every 0.2 s) well inside
# it on a busy host (a 1 s timeout declared a live prefill gone there: test_migration.py's far decode)
GONE_S = 2.0
TIMERS = ["control.heartbeat_interval_s=0.2", f"control.peer_timeout_s={GONE_S:g}", "control.request_deadline_s=8.0"]
MISSED = "missed heartbeats for 2 s"
PAGE_SIZE_ERROR = (
    "Page size mismatch: prefill server has page_size=512, but decode server has page_size=256. "
    "Both servers must use the same --page-size value."
)


def _prefill(extra: list[str] | None = None, bind: str = "tcp://127.0.0.1:0") -> Service:
    env = {"PDSTATE_AUTH__TOKEN": TOKEN}
    return Service("prefill", ["http.port=0", f"control.bind={bind}", *TIMERS, *(extra or [])], env)


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=30.0) as c:
        yield c


@pytest.fixture(scope="module")
def trio(http):
    """Prefills a, b (compatible) and c (page size 512), and a decode dialling a."""
    started: dict[str, Service] = {}
    try:
        for name, extra in (("a", []), ("b", []), ("c", ["pool.page_size=512"])):
            started[name] = _prefill(extra)
        ctl = {name: s.wait_listening()["control"] for name, s in started.items()}
        # the prefills a request may name, exactly (tcp://127.0.0.1:1: one where nothing answers)
        named = json.dumps([ctl["b"], ctl["c"], SILENT])
        # room for a request beside two a frozen prefill holds (quarantined until it is gone)
        room = ["pool.swa_tokens=2048", "pool.full_tokens=4096", "pool.max_num_reqs=8"]
        overrides = ["http.port=0", f"control.peer={ctl['a']}", f"control.prefills={named}", *room, *TIMERS]
        decode = Service("decode", overrides, {"PDSTATE_AUTH__TOKEN": TOKEN})
        started["decode"] = decode
        wait_for(lambda: ready(http, decode.url), 30, "decode ready with prefill a")
        yield {"services": started, "control": ctl}
    finally:
        for s in reversed(list(started.values())):
            s.stop()


def _post(http: httpx.Client, url: str, tokens: int, prefill: str | None = None) -> dict:
    body = {"tokens": tokens} if prefill is None else {"tokens": tokens, "prefill": prefill}
    r = http.post(f"{url}/v1/transfers", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def _metric(http: httpx.Client, url: str, line: str) -> float | None:
    for row in http.get(f"{url}/metrics").text.splitlines():
        if row.startswith(line + " "):
            return float(row.split()[-1])
    return None


def test_each_request_goes_to_the_prefill_it_names(trio, http):
    d = trio["services"]["decode"].url
    ctl = trio["control"]
    # a, then b and c named for the first time, interleaved and concurrent (tiny: 4 request slots)
    targets = [None, ctl["b"], ctl["c"], ctl["a"]] * 6
    lengths = [100, 300, 129, 1000, 0, 257]
    jobs = [(lengths[i % len(lengths)], t) for i, t in enumerate(targets)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda job: _post(http, d, *job), jobs))
    for (tokens, target), res in zip(jobs, results):
        assert res["seq_len"] == tokens and res["prefill"] == (target or ctl["a"])
        if target == ctl["c"]:
            assert res["status"] == "failed" and res["verified"] is False and res["bytes"] == 0
            # the refusal's own class and upstream's text, with the fix
            assert (res["error"]["type"], res["error"]["message"]) == ("PageSizeMismatch", PAGE_SIZE_ERROR)
            assert res["error"]["fix"].startswith("fix: Both servers must use the same --page-size value")
        else:
            assert res["status"] == "success" and res["verified"] is True and res["error"] is None, res
    # each prefill moved exactly the requests aimed at it
    for name, count in (("a", 12), ("b", 6)):
        url = trio["services"][name].url
        wait_for(lambda u=url, n=count: _metric(http, u, 'pdstate_transfers_total{outcome="success"}') == n, 10, name)
        assert _metric(http, url, 'pdstate_transfers_total{outcome="failed"}') == 0
    assert _metric(http, trio["services"]["c"].url, 'pdstate_transfers_total{outcome="success"}') == 0
    assert _metric(http, d, 'pdstate_transfers_total{outcome="success"}') == 18
    assert _metric(http, d, 'pdstate_transfers_total{outcome="failed"}') == 6
    # a finished record names its prefill
    assert http.get(f"{d}/v1/transfers/{results[1]['room']}").json() == results[1]


def test_compat_lists_every_prefill_and_every_decode(trio, http):
    svc, ctl = trio["services"], trio["control"]
    docs = {name: http.get(f"{s.url}/v1/compat", headers=AUTH).json() for name, s in svc.items()}
    dd = docs["decode"]
    ids = [p["id"] for p in dd["peers"]]
    assert ids[0] == ctl["a"] and sorted(ids[1:]) == sorted([ctl["b"], ctl["c"]])  # control.peer first
    by_id = {p["id"]: p for p in dd["peers"]}
    for name in ("a", "b"):
        assert by_id[ctl[name]] == {
            "id": ctl[name],
            "state": "accepted",
            "error": None,
            "incarnation": docs[name]["incarnation"],
            "fingerprint": docs[name]["fingerprint"],
            "factor": None,
            "transport": "shm",
        }
        mine = [p for p in docs[name]["peers"] if p["id"] == dd["worker_id"]]
        assert len(mine) == 1 and mine[0]["state"] == "accepted" and mine[0]["fingerprint"] == dd["fingerprint"]
    refused = by_id[ctl["c"]]
    assert refused["state"] == "rejected" and refused["fingerprint"] is None and refused["incarnation"] is None
    assert refused["error"]["type"] == "PageSizeMismatch" and refused["error"]["message"] == PAGE_SIZE_ERROR
    assert refused["factor"] == "PageSizeMismatch" and refused["transport"] is None
    assert docs["c"]["fingerprint"] != dd["fingerprint"]
    theirs = [p for p in docs["c"]["peers"] if p["id"] == dd["worker_id"]]
    assert len(theirs) == 1 and theirs[0]["state"] == "rejected" and theirs[0]["error"]["message"] == PAGE_SIZE_ERROR
    assert theirs[0]["fingerprint"] == dd["fingerprint"]
    # the decode stays ready: its control.peer accepted it
    assert ready(http, svc["decode"].url)["ready"] is True
    assert _metric(http, svc["decode"].url, 'pdstate_peers{state="accepted"}') == 2
    assert _metric(http, svc["decode"].url, 'pdstate_peers{state="rejected"}') == 1


def test_bad_and_silent_prefill_addresses(trio, http):
    d = trio["services"]["decode"].url
    for bad in ("http://127.0.0.1:1", "tcp://127.0.0.1", "tcp://a b:1", "tcp://" + "x" * 300 + ":1", 5601):
        r = http.post(f"{d}/v1/transfers", json={"tokens": 1, "prefill": bad}, headers=AUTH)
        assert r.status_code == 422, (bad, r.text)
    assert http.post(f"{d}/v1/transfers", json={"tokens": 1, "prefill": trio["control"]["b"]}).status_code == 401
    # nothing answers there: the request fails at its deadline (8 s), naming the silent prefill
    res = _post(http, d, 10, SILENT)
    assert res["status"] == "failed" and res["error"] == {
        "type": "TransferFailed",
        "message": f"deadline exceeded: no handshake answer from the prefill at {SILENT}",
        "fix": None,
    }
    assert _post(http, d, 10)["status"] == "success"  # and nothing else noticed


def test_a_killed_prefill_fails_only_its_requests_and_is_shaken_hands_with_again(trio, http):
    svc, ctl = trio["services"], trio["control"]
    d = svc["decode"].url
    old = http.get(f"{svc['b'].url}/v1/compat", headers=AUTH).json()["incarnation"]  # (the token reveals it)
    # b freezes with requests on their way to it: they fail with b's reason once b is silent for
    # the peer timeout (GONE_S); a's request, sent meanwhile, goes through
    os.kill(svc["b"].pid, signal.SIGSTOP)
    with ThreadPoolExecutor(3) as pool:
        to_b = [pool.submit(_post, http, d, 300, ctl["b"]) for _ in range(2)]
        to_a = pool.submit(_post, http, d, 300)
        assert to_a.result(20)["status"] == "success"
        for f in to_b:
            res = f.result(20)
            assert res["status"] == "failed" and res["prefill"] == ctl["b"]
            assert res["error"]["message"] == f"prefill {ctl['b']} {MISSED}"
    os.kill(svc["b"].pid, signal.SIGKILL)
    svc["b"].wait(10)
    peer = wait_for(
        lambda: [p for p in http.get(f"{d}/v1/compat").json()["peers"] if p["id"] == ctl["b"] and p["state"] == "gone"],
        10,
        "prefill b gone on the decode",
    )[0]
    assert peer["error"] == {
        "type": "PeerGone",
        "message": f"prefill {ctl['b']} {MISSED}",
        "fix": None,
    }
    res = _post(http, d, 300, ctl["b"])
    assert res["status"] == "failed" and res["error"]["message"] == f"prefill {ctl['b']} {MISSED}"
    for target in (None, ctl["a"]):
        assert _post(http, d, 300, target)["status"] == "success"
    assert ready(http, d)["ready"] is True
    # b comes back on the same address: the decode registers again and b's requests go through
    svc["b"] = _prefill(bind=ctl["b"])
    assert svc["b"].wait_listening()["control"] == ctl["b"]
    new = http.get(f"{svc['b'].url}/v1/compat", headers=AUTH).json()["incarnation"]
    assert new != old
    wait_for(lambda: _post(http, d, 300, ctl["b"])["status"] == "success", 20, "a transfer from the restarted b")
    peer = [p for p in http.get(f"{d}/v1/compat", headers=AUTH).json()["peers"] if p["id"] == ctl["b"]][0]
    assert peer["state"] == "accepted" and peer["incarnation"] == new and peer["error"] is None


def test_a_refused_prefill_fixed_and_restarted_is_asked_again(trio, http):
    svc, ctl = trio["services"], trio["control"]
    d = svc["decode"].url
    svc["c"].stop()
    svc["c"] = _prefill(bind=ctl["c"])  # the service file's page size this time
    assert svc["c"].wait_listening()["control"] == ctl["c"]
    # the refusal is older than the peer timeout (GONE_S) by the time a request names c again: the
    # decode registers anew instead of repeating the old refusal
    res = wait_for(lambda: (r := _post(http, d, 300, ctl["c"]))["status"] == "success" and r, 20, "c fixed")
    assert res["verified"] is True and res["prefill"] == ctl["c"]
    peer = [p for p in http.get(f"{d}/v1/compat").json()["peers"] if p["id"] == ctl["c"]][0]
    c_doc = http.get(f"{svc['c'].url}/v1/compat").json()
    assert peer["state"] == "accepted" and peer["error"] is None and peer["fingerprint"] == c_doc["fingerprint"]
