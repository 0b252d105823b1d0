"""``pdstate probe`` over SGLang rank endpoints (``service.probe_ranks``): the matrix from both
sides' documents, its text, the exit status, and rank endpoints that do not answer.

The real ranks (SGLang's scheduler queues, both releases) are ``tests/sglang/test_rank_endpoints.py``;
here the documents are written out, and one real HTTP server (serve's app over a stand-in rank)
answers for the end-to-end command.
"""

from __future__ import annotations

import socket
import threading

import pytest

from pdstate import cli
from pdstate.errors import ExitCode
from pdstate.service.probe_ranks import cell, format_ranks, probe_ranks, rank_urls

MISMATCH = {
    "type": "LayoutMismatch",
    "message": "DSV4 layout mismatch on c4_ring: prefill server has c4_ring=16, but decode server has c4_ring=8. "
    "Both servers must build the same state layout.",
    "fix": "fix: the same speculative settings on both",
}


def rank(role: str, n: int, peers: list[dict], worker_id: str = "", control: str = "") -> dict:
    return {
        "url": f"http://10.0.0.{1 if role == 'prefill' else 2}:{30100 + n}",
        "role": role,
        "rank": n,
        "ready": {"ready": True},
        "compat": {
            "role": role, "worker_id": worker_id or f"{role}-{n}", "control": control, "fingerprint": "ab" * 16,
            "peers": peers, "engine": "mooncake",
            "transport": {"engine": "mooncake", "configured": "tcp", "in_use": "tcp", "listening": [], "open": False,
                          "problem": None},
            "rank": {"rank": n, "tp_rank": n, "tp_size": 2, "pp_rank": 0, "pp_size": 1, "dp_rank": 0,
                     "dp_size": 1, "sglang": "0.5.19", "http_port": 30100 + n},
        },
    }  # fmt: skip


def test_rank_urls():
    assert rank_urls("http://10.0.0.5:30100/", 3) == [
        "http://10.0.0.5:30100",
        "http://10.0.0.5:30101",
        "http://10.0.0.5:30102",
    ]
    assert rank_urls("http://[fd00::5]:30100", 2) == ["http://[fd00::5]:30100", "http://[fd00::5]:30101"]
    with pytest.raises(ValueError, match="needs its port"):
        rank_urls("http://10.0.0.5", 2)


def test_cells_read_both_sides():
    p0 = rank("prefill", 0, [{"id": "decode-0", "state": "accepted"}], control="tcp://10.0.0.1:41000")
    p1 = rank("prefill", 1, [], control="tcp://10.0.0.1:41001")
    d0 = rank("decode", 0, [{"id": "tcp://10.0.0.1:41000", "state": "accepted"}])
    refused = {"id": "tcp://10.0.0.1:41001", "state": "rejected", "error": MISMATCH, "factor": "c4_ring"}
    d1 = rank("decode", 1, [refused])
    assert cell(d0, p0) == {"state": "accepted"}
    assert cell(d0, p1) == {"state": "silent"}  # neither lists the other
    assert cell(d1, p1) == {"state": "rejected", "factor": "c4_ring", "error": MISMATCH}  # one side says so
    assert cell(d1, {"url": "x", "role": "prefill", "rank": 2, "unreachable": "refused"}) == {"state": "unreachable"}
    gone = rank("prefill", 1, [{"id": "decode-1", "state": "gone"}], control="tcp://10.0.0.1:41001")
    assert cell(rank("decode", 1, []), gone) == {"state": "gone"}


def test_matrix_text_and_verdict():
    p0 = rank("prefill", 0, [], control="tcp://10.0.0.1:41000")
    d0 = rank("decode", 0, [{"id": "tcp://10.0.0.1:41000", "state": "accepted"}])
    refused = {"id": "tcp://10.0.0.1:41000", "state": "rejected", "error": MISMATCH, "factor": "c4_ring"}
    d1 = rank("decode", 1, [refused])
    found = {"prefills": [p0], "decodes": [d0, d1], "unreachable": [], "matrix": [[cell(d0, p0)], [cell(d1, p0)]]}
    lines = format_ranks(found).splitlines()
    assert lines[0].startswith("prefill 0  http://10.0.0.1:30100  tp 0/2 pp 0/1 dp 0/1, sglang 0.5.19")
    assert lines[4:] == [
        "            prefill 0",
        "decode 0    accepted",
        "decode 1    refused (c4_ring)",
        "",
        f"decode 1 / prefill 0: LayoutMismatch: {MISMATCH['message']}",
        f"  {MISMATCH['fix']}",
        "NO accepted prefill and none ready to pair: decode 1",
        "FAILED: a rank unreachable, or a pair refused or mismatched (above)",
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Rank:
    """A stand-in SGLang rank for serve's app: a decode rank refused by a prefill at ``control``."""

    serves_transfers = False

    def __init__(self, report, control: str) -> None:
        from pdstate.status.models import Readiness
        from pdstate.worker.stats import Stats

        self.role, self.worker_id, self.incarnation, self.engine, self.control = "decode", "d0", "i", "mooncake", ""
        self.report, self.stats = report, Stats()
        self.transport = {"engine": "mooncake", "configured": "tcp", "in_use": "tcp", "listening": []}
        self.rank = {"rank": 0, "tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "http_port": 0}
        self._peers = [{"id": control, "state": "rejected", "error": {k: MISMATCH[k] for k in ("type", "message")}}]
        self._ready = Readiness(False, f"refused by the prefill at {control}: {MISMATCH['message']}", "handshake")

    def readiness(self):
        return self._ready

    def local_check(self):
        return True, None

    def peers(self):
        return self._peers

    def in_flight(self):
        return 0

    def free_counts(self):
        return {}


@pytest.fixture
def served_rank():
    import uvicorn

    from pdstate.status.api import create_app
    from tests.support.pools import tiny

    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(_Rank(tiny(), "tcp://10.0.0.1:41000")), port=port, log_config=None)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(500):
        if server.started:
            break
        threading.Event().wait(0.01)
    yield port
    server.should_exit = True
    thread.join(5)


def test_probe_command_over_a_refused_rank_and_a_silent_one(served_rank, capsys):
    down = _free_port()  # nothing listens there: a prefill rank that does not answer
    code = cli.main(["probe", "--prefill", f"http://127.0.0.1:{down}", "--decode", f"http://127.0.0.1:{served_rank}"])
    out = capsys.readouterr().out
    assert code == ExitCode.FAILED, out
    assert f"prefill 0  http://127.0.0.1:{down}  UNREACHABLE: GET http://127.0.0.1:{down}/readyz:" in out
    assert out.splitlines()[-3:] == [
        "decode 0    unreachable",
        "NO accepted prefill and none ready to pair: decode 0",
        "FAILED: a rank unreachable, or a pair refused or mismatched (above)",
    ]
    found = probe_ranks([f"http://127.0.0.1:{served_rank}"])
    assert found["ok"] is False and found["prefills"] == [] and found["matrix"] == [[]]
    (d,) = found["decodes"]
    assert d["compat"]["peers"][0]["factor"] == "c4_ring" and d["compat"]["transport"]["in_use"] == "tcp"
    assert d["ready"]["reason"] == f"refused by the prefill at tcp://10.0.0.1:41000: {MISMATCH['message']}"
    for argv in (["probe", "http://127.0.0.1:1", "--ranks", "http://127.0.0.1:2"], ["probe"]):
        with pytest.raises(SystemExit) as usage:
            cli.main(argv)
        assert usage.value.code == ExitCode.CONFIG
