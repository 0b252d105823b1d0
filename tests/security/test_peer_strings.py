"""Bounded peer input: a decode's strings are clipped where they enter a prefill
(``pdstate.protocol.report``), so what the prefill keeps of refused registers (its peer records,
the refusals), what it serves (``/v1/compat``) and what an SGLang prefill rank snapshots for its
endpoint stay small whatever decodes send, and refused registers cannot push an accepted decode
out of its peer list; its text log keeps a forging worker id on one line.

Measured on this 2-core machine (tiny preset, a ``pdstate serve`` prefill): after 30 refused
registers each carrying a 7 MiB ``kv_dtype`` (a 7.3 MB frame; the prefill's heap reaches its
plateau, ~70 MB above start, holding one frame's transient buffers), 100 more grow its RSS by
0.1 MiB (was: 812 MiB), and ``GET /v1/compat`` listing the 130 is 143 KB (was: 632 MB after 300
of 1 MiB). An SGLang prefill rank's status snapshot after 100 registers with a 1 MiB ``kv_dtype``
and a 1 MiB fingerprint is 58 KB pickled (was: 209,739,460 bytes).
"""

from __future__ import annotations

import pickle
import types

import httpx
import pytest

from pdstate.agent import PrefillAgent
from pdstate.integrations.sglang.rank_status import RankCounters, RankStatus
from pdstate.pools.presets import build_worker_pools, preset
from pdstate.pools.reporting import build_report
from pdstate.protocol import wire
from pdstate.protocol.report import ErrorInfo, LayoutReport
from tests.support.hostile import RawDealer, agent_pair, agent_transfer
from tests.support.services import Services, ready, wait_for
from tests.support.waiting import wait_until

MIB = 1 << 20
WARM_UP = 30  # registers before the baseline: the allocator's heap grows to its plateau for frames this size
REGISTERS = 100
LOG_LINE_CHARS = 4096  # a refusal line: its message, the fix and the fields
FORGED = "hostile\n2026-12-06 02:41:03,000 CRITICAL pdstate.agent: \x1b[31mprefill compromised\x1b[0m"
FORGED_ESCAPED = "hostile\\n2026-12-06 02:41:03,000 CRITICAL pdstate.agent: \\x1b[31mprefill compromised\\x1b[0m"


@pytest.fixture(scope="module")
def tiny_report() -> LayoutReport:
    pools = build_worker_pools(preset("tiny"))
    try:
        return build_report(pools.target, pools.draft)[0]
    finally:
        pools.close()


def _register(report: LayoutReport, worker_id: str, dtype_chars: int, fingerprint_chars: int = 0) -> bytes:
    """A register refused for its KV dtype (``dtype_chars`` of it), with a fingerprint of
    ``fingerprint_chars`` characters when not 0; encoded once."""
    update = {"kv_dtype": "d" * dtype_chars}
    if fingerprint_chars:
        update["fingerprint"] = "f" * fingerprint_chars
    # ``model_copy`` skips validation: the hostile values reach the wire whole, as a raw client sends them
    hostile = report.model_copy(update=update)
    msg = wire.Register.model_construct(
        worker_id=worker_id,
        incarnation="1",
        role="decode",
        report=hostile,
        kv=None,
        engine=wire.EngineDesc(name="shm", endpoint={}),
    )
    return wire.encode(msg)


def _clipped(char: str, n: int, limit: int) -> str:
    """``char * n`` as a worker keeps it: its first characters and ``…(+N chars)``, ``limit`` in all."""
    keep = limit - len(f"…(+{n} chars)")
    return char * keep + f"…(+{n - keep} chars)"


def _dtype_refusal(theirs: str) -> str:
    return (
        "KV cache dtype mismatch: prefill server has kv_cache_dtype=float8_e4m3fn, but decode server has "
        f"kv_cache_dtype={theirs}. Both servers must use the same --kv-cache-dtype value."
    )


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_frame_sized_strings_in_refused_registers_keep_a_prefills_memory_and_compat_small(tiny_report):
    clipped = _clipped("d", 7 * MIB, 256)
    settle = wire.Heartbeat(worker_id="probe", incarnation="0", seq=1)  # answered once the frame before is done
    with Services() as services, httpx.Client(timeout=60.0) as http:
        prefill, control = services.prefill()
        wait_for(lambda: ready(http, prefill.url), 30, "prefill ready")
        dealer = RawDealer(control)
        try:
            answers = []
            for i in range(WARM_UP + REGISTERS):
                if i == WARM_UP:
                    dealer.ask(settle)
                    before = _rss_bytes(prefill.pid)
                answers.append(dealer.ask(_register(tiny_report, f"hostile-{i}", 7 * MIB), timeout_s=60))
            dealer.ask(settle)
            grown = _rss_bytes(prefill.pid) - before
            forger = dealer.ask(_register(tiny_report, FORGED, 8))  # its refusal line, in the default text log
        finally:
            dealer.close()
        assert grown < 50 * MIB, f"RSS grew by {grown / MIB:.1f} MiB over {REGISTERS} refused registers"
        r = http.get(f"{prefill.url}/v1/compat")  # no token: what anyone on the host may read
        assert r.status_code == 200 and len(r.content) < 200_000, f"/v1/compat is {len(r.content)} bytes"

        refusal = ErrorInfo(type="KVCacheDtypeMismatch", message=_dtype_refusal(clipped))
        assert all(isinstance(a, wire.Reject) and a.error == refusal for a in answers), answers[0]
        peers = {p["id"]: p for p in r.json()["peers"]}
        assert len(peers) == WARM_UP + REGISTERS + 1 and peers[FORGED]["state"] == "rejected"
        assert peers["hostile-7"] == {
            "id": "hostile-7",
            "state": "rejected",
            "error": {
                "type": "KVCacheDtypeMismatch",
                "message": _dtype_refusal(clipped),
                "fix": "fix: Both servers must use the same --kv-cache-dtype value: in pdstate, set pool.kv_dtype "
                "to one value in both workers' configs (prefill float8_e4m3fn, decode "
                + clipped.removesuffix(" chars)")
                + ")",
            },
            "incarnation": None,
            "fingerprint": tiny_report.fingerprint,
            "transport": None,
            "factor": "KVCacheDtypeMismatch",
        }
        # the refusal's log line quotes the clipped value, not the frame
        lines = wait_for(lambda: [x for x in prefill.stderr if "peer=hostile-7 " in x], 10, "the refusal line")
        assert len(lines) == 1 and len(lines[0]) < LOG_LINE_CHARS, len(lines[0])
        # a worker id forging a CRITICAL record stays in its own line, its controls escaped
        assert isinstance(forger, wire.Reject) and forger.error.type == "KVCacheDtypeMismatch"
        lines = wait_for(lambda: [x for x in prefill.stderr if "prefill compromised" in x], 10, "the forger's line")
        assert len(lines) == 1 and f" WARNING pdstate.agent: handshake refused peer={FORGED_ESCAPED} " in lines[0]
        assert not any(x.startswith("2026-12-06 02:41:03,000") or "\x1b" in x for x in prefill.stderr)


def test_an_sglang_prefill_ranks_status_snapshot_stays_small(tiny_report):
    """The snapshot an SGLang prefill rank pickles for its endpoint's process
    (``RankStatus.status``, over the rank's real ``PrefillAgent``) after refused registers with
    strings of 1 MiB in their ``kv_dtype`` and their fingerprint."""
    pools = build_worker_pools(preset("tiny"))
    from pdstate.pools.kvargs import fill_kv_args

    agent = PrefillAgent(fill_kv_args(pools.target, pools.draft), report=tiny_report)
    manager = types.SimpleNamespace(
        role="prefill",
        agent=agent,
        agent_failure=lambda: None,
        counters=RankCounters(lambda: agent),
        layout_report=tiny_report,
    )
    source = RankStatus(manager, engine="shm", transport=agent.transport(), verify="sampled", place={})
    dealer = RawDealer(agent.address)
    try:
        for i in range(REGISTERS):
            answer = dealer.ask(_register(tiny_report, f"rank-{i}", MIB, fingerprint_chars=MIB))
            assert isinstance(answer, wire.Reject) and answer.error.type == "KVCacheDtypeMismatch", answer
        blob = pickle.dumps(source.status())  # what ``status.pushed.Publisher`` sends the endpoint's process
        peers = pickle.loads(blob)["peers"]
    finally:
        dealer.close()
        agent.close()
        pools.close()
    assert len(blob) < 100_000, f"the snapshot is {len(blob)} bytes pickled"
    assert len(peers) == REGISTERS
    assert peers[0] == {
        "id": "rank-0",
        "state": "rejected",
        "error": {"type": "KVCacheDtypeMismatch", "message": _dtype_refusal(_clipped("d", MIB, 256))},
        "incarnation": "1",
        "fingerprint": _clipped("f", MIB, 64),
        "transport": None,
    }


def _refused_register(report: LayoutReport, worker_id: str, item_lens: int = 0) -> bytes:
    """A register refused for its KV dtype (a short message) or, with ``item_lens``, for its
    ``main_kv_item_lens``: a list of that many 6-digit lengths, quoted in the refusal."""
    if item_lens:
        factors = tuple((n, [100000] * item_lens if n == "main_kv_item_lens" else v) for n, v in report.factors)
        report = report.model_copy(update={"factors": factors})
    else:
        report = report.model_copy(update={"kv_dtype": "bfloat16"})
    msg = wire.Register(
        worker_id=worker_id,
        incarnation="1",
        role="decode",
        report=report,
        kv=None,
        engine=wire.EngineDesc(name="shm", endpoint={}),
    )
    return wire.encode(msg)


def _drain(dealer: RawDealer) -> list[wire.Message]:
    got = []
    while dealer.sock.poll(0):
        got.append(wire.decode(dealer.sock.recv()))
    return got


def test_refused_registers_cannot_push_an_accepted_decode_out_of_the_peer_log(tiny_report):
    """1100 refused registers (over ``MAX_PEER_LOG``), then 200 whose refusals quote 6.6 KB each
    (over the log's 1 MiB of error text): the accepted decode keeps its record and its
    transfers; the log keeps the latest refusals within both bounds (was: the accepted decode's
    record pushed out by the 1024th refusal)."""
    prefill, prefill_pools, decode, decode_pools, memory = agent_pair()
    dealer = RawDealer(prefill.address)
    try:
        agent_transfer(prefill, prefill_pools, decode, decode_pools, room=1)
        for i in range(1100):
            dealer.send(_refused_register(tiny_report, f"small-{i}"))
        for i in range(200):
            dealer.send(_refused_register(tiny_report, f"large-{i}", item_lens=800))
        got: list[wire.Message] = []
        wait_until("1300 refusals", lambda: got.extend(_drain(dealer)) or len(got) >= 1300, 60)
        assert all(isinstance(m, wire.Reject) for m in got)
        peers = prefill.peers()
        agent_transfer(prefill, prefill_pools, decode, decode_pools, room=2)
    finally:
        dealer.close()
        decode.close()
        prefill.close()
        memory.close()
    by_id = {p.id: p for p in peers}
    assert by_id["victim"].state == "accepted" and by_id["victim"].incarnation == decode.incarnation
    text = sum(len(p.error.message) for p in peers if p.error is not None)
    assert len(peers) <= 1024 and text <= 1 << 20, (len(peers), text)
    large = [p.id for p in peers if p.id.startswith("large-")]
    assert len(large) > 150 and large == [f"large-{i}" for i in range(200 - len(large), 200)]
    assert len(by_id["large-199"].error.message) > 6400
