"""Child process: SGLang's own ``load_plugins()`` registers backend pdstate, nothing imported by hand.

Reads ``{"spawn": bool}`` on stdin; prints one JSON object on the last line of stdout: what this
process saw (``main``) and, with ``spawn``, what a child it spawns with multiprocessing's ``spawn``
method saw (``spawned``), as SGLang starts its schedulers. Each process imports only the CPU stand-ins (``booted``) and SGLang's modules; pdstate's
SGLang integration must be loaded by SGLang's plugin loader alone. Run by ``test_plugin.py``.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import traceback

from pdstate.devtools.sglang_pair import booted  # noqa: F401  (first: sys.path, the GPU-only stubs and the bare sglang package)

INTEGRATION = "pdstate.integrations.sglang"


def observe() -> dict:
    """Run SGLang's plugin loader in this process and record what backend "pdstate" can do here."""
    before = INTEGRATION in sys.modules
    from sglang.srt.plugins import load_plugins

    load_plugins()
    out: dict = {"integration_imported_before": before, "integration_loaded": INTEGRATION in sys.modules}
    from sglang.srt.disaggregation import utils
    from sglang.srt.server_args import prepare_server_args

    try:
        backend = utils.TransferBackend("pdstate")
        out["member"] = f"{type(backend).__name__}.{backend.name}"
    except ValueError as exc:
        out["member"] = f"ValueError: {exc}"
        return out
    try:
        parsed = prepare_server_args(
            ["--model-path", "dummy", "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "pdstate"]
        )
        out["cli"] = parsed.disaggregation_transfer_backend
    except SystemExit as exc:
        out["cli"] = f"SystemExit({exc.code})"
    out["classes"] = {
        kind: utils.get_kv_class(backend, utils.KVClassType[kind]).__name__
        for kind in ("MANAGER", "SENDER", "RECEIVER", "BOOTSTRAP_SERVER")
    }
    return out


def _child(queue) -> None:
    try:
        queue.put({"ok": True, **observe()})
    except Exception:
        queue.put({"ok": False, "error": traceback.format_exc()})


def main() -> None:
    spawn = bool(json.load(sys.stdin).get("spawn"))
    result: dict = {}
    try:
        result["main"] = {"ok": True, **observe()}
    except Exception:
        result["main"] = {"ok": False, "error": traceback.format_exc()}
    if spawn:
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        child = ctx.Process(target=_child, args=(queue,))
        child.start()
        try:
            result["spawned"] = queue.get(timeout=240)
        finally:
            child.join(30)
    from pdstate.integrations.sglang import sglang_release  # after the checks: reading the release only

    result["release"] = sglang_release()
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
