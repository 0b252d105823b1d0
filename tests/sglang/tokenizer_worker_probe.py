"""Child process: SGLang 0.5.23's own HTTP server with ``--tokenizer-worker-num 2`` and backend pdstate.

Run by ``test_tokenizer_workers.py`` (stdin: ``{}``; the last line of stdout: one JSON object).
The process does what ``sglang.launch_server`` does up to its HTTP server: SGLang's
``load_plugins()``, SGLang's argument parser, then SGLang's own
``http_server._setup_and_run_http_server`` with 2 tokenizer workers, which writes the arguments to
shared memory and has uvicorn spawn 2 worker processes importing the app that
``SGLANG_HTTP_SERVER_APP_PATH`` names. Each worker runs SGLang's lifespan:
``init_multi_tokenizer`` builds ``TokenizerWorker``, which resolves ``TransferBackend(...)``.

Stand-ins, CPU only and never on that path: the schedulers are not started (the parent's own
tokenizer manager is a stub: the workers talk to no scheduler), the model config and tokenizer are
not loaded, templates are not read, and the Python packages missing from the CPU environment
(``MISSING``) are empty modules. Every spawned worker imports this file first (as
``__mp_main__``), which applies those stand-ins there and records, in ``$PDSTATE_TW_REPORTS``,
what the worker's ``init_multi_tokenizer`` ended with. Nothing of pdstate is imported here:
whatever of it a worker holds came through SGLang.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import shutil
import signal
import sys
import threading
import time
import traceback
import types
import urllib.error
import urllib.request

from pdstate.devtools.sglang_pair import booted  # noqa: F401  (first: sys.path, the GPU-only stubs and the bare sglang package)

REPORTS = "PDSTATE_TW_REPORTS"  # the directory each worker writes its report into
WORKERS = 2
INTEGRATION = "pdstate.integrations.sglang"
WORKER_APP = "pdstate.integrations.sglang.worker_app"
MISSING = ("jsonschema", "soundfile", "python_multipart")  # imported by SGLang's HTTP server, not in the CPU env
STARTED = time.monotonic()
DEADLINE_S = 200.0  # from this process's start: the server is stopped by then, within the runner's 280 s


class _Absent(types.ModuleType):
    """A package missing here: every name imported from it is a new empty class."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {})
        setattr(self, name, value)
        return value


def _cpu_stand_ins() -> None:
    """What SGLang's HTTP server needs to import here (both in this process and in its workers)."""
    import triton  # the GPU-only stub: fla's device probe reads the active driver's backend

    triton.runtime.driver.active.get_current_target.backend = "cpu"
    for name in MISSING:
        if importlib.util.find_spec(name) is None:
            module = _Absent(name)
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)
            module.__version__ = "0.0.20"  # fastapi's python-multipart probe
            sys.modules[name] = module


def _worker_stand_ins() -> None:
    """In a spawned worker: no model or tokenizer to load, and a report of ``init_multi_tokenizer``."""
    from unittest import mock

    from sglang.srt.entrypoints import http_server
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.parser.template_manager import TemplateManager

    def init_model_config(self) -> None:
        self.model_path = self.served_model_name = "dummy"
        self.model_config = mock.MagicMock()
        self.model_config.get_default_sampling_params.return_value = {}
        self.is_generation, self.context_len, self.image_token_id = True, 4096, None
        self.max_req_input_len, self.num_reserved_tokens = None, 0
        self.enable_priority_scheduling, self.default_priority_value = False, None

    def init_tokenizer_and_processor(self) -> None:
        self.tokenizer = self.processor = self.mm_processor = None

    TokenizerManager.init_model_config = init_model_config
    TokenizerManager.init_tokenizer_and_processor = init_tokenizer_and_processor
    TokenizerManager._validate_cuda_vmm_feature_transport_support = lambda self: None
    TemplateManager.initialize_templates = lambda self, **kw: None
    original = http_server.init_multi_tokenizer

    async def init_multi_tokenizer():
        report: dict = {"pid": os.getpid(), "app_path": os.environ.get("SGLANG_HTTP_SERVER_APP_PATH")}
        try:
            server_args = await original()
            backend = http_server.get_global_state().tokenizer_manager.disaggregation_transfer_backend
            report["backend"] = f"{type(backend).__name__}.{backend.name}"
            return server_args
        except Exception as exc:
            report["backend"] = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            report["worker_app_loaded"] = WORKER_APP in sys.modules
            report["integration_loaded"] = INTEGRATION in sys.modules
            path = os.path.join(os.environ[REPORTS], f"worker-{os.getpid()}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(report, f)
            os.replace(path + ".tmp", path)

    http_server.init_multi_tokenizer = init_multi_tokenizer


_cpu_stand_ins()
if __name__ == "__mp_main__":  # a worker uvicorn spawned
    _worker_stand_ins()


class _ParentTokenizerManager:
    """The parent's tokenizer manager: only what ``_setup_and_run_http_server`` reads of it here."""

    startup_time: dict = {}

    class socket_mapping:  # SGLang's attribute name
        @staticmethod
        def clear_all_sockets() -> None:
            pass


def _reports(directory: str) -> list[dict]:
    names = sorted(n for n in os.listdir(directory) if n.endswith(".json"))
    out = []
    for name in names:
        with open(os.path.join(directory, name)) as f:
            out.append(json.load(f))
    return out


def _get(port: int, path: str) -> int | str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def _watch(directory: str, port: int, seen: dict, finished: threading.Event) -> None:
    """Once every worker has reported (and, where all of them know the backend, one of them has
    answered a request), stop the server as ``Ctrl-C`` does. A worker whose start-up failed exits,
    but uvicorn notices that only at its health check's deadline (``SGLANG_UVICORN_WORKER_HEALTHCHECK_TIMEOUT``)."""
    deadline = STARTED + DEADLINE_S
    while time.monotonic() < deadline and not finished.is_set():
        reports = _reports(directory)
        if len(reports) >= WORKERS:
            if any(not r["backend"].startswith("TransferBackend.") for r in reports):
                break
            seen["served"] = _get(port, "/pdstate-no-such-route")
            if isinstance(seen["served"], int):  # refused until a worker's start-up has finished
                break
        time.sleep(0.1)
    if not finished.is_set():
        os.kill(os.getpid(), signal.SIGINT)


def main() -> None:
    json.load(sys.stdin)
    import tempfile

    from sglang.srt.plugins import load_plugins

    load_plugins()  # as sglang.launch_server does before it parses its arguments
    from sglang.srt.entrypoints import http_server
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import PortArgs, prepare_server_args

    directory = tempfile.mkdtemp(prefix="pdstate-tw-")
    os.environ[REPORTS] = directory
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["--model-path", "dummy", "--disaggregation-mode", "prefill"]
    argv += ["--disaggregation-transfer-backend", "pdstate", "--tokenizer-worker-num", str(WORKERS)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--skip-server-warmup"]
    server_args = prepare_server_args(argv)
    publish(server_args, role="tokenizer")
    port_args = PortArgs.init_new(server_args)
    seen: dict = {"app_path": os.environ.get("SGLANG_HTTP_SERVER_APP_PATH")}
    finished = threading.Event()
    watcher = threading.Thread(target=_watch, args=(directory, port, seen, finished), daemon=True)
    watcher.start()
    try:
        http_server._setup_and_run_http_server(
            server_args, _ParentTokenizerManager(), None, port_args, [{"max_req_input_len": 4096}], None
        )
        seen["ended"] = "returned"
    except BaseException as exc:  # uvicorn's own stop may exit
        seen["ended"] = f"{type(exc).__name__}: {exc}"
        seen["traceback"] = traceback.format_exc()[-2000:]
    finally:
        finished.set()
    watcher.join(5)
    seen["workers"] = _reports(directory)
    shutil.rmtree(directory, ignore_errors=True)
    print(json.dumps(seen, default=str))


if __name__ == "__main__":
    main()
