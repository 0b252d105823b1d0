"""A fake status source for the HTTP app (no worker, no sockets), and the routes it serves."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from pdstate.status.api import Readiness
from pdstate.worker.stats import Stats

# ``transport`` on /readyz and /v1/compat of a worker over shm: no native listener (no port)
SHM_TRANSPORT = {"engine": "shm", "configured": "shm", "in_use": "shm", "listening": [], "open": False, "problem": None}

# every route the app documents (``/openapi.json``)
API_PATHS = frozenset(
    {
        "/healthz",
        "/readyz",
        "/v1/compat",
        "/v1/compat/check",
        "/v1/transfers",
        "/v1/transfers/{room}",
        "/v1/handshake",
        "/metrics",
    }
)


@dataclass
class FakeSource:
    role: str
    report: object
    worker_id: str = "w-0"
    incarnation: str = "inc"
    engine: str = "shm"
    control: str = "tcp://127.0.0.1:5601"
    transport: dict = field(default_factory=lambda: dict(SHM_TRANSPORT))
    stats: Stats = field(default_factory=Stats)
    ready: Readiness = field(default_factory=lambda: Readiness(True))
    peer_list: list = field(default_factory=list)
    finished: dict = field(default_factory=dict)
    submitted: list = field(default_factory=list)
    named: list = field(default_factory=list)  # the keywords of each submit (``prefill`` when named)
    reregistered: int = 0

    def readiness(self):
        return self.ready

    def local_check(self):
        return self.report.local_check.ok, self.report.local_check.error

    def peers(self):
        return self.peer_list

    def in_flight(self):
        return 0

    def free_counts(self):
        return {"full_tokens": 1024}

    def result_timeout_s(self):
        return 5.0

    def submit(self, tokens, room, **named):
        self.named.append(named)
        room = 7 if room is None else room
        res = {
            "room": room,
            "status": "success",
            "seq_len": tokens,
            "bytes": tokens * 10,
            "descriptors": 3,
            "seconds": 0.01,
            "verified": True,
            "error": None,
        }
        self.finished[room] = res
        self.submitted.append((tokens, room))
        self.stats.transfers["success"] += 1
        self.stats.bytes += res["bytes"]
        self.stats.latencies_s.append(0.01)
        f: Future = Future()
        f.set_result(res)
        return f

    def lookup(self, room):
        return self.finished.get(room)

    def reregister(self):
        self.reregistered += 1
