"""``pdstate serve``: one worker + its HTTP app in one process.

``serve``: load the config (file, ``PDSTATE_*`` environment, ``--set``), start the worker (pools,
engine, control socket), then run the FastAPI app under uvicorn on ``[http] host/port``. When the
HTTP socket listens it prints one JSON line to stdout::

    {"event": "listening", "role": "prefill", "http": "http://127.0.0.1:8101",
     "control": "tcp://127.0.0.1:5601", "pid": 1234, "startup_s": 3.1}

(``http.port = 0`` and a ``tcp://host:0`` control bind are resolved to the real ports there.)
A worker whose own target/draft pair fails ``setup_state_kv_args`` with ``checks.local = true``
exits ``ExitCode.LOCAL_CHECK`` (3) with the upstream message on stderr; ``checks.local = false`` serves anyway and reports
the error on ``/readyz`` and ``/v1/compat``.

SIGTERM / SIGINT: stop accepting HTTP connections, answer new transfer requests 503, stop the
worker (which fails its in-flight requests with a reason and releases its shared memory), finish
the open HTTP responses, print ``{"event": "stopped"}`` and exit 0. A worker that cannot start (engine, bind, HTTP port)
exits ``ExitCode.FAILED`` (1); a bad configuration ``ExitCode.CONFIG`` (2, from ``pdstate.cli``).

Before anything opens, the descriptor soft limit is raised to the hard limit; HTTP connections are
capped and a request's head and body must arrive within a deadline (``status.connections``).

The status source over the worker is ``status.source``; ``probe`` is ``service.probe``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from pdstate.errors import ExitCode
from pdstate.status.source import WorkerStatus, release_partial

log = logging.getLogger("pdstate.service.server")
_T_IMPORTED = time.perf_counter()  # cli imports this module before parsing argv: ~process start


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def cmd_serve(args) -> ExitCode:
    from pdstate.worker.base import tune_interpreter

    tune_interpreter()
    from pdstate.status.connections import (
        bounded_h11,
        http_connection_cap,
        http_url,
        listen_socket,
        raise_open_files_limit,
    )

    nofile = raise_open_files_limit()  # before the worker opens anything: peers, segments, HTTP
    from pdstate.settings.auth import check_open_listener
    from pdstate.settings.config import load_config

    cfg = load_config(args.config, args.set)  # ConfigError -> ExitCode.CONFIG in cli.main
    check_open_listener(cfg.transfer.engine, cfg.transfer.open_listener_acknowledged())
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

    from pdstate.errors import LocalCheckFailed

    if cfg.role == "prefill":  # the workers (``pdstate.worker``) are callers of the agent
        from pdstate.worker.prefill import AgentPrefillWorker as Worker
    else:
        from pdstate.worker.decode import AgentDecodeWorker as Worker
    from pdstate.worker.options import WorkerOptions

    worker = Worker(WorkerOptions.from_config(cfg))
    try:
        worker.start()
    except LocalCheckFailed as exc:
        release_partial(worker)
        cause = exc.__cause__ or exc
        print(f"pdstate serve: {cfg.role} local check failed: {type(cause).__name__}: {exc}", file=sys.stderr)
        from pdstate.protocol.fixes import fix_line

        if fix := fix_line(type(cause).__name__, str(cause)):
            print(f"  {fix}", file=sys.stderr)
        print("  (checks.local = false serves anyway and reports the error on /readyz)", file=sys.stderr)
        return ExitCode.LOCAL_CHECK
    except Exception as exc:
        release_partial(worker)
        print(f"pdstate serve: {cfg.role} worker failed to start: {type(exc).__name__}: {exc}", file=sys.stderr)
        return ExitCode.FAILED
    source = WorkerStatus(worker, cfg)
    holder["source"] = source
    if stop_requested.is_set():
        source.drain()
        return ExitCode.OK
    try:
        sock = listen_socket(cfg.http.host, cfg.http.port)
    except OSError as exc:
        source.drain()
        print(f"pdstate serve: cannot listen on {cfg.http.host}:{cfg.http.port}: {exc}", file=sys.stderr)
        return ExitCode.FAILED

    import uvicorn

    from pdstate.status.api import create_app

    app = create_app(source, token=cfg.auth.secret())

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            source.draining = True  # new transfers get 503 from here on
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                _emit(
                    {
                        "event": "listening",
                        "role": cfg.role,
                        "worker_id": source.worker_id,
                        "http": http_url(sock),
                        "control": source.control,
                        "pid": os.getpid(),
                        "startup_s": round(time.perf_counter() - t0, 3),
                    }
                )

        async def shutdown(self, sockets=None) -> None:
            import asyncio

            # stop the worker while uvicorn closes the listener: in-flight transfers then end
            # (failed, with a reason) and their HTTP responses can be written before we exit
            drained = asyncio.get_running_loop().run_in_executor(None, source.drain)
            await super().shutdown(sockets=sockets)
            await drained

    cap = http_connection_cap(nofile)
    config = uvicorn.Config(
        app,
        http=bounded_h11(cap),  # a request's head and body within a deadline, connections capped
        limit_concurrency=cap,
        log_config=None,
        log_level=args.log_level.lower(),
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=10,
    )
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
    return ExitCode.OK
