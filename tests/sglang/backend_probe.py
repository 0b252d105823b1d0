"""Child process of the harness: pdstate registered as a transfer backend of the real SGLang.

Reads the names of the checks to run, in order, as a JSON list on stdin; prints one JSON object on
the last line of stdout: per check, ``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``. Run only by ``runner.run_probe(..., script="backend_probe.py")``:
importing ``booted`` changes process-wide state.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

from pdstate.devtools.sglang_pair import booted  # noqa: F401  (first: sys.path, the GPU-only stubs and the bare sglang package)

KINDS = ("MANAGER", "SENDER", "RECEIVER", "BOOTSTRAP_SERVER")
BASES = {
    "MANAGER": "BaseKVManager",
    "SENDER": "BaseKVSender",
    "RECEIVER": "BaseKVReceiver",
    "BOOTSTRAP_SERVER": "BaseKVBootstrapServer",
}
# Loaded before install(): each imported get_kv_class by name, so each must be patched in place.
IMPORTERS = (
    "sglang.srt.disaggregation.prefill",
    "sglang.srt.disaggregation.decode",
    "sglang.srt.managers.disagg_service",
)


def before_install() -> dict:
    from sglang.srt.disaggregation.utils import TransferBackend

    try:
        TransferBackend("pdstate")
        refused = False
    except ValueError:
        refused = True
    loaded = {}
    for name in IMPORTERS:
        try:
            __import__(name)
            loaded[name] = True
        except Exception as exc:  # recorded: the test says which could not load here
            loaded[name] = f"{type(exc).__name__}: {exc}"
    return {"refused": refused, "loaded": loaded}


def install_twice() -> dict:
    from sglang.srt.disaggregation import utils
    from sglang.srt.server_args import DISAGG_TRANSFER_BACKEND_CHOICES

    import pdstate.integrations.sglang as integration

    integration.install()
    first = (utils.get_kv_class, len(utils.TransferBackend), list(DISAGG_TRANSFER_BACKEND_CHOICES))
    integration.install()
    from pdstate.integrations.sglang import registry

    registry.register()  # the patches themselves, run again past install()'s flag
    second = (utils.get_kv_class, len(utils.TransferBackend), list(DISAGG_TRANSFER_BACKEND_CHOICES))
    return {
        "installed": integration.is_installed(),
        "same_function": first[0] is second[0],
        "members": [first[1], second[1]],
        "choices": second[2],
        "pdstate_choices": second[2].count("pdstate"),
    }


def enum_member() -> dict:
    from sglang.srt.disaggregation.utils import TransferBackend

    member = TransferBackend("pdstate")
    return {
        "is_attr": member is TransferBackend.PDSTATE,
        "by_name": TransferBackend["PDSTATE"] is member,
        "name": member.name,
        "value": member.value,
        "isinstance": isinstance(member, TransferBackend),
        "in_iteration": member in list(TransferBackend),
        "repr": repr(member),
        "equals_mooncake": member == TransferBackend.MOONCAKE,
        "mooncake_still": TransferBackend("mooncake") is TransferBackend.MOONCAKE,
        "hashable": {member: 1}[TransferBackend("pdstate")] == 1,
    }


def server_args_accept() -> dict:
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    args = ServerArgs(model_path="dummy", disaggregation_mode="prefill", disaggregation_transfer_backend="pdstate")
    parsed = prepare_server_args(
        ["--model-path", "dummy", "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "pdstate"]
    )
    try:
        prepare_server_args(["--model-path", "dummy", "--disaggregation-transfer-backend", "pdstatex"])
        bogus_refused = False
    except SystemExit:
        bogus_refused = True
    return {
        "direct": args.disaggregation_transfer_backend,
        "parsed": parsed.disaggregation_transfer_backend,
        "bogus_refused": bogus_refused,
    }


def kv_classes() -> dict:
    import sys as _sys

    from sglang.srt.disaggregation import utils
    from sglang.srt.disaggregation.base import KVArgs, conn

    for name in IMPORTERS:  # loaded now if install() ran first: they bind the wrapper from utils
        __import__(name)
    backend = utils.TransferBackend("pdstate")
    out = {}
    for kind in KINDS:
        cls = utils.get_kv_class(backend, utils.KVClassType[kind])
        base = getattr(conn, BASES[kind])
        out[kind] = {
            "name": cls.__name__,
            "module": cls.__module__,
            "subclass": issubclass(cls, base),
            "abstract_left": sorted(getattr(cls, "__abstractmethods__", ())),
        }
        try:
            cls.__new__(cls)  # abstract classes refuse here
            out[kind]["instantiable"] = True
        except TypeError as exc:
            out[kind]["instantiable"] = str(exc)
    out["kvargs_is_sglangs"] = utils.get_kv_class(backend, utils.KVClassType.KVARGS) is KVArgs
    fake = utils.get_kv_class(utils.TransferBackend.FAKE, utils.KVClassType.SENDER)
    out["fake_sender"] = f"{fake.__module__}.{fake.__name__}"
    out["importers"] = {
        name: (_sys.modules[name].get_kv_class is utils.get_kv_class) if name in _sys.modules else "not loaded"
        for name in IMPORTERS
    }
    out["importers_answer"] = {
        name: _sys.modules[name].get_kv_class(backend, utils.KVClassType.MANAGER).__name__
        for name in IMPORTERS
        if name in _sys.modules
    }
    return out


def launcher() -> dict:
    """The launcher's dispatch, with SGLang's real entry module and its server start replaced."""
    from pdstate.integrations.sglang import launch_server
    from sglang import launch_server as entry

    calls = []
    entry.run_server = lambda server_args: calls.append(("run_server", server_args.disaggregation_transfer_backend))
    entry.kill_process_tree = lambda pid, include_parent=True: calls.append(
        ("kill", pid == os.getpid(), include_parent)
    )
    entry.load_plugins = lambda: calls.append(("load_plugins",))
    argv = ["--model-path", "dummy", "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "pdstate"]
    launch_server.main(argv)
    sys.argv = ["launch_server", *argv[:2], "--disaggregation-transfer-backend", "pdstate"]
    launch_server.main()
    return {"calls": [list(c) for c in calls]}


CHECKS = {
    "before_install": before_install,
    "install_twice": install_twice,
    "enum_member": enum_member,
    "server_args": server_args_accept,
    "kv_classes": kv_classes,
    "launcher": launcher,
}


def main() -> None:
    results = {}
    for name in json.load(sys.stdin):
        try:
            results[name] = {"ok": True, **CHECKS[name]()}
        except Exception:
            results[name] = {"ok": False, "error": traceback.format_exc()}
    print(json.dumps(results, default=str))


if __name__ == "__main__":
    main()
