"""HTTP face of one worker: a FastAPI app factory over a status source.

``create_app(source, token=None)`` builds the app; it never starts or stops the worker (that is
``pdstate.service.server``'s job) and reads everything through the ``StatusSource`` protocol below, so a
test can hand it a fake. Routes (OpenAPI at ``/docs`` and ``/openapi.json``):

=======  =========================  ==========================================================
GET      /healthz                   200 ``{"status": "ok"}`` while the process serves HTTP
GET      /readyz                    200 ``{"ready": true}`` or 503 ``{"ready": false, "reason"}``
GET      /v1/compat                 role, protocol version, fingerprint, layout, local check,
                                    every peer (state, error, incarnation, fingerprint), and
                                    the full layout report (for ``/v1/compat/check``)
POST     /v1/compat/check           another worker's ``/v1/compat`` document -> verdict
POST     /v1/transfers              decode: run one synthetic transfer ``{tokens, room?,
                                    prefill?}`` from ``prefill`` (default ``control.peer``)
GET      /v1/transfers/{room}       decode: a transfer's record (404 unknown)
POST     /v1/handshake              decode: register again (after the prefill was fixed)
GET      /v1/requests               decode: the requests kept running (``hold``)
GET      /v1/requests/{room}        decode: one of them, with the digest of what it holds
POST     /v1/requests/{room}/steps  decode: run synthetic decode steps ``{steps}``
DELETE   /v1/requests/{room}        decode: end one (its pages go back)
POST     /v1/migrations             decode: move a running request ``{room, to}`` to the decode
                                    whose HTTP base URL is ``to`` (``worker.migrate``)
GET      /v1/migrations/{id}        decode: a migration's record
POST     /v1/drain                  decode: move every running request ``{to}``
POST     /v1/migrations/incoming    decode: what a migrating decode asks of its target
GET      /metrics                   Prometheus text, from a per-app ``CollectorRegistry``
=======  =========================  ==========================================================

A source whose ``serves_transfers`` is false (an SGLang rank's endpoint) has no transfer or
handshake routes: its transfers are SGLang's requests.

Auth: when a token is configured, the endpoints that change something (``POST /v1/transfers``,
``POST /v1/handshake``, the running requests' and migrations' routes) need ``Authorization: Bearer <token>`` (constant-time compare; 401
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
(the worker's own: one future per request, awaited here; a room in flight fails it with ``RoomInFlight``)
that always completes (the worker fails in-flight requests with a reason when it stops).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from pdstate import __version__
from pdstate.errors import AgentClosed, EngineError, RoomInFlight, UnknownRoom, VersionMismatch
from pdstate.protocol.compat import compat_errors
from pdstate.protocol.hosts import is_loopback_host
from pdstate.protocol.report import ErrorInfo
from pdstate.protocol.wire import PROTOCOL_VERSION
from pdstate.status.limits import BodyLimit
from pdstate.status.metrics import Collector
from pdstate.status.models import (  # noqa: F401  (Readiness and the limits: part of this module's surface)
    MAX_BODY_BYTES,
    MAX_COMPAT_BODY_BYTES,
    WORD_RE,
    Accepted,
    CompatCheckIn,
    CompatDocument,
    CompatVerdict,
    DrainIn,
    DrainOut,
    ErrorModel,
    Health,
    IncomingIn,
    LocalCheckModel,
    MigrationIn,
    MigrationOut,
    PeerModel,
    Readiness,
    Ready,
    RunningOut,
    StatusSource,
    StepIn,
    TransferIn,
    TransferOut,
    TransportModel,
    words_of,
)


def transport_model(source: StatusSource) -> TransportModel | None:
    """The engine's transport and listeners (``None`` for a source that does not say)."""
    t = getattr(source, "transport", None)
    return TransportModel(**t) if t else None


def compat_document(source: StatusSource, reveal: bool = True) -> CompatDocument:
    """``reveal=False``: without this worker's and its peers' incarnations (a caller that did not
    authenticate: an incarnation names a live process to impersonate)."""
    r = source.report
    ok, err = source.local_check()
    words = {"words": words_of(source)}
    return CompatDocument(
        role=source.role,
        worker_id=source.worker_id,
        incarnation=source.incarnation if reveal else "",
        protocol_version=PROTOCOL_VERSION,
        pdstate_version=__version__,
        engine=source.engine,
        control=source.control,
        transport=transport_model(source),
        fingerprint=r.fingerprint,
        layout={"page_size": r.page_size, "kv_dtype": r.kv_dtype, **dict(r.factors)},
        local_check=LocalCheckModel(
            ok=ok, error=None if err is None else ErrorModel.model_validate(err.model_dump(), context=words)
        ),
        peers=[
            PeerModel.model_validate(p if reveal else {**p, "incarnation": None}, context=words) for p in source.peers()
        ],
        quarantined=getattr(source, "quarantined", lambda: 0)(),
        rank=getattr(source, "rank", None),
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


# --- the app ----------------------------------------------------------------------------------


def _safe_loc(part: Any) -> int | str:
    """A 422's location without the client's text: a posted object's keys are input too."""
    if isinstance(part, int):
        return part
    text = str(part)
    return text if len(text) <= 64 and WORD_RE.fullmatch(text) else "<key>"


def _bearer_ok(token: bytes | None, creds: HTTPAuthorizationCredentials | None) -> bool:
    """Whether ``creds`` carry ``token`` (False when no token is configured: nobody is known)."""
    given = creds.credentials.encode() if creds is not None and creds.scheme.lower() == "bearer" else b""
    return token is not None and hmac.compare_digest(given, token)


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


def _decode_only_router(source: StatusSource, auth, tag: str) -> APIRouter:
    """A router of routes only a decode serves (tagged ``tag``): each needs ``auth``, and answers
    409 on any other worker once its request was validated (a malformed request is a 422 on every
    worker, as on the other routes)."""

    class DecodeOnly(APIRoute):
        def __init__(self, path: str, endpoint, **options) -> None:
            @functools.wraps(endpoint)
            async def decode_only(*args, **kwargs):
                if source.role != "decode":
                    raise _not_decode(source)
                return await endpoint(*args, **kwargs)

            super().__init__(path, decode_only, **options)

    return APIRouter(tags=[tag], dependencies=[Depends(auth)], route_class=DecodeOnly)


def _migration_detail(m) -> str:
    """A failed migration's one line: the target's refusal or failure, in its words."""
    e = m.error
    why = f"{e.type}: {e.message}" if e is not None else "failed"
    if m.refused:  # the handshake's sentences name the sender's side "prefill"
        head = "the target refused it (this migrating decode is the handshake's prefill side)"
    else:
        head = "the target did not take it"
    return f"room {m.room}: {head}: {why}; it runs on this decode again"


def create_app(source: StatusSource, token: bytes | None = None) -> FastAPI:
    """The worker's HTTP app. ``token``: require it (Bearer) on the mutating endpoints."""
    app = FastAPI(
        title="pdstate worker",
        version=__version__,
        description="Health, compatibility, transfers and metrics of one pdstate prefill or decode worker.",
    )
    app.add_middleware(BodyLimit)
    auth = _auth(token)
    bearer = HTTPBearer(auto_error=False, description="the [auth] token, when one is configured")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector(source))
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
            error=None
            if r.error is None
            else ErrorModel.model_validate(r.error.model_dump(), context={"words": words_of(source)}),
            transport=transport_model(source),
        )
        if r.ready:
            return body
        return JSONResponse(status_code=503, content=body.model_dump())

    @app.get("/v1/compat", response_model=CompatDocument, tags=["compat"])
    async def get_compat(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> CompatDocument:
        """What this worker states about its layout, its local check and its peers; the
        incarnations only to a caller with the token (none when no token is configured)."""
        return compat_document(source, reveal=_bearer_ok(token, creds))

    @app.post("/v1/compat/check", response_model=CompatVerdict, tags=["compat"], responses={413: {}})
    async def post_compat_check(theirs: CompatCheckIn) -> CompatVerdict:
        """Preflight: would a handshake between this worker and the posted one succeed? The body
        is bounded (1 MiB) and validated; the verdict quotes only values that passed."""
        ours = compat_document(source)
        errors = check_documents(ours, theirs)
        return CompatVerdict(
            compatible=not errors,
            errors=[ErrorModel.model_validate(e.model_dump(), context={"words": words_of(source)}) for e in errors],
            ours=ours.fingerprint,
            theirs=theirs.fingerprint,
        )

    @app.post(
        "/v1/transfers",
        response_model=TransferOut,
        tags=["transfers"],
        dependencies=[Depends(auth)],
        responses={401: {}, 403: {}, 409: {}, 503: {}, 504: {}},
    )
    async def post_transfer(body: TransferIn) -> TransferOut:
        """Decode only: run one synthetic transfer from the named prefill (default: the decode's
        ``control.peer``) and wait for its verified outcome. A prefill named for the first time
        is dialled and shaken hands with first; its refusal fails the request with its text."""
        if source.role != "decode":
            raise _not_decode(source)
        r = source.readiness()
        default = body.prefill is None or body.prefill == source.control
        # another prefill's request needs only this decode itself (pools, threads) to be ready
        if not r.ready and (default or r.check in ("local_check", "threads", "shutdown")):
            raise HTTPException(503, detail=r.reason)
        if body.room is not None and source.lookup(body.room) is not None:
            raise HTTPException(409, detail=f"room {body.room} was already used")
        refused = None if body.prefill is None else getattr(source, "prefill_refused", lambda _: None)(body.prefill)
        if refused is not None:
            raise HTTPException(403, detail=refused)
        named = {} if body.prefill is None else {"prefill": body.prefill}
        if body.hold:
            named.update(hold=True, steps=body.steps)
        elif body.steps:
            raise HTTPException(422, detail="steps need hold")
        fut = source.submit(body.tokens, body.room, **named)
        try:
            # shield: a client that hangs up must not cancel the worker's future
            res = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), source.result_timeout_s())
        except RoomInFlight as exc:
            raise HTTPException(409, detail=str(exc)) from None
        except asyncio.TimeoutError:
            raise HTTPException(504, detail="no outcome within the request deadline") from None
        return TransferOut(**(res if isinstance(res, dict) else res.as_dict()))

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

    def _incoming_refused(address: str) -> str | None:
        """Why a migration may not name the listener ``address``: the source's rule
        (``migration_source_refused``), else loopback only."""
        rule = getattr(source, "migration_source_refused", None)
        if rule is not None:
            return rule(address)
        host = address[len("tcp://") :].rsplit(":", 1)[0]
        return None if is_loopback_host(host) else "a migrating decode's listener is on this host (a loopback address)"

    async def _worker(fut):
        """A worker future's result; its errors as HTTP answers."""
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), source.result_timeout_s())
        except UnknownRoom as exc:
            raise HTTPException(404, detail=str(exc)) from None
        except RoomInFlight as exc:
            raise HTTPException(409, detail=str(exc)) from None
        except AgentClosed as exc:
            raise HTTPException(503, detail=str(exc)) from None
        except asyncio.TimeoutError:
            raise HTTPException(504, detail="no outcome within the request deadline") from None

    # the running requests' and the migrations' routes: a decode's, behind auth
    running = _decode_only_router(source, auth, "running")
    migrations = _decode_only_router(source, auth, "migrations")

    @running.get("/v1/requests", response_model=list[RunningOut])
    async def get_requests() -> list[RunningOut]:
        """Decode only: the requests kept running here (``hold``), oldest first."""
        return [RunningOut(**r) for r in source.running()]

    @running.get("/v1/requests/{room}", response_model=RunningOut, responses={404: {}})
    async def get_request(room: int) -> RunningOut:
        """Decode only: a running request, with the xxh3_128 digest of every item it holds."""
        return RunningOut(**await _worker(source.row(room)))

    @running.post("/v1/requests/{room}/steps", response_model=RunningOut, responses={404: {}, 409: {}})
    async def post_steps(room: int, body: StepIn) -> RunningOut:
        """Decode only: run synthetic decode steps of a running request (409 while it migrates)."""
        return RunningOut(**await _worker(source.advance(room, body.steps)))

    @running.delete("/v1/requests/{room}", response_model=RunningOut, responses={404: {}, 409: {}})
    async def delete_request(room: int) -> RunningOut:
        """Decode only: end a running request; its pages go back (409 while it migrates)."""
        return RunningOut(**await _worker(source.release(room)))

    def _migration_answer(m) -> JSONResponse | MigrationOut:
        out = MigrationOut(**m.as_dict())
        if m.status == "failed":
            code = 409 if m.refused else 502
            return JSONResponse(status_code=code, content={"detail": _migration_detail(m), **out.model_dump()})
        return out

    @migrations.post(
        "/v1/migrations", response_model=MigrationOut, responses={202: {}, 404: {}, 409: {}, 502: {}, 503: {}}
    )
    async def post_migration(body: MigrationIn):
        """Decode only: move running request ``room`` to the decode at ``to`` (its HTTP base URL).
        It is paused here, sent by this decode's migration listener, verified by the target and
        freed here only once the target runs it. 404: not running here; 409: the target refused
        (its refusal) or the room migrates already; 502: the target failed or died (the request
        runs here again, unchanged)."""
        try:
            m, fut = await asyncio.to_thread(source.migrate, body.room, body.to)
        except UnknownRoom as exc:
            raise HTTPException(404, detail=str(exc)) from None
        except RoomInFlight as exc:
            raise HTTPException(409, detail=str(exc)) from None
        except AgentClosed as exc:
            raise HTTPException(503, detail=str(exc)) from None
        if not body.wait:
            return JSONResponse(status_code=202, content=MigrationOut(**m.as_dict()).model_dump())
        return _migration_answer(await asyncio.shield(asyncio.wrap_future(fut)))

    @migrations.get("/v1/migrations/{mid}", response_model=MigrationOut, responses={404: {}})
    async def get_migration(mid: str) -> MigrationOut:
        """Decode only: a migration's record (``moving`` until it ended)."""
        m = source.migration(mid) if len(mid) <= 64 else None
        if m is None:
            raise HTTPException(404, detail="unknown migration")
        return MigrationOut(**m.as_dict())

    @migrations.post("/v1/drain", response_model=DrainOut, responses={503: {}})
    async def post_drain(body: DrainIn) -> DrainOut:
        """Decode only: move every running request to the decode at ``to``; what failed runs here
        again (listed with its error)."""
        try:
            ms = await asyncio.to_thread(source.drain_to, body.to)
        except AgentClosed as exc:
            raise HTTPException(503, detail=str(exc)) from None
        outs = [MigrationOut(**m.as_dict()) for m in ms]
        moved = sum(1 for m in ms if m.status == "success")
        return DrainOut(moved=moved, failed=len(ms) - moved, migrations=outs)

    @migrations.post(
        "/v1/migrations/incoming", response_model=TransferOut, responses={403: {}, 409: {}, 503: {}, 504: {}}
    )
    async def post_incoming(body: IncomingIn) -> TransferOut:
        """Decode only, asked by a migrating decode: take the room's pages, ask the migrating
        decode's listener (``source``: a loopback address or an exact entry of this decode's
        ``migration.sources``, 403 otherwise) for its state (the handshake judges the pair and
        authenticates it), verify it at decode step ``step`` and keep it running here. The answer
        is the transfer's record."""
        # the decode shows its memory to what it dials (see /v1/transfers): only what was configured
        refused = _incoming_refused(body.source)
        if refused is not None:
            raise HTTPException(403, detail=refused)
        r = source.readiness()
        if not r.ready and r.check in ("local_check", "threads", "shutdown"):
            raise HTTPException(503, detail=r.reason)
        fut = source.submit(body.tokens, body.room, body.source, hold=True, step=body.step, migrated=True)
        res = await _worker(fut)
        return TransferOut(**(res if isinstance(res, dict) else res.as_dict()), worker_id=source.worker_id)

    # their routes, each as it is (``include_router`` may add a router as one lazy entry, whose
    # paths neither ``route_paths`` nor the filter below would see)
    app.router.routes.extend([*running.routes, *migrations.routes])

    @app.get(
        "/metrics", tags=["metrics"], response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}}
    )
    async def metrics() -> Response:
        """Prometheus text exposition."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    if not getattr(source, "serves_transfers", True):  # an SGLang rank: its transfers are SGLang's requests
        app.router.routes = [r for r in app.router.routes if getattr(r, "path", "") not in TRANSFER_ROUTES]
    return app


# the routes of serve's synthetic transfers and re-registration: not on a source without
# ``serves_transfers`` (an SGLang rank's endpoint, ``integrations.sglang.endpoint``)
TRANSFER_ROUTES = frozenset(
    {
        "/v1/transfers",
        "/v1/transfers/{room}",
        "/v1/handshake",
        "/v1/requests",
        "/v1/requests/{room}",
        "/v1/requests/{room}/steps",
        "/v1/migrations",
        "/v1/migrations/{mid}",
        "/v1/migrations/incoming",
        "/v1/drain",
    }
)


def route_paths(app: FastAPI) -> set[str]:
    """Every HTTP route path of ``app`` (for manifests that name probe paths)."""
    return {getattr(r, "path", "") for r in app.routes}
