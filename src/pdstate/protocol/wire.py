"""The control protocol's messages, their msgpack codec, version and size limits.

Every frame is one msgpack map ``{"v": version, "kind": str, "body": bin, "auth": bin?}``; the
envelope is decoded first, then the body (itself a msgpack map) is validated by the pydantic model
registered for ``kind`` (a request's own frames, in the form this pdstate sends them, by a hand
check that builds the same model: ``HOT_CHECKS``). The auth tag, when a shared token is configured, is HMAC-SHA256 over
``v || kind || body`` and is compared in constant time. Index lists travel as packed
little-endian integers (``PackedIndices``), never as msgpack arrays of ints. A peer's texts in
errors and layout reports are clipped, and their structures bounded, as the body validates
(``pdstate.protocol.report``): nothing a frame carries is kept larger downstream.

Version log: ``CHANGELOG.md`` (bump ``PROTOCOL_VERSION`` and add a golden vector in
``proto/vectors/`` for any change of a message's fields, and say so there).
"""

from __future__ import annotations

import builtins
import hashlib
import hmac
import threading
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

import msgpack
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pdstate.errors import AuthError, ProtocolError, VersionMismatch
from pdstate.protocol.report import ErrorInfo, LayoutReport

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 8 * 1024 * 1024
MAX_INDICES = 1 << 22  # per list: far above any 1M-token request in pages or window rows
MAX_BUFFERS = 4096  # per component / main KV
MAX_COMPONENTS = 16
U64 = Annotated[int, Field(ge=0, lt=1 << 64)]
I63 = Annotated[int, Field(ge=0, lt=1 << 63)]
WorkerId = Annotated[str, Field(max_length=128)]
Incarnation = Annotated[str, Field(max_length=64)]


class Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)
    KIND: ClassVar[str]


class PackedIndices(BaseModel):
    """A packed little-endian int32/int64 index array."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    dtype: Literal["<i4", "<i8"]
    data: bytes

    @field_validator("data")
    @classmethod
    def _whole_items(cls, v: bytes, info) -> bytes:
        size = 4 if info.data.get("dtype") == "<i4" else 8
        if len(v) % size:
            raise ValueError(f"{len(v)} bytes is not a whole number of {size}-byte indices")
        if len(v) // size > MAX_INDICES:
            raise ValueError(f"{len(v) // size} indices exceed the limit of {MAX_INDICES}")
        return v

    @classmethod
    def pack(cls, arr) -> PackedIndices:
        a = np.asarray(arr, dtype=np.int64)
        if a.size and a.min() >= -(1 << 31) and a.max() < (1 << 31):
            return cls(dtype="<i4", data=a.astype("<i4").tobytes())
        return cls(dtype="<i8", data=a.astype("<i8").tobytes())

    def unpack(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=self.dtype).astype(np.int64)

    def __len__(self) -> int:
        return len(self.data) // (4 if self.dtype == "<i4" else 8)


class ComponentDesc(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    state_type: str
    ptrs: list[U64] = Field(max_length=MAX_BUFFERS)
    lens: list[U64] = Field(max_length=MAX_BUFFERS)
    item_lens: list[U64] = Field(max_length=MAX_BUFFERS)


class KVDesc(BaseModel):
    """A side's registered buffers (its ``KVArgs`` without Python objects)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kv_data_ptrs: list[U64] = Field(max_length=MAX_BUFFERS)
    kv_data_lens: list[U64] = Field(max_length=MAX_BUFFERS)
    kv_item_lens: list[U64] = Field(max_length=MAX_BUFFERS)
    components: list[ComponentDesc] = Field(max_length=MAX_COMPONENTS)

    @classmethod
    def of(cls, kv_args) -> KVDesc:
        return cls(
            kv_data_ptrs=kv_args.kv_data_ptrs,
            kv_data_lens=kv_args.kv_data_lens,
            kv_item_lens=kv_args.kv_item_lens,
            components=[
                ComponentDesc(state_type=getattr(t, "value", t), ptrs=p, lens=n, item_lens=i)
                for t, p, n, i in zip(
                    kv_args.state_types, kv_args.state_data_ptrs, kv_args.state_data_lens, kv_args.state_item_lens
                )
            ],
        )

    # the attribute names ``compat.check_descriptors`` reads
    @property
    def state_types(self) -> list[str]:
        return [c.state_type for c in self.components]

    @property
    def state_data_ptrs(self) -> list[list[int]]:
        return [c.ptrs for c in self.components]

    @property
    def state_data_lens(self) -> list[list[int]]:
        return [c.lens for c in self.components]

    @property
    def state_item_lens(self) -> list[list[int]]:
        return [c.item_lens for c in self.components]


class EngineDesc(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str = Field(max_length=32)
    endpoint: dict[str, Any]


class Register(Message):
    KIND: ClassVar[str] = "register"
    worker_id: WorkerId
    incarnation: Incarnation
    role: Literal["decode"]
    report: LayoutReport
    kv: KVDesc | None
    engine: EngineDesc


class Accept(Message):
    KIND: ClassVar[str] = "accept"
    worker_id: WorkerId
    incarnation: Incarnation
    report: LayoutReport
    heartbeat_interval_s: float = Field(gt=0)
    peer_timeout_s: float = Field(gt=0)


class Reject(Message):
    KIND: ClassVar[str] = "reject"
    worker_id: WorkerId
    error: ErrorInfo


class Heartbeat(Message):
    KIND: ClassVar[str] = "heartbeat"
    worker_id: WorkerId
    incarnation: Incarnation
    seq: I63


class TransferRequest(Message):
    KIND: ClassVar[str] = "transfer_request"
    room: I63
    seq_len: Annotated[int, Field(ge=0, le=1 << 24)]  # 0: an empty transfer (the control path alone)
    dst_kv_pages: PackedIndices
    dst_state_indices: list[PackedIndices] = Field(max_length=MAX_COMPONENTS)
    deadline_s: float = Field(gt=0, le=3600)


class TransferDone(Message):
    KIND: ClassVar[str] = "transfer_done"
    room: I63
    status: Literal["success", "failed"]
    bytes: U64 = 0
    descriptors: U64 = 0
    digest: builtins.bytes | None = None
    error: ErrorInfo | None = None
    compute_s: float = Field(0.0, ge=0)
    copy_s: float = Field(0.0, ge=0)
    # the form of ``digest`` when it is not the host form (``pdstate.agent.verify``); left out of
    # the frame when ``None`` (``OMIT_WHEN_NONE``)
    digest_form: Literal["device"] | None = None

    OMIT_WHEN_NONE: ClassVar[frozenset[str]] = frozenset({"digest_form"})


class AuxDest(BaseModel):
    """The decode's aux (metadata) buffers and the slot the request's aux lands in."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    ptrs: list[U64] = Field(max_length=MAX_BUFFERS)
    item_lens: list[U64] = Field(max_length=MAX_BUFFERS)
    index: I63


class AgentRequest(Message):
    """Decode -> prefill (agent): where one request's pages, state and aux land."""

    KIND: ClassVar[str] = "agent_request"
    room: I63
    dst_kv_pages: PackedIndices
    dst_state_indices: list[PackedIndices] = Field(max_length=MAX_COMPONENTS)
    dst_aux: AuxDest | None = None
    digest: bool = True
    deadline_s: float = Field(gt=0, le=3600)
    # the request's token count, for a prefill that computes on demand (``pdstate serve``'s
    # synthetic prefill); left out of the frame when ``None`` (``OMIT_WHEN_NONE``)
    seq_len: Annotated[int, Field(ge=0, le=1 << 24)] | None = None
    # the verification level (``transfer.verify``) when it is not ``full`` (``None`` with ``digest``:
    # every byte), and ``"device"`` when the decode digests its memory on its device; both left out
    # of the frame when ``None``
    verify: Literal["sampled"] | None = None
    digest_form: Literal["device"] | None = None
    # with ``verify: "sampled"``: the sampling rule the decode digests by (``pdstate.agent.verify.
    # SAMPLE_RULE``; absent: rule 1, a pdstate from before rule 2); left out of the frame when ``None``
    sample_rule: Annotated[int, Field(ge=1, le=65535)] | None = None

    OMIT_WHEN_NONE: ClassVar[frozenset[str]] = frozenset({"seq_len", "verify", "digest_form", "sample_rule"})


class AgentVerdict(Message):
    """Decode -> prefill (agent): the request's outcome after the decode compared digests."""

    KIND: ClassVar[str] = "agent_verdict"
    room: I63
    status: Literal["success", "failed"]
    error: ErrorInfo | None = None


class Landed(Message):
    """Prefill -> decode (agent, ``digest`` requests only): these bytes of ``room`` are in the
    decode's memory and the prefill writes them no more: the first ``pages`` entries of its
    ``dst_kv_pages`` and, with ``state_landed``, its state indices and aux slot. Cumulative and
    advisory: the decode may hash them before ``TransferDone``; the verdict still compares the
    digests of the whole request."""

    KIND: ClassVar[str] = "landed"
    room: I63
    pages: I63
    state_landed: bool = False


class Abort(Message):
    KIND: ClassVar[str] = "abort"
    room: I63
    reason: str = Field(max_length=1024)


class Busy(Message):
    KIND: ClassVar[str] = "busy"
    room: I63
    in_flight: int
    limit: int


class Error(Message):
    """A frame could not be processed; sent back to its sender when it can be addressed."""

    KIND: ClassVar[str] = "error"
    error: ErrorInfo
    room: I63 | None = None


class Goodbye(Message):
    """Prefill -> decode: this prefill is stopping; every request of the decode with it has ended
    (with ``reason``), and no write of it can still land."""

    KIND: ClassVar[str] = "goodbye"
    worker_id: WorkerId
    incarnation: Incarnation
    reason: str = Field(max_length=1024)


class Challenge(Message):
    """Prefill -> decode: prove that the memory the register names is yours: register again with
    this nonce answered (see ``transfer.engines.shm``)."""

    KIND: ClassVar[str] = "challenge"
    worker_id: WorkerId
    incarnation: Incarnation
    nonce: bytes = Field(min_length=16, max_length=64)


MESSAGES: dict[str, type[Message]] = {
    m.KIND: m
    for m in (
        Register,
        Accept,
        Reject,
        Heartbeat,
        TransferRequest,
        TransferDone,
        Abort,
        Busy,
        Error,
        AgentRequest,
        AgentVerdict,
        Goodbye,
        Challenge,
        Landed,
    )
}


def _tag(token: bytes, v: int, kind: str, body: bytes) -> bytes:
    return hmac.new(token, b"%d|%s|" % (v, kind.encode()) + body, hashlib.sha256).digest()


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


_SCALARS = frozenset({int, float, str, bytes, bool, type(None)})


def _dump(model: BaseModel) -> dict[str, Any]:
    """``model_dump(mode="python")`` of a plain model (every field an int, float, str, bytes, None,
    a plain model or a list of them; no serialisers, aliases or computed fields), read straight
    from the instance: its fields in declaration order, as the validated model holds them."""
    out = {}
    for k, v in model.__dict__.items():
        t = type(v)
        if t in _SCALARS:  # most fields: as they are, without asking the models' ABC
            pass
        elif t is PackedIndices:  # the index lists, the most common model in a frame: no recursion
            v = _packed(v)
        elif t is list:
            v = [_packed(x) if type(x) is PackedIndices else _dump(x) if isinstance(x, BaseModel) else x for x in v]
        elif isinstance(v, BaseModel):
            v = _dump(v)
        elif isinstance(v, list):
            v = [_dump(x) if isinstance(x, BaseModel) else x for x in v]
        out[k] = v
    return out


def _packed(p: PackedIndices) -> dict[str, Any]:
    """``_dump`` of a ``PackedIndices``: its two fields, in their order."""
    return {"dtype": p.dtype, "data": p.data}


def _request_fields(held: dict[str, Any]) -> dict[str, Any]:
    """``_dump`` of an ``AgentRequest`` (its fields ``held``), its later fields left out when
    ``None`` (``OMIT_WHEN_NONE``): the decode's frame of every request, written out."""
    pages, aux = held["dst_kv_pages"], held["dst_aux"]
    out = {
        "room": held["room"],
        "dst_kv_pages": {"dtype": pages.dtype, "data": pages.data},
        "dst_state_indices": [{"dtype": p.dtype, "data": p.data} for p in held["dst_state_indices"]],
        "dst_aux": None if aux is None else _dump(aux),
        "digest": held["digest"],
        "deadline_s": held["deadline_s"],
    }
    for name in _REQUEST_LATER:
        value = held[name]
        if value is not None:
            out[name] = value
    return out


def encode(msg: Message, token: bytes | None = None) -> bytes:
    kind, held = type(msg), msg.__dict__
    if kind is AgentRequest:
        fields = _request_fields(held)  # its later fields already left out when None
    else:
        if kind in _FLAT and held.get("error") is None:
            fields = dict(held)  # ``_dump``'s result: every field a scalar, kept as it is
        else:
            fields = _dump(msg) if kind in _PLAIN else _plain(msg.model_dump(mode="python"))
        for name in getattr(msg, "OMIT_WHEN_NONE", ()):  # fields added to a kind later: absent unless set
            if fields.get(name, 0) is None:
                del fields[name]
    pack = _packer().pack
    body = pack(fields)
    head = _HEADS.get(msg.KIND) or _head(msg.KIND)
    if not token:
        return head[0] + pack(body)
    return head[1] + pack(body) + _AUTH_KEY + pack(_tag(token, PROTOCOL_VERSION, msg.KIND, body))


# A frame's envelope is ``{"v", "kind", "body"(, "auth")}`` in that order (PROTOCOL §3): what
# ``msgpack.packb`` of that map gives, written as its constant head per kind (the map's size,
# ``v`` and ``kind``), then the body and the tag packed as ``bin``. Each thread packs with a
# ``Packer`` of its own (one made per call, as ``packb`` does, was a third of a small frame's
# encode).
_HEADS: dict[str, tuple[bytes, bytes]] = {}
_AUTH_KEY = msgpack.packb("auth")
_PACKERS = threading.local()


def _head(kind: str) -> tuple[bytes, bytes]:
    """The envelope's bytes before the body, without and with an auth tag to follow."""
    rest = msgpack.packb("v") + msgpack.packb(PROTOCOL_VERSION) + msgpack.packb("kind") + msgpack.packb(kind)
    rest += msgpack.packb("body")
    heads = _HEADS[kind] = (b"\x83" + rest, b"\x84" + rest)  # fixmap headers: 3 and 4 entries
    return heads


def _packer() -> msgpack.Packer:
    p = getattr(_PACKERS, "packer", None)
    if p is None:
        p = _PACKERS.packer = msgpack.Packer(use_bin_type=True)
    return p


def decode(frame: bytes, token: bytes | None = None, max_frame_bytes: int = MAX_FRAME_BYTES) -> Message:
    """Decode and validate one frame. Raises ``ProtocolError`` (``VersionMismatch``) or ``AuthError``.

    Order: size, envelope, auth, version, kind, body. A side configured with a token refuses a
    frame without one; a side without a token refuses a frame that carries one (the token is set
    on one side only: both sides say so, instead of one waiting forever).
    """
    if len(frame) > max_frame_bytes:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds the limit of {max_frame_bytes} bytes")
    try:
        env = msgpack.unpackb(frame, raw=False, strict_map_key=True, max_bin_len=max_frame_bytes)
    except Exception as exc:
        raise ProtocolError(f"undecodable frame: {type(exc).__name__}: {exc}") from exc
    if not isinstance(env, dict):
        raise ProtocolError(f"frame is a msgpack {type(env).__name__}, expected a map envelope")
    v, kind, body = env.get("v"), env.get("kind"), env.get("body")
    if not isinstance(v, int) or isinstance(v, bool):
        raise ProtocolError("envelope has no integer protocol version 'v'")
    if not isinstance(kind, str) or not isinstance(body, bytes):
        raise ProtocolError("envelope needs a string 'kind' and a binary 'body'")
    if token:
        # Auth before version (PROTOCOL.md): an unauthenticated sender learns nothing else.
        tag = env.get("auth")
        if not isinstance(tag, bytes):
            raise AuthError(f"{kind[:64]} frame carries no auth tag, but this worker requires one")
        if not hmac.compare_digest(tag, _tag(token, v, kind, body)):
            raise AuthError(f"{kind[:64]} frame carries a wrong auth tag")
    elif "auth" in env:
        raise AuthError(f"{kind[:64]} frame carries an auth tag, but this worker has no token")
    if v != PROTOCOL_VERSION:
        raise VersionMismatch(f"protocol version mismatch: peer speaks v{v}, this worker speaks v{PROTOCOL_VERSION}")
    cls = MESSAGES.get(kind)
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind[:64]!r}; known: {sorted(MESSAGES)}")
    try:
        fields = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:
        raise ProtocolError(f"undecodable {kind} body: {type(exc).__name__}: {exc}") from exc
    if not isinstance(fields, dict):
        raise ProtocolError(f"{kind} body is a msgpack {type(fields).__name__}, expected a map")
    check = HOT_CHECKS.get(cls)
    if check is not None:
        msg = check(fields)
        if msg is not None:
            return msg
    return validate_body(cls, fields)


def validate_body(cls: type[Message], fields: dict) -> Message:
    """The message ``cls`` of a decoded body, validated by its pydantic model; what does not
    validate is a ``ProtocolError`` naming the first error and how many there were."""
    try:
        return cls.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "<body>"
        raise ProtocolError(f"invalid {cls.KIND}: {loc}: {first['msg']} ({exc.error_count()} error(s))") from exc


# Encoding reads a plain model's fields straight from it (``_dump``: the same dict as
# ``model_dump``, so the same bytes; measured 5 us for a TransferRequest against 8).
_PLAIN = frozenset({TransferRequest, TransferDone, Heartbeat, Busy, Abort, Error, Landed, AgentRequest, AgentVerdict})
# the plain kinds whose every field is a scalar (an int, float, str, bytes, bool or None) but
# ``error`` (an ``ErrorInfo``): without an error their ``_dump`` is a copy of their fields (a
# request's TransferDone and verdict, each heartbeat)
_FLAT = frozenset({TransferDone, Heartbeat, Busy, Abort, Landed, AgentVerdict})
# an ``AgentRequest``'s fields after its first six, in their order: each left out when ``None``
_REQUEST_LATER = tuple(name for name in AgentRequest.model_fields if name in AgentRequest.OMIT_WHEN_NONE)


def json_schemas() -> dict[str, dict]:
    """JSON Schema of every message, keyed by kind (exported to ``proto/schema``)."""
    return {kind: cls.model_json_schema() for kind, cls in MESSAGES.items()}


def envelope_kind(frame: bytes) -> str | None:
    """The ``kind`` of a frame whose envelope decoded (used after a version mismatch)."""
    try:
        env = msgpack.unpackb(frame, raw=False, max_bin_len=MAX_FRAME_BYTES)
    except Exception:
        return None
    kind = env.get("kind") if isinstance(env, dict) else None
    return kind if isinstance(kind, str) else None


# --- the hot frames' check ------------------------------------------------------------------------
#
# A request's own frames (``AgentRequest`` on the prefill, ``TransferDone`` on the decode) are
# checked by hand (``HOT_CHECKS``) before pydantic is asked: a body of exactly the form this
# pdstate sends (every field of its exact Python type and within its bounds, no other key) is
# built into its model directly. Warm, the two cost about the same (an empty request's
# ``AgentRequest`` 2.5 us against ``model_validate``'s 2.6, a ``TransferDone`` 1.6 against 1.8);
# but a request's frame comes to an I/O thread that slept, and there, each call after 1 ms idle,
# interleaved, the check measured 14 us against 24 (``TransferDone``: 10 against 16). Anything
# else -- another type pydantic would coerce, a value out of bounds, an unknown key, a failed
# ``TransferDone``'s error -- returns None and goes to ``validate_body``: the model decides, and
# every error text stays the model's (``tests/unit/test_wire_hot.py`` runs a corpus of broken
# bodies through both).

_new = object.__new__
_set = object.__setattr__
_INF = float("inf")
_BYTES = builtins.bytes
_DTYPE_SIZE = {"<i4": 4, "<i8": 8}


def _built(cls: type[Message], values: dict[str, Any], given) -> Any:
    """``cls`` holding ``values`` (every field, in declaration order, already checked): what
    ``model_validate`` returns for them, ``given`` (the keys the body had) its fields set."""
    m = _new(cls)
    _set(m, "__dict__", values)
    _set(m, "__pydantic_fields_set__", set(given))
    _set(m, "__pydantic_extra__", None)
    _set(m, "__pydantic_private__", None)
    return m


def _u64_list(v: Any) -> bool:
    if type(v) is not list or len(v) > MAX_BUFFERS:
        return False
    for x in v:
        if type(x) is not int or not 0 <= x < 1 << 64:
            return False
    return True


def _hot_packed(v: Any) -> PackedIndices | None:
    """A non-empty index list's model (its caller takes ``_EMPTY_BODY`` as ``_EMPTY`` first), else None."""
    if type(v) is not dict or len(v) != 2:
        return None
    dtype, data = v.get("dtype"), v.get("data")
    size = _DTYPE_SIZE.get(dtype) if type(dtype) is str else None
    if size is None or type(data) is not bytes or len(data) % size or len(data) // size > MAX_INDICES:
        return None
    return _built(PackedIndices, {"dtype": dtype, "data": data}, ("dtype", "data"))


# the empty index list as ``PackedIndices.pack`` makes it, and its body: one frozen instance, shared
# by every message decoded with one (a body equal to ``_EMPTY_BODY`` is exactly that: msgpack gives
# only str keys here, and only ``bytes`` equals ``b""``)
_EMPTY_BODY = {"dtype": "<i8", "data": b""}
_EMPTY = _built(PackedIndices, dict(_EMPTY_BODY), ("dtype", "data"))


def _hot_aux(v: Any) -> AuxDest | None:
    if type(v) is not dict or len(v) != 3:
        return None
    ptrs, items, index = v.get("ptrs"), v.get("item_lens"), v.get("index")
    if not (_u64_list(ptrs) and _u64_list(items) and type(index) is int and 0 <= index < 1 << 63):
        return None
    return _built(AuxDest, {"ptrs": ptrs, "item_lens": items, "index": index}, ("ptrs", "item_lens", "index"))


_REQUEST_KEYS = frozenset(AgentRequest.model_fields)


def _hot_agent_request(f: dict) -> AgentRequest | None:
    """``f`` as an ``AgentRequest`` when it is one in the form this pdstate sends, else None."""
    if not f.keys() <= _REQUEST_KEYS:
        return None
    room, deadline, digest = f.get("room"), f.get("deadline_s"), f.get("digest", True)
    if type(room) is not int or not 0 <= room < 1 << 63 or type(digest) is not bool:
        return None
    if type(deadline) is not float or not 0.0 < deadline <= 3600.0:
        return None
    pages = f.get("dst_kv_pages")
    pages = _EMPTY if pages == _EMPTY_BODY else _hot_packed(pages)  # an empty request's: no call
    state = f.get("dst_state_indices")
    if pages is None or type(state) is not list or len(state) > MAX_COMPONENTS:
        return None
    states = []
    for x in state:
        p = _EMPTY if x == _EMPTY_BODY else _hot_packed(x)  # most lists of a small request: no call
        if p is None:
            return None
        states.append(p)
    aux = f.get("dst_aux")
    if aux is not None:
        aux = _hot_aux(aux)
        if aux is None:
            return None
    seq_len, verify = f.get("seq_len"), f.get("verify")
    form, rule = f.get("digest_form"), f.get("sample_rule")
    if seq_len is not None and (type(seq_len) is not int or not 0 <= seq_len <= 1 << 24):
        return None
    if verify is not None and verify != "sampled" or form is not None and form != "device":
        return None
    if rule is not None and (type(rule) is not int or not 1 <= rule <= 65535):
        return None
    values = {
        "room": room,
        "dst_kv_pages": pages,
        "dst_state_indices": states,
        "dst_aux": aux,
        "digest": digest,
        "deadline_s": deadline,
        "seq_len": seq_len,
        "verify": verify,
        "digest_form": form,
        "sample_rule": rule,
    }
    return _built(AgentRequest, values, f)


_DONE_KEYS = frozenset(TransferDone.model_fields)


def _hot_transfer_done(f: dict) -> TransferDone | None:
    """``f`` as a ``TransferDone`` when it is one in the form this pdstate sends, without an
    error (a failed one goes to the model: its ``ErrorInfo`` clips texts), else None."""
    if not f.keys() <= _DONE_KEYS or f.get("error") is not None:
        return None
    return _done(f, **f)  # every key one of the model's: each one of ``_done``'s parameters


def _done(
    given,
    room=None,
    status=None,
    bytes=0,  # the field's name (a body's key), the builtin is ``_BYTES`` here
    descriptors=0,
    digest=None,
    error=None,
    compute_s=0.0,
    copy_s=0.0,
    digest_form=None,
) -> TransferDone | None:
    """The ``TransferDone`` of these values (``given``: the fields its body had; ``error`` is
    None, the callers' test) when each is of the form this pdstate sends, else None: the one
    check of a received one (``_hot_transfer_done``) and of the one a prefill sends
    (``transfer_done``)."""
    if type(room) is not int or not 0 <= room < 1 << 63 or type(status) is not str:
        return None
    if status != "success" and status != "failed":
        return None
    if (
        type(bytes) is not int
        or not 0 <= bytes < 1 << 64
        or type(descriptors) is not int
        or not 0 <= descriptors < 1 << 64
    ):
        return None
    if (
        type(compute_s) is not float
        or not 0.0 <= compute_s < _INF
        or type(copy_s) is not float
        or not 0.0 <= copy_s < _INF
    ):
        return None
    if digest is not None and type(digest) is not _BYTES or digest_form is not None and digest_form != "device":
        return None
    values = {
        "room": room,
        "status": status,
        "bytes": bytes,
        "descriptors": descriptors,
        "digest": digest,
        "error": None,
        "compute_s": compute_s,
        "copy_s": copy_s,
        "digest_form": digest_form,
    }
    return _built(TransferDone, values, given)


# the fields ``transfer_done`` gives (its model's fields set)
_SENT_DONE = ("room", "status", "bytes", "descriptors", "digest", "copy_s", "digest_form")


def transfer_done(
    room: int, status: str, n_bytes: int, descriptors: int, digest: bytes | None, copy_s: float, form: str | None
) -> TransferDone:
    """The ``TransferDone`` a prefill sends once a request's copy ended: built by the check that
    builds a received one (``_done``) when every value is of the form it checks, else by the
    model (which coerces or refuses them as its constructor does). The same model either way
    (``tests/unit/test_wire_hot.py``): the model's constructor is the larger part of the
    prefill's work on an empty request between its frame and this one."""
    done = _done(_SENT_DONE, room, status, n_bytes, descriptors, digest, None, 0.0, copy_s, form)
    if done is not None:
        return done
    return TransferDone(
        room=room,
        status=status,
        bytes=n_bytes,
        descriptors=descriptors,
        digest=digest,
        copy_s=copy_s,
        digest_form=form,
    )


# the kinds checked by hand before their model (``decode``); each returns None to defer to it
HOT_CHECKS: dict[type[Message], Callable[[dict], Message | None]] = {
    AgentRequest: _hot_agent_request,
    TransferDone: _hot_transfer_done,
}
