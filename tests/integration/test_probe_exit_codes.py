"""``pdstate probe``'s exit status, one test per code, through the real command (a child process)
against real rank endpoints (``RankEndpoint``: the child an SGLang rank serves its HTTP from, over a
stand-in rank's status; 127.0.0.1, port 0):

- 0: a fresh, healthy prefill and decode of one layout before any request: "ready to pair";
- 1: the same pair with another layout ("mismatch" with the factor and the fix in SGLang's words),
  and a pair whose prefill rank does not answer (a closed port: bound, then closed);
- 2: three worker URLs (argparse's usage error).
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading

import pytest

from pdstate.integrations.sglang.endpoint import RankEndpoint
from pdstate.protocol import factors
from pdstate.protocol.fixes import fix_line, summarize
from pdstate.status import pushed
from pdstate.status.api import Readiness, check_documents, compat_document
from tests.support.api_source import FakeSource
from tests.support.paths import REPO, SRC_DIR
from tests.support.pools import tiny
from tests.support.workers import pdstate_command

TIMEOUT_S = 60
NO_PREFILL_YET = "no prefill accepted yet: a decode rank dials the prefill of its first request"


class FreshRank(FakeSource):
    """A rank's status before any request: a prefill ready, a decode waiting for its first request."""

    serves_transfers = False
    verify = "sampled"

    def __init__(self, role: str, report, port: int = 0) -> None:
        super().__init__(
            role, report, worker_id=f"{role}-0", control="tcp://127.0.0.1:41000" if role == "prefill" else ""
        )
        self.rank = {"rank": 0, "tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "dp_rank": 0,
                     "dp_size": 1, "sglang": "0.5.23", "http_port": port}  # fmt: skip
        self.changed = threading.Event()
        if role == "decode":
            self.ready = Readiness(False, NO_PREFILL_YET, "peer")

    def status(self) -> dict:
        stats = self.stats.snapshot()
        return pushed.status_of(self.readiness(), self.peers(), stats, 0, ([], 0))

    def status_key(self) -> tuple:
        return ()


@pytest.fixture
def endpoints():
    started: list[RankEndpoint] = []

    def start(source: FreshRank) -> str:
        started.append(RankEndpoint(source, "127.0.0.1", 0, None))
        return started[-1].url

    yield start
    for endpoint in started:
        endpoint.close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def probe(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC_DIR), str(REPO)])}
    env.pop("PDSTATE_AUTH__TOKEN", None), env.pop("PDSTATE_AUTH__TOKEN_FILE", None)
    cmd = [*pdstate_command(), "probe", *args, "--timeout", "10"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)


def test_a_matching_pair_before_any_request_is_ready_to_pair_exit_0(endpoints):
    prefill = endpoints(FreshRank("prefill", tiny()))
    decode = endpoints(FreshRank("decode", tiny()))
    r = probe("--prefill", prefill, "--decode", decode)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert f"decode 0   {decode}  tp 0/1 pp 0/1 dp 0/1, sglang 0.5.23" in lines[1]
    assert lines[1].endswith(f"NOT READY: {NO_PREFILL_YET}")
    assert lines[-3:] == [
        "            prefill 0",
        "decode 0    ready to pair",
        "ready to pair: every decode rank has an accepted prefill or a matching one (no request has paired them yet)",
    ], r.stdout


def test_a_mismatched_pair_before_any_request_exits_1_with_the_sglang_fix(endpoints):
    p_src, d_src = FreshRank("prefill", tiny()), FreshRank("decode", tiny(sliding_window=64))
    prefill, decode = endpoints(p_src), endpoints(d_src)
    r = probe("--prefill", prefill, "--decode", decode)
    assert r.returncode == 1, r.stdout + r.stderr
    # what the prefill rank's handshake checks say of the pair: the window, and the draft's window
    errors = check_documents(compat_document(p_src), compat_document(d_src))
    assert [(e.type, e.message.split(":")[0]) for e in errors] == [
        ("LayoutMismatch", "DSV4 layout mismatch on sliding_window"),
        ("LayoutMismatch", "DSV4 layout mismatch on draft"),
    ]
    window = factors.FACTORS["sliding_window"].sglang_line(128, 64)
    assert window == (
        "fix: launch both servers with the same sliding_window (config.json / --json-model-override-args) "
        "(prefill 128, decode 64)"
    )
    notes = []
    for e in errors:
        notes += [f"decode 0 / prefill 0: LayoutMismatch: {summarize(e.type, e.message)}"]
        notes += [f"  {fix_line(e.type, e.message, words='sglang')}"]
    assert notes[1] == f"  {window}" and "--speculative-num-steps (draft tokens)" in notes[3]
    assert r.stdout.splitlines()[-8:] == [
        "decode 0    mismatch (sliding_window)",
        "",
        *notes,
        "NO accepted prefill and none ready to pair: decode 0",
        "FAILED: a rank unreachable, or a pair refused or mismatched (above)",
    ], r.stdout


def test_an_unreachable_prefill_rank_exits_1(endpoints):
    down = f"http://127.0.0.1:{closed_port()}"
    decode = endpoints(FreshRank("decode", tiny()))
    r = probe("--prefill", down, "--decode", decode)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"prefill 0  {down}  UNREACHABLE: GET {down}/readyz:"), r.stdout
    assert lines[-4:] == [
        "            prefill 0",
        "decode 0    unreachable",
        "NO accepted prefill and none ready to pair: decode 0",
        "FAILED: a rank unreachable, or a pair refused or mismatched (above)",
    ], r.stdout


def test_an_unreachable_prefill_rank_beside_an_accepted_one_exits_1(endpoints):
    """Before: a decode served by one prefill rank hid the other's silence (exit 0)."""
    p_src = FreshRank("prefill", tiny())
    prefill = endpoints(p_src)
    d_src = FreshRank("decode", tiny())
    d_src.peer_list = [{"id": p_src.control, "state": "accepted", "fingerprint": p_src.report.fingerprint}]
    d_src.ready = Readiness(True)
    decode = endpoints(d_src)
    down = f"http://127.0.0.1:{closed_port()}"
    r = probe("--ranks", prefill, down, decode)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "decode 0    accepted" in r.stdout and f"{down}: UNREACHABLE: GET {down}/readyz:" in r.stdout


@pytest.mark.parametrize("urls", [["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"], []])
def test_a_wrong_number_of_urls_is_a_usage_error_exit_2(urls):
    r = probe(*urls)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout == ""
    *usage, last = r.stderr.splitlines()
    assert usage and usage[0].startswith("usage: pdstate probe ")
    assert last == (
        f"pdstate probe: error: give one or two worker URLs (got {len(urls)}), "
        "or rank endpoints (--ranks, --prefill, --decode)"
    )


def test_the_same_pair_given_as_two_urls_is_ready_to_pair_exit_0(endpoints):
    prefill = endpoints(FreshRank("prefill", tiny()))
    decode = endpoints(FreshRank("decode", tiny()))
    r = probe(prefill, decode)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1] == "pair: compatible, ready to pair (no request has paired them yet)"
