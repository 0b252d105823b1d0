"""The hot frames' hand check (``wire.HOT_CHECKS``) against their pydantic models.

A corpus of ``AgentRequest`` and ``TransferDone`` bodies -- the golden vectors, the bodies a
request of each form sends, and each of them broken field by field -- goes through ``decode``
(hand check first) and through the model alone (``wire.validate_body``): both give the same
message (equal fields, the same fields set, the same frame re-encoded) or the same error text.
The hand check must take the well-formed bodies itself, or it would save nothing.
"""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdstate.errors import ProtocolError
from pdstate.protocol import wire
from tests.support.paths import REPO

VECTORS = REPO / "proto" / "vectors"
TOKEN = b"pdstate-golden-vector-token"  # the authed vector's (proto/vectors/README.md)
REQUEST_VECTORS = ["agent_request", "agent_request.sample_rule", "agent_request.seq_len", "agent_request.verify"]
DONE_VECTORS = ["transfer_done", "transfer_done.digest_form"]


def body_of(name: str) -> dict:
    env = msgpack.unpackb((VECTORS / f"{name}.msgpack").read_bytes(), raw=False)
    return msgpack.unpackb(env["body"], raw=False)


def sent_body(msg: wire.Message) -> dict:
    """The body of ``msg``'s frame, as the receiving side unpacks it."""
    return msgpack.unpackb(msgpack.unpackb(wire.encode(msg), raw=False)["body"], raw=False)


def packed(values, dtype: str = "<i4") -> dict:
    return {"dtype": dtype, "data": np.asarray(values, dtype=dtype).tobytes()}


EMPTY = wire.PackedIndices.pack(np.zeros(0, dtype=np.int64))
SENT_REQUESTS = [  # the forms a decode sends: an empty request (the control path alone), digest off and on
    wire.AgentRequest(room=1, dst_kv_pages=EMPTY, dst_state_indices=[], digest=False, deadline_s=30.0, seq_len=0),
    wire.AgentRequest(
        room=(1 << 63) - 1,
        dst_kv_pages=wire.PackedIndices.pack([1 << 40]),
        dst_state_indices=[EMPTY, wire.PackedIndices.pack([3])],
        dst_aux=wire.AuxDest(ptrs=[(1 << 64) - 1], item_lens=[0], index=0),
        deadline_s=3600.0,
        verify="sampled",
        sample_rule=65535,
    ),
]
SENT_DONES = [
    wire.TransferDone(room=0, status="success", copy_s=1.5e-05),
    wire.TransferDone(room=5, status="failed", bytes=(1 << 64) - 1, descriptors=3, digest=b"", digest_form="device"),
]

# values that are not the field's own form: each pydantic refuses or coerces
ODD = [
    None,
    True,
    False,
    -1,
    (1 << 64) - 1,
    1 << 63,
    1.0,
    -0.0,
    math.nan,
    math.inf,
    "1",
    "",
    b"1",
    [],
    {},
    [1],
    {"x": 1},
]
PACKED_ODD = [
    {"dtype": "<i2", "data": b"\x00\x00"},
    {"dtype": "<i4", "data": b"\x00\x00\x00"},
    {"dtype": "<i8", "data": b"\x00" * 12},
    {"dtype": "<i4"},
    {"data": b""},
    {"dtype": "<i4", "data": b"", "x": 1},
    {"dtype": b"<i4", "data": b""},
    {"dtype": "<i4", "data": ""},
    {"dtype": "<i4", "data": "abcd"},
    {"dtype": "<i8", "data": b"", "extra": None},
]


def broken(base: dict) -> list[dict]:
    """``base`` with each field missing, set to each odd value, and with a key too many."""
    out = [dict(base, unknown=1), {}]
    for key in base:
        out.append({k: v for k, v in base.items() if k != key})
        out += [dict(base, **{key: v}) for v in ODD]
    return out


def request_corpus() -> list[dict]:
    bases = [body_of(n) for n in REQUEST_VECTORS] + [sent_body(m) for m in SENT_REQUESTS]
    out = list(bases)
    for base in bases:
        out += broken(base)
        out += [dict(base, dst_kv_pages=p) for p in PACKED_ODD]
        out += [dict(base, dst_state_indices=[p]) for p in PACKED_ODD]
        out += [dict(base, dst_state_indices=[packed([1])] * 17), dict(base, dst_state_indices=[packed([1])] * 16)]
        out += [dict(base, dst_state_indices=(packed([1]),)), dict(base, dst_state_indices=[None])]
        aux = {"ptrs": [1], "item_lens": [8], "index": 0}
        out += [dict(base, dst_aux=a) for a in broken(aux)]
        out += [dict(base, dst_aux=dict(aux, ptrs=[0] * 4097)), dict(base, dst_aux=dict(aux, ptrs=[0] * 4096))]
        out += [dict(base, dst_aux=dict(aux, item_lens=[1, -1])), dict(base, dst_aux=dict(aux, ptrs=[True]))]
        out += [dict(base, deadline_s=v) for v in (0.0, 3600.0, 3600.5, 1e-300, 5)]
        out += [dict(base, seq_len=v) for v in (0, 1 << 24, (1 << 24) + 1)]
        out += [dict(base, verify=v) for v in ("sampled", "full", "Sampled")]
        out += [dict(base, digest_form=v) for v in ("device", "host")]
        out += [dict(base, sample_rule=v) for v in (0, 1, 65535, 65536)]
        out += [dict(base, room=v) for v in (0, (1 << 63) - 1, 1 << 63)]
    return out


def done_corpus() -> list[dict]:
    bases = [body_of(n) for n in DONE_VECTORS] + [sent_body(m) for m in SENT_DONES]
    out = list(bases)
    for base in bases:
        out += broken(base)
        out += [dict(base, status=v) for v in ("success", "failed", "SUCCESS", "ok")]
        out += [dict(base, error={"type": "TransferFailed", "message": "x" * 5000}), dict(base, error={"type": 1})]
        out += [dict(base, compute_s=v) for v in (0.0, -1e-9, 1e300, 2)]
        out += [dict(base, copy_s=v) for v in (0.0, -1e-9, 1e300, 2)]
        out += [dict(base, bytes=v, descriptors=v) for v in (0, (1 << 64) - 1, -(1 << 63))]
        out += [dict(base, digest=v) for v in (b"", b"\x00" * 32, "ab", bytearray(b"ab"))]
    return out


def outcome(fn):
    try:
        msg = fn()
    except ProtocolError as exc:
        return ("refused", type(exc), str(exc))
    return ("message", type(msg), msg, msg.model_fields_set, wire.encode(msg))


def both(cls: type[wire.Message], body: dict):
    """The body's frame through ``decode``, and its unpacked body through the model alone."""
    packed_body = msgpack.packb(body, use_bin_type=True)
    data = msgpack.packb({"v": 1, "kind": cls.KIND, "body": packed_body}, use_bin_type=True)
    unpacked = msgpack.unpackb(packed_body, raw=False)
    return outcome(lambda: wire.decode(data)), outcome(lambda: wire.validate_body(cls, unpacked))


@pytest.mark.parametrize(("cls", "corpus"), [(wire.AgentRequest, request_corpus), (wire.TransferDone, done_corpus)])
def test_the_hand_check_and_the_model_agree_on_every_body(cls, corpus):
    bodies, taken, refused = corpus(), 0, 0
    for body in bodies:
        new, old = both(cls, body)
        assert new == old, body
        taken += wire.HOT_CHECKS[cls](msgpack.unpackb(msgpack.packb(body, use_bin_type=True), raw=False)) is not None
        refused += old[0] == "refused"
    assert refused > len(bodies) // 2  # the corpus is mostly broken frames ...
    assert taken > 20  # ... and the well-formed ones are the hand check's own


@pytest.mark.parametrize("name", REQUEST_VECTORS + DONE_VECTORS)
def test_the_hand_check_takes_the_golden_vectors(name):
    cls = wire.AgentRequest if name.startswith("agent_request") else wire.TransferDone
    body = body_of(name)
    msg = wire.HOT_CHECKS[cls](body)
    assert msg is not None
    assert msg == wire.validate_body(cls, body)
    assert wire.encode(msg) == (VECTORS / f"{name}.msgpack").read_bytes()


@pytest.mark.parametrize("msg", SENT_REQUESTS + SENT_DONES[:1], ids=lambda m: m.KIND)
def test_the_hand_check_takes_what_this_pdstate_sends(msg):
    assert wire.HOT_CHECKS[type(msg)](sent_body(msg)) == msg


_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-2, max_value=(1 << 64) - 1),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=12),
    st.sampled_from(["success", "failed", "sampled", "device", "<i4", "<i8"]),
    st.lists(st.integers(min_value=-1, max_value=9), max_size=3),
    st.fixed_dictionaries({"dtype": st.sampled_from(["<i4", "<i8", "<u4"]), "data": st.binary(max_size=9)}),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cls=st.sampled_from([wire.AgentRequest, wire.TransferDone]),
    base=st.sampled_from(REQUEST_VECTORS + DONE_VECTORS),
    changes=st.dictionaries(
        st.sampled_from(sorted(set(wire.AgentRequest.model_fields) | set(wire.TransferDone.model_fields)) + ["x"]),
        _values,
        max_size=3,
    ),
)
def test_the_hand_check_and_the_model_agree_on_random_changes(cls, base, changes):
    body = dict(body_of(base), **changes)
    new, old = both(cls, body)
    assert new == old


def test_threads_encoding_at_once_each_get_their_own_frames():
    """``encode`` keeps a packer per thread and a head per kind: frames of several kinds, with and
    without a tag, encoded on several threads at once are each the golden vector's bytes."""
    import threading

    names = ["agent_request", "transfer_done", "heartbeat.authed"]
    msgs = {
        n: wire.decode((VECTORS / f"{n}.msgpack").read_bytes(), token=TOKEN if "authed" in n else None) for n in names
    }
    wrong: list[str] = []

    def run(name: str) -> None:
        want = (VECTORS / f"{name}.msgpack").read_bytes()
        for _ in range(300):
            if wire.encode(msgs[name], TOKEN if "authed" in name else None) != want:
                wrong.append(name)

    threads = [threading.Thread(target=run, args=(n,)) for n in names * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


@pytest.mark.parametrize(
    "values",
    [
        (7, "success", 0, 0, None, 0.000123, None),  # an empty request's
        (1 << 62, "success", 1 << 40, 3, b"\x01" * 32, 2.5, "device"),
        (7, "success", np.int64(4096), np.int64(2), None, 0.5, None),  # numpy counts: the model coerces them
        (7, "success", 0, 0, None, math.inf, None),  # out of the hand check's bounds: the model takes it
    ],
)
def test_a_sent_transfer_done_is_the_model_the_constructor_gives(values):
    room, status, n, descriptors, digest, copy_s, form = values
    mine = wire.transfer_done(room, status, n, descriptors, digest, copy_s, form)
    model = wire.TransferDone(
        room=room, status=status, bytes=n, descriptors=descriptors, digest=digest, copy_s=copy_s, digest_form=form
    )
    assert list(mine.__dict__.items()) == list(model.__dict__.items())
    assert mine.model_fields_set == model.model_fields_set
    assert wire.encode(mine) == wire.encode(model)


def test_a_sent_transfer_done_is_refused_as_the_constructor_refuses_it():
    with pytest.raises(ValueError) as mine:
        wire.transfer_done(7, "success", -1, 0, None, 0.0, None)
    with pytest.raises(ValueError) as model:
        wire.TransferDone(room=7, status="success", bytes=-1, descriptors=0, digest=None, copy_s=0.0)
    assert str(mine.value) == str(model.value)
