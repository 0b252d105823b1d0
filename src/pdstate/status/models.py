"""The HTTP API's data: the status source it reads, its response models, and the bounded,
validated input of ``POST /v1/compat/check`` (nothing posted is echoed unless it passed)."""

from __future__ import annotations

import re
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, computed_field, model_validator

from pdstate.errors import DocumentValueError
from pdstate.logs import refusal_factor
from pdstate.protocol.fixes import Words, fix_line
from pdstate.protocol.report import FACTOR_NAMES, OPTIONAL_FACTOR_NAMES, ErrorInfo, LayoutReport

Role = Literal["prefill", "decode"]


# --- the source ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Readiness:
    ready: bool
    reason: str | None = None  # the exact error text when a check failed
    check: str | None = (
        None  # "local_check" | "transport" | "handshake" | "peer" | "threads" | "shutdown" | "auth" | "fair_share"
    )
    error: ErrorInfo | None = None


class StatusSource(Protocol):
    role: str
    worker_id: str
    incarnation: str
    engine: str
    control: str  # prefill: the bound control endpoint; decode: the prefill endpoint it dials
    transport: dict  # optional: ``engines.listeners.Transport.as_dict()`` (read with getattr)
    report: LayoutReport
    stats: Any  # worker.stats.Stats

    def readiness(self) -> Readiness: ...

    def local_check(self) -> tuple[bool, ErrorInfo | None]: ...

    def peers(self) -> list[dict]: ...  # {id, state, error: {type, message} | None, incarnation?, fingerprint?}

    def in_flight(self) -> int: ...

    def free_counts(self) -> dict[str, int]: ...

    # decode; Future of a dict or a TransferResult (``as_dict``); ``prefill`` only when the request names one
    def submit(self, tokens: int, room: int | None, prefill: str | None = None) -> Future: ...

    # decode, optional: why a transfer may not name ``prefill`` (None: it may; control.prefills)
    # def prefill_refused(self, prefill: str) -> str | None: ...
    # decode, optional: why a migration may not name the listener ``address`` (None: it may;
    # loopback or migration.sources); without it, loopback only
    # def migration_source_refused(self, address: str) -> str | None: ...

    def lookup(self, room: int) -> dict | None: ...  # decode; a TransferResult dict or in-flight

    def reregister(self) -> None: ...  # decode

    def result_timeout_s(self) -> float: ...


def peer_transport(transport: dict | None) -> str | None:
    """How bytes move with an accepted peer: this side's engine and the transport it has in use
    (``engines.listeners.Transport.as_dict``: ``mooncake/tcp``, ``mooncake/rdma``; ``shm``)."""
    if not transport:
        return None
    engine, in_use = transport.get("engine") or "", transport.get("in_use") or ""
    return f"{engine}/{in_use}" if in_use and in_use != engine else engine or None


# --- response and request models --------------------------------------------------------------


def words_of(source: Any) -> Words:
    """Whose words a source's fix lines use: an SGLang rank's (it states its ``rank``) SGLang's
    flags and variables, a ``pdstate serve`` worker's its config keys. Passed to the models as
    validation context (``{"words": ...}``)."""
    return "sglang" if getattr(source, "rank", None) else "serve"


class ErrorModel(BaseModel):
    type: str = Field(description="exception class name, e.g. SWAIndexMappingNotShared")
    message: str = Field(description="the exact message (upstream sentence where there is one)")
    _words: Words = PrivateAttr("serve")

    @model_validator(mode="after")
    def _rendered_where(self, info: ValidationInfo) -> ErrorModel:
        if isinstance(info.context, dict) and info.context.get("words") == "sglang":
            self._words = "sglang"
        return self

    @computed_field(
        description="how to fix it: the config key and side on a pdstate serve worker, the SGLang flag or "
        "variable on an SGLang rank (null if none)"
    )
    @property
    def fix(self) -> str | None:
        return fix_line(self.type, self.message, words=self._words)


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class TransportModel(BaseModel):
    """The engine's transport as configured and as in use, and where its native side listens
    (measured from the process's sockets at start). ``problem``: a silent fallback (not ready)."""

    engine: str = Field("", max_length=64)
    configured: str = Field("", max_length=256)
    in_use: str = Field("", max_length=256)
    listening: list[str] = Field([], max_length=64)
    open: bool = Field(False, description="whether a listener accepts connections beyond loopback")
    problem: str | None = Field(None, max_length=1024)


class Ready(BaseModel):
    ready: bool
    reason: str | None = Field(None, description="why not ready: the exact error text when a check failed")
    check: str | None = Field(
        None,
        description="local_check | transport | handshake | peer | threads | shutdown; ready with auth (decodes fail auth: a CURVE handshake or a frame's tag) or fair_share (a decode dropped for withholding verdicts)",
    )
    error: ErrorModel | None = None
    transport: TransportModel | None = None


class LocalCheckModel(BaseModel):
    ok: bool
    error: ErrorModel | None = None


class PeerModel(BaseModel):
    id: str = Field(description="prefill: the decode's worker id; decode: the prefill's control endpoint")
    state: Literal["accepted", "rejected", "pending", "gone"]
    error: ErrorModel | None = None
    incarnation: str | None = None
    fingerprint: str | None = Field(None, description="the peer's layout fingerprint, once its handshake came")
    transport: str | None = Field(
        None,
        description="how bytes move with this peer once accepted: the engine and the transport in use (mooncake/tcp)",
    )

    @computed_field(description="what a refusal is about: the layout factor it names, else the error's class")
    @property
    def factor(self) -> str | None:
        return None if self.error is None else refusal_factor(self.error.type, self.error.message)


class RankModel(BaseModel):
    """An SGLang scheduler rank serving backend pdstate (``pdstate.integrations.sglang.endpoint``):
    where it sits, which SGLang runs it, and the HTTP port it answers on (``http.port + rank``)."""

    rank: int = Field(ge=0, lt=1 << 20, description="dp_rank * pp_size * tp_size + pp_rank * tp_size + tp_rank")
    tp_rank: int = Field(ge=0, lt=1 << 20)
    tp_size: int = Field(ge=1, lt=1 << 20)
    pp_rank: int = Field(ge=0, lt=1 << 20)
    pp_size: int = Field(ge=1, lt=1 << 20)
    dp_rank: int = Field(0, ge=0, lt=1 << 20, description="the data-parallel replica (0 with DP attention)")
    dp_size: int = Field(1, ge=1, lt=1 << 20)
    sglang: str | None = Field(None, max_length=32, description="the SGLang release running this rank")
    http_port: int = Field(ge=0, lt=65536)


class CompatDocument(BaseModel):
    """``GET /v1/compat``; also the body of ``POST /v1/compat/check`` (extra keys ignored)."""

    model_config = ConfigDict(extra="ignore")
    role: Role
    worker_id: str = ""
    incarnation: str = ""
    protocol_version: int
    pdstate_version: str = ""
    engine: str = ""
    control: str = ""
    transport: TransportModel | None = None
    fingerprint: str
    layout: dict[str, Any] = Field(description="page_size, kv_dtype and every layout factor by name")
    local_check: LocalCheckModel
    peers: list[PeerModel] = []
    quarantined: int = Field(
        0, description="decode: ended requests whose pages wait for their prefill's fence (it may still write them)"
    )
    rank: RankModel | None = Field(None, description="an SGLang rank's place (none for pdstate serve)")
    report: LayoutReport = Field(description="the full layout report, as sent in the handshake")


# a prefill's control address in ``POST /v1/transfers``: tcp://host:port (a name, IPv4 or [IPv6])
PREFILL_ADDRESS_RE = r"^tcp://(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9.-]{1,200}):[0-9]{1,5}$"


# --- the bounded input of POST /v1/compat/check ------------------------------------------------

MAX_BODY_BYTES = 64 << 10
MAX_COMPAT_BODY_BYTES = 1 << 20
BODY_LIMITS = {"/v1/compat/check": MAX_COMPAT_BODY_BYTES}

_WORD = r"^[A-Za-z0-9_.+-]{0,64}$"  # dtype, layout and component names, engine, versions
_HEX = r"^[0-9a-f]{32}$"  # a layout fingerprint: blake2b-128
WORD_RE = re.compile(_WORD)
MAX_INT = 1 << 63
MAX_PEERS = 8192
MAX_MESSAGE = 4096
MAX_DEPTH = 5
MAX_LEAVES = 4096


def _check_value(value: Any, depth: int = 0, budget: list[int] | None = None) -> None:
    """A layout value as reports carry them: None, bools, 64-bit integers, short words, and lists
    or word-keyed objects of those, nested at most ``MAX_DEPTH`` deep, ``MAX_LEAVES`` in all.
    Messages never quote the value."""
    budget = [MAX_LEAVES] if budget is None else budget
    if depth > MAX_DEPTH:
        raise DocumentValueError(f"nested deeper than {MAX_DEPTH}")
    if isinstance(value, (list, tuple)):
        for v in value:
            _check_value(v, depth + 1, budget)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str) or not WORD_RE.fullmatch(k):
                raise DocumentValueError("an object key is not a short word")
            _check_value(v, depth + 1, budget)
        return
    budget[0] -= 1
    if budget[0] < 0:
        raise DocumentValueError(f"more than {MAX_LEAVES} values")
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        if not -MAX_INT <= value < MAX_INT:
            raise DocumentValueError("an integer outside 64 bits")
        return
    if isinstance(value, str):
        if not WORD_RE.fullmatch(value):
            raise DocumentValueError("a string that is not a short word")
        return
    raise DocumentValueError(f"a {type(value).__name__} where layouts hold none")


class ErrorIn(BaseModel):
    type: str = Field(max_length=128, pattern=_WORD)
    message: str = Field(max_length=MAX_MESSAGE)


class LocalCheckIn(BaseModel):
    ok: bool
    error: ErrorIn | None = None


class PeerIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str = Field(max_length=256)
    state: Literal["accepted", "rejected", "pending", "gone"]
    error: ErrorIn | None = None
    incarnation: str | None = Field(None, max_length=256)
    fingerprint: str | None = Field(None, max_length=64)
    transport: str | None = Field(None, max_length=64)


class CompatCheckIn(CompatDocument):
    """The body of ``POST /v1/compat/check``: a ``/v1/compat`` document (extra keys ignored),
    with every field bounded. What the verdict can quote (the fingerprint, the engine, the
    report's values) must also look like what a worker reports: hex, short words, 64-bit
    integers; the fields it never quotes (ids, endpoints, peers) are only bounded in length."""

    worker_id: str = Field("", max_length=256)
    incarnation: str = Field("", max_length=256)
    protocol_version: int = Field(ge=0, lt=1 << 31)
    pdstate_version: str = Field("", max_length=64)
    engine: str = Field("", max_length=32, pattern=_WORD)
    control: str = Field("", max_length=256)
    fingerprint: str = Field(pattern=_HEX)
    layout: dict[str, Any] = Field(max_length=64)
    local_check: LocalCheckIn  # type: ignore[assignment]
    peers: list[PeerIn] = Field([], max_length=MAX_PEERS)  # type: ignore[assignment]

    @model_validator(mode="after")
    def _bounded_report(self) -> CompatCheckIn:
        r = self.report
        where = "report"
        try:
            where = "layout"
            _check_value(self.layout)
            where = "report.kv_dtype"
            if not WORD_RE.fullmatch(r.kv_dtype):
                raise DocumentValueError("not a short word")
            where = "report.fingerprint"
            if not re.fullmatch(_HEX, r.fingerprint):
                raise DocumentValueError("not 32 hex digits")
            where = "report.page_size"
            _check_value(r.page_size)
            where = "report.factors"
            names = [n for n, _ in r.factors]
            if len(set(names)) != len(names) or not set(names) <= set(FACTOR_NAMES + OPTIONAL_FACTOR_NAMES):
                raise DocumentValueError("factor names must be distinct names of the protocol's factors")
            _check_value([v for _, v in r.factors])
            for side in ("target", "draft"):
                where = f"report.{side}"
                facts = getattr(r, side)
                if facts is None:
                    continue
                _check_value([facts.compression_ratios, facts.ring_geometry, facts.paged_geometry])
                mi = facts.mapping_identity
                if mi is not None:
                    _check_value([mi.nonce, mi.data_ptr, mi.numel, mi.dtype])
            where = "report.local_check"
            err = r.local_check.error
            if err is not None and (not WORD_RE.fullmatch(err.type) or len(err.message) > MAX_MESSAGE):
                raise DocumentValueError("error type must be a short word, message at most 4096 characters")
        except DocumentValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        return self


class CompatVerdict(BaseModel):
    compatible: bool
    errors: list[ErrorModel] = Field(
        description="every reason, in handshake order; the first is what the handshake raises"
    )
    ours: str = Field(description="this worker's fingerprint")
    theirs: str = Field(description="the posted worker's fingerprint")


MAX_STEPS = 100_000  # synthetic decode steps one call may ask
# a target decode's HTTP base URL: http(s)://host[:port], no path, no user part
TARGET_URL_RE = r"^https?://(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9.-]{1,200})(:[0-9]{1,5})?/?$"


class TransferIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tokens: int = Field(
        ge=0,
        description="prompt length (seq_len) of the synthetic request; 0: an empty transfer "
        "(no bytes move: the control path alone, a cheap end-to-end probe)",
    )
    room: int | None = Field(None, ge=0, lt=1 << 63, description="63-bit request id; random when omitted")
    prefill: str | None = Field(
        None,
        max_length=256,
        pattern=PREFILL_ADDRESS_RE,
        description="the prefill's control address (tcp://host:port); default: the decode's control.peer. "
        "A prefill used for the first time is dialled and shaken hands with before the request goes on.",
    )
    hold: bool = Field(
        False,
        description="keep the request running on this decode once landed and verified (GET /v1/requests; "
        "DELETE /v1/requests/{room} ends it; POST /v1/migrations moves it)",
    )
    steps: int = Field(0, ge=0, le=MAX_STEPS, description="with hold: synthetic decode steps to run once it landed")


class TransferOut(BaseModel):
    room: int
    status: Literal["success", "failed", "in_flight"]
    seq_len: int
    bytes: int = 0
    descriptors: int = 0
    seconds: float = 0.0
    verified: bool = False
    error: ErrorModel | None = None
    compute_s: float = Field(0.0, description="prefill: time synthesising the request's state")
    copy_s: float = Field(0.0, description="prefill: time the engine took to move it")
    transfer_s: float = Field(0.0, description="decode: TransferRequest sent -> TransferDone received and verified")
    verify_s: float = Field(0.0, description="decode: time checking the bytes that landed")
    prefill: str | None = Field(None, description="the control address of the prefill asked")
    held: bool = Field(False, description="kept running on this decode (hold)")
    worker_id: str | None = Field(None, description="POST /v1/migrations/incoming: the target decode's worker id")
    step: int = Field(0, description="a held request's decode step")


class StepIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    steps: int = Field(1, ge=1, le=MAX_STEPS, description="synthetic decode steps to run")


class RunningOut(BaseModel):
    room: int
    seq_len: int
    step: int = Field(description="synthetic decode steps run since it landed (counted across migrations)")
    migrating: bool = Field(description="paused: its state is moving to another decode")
    source: str = Field(description="the control address it came from (a prefill, or a migrating decode's listener)")
    running_s: float
    digest: str | None = Field(None, description="xxh3_128 of every item it holds (GET /v1/requests/{room})")


class MigrationIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    room: int = Field(ge=0, lt=1 << 63, description="a request running here (GET /v1/requests)")
    to: str = Field(
        max_length=256,
        pattern=TARGET_URL_RE,
        description="the target decode's HTTP base URL (http://host:port); it must hold this worker's token",
    )
    wait: bool = Field(True, description="answer once it ended (false: 202 at once; GET /v1/migrations/{id})")


class DrainIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    to: str = Field(max_length=256, pattern=TARGET_URL_RE, description="the target decode's HTTP base URL")


class IncomingIn(BaseModel):
    """What a migrating decode asks of its target (``POST /v1/migrations/incoming``)."""

    model_config = ConfigDict(extra="forbid")
    room: int = Field(ge=0, lt=1 << 63)
    source: str = Field(max_length=256, pattern=PREFILL_ADDRESS_RE, description="the migrating decode's listener")
    tokens: int = Field(ge=0)
    step: int = Field(0, ge=0, description="the decode step the request's state is at")


class MigrationOut(BaseModel):
    id: str
    room: int
    to: str
    status: Literal["moving", "success", "failed"]
    seq_len: int
    step: int
    bytes: int = Field(description="bytes the listener sent")
    downtime_s: float = Field(description="paused here -> running on the target (success only)")
    refused: bool = Field(description="the target refused it (layout, pair, protocol or keys)")
    error: ErrorModel | None = None
    listener_error: ErrorModel | None = Field(
        None, description="a refusal as this decode's migration listener recorded it (its own handshake's verdict)"
    )


class DrainOut(BaseModel):
    moved: int
    failed: int
    migrations: list[MigrationOut]


class Accepted(BaseModel):
    status: str
