"""``pdstate serve``'s decode moving a running request to another decode (decode -> decode).

The migrating decode acts as the sender of the ordinary handshake: a ``PrefillAgent`` over its own
pools (its *listener*, bound on first use at ``migration.bind``) sends the request's pages and
state components exactly as a prefill sends them. The target decode's ``DecodeAgent`` registers
with that listener and asks for the room, so the target is judged by layout exactly as a decode
is judged by a prefill (cross-release pairs included), and the copy is verified at the target's
configured levels (the agent's digests, then serve's own check of the content at the request's
decode step: ``synth.verify_running``).

One migration (``start``):

1. the request is paused on this decode (``AgentDecodeWorker.pause``): no decode step writes it;
2. the listener gets a sender for its room, with every page and state component;
3. the target is asked over HTTP (``POST {to}/v1/migrations/incoming``: the room, the listener's
   address as targets dial it (``migration.advertise``, default the bound one), the token count and
   the decode step), with this worker's token as its bearer token; a target dials that address
   only when it is a loopback address or listed exactly in its ``migration.sources``; the target
   takes pages, asks the listener for the room, verifies what landed and keeps the
   request running at that step, then answers;
4. only once the target answered verified **and** the sender ended in success (its fence held)
   are the pages freed here (``moved``): the paused -> resumed interval is the downtime. Anything
   else (a refusal, a target that dies or times out, a failed check) aborts the sender, which
   returns once nothing of it can be read or land any more, and the request runs here again,
   unchanged (``resume``): it can be migrated again.

``to`` is the target's HTTP base URL, validated by the API (bounded, ``http(s)://host[:port]``);
it is never trusted for identity: the target must hold this worker's token (HTTP) and complete the
control channel's CURVE handshake (the token's or the uid's keys). The request to it follows no
redirect and no proxy.
"""

from __future__ import annotations

import bisect
import json
import logging
import secrets
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from pdstate import errors
from pdstate.errors import PdStateError, PeerGone, TransferFailed, UnknownRoom
from pdstate.protocol.lifecycle import PeerState, RequestState
from pdstate.protocol.report import ErrorInfo

log = logging.getLogger("pdstate.worker.migrate")

MIGRATION_BIND = "tcp://127.0.0.1:0"  # the listener's default (``migration.bind``): a target on this host dials it
MIGRATION_THREADS = 4  # migrations moving at once (a drain's)
MAX_RECORDS = 1000  # migration records kept for ``GET /v1/migrations/{id}``
MAX_ANSWER_BYTES = 1 << 20  # what is read of the target's answer
MAX_MESSAGE = 2000  # what is kept of the target's error message
DOWNTIME_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# a target's error of these kinds is a refusal (its layout, its pair, its protocol, its keys);
# of the engine's errors only the handshake's engine mismatch (``EngineError`` itself) is one
REFUSALS = (errors.DSV4StateError, errors.CrossSideMismatch, errors.ProtocolError, errors.AuthError)


def refused(error: BaseException | None) -> bool:
    return isinstance(error, REFUSALS) or type(error) is errors.EngineError


def clip(text: object, n: int = 300) -> str:
    """A bounded, escaped rendering of text from elsewhere (an answer, a URL)."""
    r = repr(str(text))
    return r if len(r) <= n else r[: n - 3] + "..."


@dataclass
class Migration:
    """One migration's record (``GET /v1/migrations/{id}``)."""

    id: str
    room: int
    to: str
    started: float = field(default_factory=time.time)
    status: str = "moving"  # moving | success | failed
    seq_len: int = 0
    step: int = 0
    bytes: int = 0
    downtime_s: float = 0.0
    refused: bool = False  # the target refused it (its handshake or its checks)
    error: ErrorInfo | None = None
    listener_error: ErrorInfo | None = None  # the listener's own record of that refusal

    def as_dict(self) -> dict:
        return {
            "id": self.id,
            "room": self.room,
            "to": self.to,
            "status": self.status,
            "seq_len": self.seq_len,
            "step": self.step,
            "bytes": self.bytes,
            "downtime_s": self.downtime_s,
            "refused": self.refused,
            "error": None if self.error is None else self.error.model_dump(),
            "listener_error": None if self.listener_error is None else self.listener_error.model_dump(),
        }


@dataclass
class MigrationStats:
    """What ``/metrics`` reads: migrations by outcome, downtime histogram, bytes moved."""

    outcomes: dict[str, int] = field(default_factory=lambda: {"success": 0, "failed": 0, "refused": 0})
    bytes: int = 0
    bins: list[int] = field(default_factory=lambda: [0] * (len(DOWNTIME_BUCKETS_S) + 1))
    downtime_sum: float = 0.0


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # a redirect would carry the token elsewhere
        return None


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


class Migrations:
    """The migrating side of one decode worker: its listener and its migrations' records."""

    def __init__(self, worker, bind: str | None = None, advertise: str | None = None) -> None:
        from pdstate.agent import PrefillAgent

        self.worker = worker
        o = worker.opts
        bind = bind or o.migration_bind or MIGRATION_BIND
        advertise = o.migration_advertise if advertise is None else advertise
        self.agent = PrefillAgent(
            worker.kv_args,
            report=worker.report,
            bind=bind,
            engine=o.engine,
            engine_options=o.engine_options,
            worker_id=f"{worker.worker_id}-migrate",
            heartbeat_interval_s=o.heartbeat_interval_s,
            peer_timeout_s=o.peer_timeout_s,
            token=o.token,
            key_dir=o.key_dir,
            check_local=o.local_checks,
            bootstrap_timeout_s=o.request_deadline_s + o.peer_timeout_s,
            on_request=self._not_migrating,
            verdict_timeout_s=o.verdict_timeout_s,
            advertise=(advertise,) if advertise else (),
        )
        # what a target is told to dial (``migration.advertise``; default: the bound address)
        self.address = advertise or self.agent.address
        self.answer_timeout_s = o.request_deadline_s + o.peer_timeout_s + 5
        self._pool = ThreadPoolExecutor(MIGRATION_THREADS, thread_name_prefix="pdstate-migrate")
        self._lock = threading.Lock()
        self._records: OrderedDict[str, Migration] = OrderedDict()
        self._stats = MigrationStats()
        log.info(
            "decode %s: migration listener on %s (advertised: %s)", worker.worker_id, self.agent.address, self.address
        )

    @staticmethod
    def _not_migrating(room: int, seq_len: int | None, decode: str) -> None:
        raise UnknownRoom(f"room {room}: this decode is not migrating it")

    # -- API ------------------------------------------------------------------------------------
    def start(self, room: int, to: str) -> tuple[Migration, Future]:
        """Pause ``room`` and move it to the decode at ``to`` (its HTTP base URL) on a migration
        thread; raises ``UnknownRoom`` (not running here) or ``RoomInFlight`` (migrating) at once.
        The future's result is the finished record."""
        t0 = time.perf_counter()  # the downtime runs from the pause
        seq_len, step, lists = self.worker.pause(room).result(timeout=self.answer_timeout_s)
        m = Migration(secrets.token_hex(8), room, to, seq_len=seq_len, step=step)
        with self._lock:
            self._records[m.id] = m
            while len(self._records) > MAX_RECORDS:
                self._records.popitem(last=False)
        try:
            fut = self._pool.submit(self._move, m, lists, t0)
        except RuntimeError:  # shut down meanwhile
            self.worker.resume(room)
            raise errors.AgentClosed("decode shutting down") from None
        return m, fut

    def drain(self, to: str) -> list[Migration]:
        """Move every request running here (and not migrating) to ``to``, up to
        ``MIGRATION_THREADS`` at once; returns their finished records."""
        started = []
        for r in self.worker.running():
            try:
                started.append(self.start(r["room"], to))
            except (UnknownRoom, errors.RoomInFlight):  # released or migrating meanwhile
                continue
        return [fut.result() for _, fut in started]

    def get(self, mid: str) -> Migration | None:
        with self._lock:
            return self._records.get(mid)

    def stats(self) -> MigrationStats:
        with self._lock:
            s = self._stats
            return MigrationStats(dict(s.outcomes), s.bytes, list(s.bins), s.downtime_sum)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.agent.close("decode shutting down")

    # -- one migration, on a migration thread -----------------------------------------------------
    def _move(self, m: Migration, lists, t0: float) -> Migration:
        sender, ok, error, answer = None, False, None, {}
        try:
            sender = self.agent.sender(m.room, len(lists[0]))
            sender.send(lists[0], state_indices=list(lists[1:]))
            answer = self._ask(m)
            if answer.get("status") == "success" and answer.get("verified") and answer.get("held"):
                ok = sender.wait(self.answer_timeout_s) is RequestState.SUCCESS
                if not ok:  # the target runs a copy this side cannot vouch for: it ends it
                    error = sender.failure_exception() or TransferFailed(f"room {m.room}: the sender did not end")
                    try:
                        self._call(m, "DELETE", f"/v1/requests/{m.room}")
                    except PdStateError as exc:
                        log.warning("room %d: the target's copy not ended: %s", m.room, exc)
            else:
                err = answer.get("error") if isinstance(answer.get("error"), dict) else {}
                kind = str(err.get("type") or "TransferFailed")  # the target's words: bounded
                kind = kind if len(kind) <= 64 and kind.isidentifier() else "RemoteError"
                error = errors.error_from_wire(kind, str(err.get("message", ""))[:MAX_MESSAGE])
        except Exception as exc:  # an unreachable or dying target, a refused sender
            error = exc
        if ok:
            self.worker.moved(m.room).result(timeout=self.answer_timeout_s)
            m.downtime_s = time.perf_counter() - t0
            m.bytes = int(sender.metrics.get("bytes", 0))
            m.status = "success"
            log.info("room %d moved to %s in %.1f ms (%d bytes)", m.room, clip(m.to), m.downtime_s * 1e3, m.bytes)
        else:
            self._fence(m, sender)
            m.refused = refused(error)
            m.error = (
                ErrorInfo.of(error)
                if isinstance(error, PdStateError)
                else ErrorInfo(type=type(error).__name__, message=str(error)[:MAX_MESSAGE])
            )
            m.status = "failed"
            if m.refused:
                m.listener_error = self._listener_verdict(answer.get("worker_id"))
            log.warning("room %d: migration to %s failed (%s): it runs here again", m.room, clip(m.to), m.error.type)
            self.worker.resume(m.room).result(timeout=self.answer_timeout_s)
        self._count(m)
        return m

    def _listener_verdict(self, worker_id: object) -> ErrorInfo | None:
        """Why the listener refused the decode ``worker_id`` (its handshake's own record)."""
        if not isinstance(worker_id, str):
            return None
        try:
            peers = self.agent.peers()
        except (PdStateError, TimeoutError):
            return None
        return next((p.error for p in peers if p.id == worker_id and p.state is PeerState.REJECTED), None)

    def _fence(self, m: Migration, sender) -> None:
        """Nothing of the request is read or lands after this (the sender's fence)."""
        if sender is None or sender.state.terminal:
            return
        try:
            sender.abort("migration failed", timeout_s=self.answer_timeout_s)
        except PdStateError as exc:
            log.warning("room %d: migration sender not fenced: %s", m.room, exc)

    def _ask(self, m: Migration) -> dict:
        """``POST {to}/v1/migrations/incoming``; its JSON answer (``TransferOut``)."""
        body = {"room": m.room, "source": self.address, "tokens": m.seq_len, "step": m.step}
        return self._call(m, "POST", "/v1/migrations/incoming", body)

    def _call(self, m: Migration, method: str, path: str, body: dict | None = None) -> dict:
        """One HTTP call to the target (its answer, a JSON object); ``PeerGone`` when it cannot be
        reached or answers nothing readable, ``TransferFailed`` for an HTTP error."""
        headers = {"Content-Type": "application/json"}
        token = self.worker.opts.token
        if token:
            headers["Authorization"] = "Bearer " + token.decode()
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(m.to.rstrip("/") + path, data, headers, method=method)
        try:
            with _OPENER.open(req, timeout=self.answer_timeout_s) as r:
                answer = json.loads(r.read(MAX_ANSWER_BYTES))
            if not isinstance(answer, dict):
                raise ValueError("not a JSON object")
            return answer
        except urllib.error.HTTPError as exc:
            raise TransferFailed(f"target {clip(m.to)} answered HTTP {exc.code}: {clip(_detail(exc))}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            why = getattr(exc, "reason", exc)
            raise PeerGone(f"target {clip(m.to)} gone mid-migration: {clip(why)}") from None

    def _count(self, m: Migration) -> None:
        with self._lock:
            s = self._stats
            s.outcomes["refused" if m.refused else m.status] += 1
            if m.status == "success":
                s.bytes += m.bytes
                s.downtime_sum += m.downtime_s
                s.bins[_bucket(m.downtime_s)] += 1


def _bucket(v: float) -> int:
    return bisect.bisect_left(DOWNTIME_BUCKETS_S, v)


def _detail(exc: urllib.error.HTTPError) -> str:
    try:
        raw = exc.read(64 << 10)
        d = json.loads(raw).get("detail", "")
    except Exception:
        return ""
    return d if isinstance(d, str) else json.dumps(d)[:500]


__all__ = ["DOWNTIME_BUCKETS_S", "MIGRATION_BIND", "Migration", "MigrationStats", "Migrations", "clip"]
