"""Every place an installed SGLang resolves a transfer backend or a KV class is one the tests cover.

``scan`` reads a release's package source (no import): a call of ``TransferBackend(...)`` (or a
lookup ``TransferBackend[...]``) or of ``get_kv_class(...)``, a use of
``DISAGG_TRANSFER_BACKEND_CHOICES`` or ``KVClassType``, or the string
``"--disaggregation-transfer-backend"``, each as (module, enclosing function or class). ``SITES``
lists those of each release with the test that shows backend ``pdstate`` known there (or, for
0.5.19's tokenizer workers, that pdstate's KV manager refuses at start before SGLang reaches it),
or the reason it is not; a site that appears in a release and is not listed fails with its file and line, and so
does a listed one that is gone. SGLang's own test helpers (``sglang.test``) are not scanned.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.sglang import runner
from tests.support.paths import REPO

CALLS = frozenset({"TransferBackend", "get_kv_class"})
NAMES = frozenset({"DISAGG_TRANSFER_BACKEND_CHOICES", "KVClassType"})
FLAG = "--disaggregation-transfer-backend"
SKIPPED = ("sglang.test",)
WORDS = (*CALLS, *NAMES, FLAG)  # a file without any of them is not parsed

REGISTRATION = "tests/sglang/test_backend_registration.py"
TOKENIZER_WORKERS = "tests/sglang/test_tokenizer_workers.py::test_each_tokenizer_worker_resolves_pdstate"
QUEUES = "tests/sglang/test_scheduler_queues.py"  # SGLang's own prefill and decode queues, pdstate's classes
WRAPPED = f"{REGISTRATION}::test_get_kv_class_is_wrapped_where_imported_by_name"  # in every importer of get_kv_class
CHOICES = f"{REGISTRATION}::test_server_args_accept_pdstate"
SPAWNED = "tests/sglang/test_plugin.py::test_load_plugins_alone_registers_the_backend"  # main and spawned processes
REFUSED_BEFORE = (  # a site the backend's KV manager refuses to let SGLang reach, saying so
    "tests/sglang/test_adapter.py::test_several_tokenizer_workers_stop_the_manager_where_they_cannot_know_pdstate"
)

# (release, module, function) -> the test that covers the site, or "not covered: <why>".
# The scheduler, detokenizer and DP controller processes run SGLang's load_plugins() (SPAWNED);
# the launching process runs it before parsing arguments.
_BOTH = {
    ("sglang.srt.disaggregation.decode", "DecodePreallocQueue._create_receiver_and_enqueue"): QUEUES,
    ("sglang.srt.disaggregation.decode", "DecodePreallocQueue._init_kv_manager"): QUEUES,
    ("sglang.srt.disaggregation.prefill", "PrefillBootstrapQueue._init_kv_manager"): QUEUES,
    ("sglang.srt.disaggregation.prefill", "PrefillBootstrapQueue.create_sender"): QUEUES,
    (
        "sglang.srt.disaggregation.utils",
        "get_kv_class",
    ): f"{REGISTRATION}::test_get_kv_class_returns_pdstate_subclasses",
    ("sglang.srt.managers.disagg_service", "start_disagg_service"): WRAPPED,
    ("sglang.srt.managers.scheduler", "Scheduler.init_disaggregation"): SPAWNED,
}
SITES: dict[tuple[str, str, str], str] = {
    **{("0.5.19", *site): test for site, test in _BOTH.items()},
    # never reached with backend pdstate: 0.5.19's workers import SGLang's own app (fixed in its code,
    # no plugins), so pdstate's KV manager refuses --tokenizer-worker-num above 1 at start, in the
    # schedulers SGLang waits for before it spawns the workers (launch.backend.tokenizer_workers_refusal)
    ("0.5.19", "sglang.srt.managers.multi_tokenizer_mixin", "TokenizerWorker.__init__"): REFUSED_BEFORE,
    ("0.5.19", "sglang.srt.server_args", "<module>"): CHOICES,
    ("0.5.19", "sglang.srt.server_args", "ServerArgs"): CHOICES,
    **{("0.5.23", *site): test for site, test in _BOTH.items()},
    ("0.5.23", "sglang.srt.managers.disagg_service", "rust_server_serves_kv_bootstrap"): WRAPPED,
    ("0.5.23", "sglang.srt.managers.multi_tokenizer_mixin", "TokenizerWorker.__init__"): TOKENIZER_WORKERS,
    ("0.5.23", "sglang.srt.arg_groups.choices", "<module>"): CHOICES,
    ("0.5.23", "sglang.srt.arg_groups.fields.disagg", "Disagg"): CHOICES,
}


@dataclass(frozen=True)
class Site:
    module: str
    function: str  # the enclosing function or class, dotted; "<module>" at module level
    what: str  # the name or string found
    where: str  # file:line of its first occurrence


def _found(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        return f"{name}(...)" if name in CALLS else None
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "TransferBackend":
        return "TransferBackend[...]"
    if isinstance(node, ast.Name) and node.id in NAMES:
        return node.id
    if isinstance(node, ast.Attribute) and node.attr in NAMES:
        return node.attr
    if isinstance(node, ast.Constant) and node.value == FLAG:
        return repr(FLAG)
    return None


def _module_name(package: Path, path: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def scan(package: Path) -> dict[tuple[str, str], list[Site]]:
    """Every site in the package directory ``package`` (``.../sglang``), by (module, function)."""
    sites: dict[tuple[str, str], list[Site]] = {}
    for path in sorted(package.rglob("*.py")):
        module = _module_name(package, path)
        text = path.read_text(encoding="utf-8")
        if module.startswith(SKIPPED) or not any(word in text for word in WORDS):
            continue
        tree = ast.parse(text, str(path))

        def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit(child, (*scope, child.name))
                    continue
                if what := _found(child):
                    function = ".".join(scope) or "<module>"
                    where = f"{path.relative_to(package.parent)}:{child.lineno}"
                    sites.setdefault((module, function), []).append(Site(module, function, what, where))
                visit(child, scope)

        visit(tree, ())
    return sites


def problems(
    release: str, sites: dict[tuple[str, str], list[Site]], table: dict[tuple[str, str, str], str]
) -> list[str]:
    """What the table of ``release`` misses (new sites) and lists in vain (sites gone)."""
    listed = {(module, function) for (rel, module, function) in table if rel == release}
    out = []
    for key in sorted(set(sites) - listed):
        found = sites[key]
        whats = ", ".join(sorted({s.what for s in found}))
        out.append(
            f"SGLang {release}: a new site resolves a transfer backend or a KV class: {key[0]} {key[1]} "
            f"({whats}; {found[0].where}). Show that backend pdstate is known in the process that runs it, "
            f"then list it in SITES with that test."
        )
    for module, function in sorted(listed - set(sites)):
        out.append(f"SGLang {release}: {module} {function} is listed in SITES but no longer resolves a backend there.")
    return out


@pytest.mark.parametrize("release", runner.RELEASES)
def test_every_backend_site_of_the_release_is_covered(release):
    try:
        env = runner.ensure_env(release)
    except runner.EnvUnavailable as exc:
        runner.skip(exc)
    found = problems(release, scan(env / "sglang"), SITES)
    assert not found, "\n".join(found)


def test_every_covering_test_named_exists():
    for test in set(SITES.values()):
        if test.startswith("not covered: "):
            continue
        path, _, name = test.partition("::")
        source = (REPO / path).read_text()
        assert not name or re.search(rf"^def {re.escape(name)}\(", source, re.M), f"{test}: no such test"


def test_the_scan_names_a_new_site_and_a_gone_one(tmp_path):
    package = tmp_path / "sglang"
    (package / "srt" / "managers").mkdir(parents=True)
    (package / "test").mkdir()
    (package / "srt" / "managers" / "scheduler.py").write_text(
        "class Scheduler:\n    def init_disaggregation(self):\n        self.b = TransferBackend(self.name)\n"
    )
    (package / "srt" / "managers" / "audio_worker.py").write_text(
        "from x import TransferBackend\n\n"
        "class AudioWorker:\n"
        "    def __init__(self, args):\n"
        "        self.backend = TransferBackend[args.name.upper()]\n"
    )
    (package / "test" / "fixture.py").write_text("ARGS = ['--disaggregation-transfer-backend', 'nixl']\n")
    table = {
        ("9.9", "sglang.srt.managers.scheduler", "Scheduler.init_disaggregation"): SPAWNED,
        ("9.9", "sglang.srt.server_args", "ServerArgs"): CHOICES,
    }
    assert problems("9.9", scan(package), table) == [
        "SGLang 9.9: a new site resolves a transfer backend or a KV class: sglang.srt.managers.audio_worker "
        "AudioWorker.__init__ (TransferBackend[...]; sglang/srt/managers/audio_worker.py:5). Show that backend "
        "pdstate is known in the process that runs it, then list it in SITES with that test.",
        "SGLang 9.9: sglang.srt.server_args ServerArgs is listed in SITES but no longer resolves a backend there.",
    ]
