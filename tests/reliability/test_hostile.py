"""Hostile input: fuzzed control frames, fuzzed HTTP requests, crafted transfer requests.

* A hypothesis fuzz sends random, mutated and well-formed-but-wrong frames to a prefill process's
  control socket from raw DEALERs: one anonymous, one registered with a real decode layout (so
  fuzzed transfer requests reach the planner and the engine). After every example the prefill
  must still answer; at the end its pools are whole and a good decode gets verified transfers.
* A hypothesis fuzz sends random and mutated JSON to every route of the HTTP app of a live decode:
  never a 5xx other than 503 (not ready), and a good transfer verifies afterwards.
* Crafted ``TransferRequest`` s from a registered raw client (indices past the buffers, negative,
  duplicated, absurdly long lists, mismatched counts, the padding page, huge ``seq_len``) are each
  refused with the planner's exact message, and a sentinel image proves that no byte of the
  decode's pools changed; a valid crafted request changes only its own destination items.

The default run is short; ``-m slow`` runs the long versions.
"""

from __future__ import annotations

import json
import secrets
import time

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdstate.agent import curve
from pdstate.pools.memory import SharedMemory
from pdstate.pools.presets import build_worker_pools
from pdstate.pools.reporting import build_report
from pdstate.protocol import wire
from pdstate.transfer.engines.base import create_engine
from pdstate.transfer.planner import channels_of
from pdstate.worker import requests as rq
from tests.support.faults import FAULT
from tests.support.hostile import agent_request
from tests.support.images import SENTINEL, compare_images, expected_images, fill_regions
from tests.support.pools import ROOMY, TINY
from tests.support.summary import tally
from tests.support.waiting import wait_until
from tests.support.workers import (
    assert_all_verified,
    first_event,
    leaked,
    prefill_requests,
    run_batch,
    served_pair,
    transfer,
)

FUZZ_EXAMPLES = 300
FUZZ_EXAMPLES_SLOW = 6000
_FUZZ = dict(
    deadline=None,
    derandomize=False,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)


# --- raw control clients ------------------------------------------------------------------------


class Dealer:
    seen: dict[str, int] = {}  # replies by kind (TransferDone by status), over every dealer

    def __init__(self, endpoint: str, identity: bytes | None = None) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, identity or b"raw-" + secrets.token_hex(4).encode())
        curve.dial(self.sock, curve.control_keys(None))  # a peer of the prefill's trust domain (this uid)
        self.sock.connect(endpoint)
        self.endpoint = endpoint

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def replies(self, until, timeout_s: float = 10.0) -> list[wire.Message]:
        """Read replies until ``until(msg)`` is true for one; fails if none comes in time."""
        got = []
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self.sock.poll(left_ms):
                raise AssertionError(f"the prefill stopped answering; replies so far: {got[-5:]}")
            msg = wire.decode(self.sock.recv())
            key = f"{msg.KIND}:{msg.status}" if isinstance(msg, wire.TransferDone) else msg.KIND
            Dealer.seen[key] = Dealer.seen.get(key, 0) + 1
            if key == "transfer_done:success":  # as a decode agent does: the prefill frees the pages
                self.send(wire.encode(wire.AgentVerdict(room=msg.room, status="success")))
            got.append(msg)
            if until(msg):
                return got

    def ask(self, msg: wire.Message | bytes, timeout_s: float = 10.0) -> wire.Message:
        self.send(msg if isinstance(msg, bytes) else wire.encode(msg))
        return self.replies(lambda m: True, timeout_s)[-1]

    def close(self) -> None:
        self.sock.close(0)


class FakeDecode:
    """A decode's registered layout without a decode: pools in shared memory, an shm engine and
    the register message that points a prefill at them (what a raw client needs to be accepted)."""

    def __init__(self, settings=ROOMY, worker_id: str = "fuzz-registered") -> None:
        self.memory = SharedMemory()
        self.pools = build_worker_pools(settings, self.memory)
        report, self.kv_args = build_report(self.pools.target, self.pools.draft)
        self.engine = create_engine("shm")
        self.engine.start()
        self.engine.register(self.memory.regions())
        self.register = wire.Register(
            worker_id=worker_id,
            incarnation=secrets.token_hex(8),
            role="decode",
            report=report,
            kv=wire.KVDesc.of(self.kv_args),
            engine=wire.EngineDesc(name="shm", endpoint=self.engine.endpoint()),
        )

    def proven(self, nonce: bytes, audience: str) -> wire.Register:
        """The register again, answering the prefill's ownership ``challenge`` (dialled at ``audience``)."""
        claimant = f"{self.register.worker_id}/{self.register.incarnation}@{audience}"
        endpoint = {**self.register.engine.endpoint, **self.engine.prove(nonce, claimant), "audience": audience}
        return self.register.model_copy(update={"engine": wire.EngineDesc(name="shm", endpoint=endpoint)})

    def handshake(self, dealer: Dealer) -> wire.Message:
        """Register, answering the challenge; the prefill's last answer."""
        answer = dealer.ask(self.register)
        return dealer.ask(self.proven(answer.nonce, dealer.endpoint)) if isinstance(answer, wire.Challenge) else answer

    def request(self, room: int, seq_len: int) -> wire.AgentRequest:
        """A decode agent's request of ``seq_len`` tokens into this decode's own free pages (the
        prefill computes it on demand; no digests)."""
        return agent_request(self.pools, self.kv_args, room, seq_len)

    def close(self) -> None:
        self.engine.close()
        self.pools.close()


def _seeds(fake: FakeDecode) -> list[wire.Message]:
    report = fake.register.report
    return [
        fake.register,
        wire.Heartbeat(worker_id=fake.register.worker_id, incarnation=fake.register.incarnation, seq=1),
        fake.request(5, 300),
        fake.request(6, 1000),
        wire.Abort(room=5, reason="fuzz"),
        wire.AgentVerdict(room=5, status="success"),
        wire.TransferDone(room=5, status="success", bytes=10, digest=b"\0" * 16),
        wire.Busy(room=5, in_flight=1, limit=1),
        wire.Error(error={"type": "ProtocolError", "message": "x"}, room=5),
        wire.Accept(worker_id="x", incarnation="0", report=report, heartbeat_interval_s=1, peer_timeout_s=5),
        wire.Reject(worker_id="x", error={"type": "RuntimeError", "message": "no"}),
    ]


# --- strategies ---------------------------------------------------------------------------------

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.binary(max_size=64),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)),
    max_leaves=20,
)
_packed_strategy = st.builds(
    lambda dtype, ints: {"dtype": dtype, "data": np.asarray(ints, dtype=np.int64).astype(dtype).tobytes()},
    st.sampled_from(["<i4", "<i8"]),
    st.lists(st.one_of(st.integers(-3, 40), st.integers(-(1 << 31), (1 << 31) - 1)), max_size=12),
)


def _mutate_bytes(data, frame: bytes) -> bytes:
    b = bytearray(frame)
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        op = data.draw(st.sampled_from(["flip", "delete", "insert", "truncate", "dup"]), label="op")
        if not b:
            b += data.draw(st.binary(min_size=1, max_size=8))
            continue
        i = data.draw(st.integers(0, len(b) - 1), label="at")
        if op == "flip":
            b[i] ^= data.draw(st.integers(1, 255))
        elif op == "delete":
            del b[i : i + data.draw(st.integers(1, 16))]
        elif op == "insert":
            b[i:i] = data.draw(st.binary(min_size=1, max_size=16))
        elif op == "truncate":
            del b[i:]
        else:
            b[i:i] = b[i : i + data.draw(st.integers(1, 32))]
    return bytes(b)


def _mutate_fields(data, fields: dict) -> dict:
    out = dict(fields)
    keys = sorted(out)
    for k in data.draw(st.lists(st.sampled_from(keys), min_size=1, max_size=3, unique=True), label="fields"):
        if k in ("dst_kv_pages",) or (k == "dst_state_indices" and data.draw(st.booleans())):
            out[k] = (
                data.draw(_packed_strategy)
                if k == "dst_kv_pages"
                else data.draw(st.lists(_packed_strategy, max_size=5))
            )
        else:
            out[k] = data.draw(_values, label=k)
    if data.draw(st.booleans(), label="extra key"):
        out[data.draw(st.text(max_size=8))] = data.draw(_scalars)
    return out


def _envelope(kind, body, v=wire.PROTOCOL_VERSION) -> bytes:
    return msgpack.packb({"v": v, "kind": kind, "body": body}, use_bin_type=True)


def _index_list(data, expected: int) -> wire.PackedIndices:
    """Mostly near-valid: about the right count, small indices, sometimes negative, 0 or huge."""
    n = data.draw(st.one_of(st.just(expected), st.integers(0, expected + 3)), label="count")
    xs = data.draw(
        st.lists(st.one_of(st.integers(1, 12), st.integers(-2, 0), st.integers(13, 1 << 40)), min_size=n, max_size=n),
        label="indices",
    )
    return wire.PackedIndices.pack(xs)


def _draw_request(data, fake: FakeDecode) -> bytes:
    """A schema-valid transfer request with fuzzed lists: it reaches the planner (and, when the
    lists happen to be valid, the engine)."""
    seq_len = data.draw(st.one_of(st.integers(1, 1200), st.integers(1, 1 << 24)), label="seq_len")
    try:
        valid = fake.request(data.draw(st.integers(0, (1 << 63) - 1)), seq_len)
    except Exception:  # larger than the fake's pools: lists of made-up sizes
        valid = fake.request(1, 300)
    counts = [len(valid.dst_kv_pages)] + [len(x) for x in valid.dst_state_indices]
    lists = [valid.dst_kv_pages, *valid.dst_state_indices]
    for i in data.draw(st.lists(st.integers(0, len(lists) - 1), max_size=3, unique=True), label="fuzzed lists"):
        lists[i] = _index_list(data, counts[i])
    if data.draw(st.integers(0, 9), label="drop or add a list") == 0:
        lists = lists[:-1] if data.draw(st.booleans()) else lists + [_index_list(data, 1)]
    msg = wire.AgentRequest(
        room=data.draw(st.integers(0, (1 << 63) - 1)),
        seq_len=seq_len,
        dst_kv_pages=lists[0],
        dst_state_indices=lists[1:],
        deadline_s=5,
        digest=data.draw(st.booleans(), label="digest"),
    )
    return wire.encode(msg)


def _draw_frames(data, seeds: list[wire.Message], fake: FakeDecode) -> list[bytes]:
    how = data.draw(
        st.sampled_from(["random", "bytes", "fields", "envelope", "multipart", "request", "request", "seed"]),
        label="how",
    )
    if how == "request":
        return [_draw_request(data, fake)]
    seed = data.draw(st.sampled_from(seeds), label="seed")
    if how == "seed":
        return [wire.encode(seed)]
    fields = msgpack.unpackb(msgpack.unpackb(wire.encode(seed))["body"])
    if how == "random":
        return [data.draw(st.binary(max_size=600), label="random frame")]
    if how == "bytes":
        return [_mutate_bytes(data, wire.encode(seed))]
    if how == "fields":
        body = msgpack.packb(_mutate_fields(data, fields), use_bin_type=True)
        return [_envelope(seed.KIND, body)]
    if how == "envelope":
        env = data.draw(st.dictionaries(st.sampled_from(["v", "kind", "body", "auth", "x"]), _values, max_size=5))
        if data.draw(st.booleans()):
            env.setdefault("kind", data.draw(st.sampled_from(sorted(wire.MESSAGES) + ["", "nope"])))
            env.setdefault("v", data.draw(st.sampled_from([wire.PROTOCOL_VERSION, 0, 2, -1, 1 << 40])))
        return [msgpack.packb(env, use_bin_type=True)]
    n = data.draw(st.integers(2, 3))
    return [wire.encode(seed)] * n


def _fuzz_control(endpoint: str, fake: FakeDecode, examples: int) -> int:
    registered = Dealer(endpoint, f"{fake.register.worker_id}/{fake.register.incarnation}".encode())
    anon = Dealer(endpoint)
    seeds = _seeds(fake)
    hb = wire.Heartbeat(worker_id=fake.register.worker_id, incarnation=fake.register.incarnation, seq=7)
    sent = [0]

    def alive(m) -> bool:  # the answer to our probe heartbeat
        return isinstance(m, wire.Heartbeat) or (isinstance(m, wire.Error) and "not registered" in m.error.message)

    def ensure_registered() -> None:
        registered.send(wire.encode(fake.register))
        got = registered.replies(lambda m: isinstance(m, (wire.Accept, wire.Reject, wire.Challenge)))
        if isinstance(got[-1], wire.Challenge):  # prove the segments are ours
            registered.send(wire.encode(fake.proven(got[-1].nonce, endpoint)))
            got = registered.replies(lambda m: isinstance(m, (wire.Accept, wire.Reject)))
        assert isinstance(got[-1], wire.Accept), got[-1]

    ensure_registered()

    @settings(max_examples=examples, **_FUZZ)
    @given(st.data())
    def fuzz(data):
        who = data.draw(st.sampled_from(["registered", "anon"]), label="who")
        dealer = registered if who == "registered" else anon
        for frames in [_draw_frames(data, seeds, fake) for _ in range(data.draw(st.integers(1, 3)))]:
            dealer.send(*frames)
            sent[0] += 1
        # every example ends with a probe the prefill must answer (replies to the fuzz before it
        # are read and dropped); a registered dealer knocked out by a fuzzed register re-registers
        registered.send(wire.encode(hb))
        got = registered.replies(alive)
        if isinstance(got[-1], wire.Error):
            ensure_registered()
        anon.send(wire.encode(hb))
        anon.replies(alive)

    try:
        fuzz()
    finally:
        registered.close()
        anon.close()
    return sent[0]


def _control_fuzz_then_serve(workers, examples: int) -> None:
    p, ep = workers.prefill(ROOMY, **FAULT)
    free0 = prefill_requests(p)["free"]
    before = p.command({"cmd": "stats"}, "stats")["stats"]
    fake = FakeDecode()
    Dealer.seen = {}
    t0 = time.monotonic()
    try:
        sent = _fuzz_control(ep, fake, examples)
    finally:
        fake.close()
    took = time.monotonic() - t0
    after = p.command({"cmd": "stats"}, "stats")["stats"]
    assert Dealer.seen.get("error", 0) > 0  # refusals were answered
    # every refusal was a decision, not a handler tripping over a frame validation let through
    assert "Traceback" not in p.stderr_text(), p.stderr_text()[-3000:]
    # nothing of the fuzz is left in flight, no page leaked, and a good decode is served
    # (a request the fuzz sent last may still be finishing its copy on a busy host)
    r = wait_until(  # (a request the fuzz left without a verdict ends at its deadline)
        "the fuzz's requests to end", lambda: (lambda r: None if r["in_flight"] else r)(prefill_requests(p)), 40
    )
    assert r["in_flight"] == [] and r["free"] == free0, r["in_flight"]
    d = workers.decode(ep, ROOMY, worker_id="decode-after-fuzz", **FAULT)
    ev = first_event(d)
    assert ev["event"] == "ready", ev
    lengths = [100, 300, 1000, 129]
    results, done = run_batch(d, lengths, concurrency=2)
    assert_all_verified(results, lengths)
    assert done["free"] == ev["free"]
    wait_until("the prefill's pages back", lambda: prefill_requests(p)["free"] == free0, 10)
    tally(
        "control-socket fuzz",
        results,
        leaked(free0, r["free"]),
        None,
        f"{sent} fuzz messages in {took:.1f} s; replies "
        + ", ".join(f"{k} {v}" for k, v in sorted(Dealer.seen.items())),
    )
    print(
        f"\ncontrol fuzz: {sent} messages, transfers failed +"
        f"{after['transfers']['failed'] - before['transfers']['failed']}, replies {dict(sorted(Dealer.seen.items()))}"
    )


def test_control_socket_fuzz(workers):
    _control_fuzz_then_serve(workers, FUZZ_EXAMPLES)


@pytest.mark.slow
def test_control_socket_fuzz_long(workers):
    _control_fuzz_then_serve(workers, FUZZ_EXAMPLES_SLOW)


# --- HTTP -----------------------------------------------------------------------------------------

TOKEN = "fuzz-token"
_ALLOWED = {200, 202, 400, 401, 404, 405, 409, 422, 503}


def _http_fuzz(examples: int) -> None:
    import warnings

    with warnings.catch_warnings():  # starlette nags about httpx vs httpx2 on import
        warnings.simplefilter("ignore")
        from fastapi.testclient import TestClient

    from pdstate.service.server import WorkerStatus
    from pdstate.settings.config import WorkerConfig
    from pdstate.status.api import create_app

    with served_pair(ROOMY, **FAULT) as (p, d):
        free_d, free_p = d.free_counts(), p.free_counts()
        cfg = WorkerConfig.model_validate({"role": "decode", "control": {"peer": p.endpoint}})
        source = WorkerStatus(d, cfg)
        client = TestClient(create_app(source, token=TOKEN.encode()), raise_server_exceptions=False)
        doc = client.get("/v1/compat").json()
        statuses: dict[int, int] = {}
        auths = [
            {},
            {"Authorization": f"Bearer {TOKEN}"},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "Basic Zm9vOmJhcg=="},
            {"Authorization": "Bearer"},
        ]

        def mutate_doc(data, node, depth=0):
            if isinstance(node, dict) and node and depth < 6 and data.draw(st.booleans()):
                k = data.draw(st.sampled_from(sorted(node)))
                return {**node, k: mutate_doc(data, node[k], depth + 1)}
            if isinstance(node, list) and node and depth < 6 and data.draw(st.booleans()):
                i = data.draw(st.integers(0, len(node) - 1))
                return node[:i] + [mutate_doc(data, node[i], depth + 1)] + node[i + 1 :]
            return data.draw(
                st.recursive(
                    st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=20), st.floats()),
                    lambda s: st.lists(s, max_size=3) | st.dictionaries(st.text(max_size=6), s, max_size=3),
                    max_leaves=8,
                )
            )

        def post_json(method, path, body, headers):
            # json.dumps writes Infinity/NaN (as Python's and many clients' encoders do)
            return client.request(
                method, path, content=json.dumps(body).encode(), headers={**headers, "Content-Type": "application/json"}
            )

        @settings(max_examples=examples, **_FUZZ)
        @given(st.data())
        def fuzz(data):
            route = data.draw(
                st.sampled_from(
                    [
                        ("POST", "/v1/transfers"),
                        ("POST", "/v1/compat/check"),
                        ("POST", "/v1/handshake"),
                        ("GET", "/v1/transfers/{x}"),
                        ("GET", "/readyz"),
                        ("GET", "/metrics"),
                        ("DELETE", "/v1/transfers"),
                    ]
                ),
                label="route",
            )
            method, path = route
            if "{x}" in path:
                path = path.replace(
                    "{x}",
                    data.draw(
                        st.one_of(
                            st.integers(-(1 << 70), 1 << 70).map(str),
                            st.text(alphabet="abc%/.-0123456789", max_size=20),
                        )
                    ),
                )
            headers = data.draw(st.sampled_from(auths), label="auth")
            kind = data.draw(st.sampled_from(["json", "mutated", "raw"]), label="body")
            if path == "/v1/transfers" and kind == "mutated":
                body = {
                    "tokens": data.draw(st.integers(-5, 3000)),
                    "room": data.draw(st.none() | st.integers(-2, 1 << 64)),
                }
                if data.draw(st.booleans()):
                    body[data.draw(st.sampled_from(["tokens", "room", "x"]))] = data.draw(_json)
                r = post_json(method, path, body, headers)
            elif path == "/v1/compat/check" and kind == "mutated":
                r = post_json(method, path, mutate_doc(data, doc), headers)
            elif kind == "raw":
                r = client.request(
                    method,
                    path,
                    content=data.draw(st.binary(max_size=200)),
                    headers={**headers, "Content-Type": "application/json"},
                )
            else:
                r = post_json(method, path, data.draw(_json), headers)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code in _ALLOWED, (method, path, r.status_code, r.text[:300])

        _json = st.recursive(
            st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.floats(), st.text(max_size=20)),
            lambda s: st.lists(s, max_size=4) | st.dictionaries(st.text(max_size=8), s, max_size=4),
            max_leaves=12,
        )
        fuzz()
        # the worker still serves: ready again (a fuzzed POST /v1/handshake re-registers) and verified
        deadline = time.monotonic() + 10
        while client.get("/readyz").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.02)
        r = client.post("/v1/transfers", json={"tokens": 700}, headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200 and r.json()["status"] == "success" and r.json()["verified"], r.text
        deadline = time.monotonic() + 10
        while (d.free_counts() != free_d or p.free_counts() != free_p) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert d.free_counts() == free_d and p.free_counts() == free_p
        assert not d.status().dead_threads and not p.status().dead_threads
        total = sum(statuses.values())
        tally(
            "HTTP API fuzz",
            [r.json()],
            0,
            None,
            f"{total} requests: " + ", ".join(f"{k}x{v}" for k, v in sorted(statuses.items())),
        )


def test_http_api_fuzz():
    _http_fuzz(200)


@pytest.mark.slow
def test_http_api_fuzz_long():
    _http_fuzz(3000)


# --- crafted transfer requests --------------------------------------------------------------------


def _packed(xs, dtype="<i4") -> wire.PackedIndices:
    return wire.PackedIndices(dtype=dtype, data=np.asarray(xs, dtype=np.int64).astype(dtype).tobytes())


def test_crafted_transfer_requests_are_refused_and_touch_nothing():
    # the crafted requests ask for no digest: the prefill takes them (transfer.verify = off), so
    # what refuses them is the planner, as it would a digested one
    with served_pair(TINY, prefill={"transfer_verify": "off"}, **FAULT) as (p, d):
        free_p = p.free_counts()
        # the crafter owns its memory (a decode can only ever name its own segments)
        crafter = FakeDecode(TINY, worker_id="crafter")
        regions = crafter.memory.regions()
        chans = channels_of(crafter.kv_args)
        names = [c.name for c in chans]
        assert names == ["main_kv", "swa", "c128_state", "swa"]  # target main KV, SWA, C128; draft SWA
        cap = [int((c.lens // c.items).min()) for c in chans]
        j_main = int(np.argmin(chans[0].lens // chans[0].items))
        main_past = (
            f"main KV: decode index {cap[0]} is past buffer {j_main} "
            f"({int(chans[0].lens[j_main])} bytes = {cap[0]} items of {int(chans[0].items[j_main])} bytes)"
        )
        j_c = int(np.argmin(chans[2].lens // chans[2].items))
        c128_past = (
            f"component 1 (c128_state): decode index {cap[2]} is past buffer {j_c} "
            f"({int(chans[2].lens[j_c])} bytes = {cap[2]} items of {int(chans[2].items[j_c])} bytes)"
        )
        huge = 1 << 40
        main_huge = main_past.replace(f"decode index {cap[0]} ", f"decode index {huge} ")
        good = {"main": [1, 2], "swa": [1, 2], "c128": [3], "draft": [1, 2]}  # seq_len 300: 2, 2, 1, 2
        absurd = 1_500_000  # a 6 MB list: inside the frame limit, far past any layout

        def tr(room, seq_len=300, main=None, swa=None, c128=None, draft=None, lists=None, main_dtype="<i4"):
            state = (
                lists
                if lists is not None
                else [
                    _packed(good["swa"] if swa is None else swa),
                    _packed(good["c128"] if c128 is None else c128),
                    _packed(good["draft"] if draft is None else draft),
                ]
            )
            return wire.AgentRequest(
                room=room,
                seq_len=seq_len,
                deadline_s=5,
                digest=False,
                dst_state_indices=state,
                dst_kv_pages=_packed(good["main"] if main is None else main, main_dtype),
            )

        cases = [
            ("past the buffer", tr(1, main=[1, cap[0]]), "IndexOutOfRange", main_past),
            ("far past (int64)", tr(2, main=[1, huge], main_dtype="<i8"), "IndexOutOfRange", main_huge),
            ("past a state buffer", tr(3, c128=[cap[2]]), "IndexOutOfRange", c128_past),
            ("negative", tr(4, main=[-1, 2]), "IndexOutOfRange", "main KV: decode index -1 is negative"),
            (
                "negative state",
                tr(5, draft=[1, -7]),
                "IndexOutOfRange",
                "component 2 (swa): decode index -7 is negative",
            ),
            ("duplicated", tr(6, main=[2, 2]), "IndexOutOfRange", "main KV: decode indices contain duplicates"),
            (
                "duplicated state",
                tr(7, swa=[1, 1]),
                "IndexOutOfRange",
                "component 0 (swa): decode indices contain duplicates",
            ),
            (
                "padding page",
                tr(8, main=[0, 1]),
                "PaddingPageIndex",
                "main KV: decode index 0 is the reserved padding page",
            ),
            (
                "padding SWA page",
                tr(9, swa=[0, 1]),
                "PaddingPageIndex",
                "component 0 (swa): decode index 0 is the reserved padding page",
            ),
            (
                "padding draft page",
                tr(10, draft=[1, 0]),
                "PaddingPageIndex",
                "component 2 (swa): decode index 0 is the reserved padding page",
            ),
            (
                "too few indices",
                tr(11, main=[1]),
                "IndexCountMismatch",
                "main KV: index count mismatch: prefill=2, decode=1",
            ),
            (
                "too many indices",
                tr(12, c128=[1, 2]),
                "IndexCountMismatch",
                "component 1 (c128_state): index count mismatch: prefill=1, decode=2",
            ),
            (
                "absurdly long list",
                tr(13, main=np.arange(1, absurd + 1)),
                "IndexCountMismatch",
                f"main KV: index count mismatch: prefill=2, decode={absurd}",
            ),
            (
                "missing component list",
                tr(14, lists=[_packed([1, 2]), _packed([3])]),
                "IndexCountMismatch",
                "state index lists: prefill sent 3, decode sent 2, layout has 3 components",
            ),
            (
                "extra component list",
                tr(15, lists=[_packed([1, 2]), _packed([3]), _packed([1, 2]), _packed([4])]),
                "IndexCountMismatch",
                "state index lists: prefill sent 3, decode sent 4, layout has 3 components",
            ),
            (
                "valid but one list",
                tr(16, c128=[cap[2] + 5]),
                "IndexOutOfRange",
                c128_past.replace(f"decode index {cap[2]} ", f"decode index {cap[2] + 5} "),
            ),
            (
                "absurd seq_len",
                tr(17, seq_len=1 << 24),
                "AllocationError",
                f"seq_len {1 << 24} exceeds the pool of {rq.capacity_tokens(p.pools)} tokens",
            ),
        ]
        raw = Dealer(p.endpoint)
        assert isinstance(crafter.handshake(raw), wire.Accept)
        fill_regions(regions, SENTINEL)
        outcomes = []
        for label, msg, etype, text in cases:
            reply = raw.ask(msg)
            assert isinstance(reply, wire.TransferDone) and reply.room == msg.room, (label, reply)
            assert reply.status == "failed", (label, reply)
            assert reply.error.model_dump() == {"type": etype, "message": text}, (label, reply.error)
            outcomes.append({"status": "failed", "error": reply.error.model_dump()})
        untouched = [np.full(r.nbytes, SENTINEL, dtype=np.uint8) for r in regions]
        assert compare_images(regions, untouched) is None, "a refused request changed the decode's pools"
        # a valid crafted request: only its own destination items change
        lists = [np.array(good["main"]), np.array([2, 1]), np.array([5]), np.array([2, 1])]
        msg = tr(99, main=lists[0], swa=lists[1], c128=lists[2], draft=lists[3])
        reply = raw.ask(msg)
        assert reply.status == "success", reply
        problem = compare_images(regions, expected_images(regions, crafter.kv_args, 99, lists))
        assert problem is None, problem
        outcomes.append({"status": "success", "error": None})
        raw.close()
        crafter.close()
        # the real decode is still served
        assert transfer(d, 300, deadline_s=10).verified
        wait_until("the prefill's pages back", lambda: p.free_counts() == free_p, 10)
        assert p.stats.snapshot().transfers["failed"] >= len(cases)
    tally("crafted TransferRequests", outcomes, 0, None, f"{len(cases)} refused, 0 bytes changed; 1 valid")
