"""Wire codec: exported schemas and golden vectors, auth, and refusal of every kind of bad frame.

Every refusal is asserted with its exact class and message; a hypothesis test checks that
``decode`` only ever raises ``ProtocolError``/``AuthError`` subclasses, whatever it is fed.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib.util
import json
import random
import sys
import types
import typing

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdstate.errors import AuthError, ProtocolError, VersionMismatch, error_from_wire
from pdstate.protocol import wire
from pdstate.protocol.report import ErrorInfo
from tests.support.paths import REPO

PROTO = REPO / "proto"
KINDS = sorted(wire.MESSAGES)
KNOWN = str(KINDS)


def _load_export_tool():
    spec = importlib.util.spec_from_file_location("export_proto", REPO / "tools" / "export_proto.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("export_proto", mod)
    spec.loader.exec_module(mod)
    return mod


export_proto = _load_export_tool()


def vector(name: str) -> bytes:
    return (PROTO / "vectors" / f"{name}.msgpack").read_bytes()


def frame(kind: str, body, v: int = 1, **extra) -> bytes:
    """A hand-built envelope around a msgpack-encoded ``body``."""
    env = {"v": v, "kind": kind, "body": msgpack.packb(body, use_bin_type=True), **extra}
    return msgpack.packb(env, use_bin_type=True)


def body_of(name: str) -> dict:
    return msgpack.unpackb(msgpack.unpackb(vector(name), raw=False)["body"], raw=False)


def refused(data: bytes, cls: type[BaseException], message: str, **kw) -> None:
    with pytest.raises(cls) as info:
        wire.decode(data, **kw)
    assert type(info.value) is cls
    assert str(info.value) == message


# --- exported schemas -------------------------------------------------------------------------


def test_schema_files_cover_every_kind():
    files = sorted(p.stem for p in (PROTO / "schema").glob("*.json"))
    assert files == KINDS, "proto/schema is stale: run `python tools/export_proto.py`"


@pytest.mark.parametrize("kind", KINDS)
def test_exported_schema_equals_model_schema(kind):
    path = PROTO / "schema" / f"{kind}.json"
    expected = export_proto.schema_text(wire.json_schemas()[kind])
    assert path.read_text() == expected, (
        f"proto/schema/{kind}.json differs from wire.json_schemas()['{kind}']: "
        "run `python tools/export_proto.py` (and bump the protocol version if fields changed)"
    )
    assert json.loads(path.read_text()) == json.loads(json.dumps(wire.json_schemas()[kind]))


# --- golden vectors ---------------------------------------------------------------------------


def test_vector_files_cover_every_kind():
    names = sorted(p.name for p in (PROTO / "vectors").iterdir() if p.suffix in (".msgpack", ".json"))
    expected = sorted(
        [f"{k}.msgpack" for k in KINDS]
        + [f"{k}.json" for k in KINDS]
        + [
            f"{n}.{ext}"
            for n in (
                export_proto.AUTHED_NAME,
                export_proto.SEQ_LEN_NAME,
                export_proto.VERIFY_NAME,
                export_proto.DIGEST_FORM_NAME,
                export_proto.SAMPLE_RULE_NAME,
            )
            for ext in ("msgpack", "json")
        ]
    )
    assert names == expected, "proto/vectors is stale: run `python tools/export_proto.py`"


@pytest.mark.parametrize("kind", KINDS)
def test_golden_vector_decodes_and_reencodes_byte_exact(kind):
    data = vector(kind)
    msg = wire.decode(data)
    assert type(msg) is wire.MESSAGES[kind]
    assert wire.encode(msg) == data
    # and again through a fresh model built from the dump (no hidden state in the instance)
    assert wire.encode(type(msg).model_validate(msg.model_dump())) == data


@pytest.mark.parametrize(
    "name",
    KINDS
    + [
        export_proto.AUTHED_NAME,
        export_proto.SEQ_LEN_NAME,
        export_proto.VERIFY_NAME,
        export_proto.DIGEST_FORM_NAME,
        export_proto.SAMPLE_RULE_NAME,
    ],
)
def test_golden_vector_json_matches_its_bytes(name):
    text = (PROTO / "vectors" / f"{name}.json").read_text()
    assert text == export_proto.human_text(vector(name))


def test_optional_seq_len_is_absent_unless_set_and_round_trips_when_set():
    """``AgentRequest.seq_len`` came after the first agent vector: unset, the frame is the old
    one byte for byte (no ``seq_len`` key in the body); set, it decodes and re-encodes exactly."""
    import msgpack

    old = wire.decode(vector("agent_request"))
    assert old.seq_len is None
    assert "seq_len" not in msgpack.unpackb(msgpack.unpackb(vector("agent_request"))["body"])
    data = vector(export_proto.SEQ_LEN_NAME)
    msg = wire.decode(data)
    assert msg.seq_len == 300 and wire.encode(msg) == data
    assert msg.model_copy(update={"seq_len": None}) == old
    with pytest.raises(
        ProtocolError, match=r"invalid agent_request: seq_len: Input should be less than or equal to 16777216"
    ):
        wire.decode(wire.encode(old.model_copy(update={"seq_len": (1 << 24) + 1})))


@pytest.mark.parametrize(
    ("name", "kind", "fields"),
    [
        (export_proto.VERIFY_NAME, "agent_request", {"verify": "sampled", "digest_form": "device"}),
        (export_proto.DIGEST_FORM_NAME, "transfer_done", {"digest_form": "device"}),
        (export_proto.SAMPLE_RULE_NAME, "agent_request", {"verify": "sampled", "sample_rule": 2}),
    ],
)
def test_optional_verify_fields_are_absent_unless_set_and_round_trip_when_set(name, kind, fields):
    """The verification fields came after the first vectors: unset, the frames are the old ones
    byte for byte; set, they decode and re-encode exactly; another value is refused."""
    import msgpack

    old = wire.decode(vector(kind))
    assert not set(fields) & set(msgpack.unpackb(msgpack.unpackb(vector(kind))["body"]))
    data = vector(name)
    msg = wire.decode(data)
    assert {k: getattr(msg, k) for k in fields} == fields and wire.encode(msg) == data
    assert msg.model_copy(update=dict.fromkeys(fields)) == old
    with pytest.raises(ProtocolError, match=f"invalid {kind}: digest_form: Input should be 'device'"):
        wire.decode(wire.encode(old.model_copy(update={"digest_form": "gpu"})))


def test_golden_examples_still_encode_to_the_vectors():
    """The tool's example messages and the committed bytes agree (the vectors are not stale)."""
    for kind, msg in export_proto.examples().items():
        assert wire.encode(msg) == vector(kind), f"run `python tools/export_proto.py` ({kind})"


def test_register_vector_carries_a_consistent_report():
    from pdstate.protocol.report import fingerprint

    msg = wire.decode(vector("register"))
    r = msg.report
    assert r.fingerprint == fingerprint(r.page_size, r.kv_dtype, r.factors)
    assert r.local_check.ok and r.target.mapping_identity == r.draft.mapping_identity
    assert [c.state_type for c in msg.kv.components] == ["swa", "c128_state", "swa"]


def test_transfer_request_vector_unpacks_its_indices():
    msg = wire.decode(vector("transfer_request"))
    assert msg.dst_kv_pages.unpack().tolist() == [1, 2]
    assert [p.unpack().tolist() for p in msg.dst_state_indices] == [[3, 4], [2], [3, 4]]


# --- auth ---------------------------------------------------------------------------------------


TOKEN = b"pdstate-golden-vector-token"


def test_authed_vector_token_is_the_documented_one():
    assert export_proto.GOLDEN_TOKEN == TOKEN
    assert TOKEN.decode() in (PROTO / "vectors" / "README.md").read_text()


def test_authed_vector_verifies_with_the_token():
    data = vector(export_proto.AUTHED_NAME)
    msg = wire.decode(data, token=TOKEN)
    assert msg == wire.Heartbeat(worker_id="decode-0", incarnation="0123456789abcdef", seq=43)
    assert wire.encode(msg, token=TOKEN) == data


def test_authed_vector_tag_is_hmac_sha256_over_version_kind_body():
    env = msgpack.unpackb(vector(export_proto.AUTHED_NAME), raw=False)
    expected = hmac.new(TOKEN, b"1|heartbeat|" + env["body"], hashlib.sha256).digest()
    assert env["auth"] == expected


def test_authed_vector_refused_with_a_wrong_token():
    refused(vector(export_proto.AUTHED_NAME), AuthError, "heartbeat frame carries a wrong auth tag", token=b"other")


def test_frame_without_tag_refused_by_a_worker_with_a_token():
    refused(
        vector("heartbeat"), AuthError, "heartbeat frame carries no auth tag, but this worker requires one", token=TOKEN
    )


def test_stripped_tag_refused():
    env = msgpack.unpackb(vector(export_proto.AUTHED_NAME), raw=False)
    del env["auth"]
    data = msgpack.packb(env, use_bin_type=True)
    refused(data, AuthError, "heartbeat frame carries no auth tag, but this worker requires one", token=TOKEN)


def test_tampered_body_refused():
    env = msgpack.unpackb(vector(export_proto.AUTHED_NAME), raw=False)
    body = msgpack.unpackb(env["body"], raw=False)
    body["seq"] = 44
    env["body"] = msgpack.packb(body, use_bin_type=True)
    refused(msgpack.packb(env, use_bin_type=True), AuthError, "heartbeat frame carries a wrong auth tag", token=TOKEN)


def test_tag_of_the_wrong_kind_refused():
    env = msgpack.unpackb(vector(export_proto.AUTHED_NAME), raw=False)
    env["kind"] = "abort"
    refused(msgpack.packb(env, use_bin_type=True), AuthError, "abort frame carries a wrong auth tag", token=TOKEN)


def test_non_binary_tag_counts_as_missing():
    data = frame("heartbeat", body_of("heartbeat"), auth="not-bytes")
    refused(data, AuthError, "heartbeat frame carries no auth tag, but this worker requires one", token=TOKEN)


def test_worker_without_token_refuses_a_tag():
    # was ignored: a token on one side only left the side with it waiting forever
    refused(
        vector(export_proto.AUTHED_NAME), AuthError, "heartbeat frame carries an auth tag, but this worker has no token"
    )


def test_auth_is_checked_before_the_version():
    data = frame("heartbeat", body_of("heartbeat"), v=2)
    refused(data, AuthError, "heartbeat frame carries no auth tag, but this worker requires one", token=TOKEN)
    body = msgpack.packb(body_of("heartbeat"), use_bin_type=True)
    tag = hmac.new(TOKEN, b"2|heartbeat|" + body, hashlib.sha256).digest()
    authed_v2 = msgpack.packb({"v": 2, "kind": "heartbeat", "body": body, "auth": tag}, use_bin_type=True)
    refused(authed_v2, VersionMismatch, "protocol version mismatch: peer speaks v2, this worker speaks v1", token=TOKEN)


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_round_trips_with_auth(kind):
    msg = wire.decode(vector(kind))
    assert wire.decode(wire.encode(msg, token=TOKEN), token=TOKEN) == msg


# --- bad frames: envelope ---------------------------------------------------------------------


def test_random_bytes_refused():
    data = random.Random(0).randbytes(64)
    refused(data, ProtocolError, "undecodable frame: ExtraData: unpack(b) received extra data.")


def test_reserved_byte_refused():
    refused(b"\xc1", ProtocolError, "undecodable frame: FormatError: ")


def test_empty_frame_refused():
    refused(b"", ProtocolError, "undecodable frame: ValueError: Unpack failed: incomplete input")


def test_truncated_frame_refused():
    refused(vector("abort")[:-3], ProtocolError, "undecodable frame: ValueError: Unpack failed: incomplete input")


def test_trailing_bytes_refused():
    refused(vector("abort") + b"\x00", ProtocolError, "undecodable frame: ExtraData: unpack(b) received extra data.")


@pytest.mark.parametrize(
    "value,name", [([1, 2], "list"), (7, "int"), ("abort", "str"), (b"\x00", "bytes"), (None, "NoneType")]
)
def test_non_map_envelope_refused(value, name):
    refused(
        msgpack.packb(value, use_bin_type=True), ProtocolError, f"frame is a msgpack {name}, expected a map envelope"
    )


@pytest.mark.parametrize("v", [None, "1", 1.0, True, [1]])
def test_envelope_without_integer_version_refused(v):
    env = {"kind": "abort", "body": b""} if v is None else {"v": v, "kind": "abort", "body": b""}
    refused(msgpack.packb(env, use_bin_type=True), ProtocolError, "envelope has no integer protocol version 'v'")


@pytest.mark.parametrize(
    "env",
    [
        {"v": 1, "kind": 5, "body": b""},
        {"v": 1, "kind": b"abort", "body": b""},
        {"v": 1, "body": b""},
        {"v": 1, "kind": "abort", "body": "\x80"},
        {"v": 1, "kind": "abort"},
        {"v": 1, "kind": "abort", "body": {"room": 1, "reason": "x"}},
    ],
)
def test_envelope_needs_string_kind_and_binary_body(env):
    refused(msgpack.packb(env, use_bin_type=True), ProtocolError, "envelope needs a string 'kind' and a binary 'body'")


def test_bytes_keys_are_not_the_envelope():
    data = msgpack.packb({b"v": 1, b"kind": "abort", b"body": b""}, use_bin_type=True)
    refused(data, ProtocolError, "envelope has no integer protocol version 'v'")


@pytest.mark.parametrize("v", [2, 0, -1, 1 << 40])
def test_wrong_version_refused(v):
    data = frame("abort", {"room": 1, "reason": "x"}, v=v)
    refused(data, VersionMismatch, f"protocol version mismatch: peer speaks v{v}, this worker speaks v1")
    assert issubclass(VersionMismatch, ProtocolError)


def test_version_mismatch_survives_the_wire_as_a_reject():
    err = None
    try:
        wire.decode(frame("register", {}, v=2))
    except VersionMismatch as exc:
        err = exc
    reject = wire.decode(wire.encode(wire.Reject(worker_id="prefill-0", error=ErrorInfo.of(err))))
    rebuilt = error_from_wire(reject.error.type, reject.error.message)
    assert type(rebuilt) is VersionMismatch
    assert str(rebuilt) == "protocol version mismatch: peer speaks v2, this worker speaks v1"


def test_unknown_kind_refused():
    refused(frame("hello", {}), ProtocolError, f"unknown message kind 'hello'; known: {KNOWN}")


def test_unknown_kind_is_truncated_in_the_message():
    refused(frame("x" * 500, {}), ProtocolError, f"unknown message kind {'x' * 64!r}; known: {KNOWN}")


def test_oversized_frame_refused_before_decoding():
    data = b"\xc1" * (wire.MAX_FRAME_BYTES + 1)
    refused(data, ProtocolError, "frame of 8388609 bytes exceeds the limit of 8388608 bytes")
    assert wire.MAX_FRAME_BYTES == 8 * 1024 * 1024


def test_frame_over_a_custom_limit_refused():
    data = vector("abort")
    refused(data, ProtocolError, f"frame of {len(data)} bytes exceeds the limit of 16 bytes", max_frame_bytes=16)
    assert wire.decode(data, max_frame_bytes=len(data)).room == 7


def test_body_that_is_not_msgpack_refused():
    data = msgpack.packb({"v": 1, "kind": "abort", "body": b"\xc1"}, use_bin_type=True)
    refused(data, ProtocolError, "undecodable abort body: FormatError: ")


def test_body_that_is_not_a_map_refused():
    data = msgpack.packb({"v": 1, "kind": "abort", "body": msgpack.packb([7, "x"])}, use_bin_type=True)
    refused(data, ProtocolError, "abort body is a msgpack list, expected a map")


# --- bad frames: bodies -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body,message",
    [
        (
            {"room": "x", "reason": "r"},
            "invalid abort: room: Input should be a valid integer, unable to parse string as an integer (1 error(s))",
        ),
        ({"room": 1, "reason": 5}, "invalid abort: reason: Input should be a valid string (1 error(s))"),
        ({"room": [1], "reason": "r"}, "invalid abort: room: Input should be a valid integer (1 error(s))"),
        (
            {"room": 1.5, "reason": "r"},
            "invalid abort: room: Input should be a valid integer, got a number with a fractional part (1 error(s))",
        ),
        ({"room": -1, "reason": "r"}, "invalid abort: room: Input should be greater than or equal to 0 (1 error(s))"),
        (
            {"room": 1 << 63, "reason": "r"},
            "invalid abort: room: Input should be less than 9223372036854775808 (1 error(s))",
        ),
        (
            {"room": 1, "reason": "r" * 1025},
            "invalid abort: reason: String should have at most 1024 characters (1 error(s))",
        ),
    ],
)
def test_wrong_field_types_and_ranges_refused(body, message):
    refused(frame("abort", body), ProtocolError, message)


@pytest.mark.parametrize(
    "kind,body,message",
    [
        ("abort", {"room": 1}, "invalid abort: reason: Field required (1 error(s))"),
        ("abort", {}, "invalid abort: room: Field required (2 error(s))"),
        ("heartbeat", {"worker_id": "d"}, "invalid heartbeat: incarnation: Field required (2 error(s))"),
        ("register", {}, "invalid register: worker_id: Field required (6 error(s))"),
        ("transfer_request", {"room": 1}, "invalid transfer_request: seq_len: Field required (4 error(s))"),
    ],
)
def test_missing_fields_refused(kind, body, message):
    refused(frame(kind, body), ProtocolError, message)


def test_unknown_field_refused():
    refused(
        frame("abort", {"room": 1, "reason": "r", "extra": 1}),
        ProtocolError,
        "invalid abort: extra: Extra inputs are not permitted (1 error(s))",
    )


def test_wrong_literal_refused():
    body = body_of("transfer_done") | {"status": "maybe"}
    refused(
        frame("transfer_done", body),
        ProtocolError,
        "invalid transfer_done: status: Input should be 'success' or 'failed' (1 error(s))",
    )
    body = body_of("register") | {"role": "prefill"}
    refused(frame("register", body), ProtocolError, "invalid register: role: Input should be 'decode' (1 error(s))")


def test_nan_deadline_refused():
    body = body_of("transfer_request") | {"deadline_s": float("nan")}
    refused(
        frame("transfer_request", body),
        ProtocolError,
        "invalid transfer_request: deadline_s: Input should be less than or equal to 3600 (1 error(s))",
    )


def _request_with(dst_kv_pages) -> bytes:
    body = body_of("transfer_request") | {"dst_kv_pages": dst_kv_pages}
    return frame("transfer_request", body)


@pytest.mark.parametrize(
    "dtype,data,message",
    [
        ("<i4", b"\x01\x00\x00\x00\x02", "Value error, 5 bytes is not a whole number of 4-byte indices"),
        ("<i8", b"\x01\x00\x00\x00", "Value error, 4 bytes is not a whole number of 8-byte indices"),
        ("<i8", b"\x00" * 12, "Value error, 12 bytes is not a whole number of 8-byte indices"),
    ],
)
def test_packed_indices_with_a_partial_item_refused(dtype, data, message):
    refused(
        _request_with({"dtype": dtype, "data": data}),
        ProtocolError,
        f"invalid transfer_request: dst_kv_pages.data: {message} (1 error(s))",
    )


def test_packed_indices_with_an_unknown_dtype_refused():
    refused(
        _request_with({"dtype": ">i4", "data": b""}),
        ProtocolError,
        "invalid transfer_request: dst_kv_pages.dtype: Input should be '<i4' or '<i8' (1 error(s))",
    )


def test_packed_indices_as_a_msgpack_array_refused():
    refused(
        _request_with([1, 2, 3]),
        ProtocolError,
        "invalid transfer_request: dst_kv_pages: Input should be a valid dictionary or instance of PackedIndices (1 error(s))",
    )


def test_packed_indices_over_the_limit_refused():
    # 2**22 int32 indices (16 MiB) do not fit in a default 8 MiB frame: raise the frame limit to
    # reach the per-list limit at all.
    data = b"\x00" * (4 * (wire.MAX_INDICES + 1))
    refused(
        _request_with({"dtype": "<i4", "data": data}),
        ProtocolError,
        f"invalid transfer_request: dst_kv_pages.data: Value error, {wire.MAX_INDICES + 1} indices exceed the limit of {wire.MAX_INDICES} (1 error(s))",
        max_frame_bytes=4 * wire.MAX_FRAME_BYTES,
    )
    refused(
        _request_with({"dtype": "<i4", "data": data}),
        ProtocolError,
        f"frame of {len(_request_with({'dtype': '<i4', 'data': data}))} bytes exceeds the limit of 8388608 bytes",
    )


def test_too_many_index_lists_refused():
    body = body_of("transfer_request")
    body["dst_state_indices"] = [body["dst_kv_pages"]] * (wire.MAX_COMPONENTS + 1)
    refused(
        frame("transfer_request", body),
        ProtocolError,
        "invalid transfer_request: dst_state_indices: List should have at most 16 items after validation, not 17 (1 error(s))",
    )


def _register_with(**kv_changes) -> bytes:
    body = body_of("register")
    body["kv"] = body["kv"] | kv_changes
    return frame("register", body)


@pytest.mark.parametrize(
    "changes,message",
    [
        (
            {"kv_data_ptrs": [1] * (wire.MAX_BUFFERS + 1)},
            "kv.kv_data_ptrs: List should have at most 4096 items after validation, not 4097",
        ),
        (
            {"kv_data_lens": [1] * (wire.MAX_BUFFERS + 1)},
            "kv.kv_data_lens: List should have at most 4096 items after validation, not 4097",
        ),
        ({"kv_data_ptrs": [-1, 1, 2]}, "kv.kv_data_ptrs.0: Input should be greater than or equal to 0"),
        ({"kv_item_lens": [1, -5, 2]}, "kv.kv_item_lens.1: Input should be greater than or equal to 0"),
        # msgpack has no integer >= 2**64; a float is the only way to send one
        (
            {"kv_data_ptrs": [1, 2, float(1 << 64)]},
            "kv.kv_data_ptrs.2: Unable to parse input string as an integer, exceeded maximum size",
        ),
        (
            {"kv_data_ptrs": [1, 2, 1e300]},
            "kv.kv_data_ptrs.2: Unable to parse input string as an integer, exceeded maximum size",
        ),
        ({"kv_data_ptrs": "0x1000"}, "kv.kv_data_ptrs: Input should be a valid list"),
    ],
)
def test_register_with_absurd_pointer_lists_refused(changes, message):
    refused(_register_with(**changes), ProtocolError, f"invalid register: {message} (1 error(s))")


def test_register_with_absurd_component_lists_refused():
    body = body_of("register")
    comp = dict(body["kv"]["components"][0])
    comp["ptrs"] = [1] * (wire.MAX_BUFFERS + 1)
    body["kv"]["components"][0] = comp
    refused(
        frame("register", body),
        ProtocolError,
        "invalid register: kv.components.0.ptrs: List should have at most 4096 items after validation, not 4097 (1 error(s))",
    )
    body = body_of("register")
    body["kv"]["components"] = body["kv"]["components"] * 6  # 18 > MAX_COMPONENTS
    refused(
        frame("register", body),
        ProtocolError,
        "invalid register: kv.components: List should have at most 16 items after validation, not 18 (1 error(s))",
    )


def test_u64_bounds_are_inclusive_of_the_largest_address():
    top = (1 << 64) - 1
    msg = wire.decode(_register_with(kv_data_ptrs=[top, 1, 2]))
    assert msg.kv.kv_data_ptrs[0] == top
    with pytest.raises(OverflowError):
        msgpack.packb(1 << 64)


# --- packed indices -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values,dtype",
    [
        ([], "<i8"),
        ([0, 1, 2], "<i4"),
        ([-(1 << 31), (1 << 31) - 1], "<i4"),
        ([1 << 31], "<i8"),
        ([-(1 << 31) - 1], "<i8"),
    ],
)
def test_packed_indices_pick_the_narrowest_dtype_and_round_trip(values, dtype):
    p = wire.PackedIndices.pack(values)
    assert p.dtype == dtype
    assert len(p) == len(values)
    assert p.unpack().tolist() == values
    assert p.unpack().dtype == np.int64
    assert p.data == np.asarray(values, dtype=dtype).tobytes()


# --- decode never raises anything else -------------------------------------------------------


DECODE_ERRORS = (ProtocolError, AuthError)
_VECTORS = {k: vector(k) for k in KINDS}


def _decode_only_raises_protocol_errors(data: bytes, token: bytes | None = None) -> None:
    try:
        msg = wire.decode(data, token=token)
    except DECODE_ERRORS:
        return
    assert isinstance(msg, wire.Message)
    wire.encode(msg)  # whatever decodes also encodes


_FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FAST
@given(st.binary(max_size=256), st.sampled_from([None, TOKEN]))
def test_decode_of_arbitrary_bytes_only_raises_protocol_errors(data, token):
    _decode_only_raises_protocol_errors(data, token)


@st.composite
def mutated_frames(draw):
    data = bytearray(_VECTORS[draw(st.sampled_from(KINDS))])
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "cut", "insert", "delete"]))
        i = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[i] = draw(st.integers(0, 255))
        elif op == "cut":
            del data[i:]
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and data:
            del data[i : i + draw(st.integers(1, 8))]
    return bytes(data)


@_FAST
@given(mutated_frames(), st.sampled_from([None, TOKEN]))
def test_decode_of_mutated_frames_only_raises_protocol_errors(data, token):
    _decode_only_raises_protocol_errors(data, token)


_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def mutated_bodies(draw):
    """Valid envelopes around bodies with one field replaced, removed or added: reaches validation."""
    kind = draw(st.sampled_from(KINDS))
    body = msgpack.unpackb(msgpack.unpackb(_VECTORS[kind], raw=False)["body"], raw=False)
    key = draw(st.sampled_from(sorted(body)))
    op = draw(st.sampled_from(["replace", "remove", "add"]))
    if op == "replace":
        body[key] = draw(_msgpack_values)
    elif op == "remove":
        del body[key]
    else:
        body[draw(st.text(max_size=8))] = draw(_msgpack_values)
    return frame(kind, body)


@_FAST
@given(mutated_bodies())
def test_decode_of_mutated_bodies_only_raises_protocol_errors(data):
    _decode_only_raises_protocol_errors(data)


def test_seq_len_zero_is_an_empty_transfer_and_negative_is_refused():
    body = body_of("transfer_request") | {"seq_len": 0}
    assert wire.decode(frame("transfer_request", body)).seq_len == 0
    refused(
        frame("transfer_request", body | {"seq_len": -1}),
        ProtocolError,
        "invalid transfer_request: seq_len: Input should be greater than or equal to 0 (1 error(s))",
    )
    refused(
        frame("transfer_request", body | {"seq_len": (1 << 24) + 1}),
        ProtocolError,
        "invalid transfer_request: seq_len: Input should be less than or equal to 16777216 (1 error(s))",
    )


def _model_dump_encoding(msg) -> bytes:
    fields = wire._plain(msg.model_dump(mode="python"))
    for name in getattr(msg, "OMIT_WHEN_NONE", ()):  # a later field, absent unless set
        if fields[name] is None:
            del fields[name]
    body = msgpack.packb(fields, use_bin_type=True)
    return msgpack.packb({"v": wire.PROTOCOL_VERSION, "kind": msg.KIND, "body": body}, use_bin_type=True)


def test_plain_kinds_encode_byte_for_byte_as_their_model_dump():
    """The hot kinds are encoded from their fields, not through ``model_dump``: the bytes must
    not differ, defaults, nested models and lists included."""
    packed = wire.PackedIndices.pack
    msgs = [
        wire.TransferRequest(
            room=(1 << 63) - 1,
            seq_len=0,
            dst_kv_pages=packed([]),
            dst_state_indices=[packed([1 << 40]), packed([3, 4]), packed([])],
            deadline_s=0.25,
        ),
        wire.TransferRequest(room=1, seq_len=9, dst_kv_pages=packed([1]), dst_state_indices=[], deadline_s=30),
        wire.TransferDone(room=3, status="failed", error=ErrorInfo(type="TransferFailed", message="x")),
        wire.TransferDone(room=3, status="success", bytes=5, descriptors=1, digest=b"\x00" * 16, copy_s=1e-3),
        wire.Heartbeat(worker_id="w", incarnation="i", seq=2),
        wire.Busy(room=4, in_flight=64, limit=64),
        wire.Abort(room=5, reason="deadline exceeded on decode"),
        wire.Error(error=ErrorInfo(type="ProtocolError", message="bad"), room=None),
        wire.Error(error=ErrorInfo(type="NotRegistered", message="who"), room=6),
        wire.Landed(room=7, pages=0),
        wire.AgentRequest(
            room=9,
            dst_kv_pages=packed([5, 6, 1 << 40]),
            dst_state_indices=[packed([3]), packed([])],
            dst_aux=wire.AuxDest(ptrs=[1 << 40, 4096], item_lens=[64, 8], index=3),
            deadline_s=600.0,
        ),
        wire.AgentRequest(
            room=10, dst_kv_pages=packed([]), dst_state_indices=[], digest=False, deadline_s=1, seq_len=300
        ),
        wire.AgentVerdict(room=9, status="success"),
        wire.AgentVerdict(room=9, status="failed", error=ErrorInfo(type="DigestMismatch", message="differs")),
        wire.Landed(room=(1 << 63) - 1, pages=12, state_landed=True),
    ]
    assert {type(m) for m in msgs} == wire._PLAIN
    for msg in msgs:
        assert wire.encode(msg) == _model_dump_encoding(msg), msg.KIND
        assert wire.encode(msg, b"t") != wire.encode(msg)  # (the tag is over the same body)
        assert wire.decode(wire.encode(msg)) == msg


def _leaf_types(annotation) -> set:
    """The types a field's annotation lets it hold (``Annotated``, unions and ``Literal`` unwrapped)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return {type(a) for a in args}
    if origin is typing.Annotated:
        return _leaf_types(args[0])
    if args and origin in (typing.Union, types.UnionType):
        return set().union(*(_leaf_types(a) for a in args))
    return {origin or annotation}


def test_flat_kinds_hold_only_scalars_but_their_error():
    """``encode`` copies a flat kind's fields as they are when it has no error (no ``_dump``): no
    other field of it may hold a model or a list (their byte-exact encoding: the test above)."""
    assert wire._FLAT <= wire._PLAIN
    assert wire.TransferDone in wire._FLAT and wire.AgentVerdict in wire._FLAT  # a request's own frames
    scalars = {int, float, str, bytes, bool, type(None)}
    for kind in wire._FLAT:
        for name, field in kind.model_fields.items():
            if name != "error":
                assert _leaf_types(field.annotation) <= scalars, (kind.KIND, name, field.annotation)
    assert _leaf_types(wire.AgentRequest.model_fields["dst_kv_pages"].annotation) == {wire.PackedIndices}
    assert wire.AgentRequest not in wire._FLAT  # its index lists are models


def test_the_written_out_agent_request_encoding_names_every_field_in_order():
    """``encode`` writes an ``AgentRequest``'s fields out by name: a field added to the model must
    be added there too (each later field, left out when ``None``, in ``_REQUEST_LATER``)."""
    fields = list(wire.AgentRequest.model_fields)
    assert fields[6:] == list(wire._REQUEST_LATER)
    assert set(wire._REQUEST_LATER) == wire.AgentRequest.OMIT_WHEN_NONE
    packed = wire.PackedIndices.pack
    full = wire.AgentRequest(
        room=3,
        dst_kv_pages=packed([1, 2]),
        dst_state_indices=[packed([])],
        dst_aux=wire.AuxDest(ptrs=[8], item_lens=[4], index=1),
        deadline_s=5.0,
        seq_len=7,
        verify="sampled",
        digest_form="device",
        sample_rule=3,
    )
    assert list(msgpack.unpackb(msgpack.unpackb(wire.encode(full))["body"])) == fields
    assert wire.encode(full) == _model_dump_encoding(full)


# --- peer strings: clipped or refused where they enter ------------------------------------------


def _register_body(**report_update) -> dict:
    body = body_of("register")
    body["report"] = {**body["report"], **report_update}
    return body


def test_a_peers_long_texts_are_clipped_as_the_frame_decodes():
    n = 3 << 20  # two of them: a frame near the 8 MiB limit
    long_factors = [[k, v] for k, v in body_of("register")["report"]["factors"]] + [["x" * 300, "v" * 1000]]
    reg = wire.decode(frame("register", _register_body(kv_dtype="d" * n, fingerprint="f" * n, factors=long_factors)))
    assert reg.report.kv_dtype == "d" * 239 + "…(+3145489 chars)"  # 256 characters in all
    assert reg.report.fingerprint == "f" * 47 + "…(+3145681 chars)"  # 64
    assert reg.report.factors[-1] == ("x" * 115 + "…(+185 chars)", "v" * 242 + "…(+758 chars)")
    rej = wire.decode(frame("reject", {"worker_id": "p", "error": {"type": "T" * 200, "message": "m" * n}}))
    assert (rej.error.type, rej.error.message) == ("T" * 115 + "…(+85 chars)", "m" * 8175 + "…(+3137553 chars)")
    assert ErrorInfo(**rej.error.model_dump()) == rej.error  # clipped once: the same when validated again


def test_a_peers_texts_at_the_caps_are_kept_whole():
    err = ErrorInfo(type="T" * 128, message="m" * 8192)
    assert wire.decode(wire.encode(wire.Error(error=err))).error == err
    reg = wire.decode(frame("register", _register_body(kv_dtype="d" * 256)))
    assert reg.report.kv_dtype == "d" * 256


@pytest.mark.parametrize(
    "update,message",
    [
        (
            {"factors": [["components", list(range(2000))]]},
            "invalid register: report.factors: Value error, factor 'components' is 5619 bytes encoded, "
            "over the limit of 4096 (1 error(s))",
        ),
        (
            {"factors": [[f"f{i}", i] for i in range(65)]},
            "invalid register: report.factors: Value error, 65 factors, over the limit of 64 (1 error(s))",
        ),
    ],
)
def test_a_peers_oversized_structures_are_refused_unquoted(update, message):
    refused(frame("register", _register_body(**update)), ProtocolError, message)


def test_a_peers_layer_list_and_mapping_identity_are_bounded():
    body = body_of("register")
    target = {**body["report"]["target"], "compression_ratios": [4] * 4097}
    refused(
        frame("register", _register_body(target=target)),
        ProtocolError,
        "invalid register: report.target.compression_ratios: Value error, 4097 layers, over the limit of 4096 "
        "(1 error(s))",
    )
    mi = body["report"]["target"]["mapping_identity"]
    target = {**body["report"]["target"], "mapping_identity": {**mi, "nonce": "n" * 257}}
    refused(
        frame("register", _register_body(target=target)),
        ProtocolError,
        "invalid register: report.target.mapping_identity.nonce: Value error, nonce has 257 characters, "
        "over the limit of 256 (1 error(s))",
    )


def test_an_honest_refusal_of_the_longest_factor_travels_whole():
    """The longest refusal an honest pair can meet: ``components`` of two DeepSeek-V4 layouts of
    61 layers (Pro's), each value quoted whole, under the message cap."""
    from pdstate.errors import LayoutMismatch

    value = [["swa", 125, [149760] * 125], ["c4_kv", 60, [37440] * 60], ["c128_state", 31, [524288] * 31]]
    err = LayoutMismatch.build("components", value, value[:2])
    assert 2000 < len(str(err)) < 8192
    assert (
        error_from_wire(*wire.decode(wire.encode(wire.Error(error=ErrorInfo.of(err)))).error.model_dump().values()).args
        == err.args
    )


def test_a_sample_rule_out_of_range_is_refused():
    old = wire.decode(vector("agent_request"))
    with pytest.raises(
        ProtocolError, match=r"invalid agent_request: sample_rule: Input should be greater than or equal to 1"
    ):
        wire.decode(wire.encode(old.model_copy(update={"verify": "sampled", "sample_rule": 0})))
