"""Security: authenticated control plane and mutating HTTP endpoints, loopback-only defaults,
owner-only shared memory that does not outlive its creator (even after a crash).

Already covered elsewhere (not repeated here): a decode registering without a tag or with a
wrong one hears nothing and registers nobody
(``tests/integration/test_handshake_processes.py::test_auth_token``); ``POST /v1/transfers`` and
``POST /v1/handshake`` answer 401 without the bearer token on a real ``pdstate serve``
(``tests/integration/test_services.py``). What this module adds: unauthenticated *mutating*
frames against a session that is running, every mutating HTTP route (a new one without auth
fails the test), the defaults, and the shared-memory lifecycle.
"""

from __future__ import annotations

import os
import secrets
import stat
import warnings

import pytest

from pdstate.pools.memory import SHM_DIR
from pdstate.protocol import wire
from pdstate.settings.config import load_config
from pdstate.status.api import create_app
from pdstate.worker.decode import AgentDecodeWorker
from pdstate.worker.options import WorkerOptions
from pdstate.worker.prefill import AgentPrefillWorker
from tests.support.faults import FAULT, holding_hooks, release_copies
from tests.support.hostile import HandshakeFailed, RawDealer
from tests.support.pools import ROOMY, TINY, report_of
from tests.support.summary import tally
from tests.support.waiting import wait_until
from tests.support.workers import (
    assert_all_verified,
    first_event,
    kill,
    options,
    run_batch,
    segments,
    served_pair,
    wait_accepted,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient


def test_unauthenticated_frames_cannot_touch_a_running_session():
    """A client without the token cannot join the control session: its CURVE handshake fails
    (``agent.curve``), nothing is delivered or answered. A peer of the session whose frames lack
    the right tag (the frame check behind it): each is answered ``AuthError`` and acted on by
    nobody. The held request ends verified, the decode stays the only peer."""
    token = b"reliability-secret"
    with served_pair(ROOMY, hooks=holding_hooks(), token=token, **FAULT) as (p, d):
        fut = d.submit(300, room=777)
        wait_until("room 777 in flight", lambda: p.in_flight() == 1, 5)
        outsider = RawDealer(p.endpoint, identity=b"mallory-" + secrets.token_hex(4).encode())
        try:
            with pytest.raises(HandshakeFailed, match="HANDSHAKE_FAILED_NO_DETAIL"):
                outsider.ask(wire.encode(wire.Abort(room=777, reason="mallory")))
        finally:
            outsider.close()
        attacker = RawDealer(p.endpoint, identity=b"mallory-" + secrets.token_hex(4).encode(), token=token)
        frames = [
            wire.encode(wire.Abort(room=777, reason="mallory")),  # no tag
            wire.encode(wire.Abort(room=777, reason="mallory"), b"guessed"),  # wrong tag
            wire.encode(wire.Heartbeat(worker_id=d.worker_id, incarnation=d.incarnation, seq=1)),
            wire.encode(
                wire.AgentRequest(
                    room=1, dst_kv_pages=wire.PackedIndices.pack([1]), dst_state_indices=[], deadline_s=1
                ),
                b"guessed",
            ),
        ]
        for f in frames:
            reply = attacker.ask(f, timeout_s=5)
            assert isinstance(reply, wire.Error) and reply.error.type == "AuthError", reply
        attacker.close()
        peers = p.status().peers
        assert [(x.id, x.state.value) for x in peers] == [(d.worker_id, "accepted")]
        release_copies(p)
        res = fut.result(60)
        assert res.status == "success" and res.verified  # the forged abort did nothing


class _Source:
    """Just enough of ``api.StatusSource`` for the routes to run."""

    role, worker_id, incarnation, engine, control = "decode", "w", "i", "shm", "tcp://127.0.0.1:1"

    def __init__(self) -> None:
        from concurrent.futures import Future

        from pdstate.worker.stats import Stats

        self.report = report_of(TINY)
        self.stats = Stats()
        self._future = Future
        self.reregistered = 0

    def readiness(self):
        from pdstate.status.api import Readiness

        return Readiness(True)

    def local_check(self):
        return True, None

    def peers(self):
        return []

    def in_flight(self):
        return 0

    def free_counts(self):
        return {}

    def result_timeout_s(self):
        return 5.0

    def submit(self, tokens, room, prefill=None, **running):
        f = self._future()
        f.set_result({"room": room or 1, "status": "success", "seq_len": tokens, "verified": True})
        return f

    def lookup(self, room):
        return None

    # running requests and migrations (decode)
    def _row(self, room, *_):
        f = self._future()
        f.set_result({"room": room, "seq_len": 1, "step": 0, "migrating": False, "source": "", "running_s": 0.0})
        return f

    row = advance = release = _row

    def migrate(self, room, to):
        from pdstate.worker.migrate import Migration

        m = Migration("m1", room, to, status="success")
        f = self._future()
        f.set_result(m)
        return m, f

    def drain_to(self, to):
        return []

    def reregister(self):
        self.reregistered += 1


OPEN_MUTATING = {"/v1/compat/check"}  # a pure function of the posted document (see api.py)


def test_every_mutating_http_route_needs_the_token():
    token = "http-secret"
    source = _Source()
    app = create_app(source, token=token.encode())
    client = TestClient(app)
    bodies = {
        "/v1/transfers": {"tokens": 10},
        "/v1/requests/{room}/steps": {"steps": 1},
        "/v1/migrations": {"room": 1, "to": "http://127.0.0.1:1"},
        "/v1/drain": {"to": "http://127.0.0.1:1"},
        "/v1/migrations/incoming": {"room": 1, "source": "tcp://127.0.0.1:1", "tokens": 10},
    }
    mutating = [
        (m, r.path)
        for r in app.routes
        for m in sorted(getattr(r, "methods", None) or ())
        if m in ("POST", "PUT", "PATCH", "DELETE") and r.path not in OPEN_MUTATING
    ]
    assert ("POST", "/v1/transfers") in mutating and ("POST", "/v1/handshake") in mutating
    for method, path in mutating:
        body = bodies.get(path)
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": f"Basic {token}"},
            {"Authorization": f"Bearer {token}x"},
        ):
            r = client.request(method, path, json=body, headers=headers)
            assert r.status_code == 401, (method, path, headers, r.status_code)
            assert r.headers.get("www-authenticate") == "Bearer"
        url = path.replace("{room}", "1")
        r = client.request(method, url, json=body, headers={"Authorization": f"Bearer {token}"})
        assert r.status_code in (200, 202), (method, path, r.status_code, r.text)
    assert source.reregistered == 1


def test_defaults_bind_to_loopback():
    opts = WorkerOptions(role="prefill", pool=TINY)
    assert opts.bind.startswith("tcp://127.0.0.1:")
    for role in ("prefill", "decode"):
        cfg = load_config(None, [f"role={role}"], environ={})
        assert cfg.control.bind.startswith("tcp://127.0.0.1:") and cfg.control.peer.startswith("tcp://127.0.0.1:")
        assert cfg.http.host == "127.0.0.1"
        assert cfg.transfer.mooncake.host == "127.0.0.1"
        assert WorkerOptions.from_config(cfg).bind == cfg.control.bind
        assert cfg.auth.secret() is None  # no token unless one is configured
    with AgentPrefillWorker(WorkerOptions(role="prefill", pool=TINY)) as p:
        assert p.endpoint.startswith("tcp://127.0.0.1:")


def _mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_shared_memory_owner_only_and_removed_on_exit():
    with AgentPrefillWorker(options("prefill", TINY, "shm", **FAULT)) as p:
        d = AgentDecodeWorker(options("decode", TINY, "shm", peer=p.endpoint, **FAULT)).start()
        try:
            wait_accepted(d)
            segs = [s.path for s in d.pools.memory.segments]
            assert segs and all(os.path.dirname(s) == str(SHM_DIR) for s in segs)
            for s in segs:
                assert _mode(s) == 0o600, (s, oct(_mode(s)))
                assert os.stat(s).st_uid == os.getuid()
        finally:
            d.stop()
        assert not [s for s in segs if os.path.exists(s)], "segments outlived their decode"


def test_crashed_decode_segments_are_swept_by_the_next_start(workers):
    # (Run serially, as the suite does: any other pdstate decode starting on this host meanwhile
    # would sweep the crashed one's segments first, which is the point, but not this assertion.)
    p, ep = workers.prefill(TINY, **FAULT)
    mine_before = segments(os.getpid())
    with AgentDecodeWorker(options("decode", TINY, "shm", peer=ep, **FAULT)):  # a live owner's segments stay
        live_segs = segments(os.getpid())
        assert len(live_segs) > len(mine_before)
        crashed = workers.decode(ep, TINY, worker_id="crash", **FAULT)
        assert first_event(crashed)["event"] == "ready"
        left = segments(crashed.pid)
        assert left and all(_mode(s) == 0o600 for s in left)
        kill(crashed)
        assert crashed.wait(10) < 0
        assert segments(crashed.pid) == left, "a SIGKILLed creator cannot remove its segments"
        nxt = workers.decode(ep, TINY, worker_id="next", **FAULT)
        ev = first_event(nxt)
        assert ev["event"] == "ready"
        assert segments(crashed.pid) == [], "the next decode's start must sweep the crashed one's segments"
        assert segments(os.getpid()) == live_segs, "a live process's segments must not be swept"
        results, _ = run_batch(nxt, [300])
        assert_all_verified(results, [300])
        assert nxt.close() == 0
        assert segments(nxt.pid) == [], "a decode that exits normally removes its segments"
    tally("shm segments after a crash", results, 0, None, f"{len(left)} stale segments swept at next start")
