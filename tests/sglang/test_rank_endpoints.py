"""Each SGLang rank's HTTP endpoint (``integrations.sglang.endpoint``), through SGLang's own scheduler
queues (``devtools.sglang_queues``), and ``pdstate probe`` over the ranks.

Per release (0.5.19 and 0.5.23), one prefill child and one decode child (``queue_pair``, shared
with ``test_scheduler_queues.py``), each case's managers with ``PDSTATE_HTTP__PORT`` set (a port
of its own: both ranks are rank 0 on one host), run two cases
with backend ``pdstate``, one request each:

- the same DSV4-Flash layout on both: the request succeeds; each rank's ``/v1/compat`` lists the
  other as accepted, with its fingerprint and the transport (``mooncake/tcp``); both ranks'
  ``/readyz`` are 200; ``/metrics`` counts one successful transfer, its bytes and its verification
  level; ``pdstate probe --prefill URL --decode URL`` prints ``accepted`` and exits 0;
- the same C4/C128 layer counts in another order: the request fails on both sides; each rank
  lists the other as rejected with the factor (``compression_ratios``), upstream's text and the
  fix line in SGLang's words (the model config that sets the layers); the decode rank's ``/readyz``
  is 503 with that reason; both ranks' ``/metrics`` count the failed request by kind and factor;
  ``pdstate probe`` prints ``refused (compression_ratios)`` with the fix, and exits 1.

Before each case's request ``pdstate probe`` runs once on the fresh pair (the decode rank has
dialled no prefill): the same layout reads ``ready to pair`` and exits 0; the other order reads
``mismatch (compression_ratios)`` with SGLang's fix, and exits 1.

A rank's endpoint is served by a child process fed with the rank's snapshots (at most one per
0.1 s, at each change): the ranks are asked once their ``/metrics`` show the request ended.
"""

from __future__ import annotations

import os
import subprocess
import time

import httpx
import pytest

from pdstate.devtools.sglang_pair.cases import CASES
from pdstate.protocol.fixes import fix_line
from tests.support.paths import REPO, SRC_DIR
from tests.support.workers import pdstate_command

DEADLINE_S = 3.0
SETTLE_S = 5.0
MISMATCH = "c4_c128_order"  # its factor: compression_ratios
ROLES = ("prefill", "decode")


def _ask(port: int) -> dict:
    base = f"http://127.0.0.1:{port}"
    ready = httpx.get(f"{base}/readyz", timeout=10)
    return {
        "url": base,
        "ready_status": ready.status_code,
        "ready": ready.json(),
        "compat": httpx.get(f"{base}/v1/compat", timeout=10).json(),
        "metrics": httpx.get(f"{base}/metrics", timeout=10).text,
        "transfers": httpx.post(f"{base}/v1/transfers", json={"tokens": 1}, timeout=10).status_code,
    }


def _settled(port: int) -> None:
    """Until the rank's endpoint shows no request in flight and one ended (bounded: ``SETTLE_S``)."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        ended = [
            line
            for line in text.splitlines()
            if line.startswith(('pdstate_transfers_total{outcome="success', 'pdstate_transfers_total{outcome="failed'))
        ]
        if "pdstate_transfers_in_flight 0.0" in text.splitlines() and sum(float(x.rsplit(" ", 1)[1]) for x in ended):
            return
        time.sleep(0.05)


def _probe(ports: dict[str, int]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC_DIR), str(REPO)])}
    argv = ["probe", "--prefill", f"http://127.0.0.1:{ports['prefill']}"]
    argv += ["--decode", f"http://127.0.0.1:{ports['decode']}"]
    return subprocess.run(pdstate_command() + argv, capture_output=True, text=True, timeout=60, env=env)


@pytest.fixture(scope="module")
def ranks(sglang_release, queue_pair, queue_runs) -> tuple[str, dict]:
    """``(release, {case: {"request", "prefill", "decode", "probe"}})`` (after ``queue_runs``, whose
    SGLang's Mooncake cases need the pair fresh)."""
    from pdstate.devtools.sglang_pair.pair import free_port

    out: dict = {}
    for name in ("correct", MISMATCH):
        ports = {role: free_port() for role in ROLES}  # each case's managers answer on ports of their own
        role_env = {role: {"PDSTATE_HTTP__PORT": str(port)} for role, port in ports.items()}
        setup = queue_pair.setup(CASES[name], "pdstate", role_env=role_env)
        assert "setup_error" not in setup, setup
        res = {"fresh": _probe(ports)}  # before any request: the decode rank has dialled no prefill yet
        res["request"] = queue_pair.request(600, DEADLINE_S)
        for port in ports.values():
            _settled(port)
        res.update({role: _ask(port) for role, port in ports.items()})
        res["probe"] = _probe(ports)
        out[name] = res
    return sglang_release.version, out


def _peer(side: dict) -> dict:
    peers = side["compat"]["peers"]
    assert len(peers) == 1, peers
    return peers[0]


def _metric(text: str, line_start: str) -> float:
    found = [line for line in text.splitlines() if line.startswith(line_start + " ")]
    assert len(found) == 1, (line_start, [x for x in text.splitlines() if x.startswith("pdstate_transfer")])
    return float(found[0].rsplit(" ", 1)[1])


def test_same_config_pair_lists_its_peer_accepted(ranks):
    release, out = ranks
    res = out["correct"]
    assert res["request"]["prefill"]["outcome"] == "Success" and res["request"]["decode"]["outcome"] == "Success"
    pre, dec = res["prefill"], res["decode"]
    for side, other in ((pre, dec), (dec, pre)):
        doc = side["compat"]
        assert doc["rank"] == {
            "rank": 0, "tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "dp_rank": 0, "dp_size": 1,
            "sglang": release, "http_port": int(side["url"].rsplit(":", 1)[1]),
        }  # fmt: skip
        assert doc["transport"]["engine"] == doc["engine"] == "mooncake" and doc["transport"]["in_use"] == "tcp"
        peer = _peer(side)
        assert peer["state"] == "accepted" and peer["error"] is None and peer["factor"] is None
        assert peer["fingerprint"] == other["compat"]["fingerprint"] == doc["fingerprint"]
        assert peer["transport"] == "mooncake/tcp"  # the engine and the transport it has in use
        assert peer["incarnation"] is None  # no token configured: nobody is shown incarnations
        assert side["ready_status"] == 200 and side["ready"]["ready"] is True
        assert side["transfers"] == 404  # a rank's transfers are SGLang's requests: no synthetic ones
        m = side["metrics"]
        assert _metric(m, 'pdstate_transfers_total{outcome="success"}') == 1
        assert _metric(m, 'pdstate_transfers_total{outcome="failed"}') == 0
        assert _metric(m, 'pdstate_transfers_verified_total{level="sampled"}') == 1
        assert _metric(m, 'pdstate_verify_level{level="sampled"}') == 1
        assert _metric(m, "pdstate_transfer_latency_seconds_count") == 1
        assert _metric(m, 'pdstate_peers{state="accepted"}') == 1
    moved = res["request"]["prefill"]["bytes"]
    assert moved > 0 and _metric(pre["metrics"], "pdstate_transfer_bytes_total") == moved
    assert _metric(dec["metrics"], "pdstate_transfer_bytes_total") == moved
    assert _peer(dec)["id"] == pre["compat"]["control"]  # a decode lists prefills by agent address
    assert _peer(pre)["id"] == dec["compat"]["worker_id"]  # a prefill lists decodes by worker id


def test_same_config_pair_probe_prints_accepted_and_exits_0(ranks):
    _, out = ranks
    probe = out["correct"]["probe"]
    assert probe.returncode == 0, probe.stdout + probe.stderr
    lines = probe.stdout.splitlines()
    assert lines[-3:] == [
        "            prefill 0",
        "decode 0    accepted",
        "every decode rank has an accepted prefill",
    ], probe.stdout


def test_mismatched_pair_is_refused_with_factor_and_fix_on_both_ranks(ranks):
    _, out = ranks
    res = out[MISMATCH]
    assert res["request"]["prefill"]["outcome"] == "Failed" and res["request"]["decode"]["outcome"] == "Failed"
    pre, dec = res["prefill"], res["decode"]
    for side in (pre, dec):
        peer = _peer(side)
        assert peer["state"] == "rejected" and peer["factor"] == "compression_ratios"
        assert peer["error"]["type"] == "LayoutMismatch"
        assert peer["error"]["message"].startswith("DSV4 layout mismatch on compression_ratios: prefill server has")
        assert peer["error"]["fix"].startswith("fix: ") and "another order" in peer["error"]["fix"]
        # an SGLang rank's words: the model config that sets the layers, never pdstate serve's keys
        assert peer["error"]["fix"] == fix_line("LayoutMismatch", peer["error"]["message"], words="sglang")
        assert "compress_ratios / num_hidden_layers (the model's config.json)" in peer["error"]["fix"]
        assert "preset" not in peer["error"]["fix"] and "workers" not in peer["error"]["fix"]
        assert peer["transport"] is None
        m = side["metrics"]
        assert _metric(m, 'pdstate_transfers_total{outcome="failed"}') == 1
        assert _metric(m, 'pdstate_transfer_failures_total{factor="compression_ratios",kind="LayoutMismatch"}') == 1
        assert _metric(m, 'pdstate_peers{state="rejected"}') == 1
    assert _peer(pre)["fingerprint"] == dec["compat"]["fingerprint"] != pre["compat"]["fingerprint"]
    assert pre["ready_status"] == 200  # a prefill rank is ready while its agent serves
    assert dec["ready_status"] == 503
    message = _peer(dec)["error"]["message"]
    assert dec["ready"]["reason"] == f"refused by the prefill at {pre['compat']['control']}: {message}"
    assert dec["ready"]["check"] == "handshake" and dec["ready"]["error"]["fix"] == _peer(dec)["error"]["fix"]
    assert _metric(dec["metrics"], "pdstate_ready") == 0


def test_mismatched_pair_probe_prints_the_refusal_and_exits_1(ranks):
    _, out = ranks
    res = out[MISMATCH]
    probe = res["probe"]
    assert probe.returncode == 1, probe.stdout + probe.stderr
    lines = probe.stdout.splitlines()
    fix = _peer(res["decode"])["error"]["fix"]
    assert "decode 0    refused (compression_ratios)" in lines, probe.stdout
    assert lines[-3:] == [
        f"  {fix}",
        "NO accepted prefill and none ready to pair: decode 0",
        "FAILED: a rank unreachable, or a pair refused or mismatched (above)",
    ], probe.stdout
    assert any(
        x.startswith("decode 0 / prefill 0: LayoutMismatch: DSV4 layout mismatch on compression_ratios") for x in lines
    )


def test_a_fresh_same_config_pair_probe_reads_ready_to_pair_and_exits_0(ranks):
    _, out = ranks
    fresh = out["correct"]["fresh"]
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    assert fresh.stdout.splitlines()[-3:] == [
        "            prefill 0",
        "decode 0    ready to pair",
        "ready to pair: every decode rank has an accepted prefill or a matching one (no request has paired them yet)",
    ], fresh.stdout


def test_a_fresh_mismatched_pair_probe_names_the_factor_and_sglangs_fix_and_exits_1(ranks):
    _, out = ranks
    fresh = out[MISMATCH]["fresh"]
    assert fresh.returncode == 1, fresh.stdout + fresh.stderr
    lines = fresh.stdout.splitlines()
    assert "decode 0    mismatch (compression_ratios)" in lines, fresh.stdout
    (note,) = [x for x in lines if x.startswith("decode 0 / prefill 0: LayoutMismatch: ")]
    fix = lines[lines.index(note) + 1]
    assert fix.startswith("  fix: launch both servers with the same compress_ratios / num_hidden_layers"), fresh.stdout
    assert lines[-2:] == [
        "NO accepted prefill and none ready to pair: decode 0",
        "FAILED: a rank unreachable, or a pair refused or mismatched (above)",
    ], fresh.stdout
