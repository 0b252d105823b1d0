"""``pdstate serve`` (one worker + its HTTP app in one process) and ``pdstate probe``.

``serve``: load the config (file, ``PDSTATE_*`` environment, ``--set``), start the worker (pools,
engine, control socket), then run the FastAPI app under uvicorn on ``[http] host/port``. When the
HTTP socket listens it prints one JSON line to stdout::

    {"event": "listening", "role": "prefill", "http": "http://127.0.0.1:8101",
     "control": "tcp://127.0.0.1:5601", "pid": 1234, "startup_s": 3.1}

(``http.port = 0`` and a ``tcp://host:0`` control bind are resolved to the real ports there.)
A worker whose own target/draft pair fails ``setup_state_kv_args`` with ``checks.local = true``
exits 3 with the upstream message on stderr; ``checks.local = false`` serves anyway and reports
the error on ``/readyz`` and ``/v1/compat``.

SIGTERM / SIGINT: stop accepting HTTP connections, answer new transfer requests 503, stop the
worker (which fails its in-flight requests with a reason and releases its shared memory), finish
the open HTTP responses, print ``{"event": "stopped"}`` and exit 0.

``probe URL [URL]``: GET ``/v1/compat`` and ``/readyz`` of running workers and print a readable
report; with two URLs, POST the first one's document to the second's ``/v1/compat/check``.
Probe only needs the standard library (httpx when installed), not torch.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any

log = logging.getLogger("pdstate.serve")
_T_IMPORTED = time.perf_counter()  # cli imports this module before parsing argv: ~process start

EXIT_LOCAL_CHECK = 3


# --- the status source over a live worker ------------------------------------------------------


class WorkerStatus:
    """``api.StatusSource`` over a started ``PrefillWorker`` or ``DecodeWorker``.

    ``drain()`` is the one way to stop the worker: idempotent, thread-safe; it marks the source
    as shutting down (so no new transfer is accepted), stops the worker, and completes any future
    the worker did not get to with a failed result.
    """

    def __init__(self, worker, cfg) -> None:
        self.worker = worker
        self.cfg = cfg
        self.role: str = cfg.role
        self.worker_id: str = worker.worker_id
        self.incarnation: str = worker.incarnation
        self.engine: str = cfg.transfer.engine
        self.control: str = worker.endpoint if cfg.role == "prefill" else cfg.control.peer
        self.report = worker.report
        self.stats = worker.stats
        self.draining = False
        self._lock = threading.Lock()
        self._stopped = False
        self._futures: dict[Future, tuple[int, int]] = {}  # submitted by us -> (room, tokens)

    # read side
    def local_check(self):
        r = self.report.local_check
        return r.ok, r.error

    def readiness(self):
        from pdstate.api import Readiness
        from pdstate.layout import ErrorInfo

        if self.draining:
            return Readiness(False, "shutting down", "shutdown")
        ok, err = self.local_check()
        if not ok:
            return Readiness(False, err.message, "local_check", err)
        threads = [t for t in (getattr(self.worker, "_threads", None) or [getattr(self.worker, "_thread", None)]) if t]
        dead = [t.name for t in threads if not t.is_alive()]
        if dead:  # a worker thread died: nothing would answer (see the worker's log for why)
            return Readiness(False, f"worker thread stopped: {', '.join(dead)}", "peer")
        if self.role == "prefill":
            if not self.worker.endpoint:
                return Readiness(False, "control socket not listening", "peer")
            return Readiness(True)
        state = self.worker.peer_state.value
        if state == "accepted":
            return Readiness(True)
        if state == "rejected":
            e = self.worker.peer_error or ErrorInfo(type="RuntimeError", message="handshake refused")
            return Readiness(False, e.message, "handshake", e)
        if state == "gone":
            return Readiness(False, f"prefill at {self.control} is gone (no heartbeat); registering again", "peer")
        return Readiness(False, f"waiting for the prefill at {self.control} to answer the handshake", "peer")

    def peers(self) -> list[dict]:
        if self.role == "prefill":
            return [{"id": p["id"], "state": p["state"], "error": p["error"], "incarnation": p["incarnation"]}
                    for p in self.worker.peer_states()]
        w = self.worker
        err = None if w.peer_error is None else w.peer_error.model_dump()
        return [{"id": self.control, "state": w.peer_state.value, "error": err, "incarnation": w.prefill_incarnation}]

    def in_flight(self) -> int:
        return len(self.worker.requests if self.role == "decode" else self.worker.jobs)

    def free_counts(self) -> dict[str, int]:
        if self._stopped:
            return {}
        return self.worker.free_counts()

    def result_timeout_s(self) -> float:
        o = self.worker.opts
        return o.request_deadline_s + o.peer_timeout_s + 5

    # decode actions
    def submit(self, tokens: int, room: int | None) -> Future:
        with self._lock:
            if self.draining:
                fut: Future = Future()
                fut.set_result(self._failed(room or 0, tokens, "decode shutting down"))
                return fut
            inner = self.worker.submit(tokens, room)
            outer: Future = Future()
            self._futures[outer] = (room or 0, tokens)

        def relay(f: Future) -> None:
            from pdstate.runtime.common import settle

            if f.cancelled():
                exc: BaseException | None = RuntimeError(f"transfer of room {room} was cancelled")
            else:
                exc = f.exception()
            with self._lock:  # drain() may have completed ``outer`` already, its caller cancelled it
                self._futures.pop(outer, None)
                if exc is not None:
                    settle(outer, exc=exc)
                else:
                    settle(outer, f.result().as_dict())

        inner.add_done_callback(relay)
        return outer

    def lookup(self, room: int) -> dict | None:
        w = self.worker
        res = w.finished.get(room)
        if res is not None:
            return res.as_dict()
        req = w.requests.get(room)
        if req is not None:
            from pdstate.runtime.common import now

            return {"room": room, "status": "in_flight", "seq_len": req.seq_len, "seconds": now() - req.started}
        return None

    def reregister(self) -> None:
        self.worker.reregister()

    @staticmethod
    def _failed(room: int, tokens: int, reason: str) -> dict:
        return {"room": room, "status": "failed", "seq_len": tokens, "bytes": 0, "descriptors": 0,
                "seconds": 0.0, "verified": False, "error": {"type": "TransferFailed", "message": reason}}

    def drain(self) -> None:
        with self._lock:
            self.draining = True
            if self._stopped:
                return
            self._stopped = True
        try:
            self.worker.stop()
        finally:
            with self._lock:
                from pdstate.runtime.common import settle

                for f, (room, tokens) in self._futures.items():
                    settle(f, self._failed(room, tokens, f"{self.role} shutting down"))
                self._futures.clear()


def release_partial(worker) -> None:
    """Free what a worker built before its ``start()`` raised (its shm segments above all)."""
    for name in ("engine", "pools"):
        obj = getattr(worker, name, None)
        if obj is not None:
            try:
                obj.close()
            except Exception:  # best effort on the way out
                log.debug("closing %s after a failed start", name, exc_info=True)


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def cmd_serve(args) -> int:
    from pdstate.runtime.common import tune_interpreter

    tune_interpreter()
    from pdstate.config import load_config

    cfg = load_config(args.config, args.set)  # ConfigError -> exit 2 in cli.main
    logging.getLogger().setLevel(args.log_level.upper())
    t0 = _T_IMPORTED

    stop_requested = threading.Event()
    holder: dict[str, Any] = {}

    def on_signal(signum, frame) -> None:  # before/after uvicorn's own handlers are installed
        stop_requested.set()
        src = holder.get("source")
        if src is not None:
            src.draining = True
        srv = holder.get("server")
        if srv is not None:
            srv.should_exit = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    from pdstate.runtime.common import LocalCheckFailed

    if cfg.role == "prefill":
        from pdstate.runtime.prefill import PrefillWorker as Worker
    else:
        from pdstate.runtime.decode import DecodeWorker as Worker
    worker = Worker(cfg.worker_options())
    try:
        worker.start()
    except LocalCheckFailed as exc:
        release_partial(worker)
        cause = exc.__cause__ or exc
        print(f"pdstate serve: {cfg.role} local check failed: {type(cause).__name__}: {exc}", file=sys.stderr)
        from pdstate.cli_ops import FIX_HINTS

        if type(cause).__name__ in FIX_HINTS:
            print(f"  {FIX_HINTS[type(cause).__name__]}", file=sys.stderr)
        print("  (checks.local = false serves anyway and reports the error on /readyz)", file=sys.stderr)
        return EXIT_LOCAL_CHECK
    except Exception as exc:
        release_partial(worker)
        print(f"pdstate serve: {cfg.role} worker failed to start: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    source = WorkerStatus(worker, cfg)
    holder["source"] = source
    if stop_requested.is_set():
        source.drain()
        return 0
    try:
        sock = _listen(cfg.http.host, cfg.http.port)
    except OSError as exc:
        source.drain()
        print(f"pdstate serve: cannot listen on {cfg.http.host}:{cfg.http.port}: {exc}", file=sys.stderr)
        return 1

    import uvicorn

    from pdstate.api import create_app

    app = create_app(source, token=cfg.auth.secret())

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            source.draining = True  # new transfers get 503 from here on
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                _emit({"event": "listening", "role": cfg.role, "worker_id": source.worker_id,
                       "http": _url(sock), "control": source.control, "pid": os.getpid(),
                       "startup_s": round(time.perf_counter() - t0, 3)})

        async def shutdown(self, sockets=None) -> None:
            import asyncio

            # stop the worker while uvicorn closes the listener: in-flight transfers then end
            # (failed, with a reason) and their HTTP responses can be written before we exit
            drained = asyncio.get_running_loop().run_in_executor(None, source.drain)
            await super().shutdown(sockets=sockets)
            await drained

    config = uvicorn.Config(app, log_config=None, log_level=args.log_level.lower(), access_log=False,
                            lifespan="off", timeout_graceful_shutdown=10)
    server = Server(config)
    holder["server"] = server
    if stop_requested.is_set():
        server.should_exit = True
    try:
        server.run(sockets=[sock])
    finally:
        source.drain()
        sock.close()
    _emit({"event": "stopped", "role": cfg.role, "pid": os.getpid()})
    return 0


# --- probe ------------------------------------------------------------------------------------


class ProbeError(Exception):
    pass


def _http(method: str, url: str, body: dict | None = None, token: str | None = None, timeout_s: float = 5.0):
    """``(status, json_or_text)``; raises ``ProbeError`` when the worker cannot be reached."""
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        import httpx
    except ImportError:  # pragma: no cover - httpx is a dev dependency
        httpx = None
    if httpx is not None:
        try:
            r = httpx.request(method, url, json=body, headers=headers, timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise ProbeError(f"{method} {url}: {exc}") from None
        status, text = r.status_code, r.text
    else:  # pragma: no cover
        import urllib.error
        import urllib.request

        data = None if body is None else json.dumps(body).encode()
        if data is not None:
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                status, text = resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            status, text = exc.code, exc.read().decode()
        except (urllib.error.URLError, OSError) as exc:
            raise ProbeError(f"{method} {url}: {exc}") from None
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def _short(value: Any, limit: int = 60) -> str:
    s = json.dumps(value) if not isinstance(value, str) else value
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _fmt_error(e: dict | None) -> str:
    return "" if not e else f"{e['type']}: {e['message']}"


def probe(urls: list[str], token: str | None = None, timeout_s: float = 5.0) -> dict:
    """Query each worker; with two, ask the second to check the first. Returns the findings."""
    out: dict[str, Any] = {"workers": [], "pair": None, "ok": True}
    docs = []
    for url in urls:
        base = url.rstrip("/")
        w: dict[str, Any] = {"url": base}
        try:
            status, ready = _http("GET", f"{base}/readyz", token=token, timeout_s=timeout_s)
            w["ready"] = ready if isinstance(ready, dict) else {"ready": False, "reason": str(ready)}
            status, doc = _http("GET", f"{base}/v1/compat", token=token, timeout_s=timeout_s)
            if status != 200 or not isinstance(doc, dict):
                raise ProbeError(f"GET {base}/v1/compat answered {status}: {_short(doc, 200)}")
            w["compat"] = doc
        except ProbeError as exc:
            w["unreachable"] = str(exc)
        docs.append(w.get("compat"))
        out["ok"] &= bool(w.get("ready", {}).get("ready")) and "compat" in w
        out["workers"].append(w)
    if len(urls) == 2 and all(docs):
        base = urls[1].rstrip("/")
        try:
            status, verdict = _http("POST", f"{base}/v1/compat/check", body=docs[0], token=token, timeout_s=timeout_s)
            if status != 200 or not isinstance(verdict, dict):
                raise ProbeError(f"POST {base}/v1/compat/check answered {status}: {_short(verdict, 300)}")
            out["pair"] = verdict
            out["ok"] &= bool(verdict["compatible"])
        except ProbeError as exc:
            out["pair"] = {"compatible": False, "errors": [{"type": "ProbeError", "message": str(exc)}]}
            out["ok"] = False
    return out


def format_probe(found: dict) -> str:
    from pdstate.cli_ops import FIX_HINTS

    lines = []
    for w in found["workers"]:
        if "unreachable" in w:
            lines.append(f"{w['url']}: UNREACHABLE: {w['unreachable']}")
            continue
        d, r = w["compat"], w.get("ready", {})
        state = "ready" if r.get("ready") else f"NOT READY: {r.get('reason')}"
        lines.append(f"{d['role']:<8} {w['url']}  {state}")
        lines.append(f"  worker       {d.get('worker_id')} (incarnation {d.get('incarnation')}), "
                     f"protocol v{d['protocol_version']}, engine {d.get('engine')}, control {d.get('control')}")
        lines.append(f"  fingerprint  {d['fingerprint']}")
        lay = d.get("layout", {})
        scalars = [f"{k}={_short(v, 40)}" for k, v in lay.items() if k not in ("components", "main_kv_item_lens", "draft")]
        lines.append(f"  layout       {' '.join(scalars)}")
        draft = lay.get("draft")
        lines.append(f"  draft        {'none' if not draft else _short(draft, 100)}")
        lines.append(f"  components   {len(lay.get('components') or [])} state components, "
                     f"{len(lay.get('main_kv_item_lens') or [])} main KV buffers")
        lc = d.get("local_check", {})
        lines.append(f"  local check  {'ok' if lc.get('ok') else 'FAILED: ' + _fmt_error(lc.get('error'))}")
        peers = d.get("peers") or []
        if not peers:
            lines.append("  peers        none")
        for i, p in enumerate(peers):
            label = "  peers        " if i == 0 else "               "
            err = f": {_fmt_error(p.get('error'))}" if p.get("error") else ""
            lines.append(f"{label}{p['id']} {p['state']}{err}")
    pair = found.get("pair")
    if pair is not None:
        if pair["compatible"]:
            lines.append("pair: compatible")
        else:
            lines.append("pair: INCOMPATIBLE")
            for e in pair["errors"]:
                lines.append(f"  - {e['type']}: {e['message']}")
                if e["type"] in FIX_HINTS:
                    lines.append(f"    {FIX_HINTS[e['type']]}")
    return "\n".join(lines)


def cmd_probe(args) -> int:
    found = probe(args.urls, token=args.token or None, timeout_s=args.timeout)
    print(json.dumps(found) if args.json else format_probe(found))
    return 0 if found["ok"] else 1


def add_commands(sub) -> None:
    s = sub.add_parser("serve", help="run one worker (prefill or decode) with its HTTP endpoint")
    s.add_argument("--config", required=True, metavar="FILE", help="worker config (TOML)")
    s.add_argument("--set", action="append", default=[], metavar="section.key=value",
                   help="override one config key (wins over PDSTATE_* environment and the file)")
    s.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    s.set_defaults(func=cmd_serve)

    p = sub.add_parser("probe", help="query running workers' /v1/compat and /readyz; with two, check the pair")
    p.add_argument("urls", nargs="+", metavar="URL", help="worker base URL, e.g. http://127.0.0.1:8101")
    p.add_argument("--token", default="", help="bearer token (only needed by mutating endpoints)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per HTTP call")
    p.add_argument("--json", action="store_true", help="print the findings as one JSON object")
    p.set_defaults(func=cmd_probe)
