"""The handshake between real worker processes on 127.0.0.1: acceptance, refusal with the exact
upstream text on both sides, a refused decode next to a served one, bad control input, auth.

Every decode here is configured wrong on purpose with ``local_checks=False`` (it behaves like a
peer that does not verify its own pair), so the *prefill* has to find the problem. The refusal must
read the same on both sides: the decode's ``refused`` event and the error the prefill recorded
for that decode (its ``peers`` command).
"""

from __future__ import annotations

import random
import secrets

import msgpack
import pytest
import zmq

from pdstate.agent import curve
from pdstate.errors import ExitCode
from pdstate.protocol import wire
from tests.support.pools import TINY, report_and_kv
from tests.support.upstream import MAPPING_ERROR, SWA_ONLY_ERROR, UNIFIED_ERROR
from tests.support.workers import assert_all_verified, first_event, peer_record, run_batch

# (id, decode pool changes, error type, exact upstream text)
DRAFT_ERRORS = [
    (
        "draft-not-swa-only",
        dict(draft_compression_ratios=(4,)),
        "DraftNotSWAOnly",
        SWA_ONLY_ERROR,
    ),
    (
        "draft-no-layers",
        dict(draft_layers=0),
        "DraftNotSWAOnly",
        SWA_ONLY_ERROR,
    ),
    (
        "unified-vs-paged-draft",
        dict(draft_unified_kv=True),
        "UnifiedKVModeMismatch",
        UNIFIED_ERROR,
    ),
    (
        "ring-geometry",
        dict(unified_kv=True, draft_sliding_window=64),
        "SWARingGeometryMismatch",
        "DSV4 target and draft pools must share SWA ring geometry: target=(128, 131, 655), draft=(64, 67, 335)",
    ),
    ("mapping-own", dict(draft_mapping="own"), "SWAIndexMappingNotShared", MAPPING_ERROR),
    ("mapping-clone", dict(draft_mapping="clone"), "SWAIndexMappingNotShared", MAPPING_ERROR),
    ("mapping-view", dict(draft_mapping="view"), "SWAIndexMappingNotShared", MAPPING_ERROR),
    (
        "paged-geometry-page",
        dict(draft_page_size=512, upstream="0.5.19"),
        "PagedSWAGeometryMismatch",
        "DSV4 target and draft pools must share paged SWA geometry: target=(256, 128), draft=(512, 128)",
    ),
    (
        "paged-geometry-window",
        dict(draft_sliding_window=64),
        "SWAGeometryMismatch",
        "DSV4 target and draft pools must share SWA geometry: target=(256, 128, None), draft=(256, 64, None)",
    ),
]

_LAYOUT = "Both servers must build the same state layout."
CROSS_SIDE = [
    (
        "page-size",
        dict(page_size=512),
        "PageSizeMismatch",
        "Page size mismatch: prefill server has page_size=256, but decode server has page_size=512. "
        "Both servers must use the same --page-size value.",
    ),
    (
        "kv-dtype",
        dict(kv_dtype="float8_e5m2"),
        "KVCacheDtypeMismatch",
        "KV cache dtype mismatch: prefill server has kv_cache_dtype=float8_e4m3fn, but decode server has "
        "kv_cache_dtype=float8_e5m2. Both servers must use the same --kv-cache-dtype value.",
    ),
    (
        "speculative-one-side",
        dict(speculative_num_draft_tokens=None),
        "LayoutMismatch",
        f"DSV4 layout mismatch on c4_ring: prefill server has c4_ring=16, but decode server has c4_ring=8. {_LAYOUT}",
    ),
    (
        "unified-vs-paged",
        dict(unified_kv=True),
        "LayoutMismatch",
        "DSV4 layout mismatch on layout: prefill server has layout='paged', but decode server has "
        f"layout='unified'. {_LAYOUT}",
    ),
    (
        "window",
        dict(sliding_window=64),
        "LayoutMismatch",
        "DSV4 layout mismatch on sliding_window: prefill server has sliding_window=128, but decode server "
        f"has sliding_window=64. {_LAYOUT}",
    ),
    (
        "state-dtype",
        dict(state_dtype="bfloat16"),
        "LayoutMismatch",
        "DSV4 layout mismatch on c4_state_dtype: prefill server has c4_state_dtype='float32', but decode "
        f"server has c4_state_dtype='bfloat16'. {_LAYOUT}",
    ),
    (
        "draft-one-side",
        dict(draft_enabled=False),
        "LayoutMismatch",
        "DSV4 layout mismatch on draft: prefill server has draft={'layers': 1, 'layout': 'paged', "
        "'page_size': 256, 'swa_page_size': 256, 'sliding_window': 128, 'ring_size': None}, but decode "
        f"server has draft=None. {_LAYOUT}",
    ),
]


@pytest.fixture(scope="module")
def prefill(module_workers):
    """One good prefill (tiny preset, shm) shared by the module: it must survive everything."""
    return module_workers.prefill()


def _assert_refused_both_sides(
    prefill_proc, decode_proc, worker_id: str, etype: str, message: str, prefill_refused: bool = True
) -> None:
    """The decode refused (its event, its exit status); with ``prefill_refused``, the prefill
    refused it too and recorded why. A decode agent that refuses a prefill's ``Accept`` tells the
    prefill nothing: the prefill records it as accepted, then gone once its heartbeats stop."""
    ev = first_event(decode_proc)
    assert ev == {"event": "refused", "type": etype, "message": message}
    if prefill_refused:
        rec = peer_record(prefill_proc, worker_id, "rejected")
        assert rec["error"] == {"type": etype, "message": message}
    assert decode_proc.wait(15) == ExitCode.REFUSED, decode_proc.stderr_text()[-3000:]


def test_matching_pair_is_accepted_over_python_m(workers):
    """The plain ``python -m pdstate.devtools.processes`` entry point on both sides: accepted, then served."""
    p, ep = workers.prefill(launcher="subprocess")
    d = workers.decode(ep, launcher="subprocess", worker_id="decode-match")
    ev = first_event(d, 60)
    assert ev["event"] == "ready" and ev["handshake_ms"] > 0
    rec = peer_record(p, "decode-match")
    assert rec["state"] == "accepted" and rec["error"] is None
    results, done = run_batch(d, [100, 257])
    assert_all_verified(results, [100, 257])
    assert done["free"] == ev["free"]
    assert d.close() == 0 and p.close() == 0


@pytest.mark.parametrize("changes, etype, message", [c[1:] for c in DRAFT_ERRORS], ids=[c[0] for c in DRAFT_ERRORS])
def test_decode_draft_pair_error_is_refused_with_upstream_text(prefill, workers, changes, etype, message):
    p, ep = prefill
    wid = f"decode-{secrets.token_hex(3)}"
    d = workers.decode(ep, TINY.with_(**changes), local_checks=False, worker_id=wid)
    _assert_refused_both_sides(p, d, wid, etype, message)


@pytest.mark.parametrize("changes, etype, message", [c[1:] for c in CROSS_SIDE], ids=[c[0] for c in CROSS_SIDE])
def test_cross_side_mismatch_is_refused_with_same_text(prefill, workers, changes, etype, message):
    p, ep = prefill
    wid = f"decode-{secrets.token_hex(3)}"
    d = workers.decode(ep, TINY.with_(**changes), worker_id=wid)
    _assert_refused_both_sides(p, d, wid, etype, message)


@pytest.mark.parametrize("mapping", ["own", "clone"])
def test_prefill_with_a_bad_own_pair_is_refused_by_the_decode(workers, mapping):
    # Only the mapping wiring is wrong, so every cross-side factor matches and the prefill accepts;
    # the good decode (checked locally) re-runs the five checks on the prefill's report and refuses.
    # (A prefill whose draft *geometry* is wrong differs from a good decode in the ``draft`` factor
    # and is refused by the prefill's cross-side check first.)
    p, ep = workers.prefill(TINY.with_(draft_mapping=mapping), local_checks=False)
    d = workers.decode(ep, worker_id="decode-judge")
    _assert_refused_both_sides(p, d, "decode-judge", "SWAIndexMappingNotShared", MAPPING_ERROR, prefill_refused=False)
    assert peer_record(p, "decode-judge")["state"] in ("accepted", "gone")


def test_good_decode_is_served_while_a_bad_one_is_refused(prefill, workers):
    p, ep = prefill
    bad = workers.decode(ep, TINY.with_(draft_mapping="own"), local_checks=False, worker_id="decode-bad")
    good = workers.decode(ep, worker_id="decode-good")
    ev_good = first_event(good)
    assert ev_good["event"] == "ready"
    _assert_refused_both_sides(p, bad, "decode-bad", "SWAIndexMappingNotShared", MAPPING_ERROR)
    # and a second bad one arriving while the good one transfers
    bad2 = workers.decode(ep, TINY.with_(page_size=512), worker_id="decode-bad2")
    results, done = run_batch(good, [100, 256, 1000], concurrency=2)
    assert_all_verified(results, [100, 256, 1000])
    assert done["free"] == ev_good["free"]
    assert first_event(bad2)["type"] == "PageSizeMismatch"
    assert peer_record(p, "decode-good")["state"] == "accepted"


def test_local_check_failure_exits_nonzero_with_upstream_message(workers):
    """A real ``python -m pdstate.devtools.processes`` decode whose own pair is wrong never starts."""
    d = workers.decode("tcp://127.0.0.1:9", TINY.with_(draft_mapping="own"), launcher="subprocess")
    assert d.wait(60) == ExitCode.LOCAL_CHECK
    assert f"SWAIndexMappingNotShared: {MAPPING_ERROR}" in d.stderr_text()


@pytest.mark.parametrize(
    "role, changes, text",
    [
        (
            "prefill",
            dict(draft_page_size=512),
            "DSV4 target and draft pools must share SWA geometry: target=(256, 128, None), draft=(512, 128, None)",
        ),
        ("decode", dict(draft_compression_ratios=(0, 128)), SWA_ONLY_ERROR),
    ],
)
def test_local_check_failure_forked_worker(workers, role, changes, text):
    w = workers.spawn(role, TINY.with_(**changes), peer="tcp://127.0.0.1:9" if role == "decode" else "")
    assert w.wait(30) == ExitCode.LOCAL_CHECK
    assert text in w.stderr_text()


# --- bad input on the control socket ----------------------------------------------------------------


class RawDealer:
    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, b"raw-" + secrets.token_hex(4).encode())
        curve.dial(self.sock, curve.control_keys(None))  # a peer of the prefill's trust domain (this uid)
        self.sock.connect(endpoint)

    def ask(self, *frames: bytes, timeout_s: float = 10.0) -> wire.Message:
        self.sock.send_multipart(list(frames))
        if not self.sock.poll(int(timeout_s * 1000)):
            raise AssertionError(f"no answer within {timeout_s} s to {frames[0][:40]!r}")
        return wire.decode(self.sock.recv())

    def close(self) -> None:
        self.sock.close(0)


def _env(kind: str, body, v: int = wire.PROTOCOL_VERSION) -> bytes:
    if not isinstance(body, bytes):
        body = msgpack.packb(body, use_bin_type=True)
    return msgpack.packb({"v": v, "kind": kind, "body": body}, use_bin_type=True)


def _good_report_and_kv():
    """The layout report and descriptors of a good tiny worker (built in this process)."""
    report, kv_args = report_and_kv(TINY)
    return report, wire.KVDesc.of(kv_args)


def _register_fields(report, kv) -> dict:
    """A schema-valid register of a good tiny decode, as the plain map a raw frame carries."""
    msg = wire.Register(
        worker_id="raw",
        incarnation="0",
        role="decode",
        report=report,
        kv=kv,
        engine=wire.EngineDesc(name="shm", endpoint={}),
    )
    return msgpack.unpackb(msgpack.unpackb(wire.encode(msg))["body"])


def _with_kv(fields: dict, **kv_changes) -> dict:
    return {**fields, "kv": {**fields["kv"], **kv_changes}}


def _bad_frames(endpoint: str) -> list[tuple[str, list[bytes], str, str]]:
    """(id, frames, expected reply kind, text the reply's message contains): the agent's prefill
    answers each with an error or a refusal (a heartbeat before a register: ``NotRegistered``;
    two frames in one message: a ``ProtocolError``, PROTOCOL §1)."""
    hb = wire.encode(wire.Heartbeat(worker_id="raw", incarnation="0", seq=1))
    report, kv = _good_report_and_kv()
    reg = _register_fields(report, kv)
    accept = wire.Accept(worker_id="x", incarnation="0", report=report, heartbeat_interval_s=1, peer_timeout_s=5)
    n = wire.MAX_BUFFERS + 1
    return [
        ("random-bytes", [random.Random(7).randbytes(300)], "error", "undecodable frame"),
        ("msgpack-scalar", [msgpack.packb(42)], "error", "expected a map envelope"),
        ("truncated-msgpack", [hb[:-3]], "error", "undecodable frame"),
        (
            "wrong-version",
            [_env("heartbeat", {"worker_id": "x", "incarnation": "0", "seq": 1}, v=99)],
            "error",
            "peer speaks v99, this worker speaks v1",
        ),
        ("unknown-kind", [_env("frobnicate", {})], "error", "unknown message kind 'frobnicate'"),
        ("body-not-a-map", [_env("heartbeat", [1, 2, 3])], "error", "expected a map"),
        ("envelope-missing-body", [msgpack.packb({"v": 1, "kind": "heartbeat"})], "error", "binary 'body'"),
        (
            "wrong-field-types",
            [_env("heartbeat", {"worker_id": 5, "incarnation": "0", "seq": "x"})],
            "error",
            "invalid heartbeat",
        ),
        ("missing-fields", [_env("transfer_request", {"room": 1})], "error", "invalid transfer_request"),
        ("oversized-frame", [b"\x00" * (wire.MAX_FRAME_BYTES + 1)], "error", "exceeds the limit"),
        ("two-frames", [hb, hb], "error", "a message is one frame (one ZeroMQ part); this one has 2"),
        ("wrong-direction", [wire.encode(accept)], "error", "not registered"),
        (
            "request-before-register",
            [
                wire.encode(
                    wire.TransferRequest(
                        room=5,
                        seq_len=100,
                        dst_kv_pages=wire.PackedIndices.pack([1]),
                        dst_state_indices=[],
                        deadline_s=5,
                    )
                )
            ],
            "error",
            "not registered",
        ),
        ("heartbeat-before-register", [hb], "error", "not registered"),
        (
            "register-too-many-pointers",
            [_env("register", _with_kv(reg, kv_data_ptrs=[4096] * n))],
            "error",
            "kv.kv_data_ptrs",
        ),
        (
            "register-negative-pointer",
            [_env("register", _with_kv(reg, kv_data_ptrs=[-1] * len(reg["kv"]["kv_data_ptrs"])))],
            "error",
            "kv.kv_data_ptrs",
        ),
        (
            "register-uneven-lists",
            [_env("register", _with_kv(reg, kv_data_lens=reg["kv"]["kv_data_lens"][:-1]))],
            "reject",
            "pointers",
        ),
        (
            "register-absurd-lengths",
            [_env("register", _with_kv(reg, kv_data_lens=[1 << 62] * len(reg["kv"]["kv_data_lens"])))],
            "reject",
            "implausible range",
        ),
        (
            "register-overlapping-ranges",
            [_env("register", _with_kv(reg, kv_data_ptrs=[1 << 20] * len(reg["kv"]["kv_data_ptrs"])))],
            "reject",
            "overlap",
        ),
        (
            "register-bad-endpoint",
            [
                _env(
                    "register",
                    {
                        **reg,
                        "engine": {
                            "name": "shm",
                            "endpoint": {
                                "engine": "shm",
                                "engine_id": "x",
                                "boot_id": "",
                                "regions": [{"bogus": 1}],
                                "challenge": "00" * 16,  # (past the challenge: the endpoint is read)
                                "audience": endpoint,
                                "proofs": {},
                            },
                        },
                    },
                )
            ],
            "reject",
            "malformed",
        ),
    ]


def test_bad_control_input_gets_clear_errors_and_never_wedges_the_prefill(prefill, workers):
    p, ep = prefill
    before = p.command({"cmd": "stats"}, "stats")["stats"]
    dealer = RawDealer(ep)
    try:
        for case, frames, kind, text in _bad_frames(ep):
            if len(frames) > 1:
                dealer.sock.send_multipart(frames)
                assert dealer.sock.poll(10_000), case
                reply = wire.decode(dealer.sock.recv())
            else:
                reply = dealer.ask(*frames)
            assert reply.KIND == kind, (case, reply)
            assert text in reply.error.message, (case, reply.error)
            assert reply.error.type in (
                "ProtocolError",
                "NotRegistered",
                "VersionMismatch",
                "DescriptorMismatch",
                "InvalidEndpoint",
            ), (case, reply.error)
    finally:
        dealer.close()
    # A frame far over ZMQ's own size cap drops that connection at the transport: no reply can
    # be addressed, and the prefill carries on.
    huge = RawDealer(ep)
    huge.sock.setsockopt(zmq.LINGER, 2000)  # let the frame actually leave before the close
    huge.sock.send(b"\x00" * (2 * wire.MAX_FRAME_BYTES))
    huge.close()
    after = p.command({"cmd": "stats"}, "stats")["stats"]
    assert after["handshakes"]["rejected"] == before["handshakes"]["rejected"] + 4  # the four refused registers
    peers = p.command({"cmd": "peers"}, "peers")["peers"]
    assert [r for r in peers if r["id"] in ("raw", "x") and r["state"] == "accepted"] == []  # the raw frames
    # ... and still accepts a good decode and serves a verified transfer.
    d = workers.decode(ep, worker_id="decode-after-garbage")
    ev = first_event(d)
    assert ev["event"] == "ready"
    results, done = run_batch(d, [129, 1000])
    assert_all_verified(results, [129, 1000])
    assert done["free"] == ev["free"]


# --- auth -------------------------------------------------------------------------------------------


def test_auth_token(workers):
    token = b"integration-secret"
    p, ep = workers.prefill(token=token)
    none = workers.decode(ep, worker_id="decode-no-token")
    wrong = workers.decode(ep, worker_id="decode-wrong-token", token=b"not-the-secret")
    right = workers.decode(ep, worker_id="decode-right-token", token=token)
    # their CURVE keys (from no token: the uid's key file; from another token) are not the
    # prefill's: the handshake fails before any frame and each refuses the prefill with AuthError
    # at once (it used to wait for the handshake timeout)
    said = (
        f"prefill {ep} failed the CURVE handshake (no detail): it does not hold this worker's control key "
        "(another auth token, a token on one side only, or without a token another uid or auth.key_dir)"
    )
    for d in (none, wrong):
        ev = first_event(d, 60)
        assert ev == {"event": "refused", "type": "AuthError", "message": said}, ev
    ev = first_event(right)
    assert ev["event"] == "ready", ev
    results, _ = run_batch(right, [300])
    assert_all_verified(results, [300])
    peers = {r["id"]: r["state"] for r in p.command({"cmd": "peers"}, "peers")["peers"]}
    assert peers == {"decode-right-token": "accepted"}  # unauthenticated frames register nobody
