"""Decode -> decode migration of running requests between real ``pdstate serve`` processes.

One prefill and three decodes on 127.0.0.1 (ports 0, shm engine, pools with room for 16
requests) for the module: ``a`` and ``b`` alike but for their SGLang release (``b`` builds
0.5.19's pools: every migration between them is a cross-release pair), ``unlike`` without a NextN
draft (a layout the migration's handshake refuses). Requests are kept running (``hold``) and
advanced by synthetic decode steps, so what moves is post-landing state, not the prefill's. Each
side reads its own memory: ``GET /v1/requests/{room}`` answers the xxh3_128 of every item the
request holds (``synth.rows_digest``), and a target checks what landed against the room's content
at the request's decode step (``synth.verify_running``, ``full``).
"""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from tests.support.services import Services, ready, wait_for
from tests.support.waiting import wait_until

READY_S = 60.0
# room for the drain's 8 running requests beside the others (the same on every side)
POOL = ["pool.full_tokens=16384", "pool.swa_tokens=8192", "pool.max_num_reqs=16"]
# a listener beyond loopback that b may dial (migration.sources); nothing answers there
FAR = "tcp://10.255.255.1:5555"


@pytest.fixture(scope="module")
def cluster():
    with Services() as sv:
        _, control = sv.prefill(*POOL)
        decodes = {
            name: sv.start("decode", ["http.port=0", f"control.peer={control}", *POOL, *extra])
            for name, extra in (
                ("a", []),
                ("b", ["pool.upstream=0.5.19", f'migration.sources=["{FAR}"]']),
                ("unlike", ["draft.enabled=false"]),
            )
        }
        with httpx.Client(timeout=60) as http:
            for name in ("a", "b"):
                wait_for(lambda name=name: ready(http, decodes[name].url), READY_S, f"decode {name} ready")
            decodes["unlike"].wait_listening()
            yield sv, control, decodes, http


def _hold(http, url: str, room: int, tokens: int, steps: int) -> dict:
    r = http.post(f"{url}/v1/transfers", json={"tokens": tokens, "room": room, "hold": True, "steps": steps})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["status"], body["verified"], body["held"], body["step"]) == ("success", True, True, steps)
    return body


def _row(http, url: str, room: int) -> dict:
    r = http.get(f"{url}/v1/requests/{room}")
    assert r.status_code == 200, r.text
    return r.json()


def _rooms(http, url: str) -> set[int]:
    return {r["room"] for r in http.get(f"{url}/v1/requests").json()}


def _peers(http, url: str) -> set[str]:
    return {p["id"] for p in http.get(f"{url}/v1/compat").json()["peers"]}


def _metric(http, url: str, line: str) -> float:
    for got in http.get(f"{url}/metrics").text.splitlines():
        if got.startswith(line + " "):
            return float(got.split()[-1])
    raise AssertionError(f"no {line} in /metrics")


def test_a_migrated_request_runs_on_the_target_byte_equal(cluster):
    _, _, d, http = cluster
    a, b = d["a"].url, d["b"].url
    moved_before = _metric(http, a, 'pdstate_migrations_total{outcome="success"}')
    _hold(http, a, 101, 700, 3)
    stepped = http.post(f"{a}/v1/requests/101/steps", json={"steps": 2}).json()
    assert stepped["step"] == 5
    before = _row(http, a, 101)

    r = http.post(f"{a}/v1/migrations", json={"room": 101, "to": b})
    assert r.status_code == 200, r.text
    m = r.json()
    assert (m["status"], m["room"], m["step"], m["seq_len"]) == ("success", 101, 5, 700)
    assert m["bytes"] > 0 and m["downtime_s"] > 0
    after = _row(http, b, 101)
    assert (after["digest"], after["step"]) == (before["digest"], 5)  # the advanced state, byte for byte
    assert 101 not in _rooms(http, a)  # freed on the source once the target ran it
    assert http.get(f"{a}/v1/migrations/{m['id']}").json()["status"] == "success"
    assert _metric(http, a, 'pdstate_migrations_total{outcome="success"}') == moved_before + 1
    assert _metric(http, a, "pdstate_migration_downtime_seconds_count") >= 1

    # it runs on: a step on the target, then back to the source
    assert http.post(f"{b}/v1/requests/101/steps", json={"steps": 1}).json()["step"] == 6
    again = _row(http, b, 101)
    assert again["digest"] != after["digest"]
    r = http.post(f"{b}/v1/migrations", json={"room": 101, "to": a})
    assert r.status_code == 200, r.text
    assert _row(http, a, 101)["digest"] == again["digest"]
    assert http.delete(f"{a}/v1/requests/101").status_code == 200
    assert http.get(f"{a}/v1/requests/101").status_code == 404


def test_a_drain_of_8_running_requests_loses_none(cluster):
    _, _, d, http = cluster
    a, b = d["a"].url, d["b"].url
    rooms = list(range(200, 208))
    for i, room in enumerate(rooms):  # shorter than the window, pages +-1, several pages
        _hold(http, a, room, [100, 128, 255, 256, 257, 384, 700, 1000][i], i)
    before = {room: _row(http, a, room)["digest"] for room in rooms}

    r = http.post(f"{a}/v1/drain", json={"to": b})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["moved"], body["failed"]) == (8, 0), body
    assert sorted(m["room"] for m in body["migrations"]) == rooms
    assert not _rooms(http, a) & set(rooms)
    assert {room: _row(http, b, room)["digest"] for room in rooms} == before
    for room in rooms:
        assert http.delete(f"{b}/v1/requests/{room}").status_code == 200


def test_an_unlike_target_is_refused_on_both_sides(cluster):
    _, _, d, http = cluster
    a, unlike = d["a"].url, d["unlike"].url
    _hold(http, a, 301, 500, 2)
    before = _row(http, a, 301)

    r = http.post(f"{a}/v1/migrations", json={"room": 301, "to": unlike})
    assert r.status_code == 409, r.text
    m = r.json()
    assert (m["status"], m["refused"], m["error"]["type"]) == ("failed", True, "LayoutMismatch")
    assert "layout mismatch on draft" in m["error"]["message"]
    assert "the target refused it" in m["detail"]
    assert m["listener_error"]["type"] == "LayoutMismatch"  # the source's own handshake refused it
    target_side = http.get(f"{unlike}/v1/transfers/301").json()
    assert (target_side["status"], target_side["error"]["type"]) == ("failed", "LayoutMismatch")
    assert 301 not in _rooms(http, unlike)
    still = _row(http, a, 301)
    assert (still["digest"], still["step"], still["migrating"]) == (before["digest"], 2, False)
    assert http.post(f"{a}/v1/requests/301/steps", json={"steps": 1}).status_code == 200  # running again
    assert _metric(http, a, 'pdstate_migrations_total{outcome="refused"}') >= 1
    http.delete(f"{a}/v1/requests/301")


def test_a_target_killed_mid_migration_leaves_the_request_on_the_source(cluster):
    sv, control, d, http = cluster
    a, b = d["a"].url, d["b"].url
    victim = sv.start("decode", ["http.port=0", f"control.peer={control}", *POOL])
    wait_for(lambda: ready(http, victim.url), READY_S, "victim decode ready")
    _hold(http, a, 401, 900, 4)
    before = _row(http, a, 401)
    # the victim is a source first: b keeps the link to its listener while it serves
    _hold(http, victim.url, 402, 300, 1)
    assert http.post(f"{victim.url}/v1/migrations", json={"room": 402, "to": b}).status_code == 200
    listener = _row(http, b, 402)["source"]
    assert listener in _peers(http, b)

    os.kill(victim.pid, signal.SIGSTOP)  # it accepts the connection (the kernel's backlog), answers nothing
    r = http.post(f"{a}/v1/migrations", json={"room": 401, "to": victim.url, "wait": False})
    assert r.status_code == 202, r.text
    mid = r.json()["id"]
    assert http.get(f"{a}/v1/migrations/{mid}").json()["status"] == "moving"
    assert _row(http, a, 401)["migrating"] is True
    assert http.post(f"{a}/v1/requests/401/steps", json={"steps": 1}).status_code == 409  # paused
    os.kill(victim.pid, signal.SIGKILL)
    m = wait_until(
        "the migration to end",
        lambda: (x := http.get(f"{a}/v1/migrations/{mid}").json())["status"] != "moving" and x,
        30,
    )
    assert (m["status"], m["refused"], m["error"]["type"]) == ("failed", False, "PeerGone")
    still = _row(http, a, 401)
    assert (still["digest"], still["step"], still["migrating"]) == (before["digest"], 4, False)

    r = http.post(f"{a}/v1/migrations", json={"room": 401, "to": b})  # and it migrates again later
    assert r.status_code == 200, r.text
    assert _row(http, b, 401)["digest"] == before["digest"]
    http.delete(f"{b}/v1/requests/401")
    # the dead source's listener: b closes its link and does not dial it again
    wait_until("b to drop the dead listener", lambda: listener not in _peers(http, b), 30)
    assert _row(http, b, 402)["step"] == 1  # what came from it still runs
    http.delete(f"{b}/v1/requests/402")


def test_unknown_rooms_and_bad_targets_get_clear_errors(cluster):
    _, _, d, http = cluster
    a, b = d["a"].url, d["b"].url
    r = http.post(f"{a}/v1/migrations", json={"room": 999, "to": b})
    assert (r.status_code, r.json()["detail"]) == (404, "no running request in room 999")
    assert http.delete(f"{a}/v1/requests/999").status_code == 404
    assert http.get(f"{a}/v1/migrations/nope").status_code == 404
    hostile = "http://evil\n<script>" + "x" * 300
    for to in ["ftp://127.0.0.1:1", "http://user@127.0.0.1:1", "http://127.0.0.1:1/path", hostile, 7]:
        r = http.post(f"{a}/v1/migrations", json={"room": 1, "to": to})
        assert r.status_code == 422, (to, r.text)
        assert "evil" not in r.text and "<script>" not in r.text
    assert http.post(f"{a}/v1/migrations", json={"room": 1, "to": b, "x": 1}).status_code == 422
    # a target dials only a listener on its own host or one listed in its migration.sources: it
    # shows what it dials its memory (FAR is listed: an address on the list, not the one beside it)
    far = {"room": 1, "source": "tcp://10.255.255.1:5556", "tokens": 10}
    r = http.post(f"{b}/v1/migrations/incoming", json=far)
    assert (r.status_code, r.json()["detail"]) == (
        403,
        "migration source 'tcp://10.255.255.1:5556' is not a listener this decode may dial: a loopback "
        "address, or an exact entry of migration.sources (list the migrating decode's migration.advertise there)",
    )
    assert http.post(f"{a}/v1/migrations/incoming", json={**far, "source": FAR}).status_code == 403  # not a's
    assert http.post(f"{a}/v1/transfers", json={"tokens": 10, "steps": 2}).status_code == 422  # steps need hold
    # a transfer without hold keeps serve's behaviour: verified, freed, nothing running
    r = http.post(f"{a}/v1/transfers", json={"tokens": 300, "room": 501})
    assert (r.json()["status"], r.json()["held"]) == ("success", False)
    assert 501 not in _rooms(http, a)


def test_a_listener_on_another_address_and_a_listed_one_that_is_gone(cluster):
    """``migration.bind`` on 127.0.0.2 (all of 127/8 is lo on Linux): the target dials the bound
    address it is told. A listener advertised beyond loopback and listed in the target's
    ``migration.sources`` is dialled; when nothing answers there the request stays on its source."""
    sv, control, d, http = cluster
    b = d["b"].url
    # a short deadline for far's migration; heartbeats well inside the timeout (a busy host)
    timers = ["control.request_deadline_s=2", "control.heartbeat_interval_s=0.2", "control.peer_timeout_s=2"]
    alias = sv.start("decode", ["http.port=0", f"control.peer={control}", "migration.bind=tcp://127.0.0.2:0", *POOL])
    far = sv.start("decode", ["http.port=0", f"control.peer={control}", f"migration.advertise={FAR}", *POOL, *timers])
    for s in (alias, far):
        wait_for(lambda s=s: ready(http, s.url), READY_S, "decode ready")

    _hold(http, alias.url, 601, 600, 2)
    before = _row(http, alias.url, 601)
    r = http.post(f"{alias.url}/v1/migrations", json={"room": 601, "to": b})
    assert r.status_code == 200, r.text
    after = _row(http, b, 601)
    assert after["source"].startswith("tcp://127.0.0.2:")
    assert (after["digest"], after["step"]) == (before["digest"], 2)
    http.delete(f"{b}/v1/requests/601")

    _hold(http, far.url, 602, 600, 3)
    before = _row(http, far.url, 602)
    r = http.post(f"{far.url}/v1/migrations", json={"room": 602, "to": b})
    assert r.status_code == 502, r.text  # b took the address and dialled it: no answer in far's deadline
    m = r.json()
    assert (m["status"], m["refused"], m["error"]["type"]) == ("failed", False, "PeerGone")
    assert "it runs on this decode again" in m["detail"]
    still = _row(http, far.url, 602)
    assert (still["digest"], still["step"], still["migrating"]) == (before["digest"], 3, False)
    assert 602 not in _rooms(http, b)


def test_a_decode_step_rewrites_the_last_page_and_the_state_only():
    """In process, no server: what ``synth.advance`` writes, and that a target checking the
    wrong step (a stale state) fails."""
    import pdstate
    from pdstate.worker import requests as rq
    from pdstate.worker import synth

    pools = pdstate.build_worker_pools(pdstate.preset("tiny"))
    try:
        kv = pdstate.fill_kv_args(pools.target, pools.draft)
        lists = rq.allocate(pools, rq.channel_names(kv), 700).lists
        synth.fill_source(kv, 7, lists)
        pages = [lists[0][:-1]] + [lists[0][:0]] * (len(lists) - 1)
        kept, whole = synth.rows_digest(kv, pages), synth.rows_digest(kv, lists)
        synth.advance(kv, 7, 1, lists)
        synth.advance(kv, 7, 2, lists)
        assert synth.rows_digest(kv, pages) == kept  # every page but the last: as the prefill wrote it
        assert synth.rows_digest(kv, lists) != whole
        assert synth.verify_running(kv, 7, 2, lists, "full", pools.memory) is None
        for stale in (0, 1, 3):
            assert synth.verify_running(kv, 7, stale, lists, "full", pools.memory) is not None
        assert synth.verify_running(kv, 7, 2, lists, "sample", pools.memory) is None
        assert synth.verify_running(kv, 7, 1, lists, "sample", pools.memory) is not None
    finally:
        pools.close()
