"""HTTP face of one worker: a FastAPI app factory over a status source.

``create_app(source, token=None)`` builds the app; it never starts or stops the worker (that is
``pdstate.service.server``'s job) and reads everything through the ``StatusSource`` protocol below, so a
test can hand it a fake. Routes (OpenAPI at ``/docs`` and ``/openapi.json``):

=======  =========================  ==========================================================
GET      /healthz                   200 ``{"status": "ok"}`` while the process serves HTTP
GET      /readyz                    200 ``{"ready": true}`` or 503 ``{"ready": false, "reason"}``
GET      /v1/compat                 role, protocol version, fingerprint, layout, local check,
                                    peers, and the full layout report (for ``/v1/compat/check``)
POST     /v1/compat/check           another worker's ``/v1/compat`` document -> verdict
POST     /v1/transfers              decode: run one synthetic transfer ``{tokens, room?}``
GET      /v1/transfers/{room}       decode: a transfer's record (404 unknown)
POST     /v1/handshake              decode: register again (after the prefill was fixed)
GET      /metrics                   Prometheus text, from a per-app ``CollectorRegistry``
=======  =========================  ==========================================================

Auth: when a token is configured, the endpoints that change something (``POST /v1/transfers``,
``POST /v1/handshake``) need ``Authorization: Bearer <token>`` (constant-time compare; 401
otherwise). ``POST /v1/compat/check`` is a pure function of the posted document and ours (it
reveals nothing ``GET /v1/compat`` does not), so it stays open for an operator's preflight.

Request bodies are bounded on every route (``BodyLimit``): 64 KiB, 1 MiB for
``/v1/compat/check`` (a real ``/v1/compat`` document is ~4 KiB for ``dsv4-flash`` plus ~100 bytes
per listed peer). A larger ``Content-Length`` is answered 413 before a byte of the body is read; a
body without one (chunked) is counted while it streams in and refused at the limit. The posted
compat document is validated against bounds (identifier-like strings, known factor names, small
integers, bounded nesting) and nothing of it is echoed back but values that passed them; a 422
names where the input is wrong, never what it was.

Contract of the source: every method is safe to call from the event loop thread while the worker
runs (reads of counters and small dicts), and ``submit`` returns a ``concurrent.futures.Future``
that always completes (the worker fails in-flight requests with a reason when it stops).
"""

from __future__ import annotations

import asyncio
import bisect
import hmac
import itertools
import re
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdstate import __version__
from pdstate.errors import EngineError, VersionMismatch
from pdstate.protocol.compat import compat_errors
from pdstate.protocol.report import FACTOR_NAMES, ErrorInfo, LayoutReport
from pdstate.protocol.wire import PROTOCOL_VERSION

Role = Literal["prefill", "decode"]
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


# --- the source ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Readiness:
    ready: bool
    reason: str | None = None  # the exact error text when a check failed
    check: str | None = None  # which check: "local_check" | "handshake" | "peer" | "shutdown"
    error: ErrorInfo | None = None


class StatusSource(Protocol):
    role: str
    worker_id: str
    incarnation: str
    engine: str
    control: str  # prefill: the bound control endpoint; decode: the prefill endpoint it dials
    report: LayoutReport
    stats: Any  # runtime.common.Stats

    def readiness(self) -> Readiness: ...

    def local_check(self) -> tuple[bool, ErrorInfo | None]: ...

    def peers(self) -> list[dict]: ...  # {id, state, error: {type, message} | None, incarnation?}

    def in_flight(self) -> int: ...

    def free_counts(self) -> dict[str, int]: ...

    def submit(self, tokens: int, room: int | None) -> Future: ...  # decode; Future[dict]

    def lookup(self, room: int) -> dict | None: ...  # decode; a TransferResult dict or in-flight

    def reregister(self) -> None: ...  # decode

    def result_timeout_s(self) -> float: ...


# --- response and request models --------------------------------------------------------------


class ErrorModel(BaseModel):
    type: str = Field(description="exception class name, e.g. SWAIndexMappingNotShared")
    message: str = Field(description="the exact message (upstream sentence where there is one)")


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class Ready(BaseModel):
    ready: bool
    reason: str | None = Field(None, description="why not ready: the exact error text when a check failed")
    check: str | None = Field(None, description="local_check | handshake | peer | shutdown")
    error: ErrorModel | None = None


class LocalCheckModel(BaseModel):
    ok: bool
    error: ErrorModel | None = None


class PeerModel(BaseModel):
    id: str = Field(description="prefill: the decode's worker id; decode: the prefill's control endpoint")
    state: Literal["accepted", "rejected", "pending", "gone"]
    error: ErrorModel | None = None
    incarnation: str | None = None


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
    fingerprint: str
    layout: dict[str, Any] = Field(description="page_size, kv_dtype and every layout factor by name")
    local_check: LocalCheckModel
    peers: list[PeerModel] = []
    report: LayoutReport = Field(description="the full layout report, as sent in the handshake")


# --- the bounded input of POST /v1/compat/check ------------------------------------------------

MAX_BODY_BYTES = 64 << 10
MAX_COMPAT_BODY_BYTES = 1 << 20
BODY_LIMITS = {"/v1/compat/check": MAX_COMPAT_BODY_BYTES}

_WORD = r"^[A-Za-z0-9_.+-]{0,64}$"  # dtype, layout and component names, engine, versions
_HEX = r"^[0-9a-f]{32}$"  # a layout fingerprint: blake2b-128
_WORD_RE = re.compile(_WORD)
MAX_INT = 1 << 63
MAX_PEERS = 8192
MAX_MESSAGE = 4096
MAX_DEPTH = 5
MAX_LEAVES = 4096


class _BadValue(ValueError):
    pass


def _check_value(value: Any, depth: int = 0, budget: list[int] | None = None) -> None:
    """A layout value as reports carry them: None, bools, 64-bit integers, short words, and lists
    or word-keyed objects of those, nested at most ``MAX_DEPTH`` deep, ``MAX_LEAVES`` in all.
    Messages never quote the value."""
    budget = [MAX_LEAVES] if budget is None else budget
    if depth > MAX_DEPTH:
        raise _BadValue(f"nested deeper than {MAX_DEPTH}")
    if isinstance(value, (list, tuple)):
        for v in value:
            _check_value(v, depth + 1, budget)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str) or not _WORD_RE.fullmatch(k):
                raise _BadValue("an object key is not a short word")
            _check_value(v, depth + 1, budget)
        return
    budget[0] -= 1
    if budget[0] < 0:
        raise _BadValue(f"more than {MAX_LEAVES} values")
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        if not -MAX_INT <= value < MAX_INT:
            raise _BadValue("an integer outside 64 bits")
        return
    if isinstance(value, str):
        if not _WORD_RE.fullmatch(value):
            raise _BadValue("a string that is not a short word")
        return
    raise _BadValue(f"a {type(value).__name__} where layouts hold none")


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
            if not _WORD_RE.fullmatch(r.kv_dtype):
                raise _BadValue("not a short word")
            where = "report.fingerprint"
            if not re.fullmatch(_HEX, r.fingerprint):
                raise _BadValue("not 32 hex digits")
            where = "report.page_size"
            _check_value(r.page_size)
            where = "report.factors"
            names = [n for n, _ in r.factors]
            if len(set(names)) != len(names) or not set(names) <= set(FACTOR_NAMES):
                raise _BadValue("factor names must be distinct names of the protocol's factors")
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
            if err is not None and (not _WORD_RE.fullmatch(err.type) or len(err.message) > MAX_MESSAGE):
                raise _BadValue("error type must be a short word, message at most 4096 characters")
        except _BadValue as exc:
            raise ValueError(f"{where}: {exc}") from None
        return self


class CompatVerdict(BaseModel):
    compatible: bool
    errors: list[ErrorModel] = Field(
        description="every reason, in handshake order; the first is what the handshake raises"
    )
    ours: str = Field(description="this worker's fingerprint")
    theirs: str = Field(description="the posted worker's fingerprint")


class TransferIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tokens: int = Field(
        ge=0,
        description="prompt length (seq_len) of the synthetic request; 0: an empty transfer "
        "(no bytes move: the control path alone, a cheap end-to-end probe)",
    )
    room: int | None = Field(None, ge=0, lt=1 << 63, description="63-bit request id; random when omitted")


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


class Accepted(BaseModel):
    status: str


def compat_document(source: StatusSource) -> CompatDocument:
    r = source.report
    ok, err = source.local_check()
    return CompatDocument(
        role=source.role,
        worker_id=source.worker_id,
        incarnation=source.incarnation,
        protocol_version=PROTOCOL_VERSION,
        pdstate_version=__version__,
        engine=source.engine,
        control=source.control,
        fingerprint=r.fingerprint,
        layout={"page_size": r.page_size, "kv_dtype": r.kv_dtype, **dict(r.factors)},
        local_check=LocalCheckModel(ok=ok, error=None if err is None else ErrorModel(**err.model_dump())),
        peers=[PeerModel(**p) for p in source.peers()],
        report=r,
    )


def check_documents(ours: CompatDocument, theirs: CompatDocument) -> list[ErrorInfo]:
    """The handshake's checks on two ``/v1/compat`` documents, every failure listed, in the
    handshake's order: protocol version, engine, each side's own pair, then cross-side factors."""
    errors: list[ErrorInfo] = []
    if ours.role == theirs.role:
        errors.append(
            ErrorInfo(
                type="RoleMismatch", message=(f"both workers are {ours.role} workers: a prefill pairs with a decode")
            )
        )
    if theirs.protocol_version != ours.protocol_version:
        errors.append(
            ErrorInfo.of(
                VersionMismatch(
                    f"protocol version mismatch: peer speaks v{theirs.protocol_version}, "
                    f"this worker speaks v{ours.protocol_version}"
                )
            )
        )
    if ours.role != theirs.role and theirs.engine and ours.engine and theirs.engine != ours.engine:
        prefill, decode = (ours, theirs) if ours.role == "prefill" else (theirs, ours)
        errors.append(
            ErrorInfo.of(
                EngineError(  # the sentence of handshake.PrefillHandshake.validate
                    f"transfer engine mismatch: prefill server uses {prefill.engine!r}, "
                    f"but decode server uses {decode.engine!r}"
                )
            )
        )
    for e in compat_errors(ours.report, theirs.report, ours.role):
        if e not in errors:
            errors.append(e)
    return errors


# --- metrics ----------------------------------------------------------------------------------


class _Collector:
    """Reads the worker's counters at scrape time. The latency histogram is folded in
    incrementally: each scrape only bins what was appended since the last one. The worker keeps
    a bounded window (``runtime.common.RecentLatencies``: ``since(seen)`` and ``total``); a plain
    list (tests' fakes) is read by position."""

    def __init__(self, source: StatusSource) -> None:
        self.source = source
        self._seen = 0
        self._bins = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self._sum = 0.0
        self._count = 0

    def collect(self):
        src = self.source
        stats = src.stats
        lat = stats.latencies_s
        if hasattr(lat, "since"):
            # values beyond the window (more than its size between two scrapes) are not binned
            new, self._seen = lat.since(self._seen)
        else:
            n = len(lat)
            if n < self._seen:  # the list was trimmed: count what is there from now on
                self._seen = n
            new, self._seen = list(itertools.islice(lat, self._seen, n)), n
        for v in new:
            self._bins[bisect.bisect_left(LATENCY_BUCKETS_S, v)] += 1
            self._sum += v
            self._count += 1

        info = GaugeMetricFamily(
            "pdstate_worker_info",
            "Worker identity (value 1)",
            labels=["role", "worker_id", "engine", "protocol_version", "fingerprint"],
        )
        info.add_metric([src.role, src.worker_id, src.engine, str(PROTOCOL_VERSION), src.report.fingerprint], 1)
        yield info
        ready = GaugeMetricFamily("pdstate_ready", "1 when /readyz answers 200")
        ready.add_metric([], 1 if src.readiness().ready else 0)
        yield ready
        hs = CounterMetricFamily("pdstate_handshakes", "Handshakes by outcome", labels=["outcome"])
        for k, v in stats.handshakes.items():
            hs.add_metric([k], v)
        yield hs
        tr = CounterMetricFamily(
            "pdstate_transfers",
            "Transfers by outcome (busy: refused by a full prefill and retried)",
            labels=["outcome"],
        )
        for k, v in stats.transfers.items():
            tr.add_metric([k], v)
        yield tr
        yield CounterMetricFamily("pdstate_transfer_bytes", "Bytes moved by successful transfers", value=stats.bytes)
        cum, buckets = 0, []
        for bound, count in zip(LATENCY_BUCKETS_S, self._bins):
            cum += count
            buckets.append((repr(bound), cum))
        buckets.append(("+Inf", self._count))
        h = HistogramMetricFamily(
            "pdstate_transfer_latency_seconds",
            "Latency of successful transfers (decode: submit to verified; prefill: engine copy)",
        )
        h.add_metric([], buckets, sum_value=self._sum)
        yield h
        g = GaugeMetricFamily("pdstate_transfers_in_flight", "Requests entered and not yet finished")
        g.add_metric([], src.in_flight())
        yield g
        yield CounterMetricFamily("pdstate_engine_errors", "Transfer engine failures", value=stats.engine_errors)
        yield CounterMetricFamily(
            "pdstate_protocol_errors",
            "Control frames refused (undecodable, bad auth, bad version)",
            value=stats.protocol_errors,
        )
        peers = GaugeMetricFamily("pdstate_peers", "Peers by handshake state", labels=["state"])
        counts = {k: 0 for k in ("accepted", "rejected", "pending", "gone")}
        for p in src.peers():
            counts[p["state"]] = counts.get(p["state"], 0) + 1
        for k, v in counts.items():
            peers.add_metric([k], v)
        yield peers
        free = GaugeMetricFamily("pdstate_pool_free", "Free capacity of the pools", labels=["pool"])
        for k, v in src.free_counts().items():
            free.add_metric([k], v)
        yield free


# --- the app ----------------------------------------------------------------------------------


class BodyLimit:
    """ASGI middleware: refuse a request body over its route's limit with 413, before the app
    reads it. A ``Content-Length`` over the limit is refused at once (the body is never read and
    the connection is closed); a body without one is read here up to the limit, then handed to
    the app from memory (so nothing downstream reads an unbounded stream)."""

    def __init__(self, app, default: int = MAX_BODY_BYTES, limits: dict[str, int] | None = None) -> None:
        self.app = app
        self.default = default
        self.limits = BODY_LIMITS if limits is None else limits

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limits.get(scope.get("path", ""), self.default)
        length = None
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    length = limit + 1  # the server rejects malformed framing first; never trust it here
        if length is not None and length > limit:
            await self._too_large(scope, receive, send, limit)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                await self._too_large(scope, receive, send, limit)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _too_large(scope, receive, send, limit: int) -> None:
        response = JSONResponse(
            status_code=413,
            content={"detail": f"request body larger than {limit} bytes"},
            headers={"Connection": "close"},
        )
        await response(scope, receive, send)


def _safe_loc(part: Any) -> int | str:
    """A 422's location without the client's text: a posted object's keys are input too."""
    if isinstance(part, int):
        return part
    text = str(part)
    return text if len(text) <= 64 and _WORD_RE.fullmatch(text) else "<key>"


def _auth(token: bytes | None):
    bearer = HTTPBearer(auto_error=False, description="the [auth] token, when one is configured")

    def check(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if token is None:
            return
        given = creds.credentials.encode() if creds is not None and creds.scheme.lower() == "bearer" else b""
        if not hmac.compare_digest(given, token):
            raise HTTPException(401, detail="missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    return check


def _not_decode(source: StatusSource) -> HTTPException:
    return HTTPException(409, detail=f"transfers are started by a decode worker; this is a {source.role} worker")


def create_app(source: StatusSource, token: bytes | None = None) -> FastAPI:
    """The worker's HTTP app. ``token``: require it (Bearer) on the mutating endpoints."""
    app = FastAPI(
        title="pdstate worker",
        version=__version__,
        description="Health, compatibility, transfers and metrics of one pdstate prefill or decode worker.",
    )
    app.add_middleware(BodyLimit)
    auth = _auth(token)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(source))
    app.state.source = source
    app.state.registry = registry

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        """422 naming where and what, without echoing the input: FastAPI's default handler
        reflects it, and a body such as ``Infinity`` (valid for Python's JSON parser, not for its
        encoder) then turned the 422 into a 500 (found by the HTTP fuzz test). Locations keep
        only short words (a posted object's keys are input too), at most 20 errors."""
        detail = [
            {
                "loc": [_safe_loc(p) for p in e.get("loc", ())],
                "msg": str(e.get("msg", ""))[:300],
                "type": str(e.get("type", "")),
            }
            for e in exc.errors()[:20]
        ]
        return JSONResponse(status_code=422, content={"detail": detail})

    @app.get("/healthz", response_model=Health, tags=["health"])
    async def healthz() -> Health:
        """Liveness: the process answers HTTP."""
        return Health()

    @app.get("/readyz", response_model=Ready, tags=["health"], responses={503: {"model": Ready}})
    async def readyz():
        """Readiness: pools built, local check passed, and (decode) handshake accepted /
        (prefill) control socket listening. 503 carries the exact error text."""
        r = source.readiness()
        body = Ready(
            ready=r.ready,
            reason=r.reason,
            check=r.check,
            error=None if r.error is None else ErrorModel(**r.error.model_dump()),
        )
        if r.ready:
            return body
        return JSONResponse(status_code=503, content=body.model_dump())

    @app.get("/v1/compat", response_model=CompatDocument, tags=["compat"])
    async def get_compat() -> CompatDocument:
        """What this worker states about its layout, its local check and its peers."""
        return compat_document(source)

    @app.post("/v1/compat/check", response_model=CompatVerdict, tags=["compat"], responses={413: {}})
    async def post_compat_check(theirs: CompatCheckIn) -> CompatVerdict:
        """Preflight: would a handshake between this worker and the posted one succeed? The body
        is bounded (1 MiB) and validated; the verdict quotes only values that passed."""
        ours = compat_document(source)
        errors = check_documents(ours, theirs)
        return CompatVerdict(
            compatible=not errors,
            errors=[ErrorModel(**e.model_dump()) for e in errors],
            ours=ours.fingerprint,
            theirs=theirs.fingerprint,
        )

    @app.post(
        "/v1/transfers",
        response_model=TransferOut,
        tags=["transfers"],
        dependencies=[Depends(auth)],
        responses={401: {}, 409: {}, 503: {}, 504: {}},
    )
    async def post_transfer(body: TransferIn) -> TransferOut:
        """Decode only: run one synthetic transfer and wait for its verified outcome."""
        if source.role != "decode":
            raise _not_decode(source)
        r = source.readiness()
        if not r.ready:
            raise HTTPException(503, detail=r.reason)
        if body.room is not None and source.lookup(body.room) is not None:
            raise HTTPException(409, detail=f"room {body.room} was already used")
        fut = source.submit(body.tokens, body.room)
        try:
            # shield: a client that hangs up must not cancel the worker's future
            res = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), source.result_timeout_s())
        except ValueError as exc:  # the room is already in flight
            raise HTTPException(409, detail=str(exc)) from None
        except asyncio.TimeoutError:
            raise HTTPException(504, detail="no outcome within the request deadline") from None
        return TransferOut(**res)

    @app.get("/v1/transfers/{room}", response_model=TransferOut, tags=["transfers"], responses={404: {}, 409: {}})
    async def get_transfer(room: int) -> TransferOut:
        """Decode only: the record of a transfer (finished, or ``in_flight``)."""
        if source.role != "decode":
            raise _not_decode(source)
        rec = source.lookup(room)
        if rec is None:
            raise HTTPException(404, detail=f"unknown room {room}")
        return TransferOut(**rec)

    @app.post(
        "/v1/handshake",
        response_model=Accepted,
        status_code=202,
        tags=["compat"],
        dependencies=[Depends(auth)],
        responses={401: {}, 409: {}},
    )
    async def post_handshake() -> Accepted:
        """Decode only: send a new Register (a refused decode otherwise waits to be asked)."""
        if source.role != "decode":
            raise HTTPException(409, detail="only a decode worker registers; this is a prefill worker")
        source.reregister()
        return Accepted(status="registering")

    @app.get(
        "/metrics", tags=["metrics"], response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}}
    )
    async def metrics() -> Response:
        """Prometheus text exposition."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def route_paths(app: FastAPI) -> set[str]:
    """Every HTTP route path of ``app`` (for manifests that name probe paths)."""
    return {getattr(r, "path", "") for r in app.routes}
