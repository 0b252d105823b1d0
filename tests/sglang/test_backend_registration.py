"""``pdstate.integrations.sglang.install()`` against the real SGLang 0.5.19 code (child processes).

Two children run ``backend_probe.py``: one loads SGLang's modules that import ``get_kv_class`` by
name *before* installing (they are patched in place), the other installs first (they bind the
wrapper when loaded). Without SGLang, importing the package works and ``install()`` raises
``SGLangUnavailable`` naming the missing module.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.sglang import runner
from tests.support.paths import run_python

KINDS = ("MANAGER", "SENDER", "RECEIVER", "BOOTSTRAP_SERVER")
LOADED_FIRST = ["before_install", "install_twice", "enum_member", "server_args", "kv_classes", "launcher"]
INSTALLED_FIRST = ["install_twice", "kv_classes"]


@pytest.fixture(scope="module")
def probes(sglang_release) -> dict[str, dict]:
    sglang_env = sglang_release.env
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            name: pool.submit(runner.run_probe, sglang_env, {}, checks, 300, "backend_probe.py")
            for name, checks in (("loaded_first", LOADED_FIRST), ("installed_first", INSTALLED_FIRST))
        }
        results = {name: f.result() for name, f in futures.items()}
    for name, checks in results.items():
        for check, r in checks.items():
            assert r["ok"], f"{name}:{check}\n{r.get('error')}"
    return results


def test_sglang_alone_refuses_the_backend(probes):
    before = probes["loaded_first"]["before_install"]
    assert before["refused"] is True
    assert all(v is True for v in before["loaded"].values()), before["loaded"]


@pytest.mark.parametrize("order", ["loaded_first", "installed_first"])
def test_install_is_idempotent(probes, order):
    r = probes[order]["install_twice"]
    assert r["installed"] is True
    assert r["same_function"] is True  # a second install does not wrap the wrapper
    assert r["members"][0] == r["members"][1] == 6  # SGLang's five + PDSTATE, once
    assert r["pdstate_choices"] == 1
    assert r["choices"][:6] == ["mooncake", "nixl", "ascend", "fake", "mori", "mooncake_tcp"]


def test_transfer_backend_has_a_real_member(probes):
    r = probes["loaded_first"]["enum_member"]
    assert r["is_attr"] and r["by_name"] and r["isinstance"] and r["in_iteration"] and r["hashable"]
    assert (r["name"], r["value"]) == ("PDSTATE", "pdstate")
    assert r["repr"] == "<TransferBackend.PDSTATE: 'pdstate'>"
    assert r["equals_mooncake"] is False and r["mooncake_still"] is True


def test_server_args_accept_pdstate(probes):
    r = probes["loaded_first"]["server_args"]
    assert r["direct"] == "pdstate"  # ServerArgs(..., disaggregation_transfer_backend="pdstate")
    assert r["parsed"] == "pdstate"  # SGLang's own parser, --disaggregation-transfer-backend pdstate
    assert r["bogus_refused"] is True  # the choices are still checked


@pytest.mark.parametrize("order", ["loaded_first", "installed_first"])
@pytest.mark.parametrize("kind", KINDS)
def test_get_kv_class_returns_pdstate_subclasses(probes, order, kind):
    r = probes[order]["kv_classes"][kind]
    assert (
        r["module"]
        == {
            "MANAGER": "pdstate.integrations.sglang.manager",
            "SENDER": "pdstate.integrations.sglang.sender",
            "RECEIVER": "pdstate.integrations.sglang.receiver",
            "BOOTSTRAP_SERVER": "pdstate.integrations.sglang.classes",
        }[kind]
    )
    assert r["subclass"] is True
    assert r["abstract_left"] == [] and r["instantiable"] is True


@pytest.mark.parametrize("order", ["loaded_first", "installed_first"])
def test_get_kv_class_is_wrapped_where_imported_by_name(probes, order):
    r = probes[order]["kv_classes"]
    assert r["kvargs_is_sglangs"] is True
    assert r["fake_sender"] == "sglang.srt.disaggregation.fake.conn.FakeKVSender"
    assert set(r["importers"].values()) == {True}, r["importers"]
    assert set(r["importers_answer"].values()) == {"PdStateKVManager"}


def test_launcher_installs_then_runs_sglangs_entry(probes):
    calls = probes["loaded_first"]["launcher"]["calls"]
    once = [["load_plugins"], ["run_server", "pdstate"], ["kill", True, False]]
    assert calls == once + once  # main(argv), then main() on sys.argv


def test_import_without_sglang_and_a_clear_install_error():
    code = (
        "import sys; sys.modules['sglang'] = None\n"
        "import pdstate.integrations.sglang as m\n"
        "from pdstate.errors import SGLangUnavailable, PdStateError\n"
        "assert 'sglang' not in [k for k, v in sys.modules.items() if v is not None and k.startswith('sglang')]\n"
        "try:\n"
        "    m.install()\n"
        "except SGLangUnavailable as exc:\n"
        "    assert isinstance(exc, PdStateError) and isinstance(exc, ImportError)\n"
        "    assert not m.is_installed()\n"
        "    print(exc)\n"
        "else:\n"
        "    raise SystemExit('install() did not raise')\n"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert "'sglang.srt.disaggregation.utils'" in out.stdout
    assert "Install SGLang" in out.stdout
