"""SGLang's own plugin loader alone makes backend pdstate work, on both releases (``plugin_probe.py``).

pdstate's distribution declares the entry point ``pdstate`` in SGLang's group ``sglang.srt.plugins``.
In a fresh process, and in a child that process spawns as SGLang starts its schedulers, SGLang's
``load_plugins()`` (nothing of pdstate's integration imported by hand) must make
``TransferBackend("pdstate")``, ``--disaggregation-transfer-backend pdstate`` and ``get_kv_class``
work; ``SGLANG_PLUGINS`` without ``pdstate`` must leave it out.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.sglang import runner
from tests.support.paths import run_python

CLASSES = {
    "MANAGER": "PdStateKVManager",
    "SENDER": "PdStateKVSender",
    "RECEIVER": "PdStateKVReceiver",
    "BOOTSTRAP_SERVER": "PdStateKVBootstrapServer",
}


@pytest.fixture(scope="module", params=runner.RELEASES)
def probes(request) -> dict:
    try:
        env = runner.ensure_env(request.param)
    except runner.EnvUnavailable as exc:
        runner.skip(exc)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            name: pool.submit(runner.run_probe, env, extra, {"spawn": spawn}, 300, "plugin_probe.py")
            for name, extra, spawn in (("allowed", {}, True), ("left_out", {"SGLANG_PLUGINS": "another"}, False))
        }
        results = {name: f.result() for name, f in futures.items()}
    assert results["allowed"]["release"] == request.param
    return results


@pytest.mark.parametrize("process", ["main", "spawned"])
def test_load_plugins_alone_registers_the_backend(probes, process):
    seen = probes["allowed"][process]
    assert seen["ok"], seen.get("error")
    assert seen["integration_imported_before"] is False  # nothing but SGLang's loader brought it in
    assert seen["integration_loaded"] is True
    assert seen["member"] == "TransferBackend.PDSTATE"
    assert seen["cli"] == "pdstate"
    assert seen["classes"] == CLASSES


def test_sglang_plugins_without_pdstate_leaves_it_out(probes):
    seen = probes["left_out"]["main"]
    assert seen["ok"], seen.get("error")
    assert seen["integration_loaded"] is False
    assert seen["member"] == "ValueError: 'pdstate' is not a valid TransferBackend"


def test_the_entry_point_is_declared():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("pdstate") == "pdstate.integrations.sglang.plugin:load"


def test_the_plugin_without_sglang_logs_one_line_and_raises_nothing():
    code = (
        "import logging, sys; sys.modules['sglang'] = None\n"
        "logging.basicConfig(level=logging.INFO, format='%(levelname)s %(message)s')\n"
        "from pdstate.integrations.sglang import plugin, is_installed\n"
        "plugin.load()\n"
        "assert not is_installed()\n"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("ERROR pdstate: backend pdstate not registered: pdstate's SGLang backend needs")
    assert "Traceback" not in out.stderr


def test_the_old_launcher_without_sglang_says_so_in_one_line():
    code = (
        "import runpy, sys; sys.modules['sglang'] = None\n"
        "runpy.run_module('pdstate.integrations.sglang.launch_server', run_name='__main__')\n"
    )
    out = run_python(code, "--help")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdstate: pdstate's SGLang backend needs the module"), out.stderr
