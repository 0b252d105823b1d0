"""SGLang 0.5.23's tokenizer workers (``--tokenizer-worker-num 2``) know backend pdstate.

``tokenizer_worker_probe.py`` runs SGLang's own HTTP server start-up with 2 tokenizer workers and
``--disaggregation-transfer-backend pdstate``: uvicorn spawns 2 processes, each importing the app
``SGLANG_HTTP_SERVER_APP_PATH`` names, and each worker's lifespan builds
``multi_tokenizer_mixin.TokenizerWorker``, whose ``__init__`` resolves ``TransferBackend(...)``.
SGLang runs no ``load_plugins()`` there: pdstate's plugin names its ``worker_app`` in that setting
(SGLang's app, after SGLang's own plugin loader). The control (``slow``: ``pytest -m slow``) is an
operator's own choice of SGLang's app: the workers refuse ``pdstate`` and uvicorn stops the server.
Each start-up costs three imports of SGLang's HTTP server (the launching process and 2 workers).
"""

from __future__ import annotations

import pytest

from tests.sglang import runner
from tests.support.paths import run_python

RELEASE = "0.5.23"  # the first release with SGLANG_HTTP_SERVER_APP_PATH (0.5.19 fixes the workers' app)
WORKER_APP = "pdstate.integrations.sglang.worker_app:app"
SGLANG_APP = "sglang.srt.entrypoints.http_server:app"
# a worker's import of SGLang's HTTP server takes >10 s (uvicorn's default wait) on a loaded CPU box
SLOW_BOX = {"SGLANG_UVICORN_WORKER_HEALTHCHECK_TIMEOUT": "240"}


def _run(extra_env: dict[str, str]) -> dict:
    """One start-up of SGLang's HTTP server with 2 tokenizer workers (``tokenizer_worker_probe.py``)."""
    assert RELEASE in runner.RELEASES
    try:
        env = runner.ensure_env(RELEASE)
    except runner.EnvUnavailable as exc:
        runner.skip(exc)
    return runner.run_probe(env, {**SLOW_BOX, **extra_env}, {}, 280, "tokenizer_worker_probe.py")


def test_each_tokenizer_worker_resolves_pdstate():
    run = _run({})
    assert run["app_path"] == WORKER_APP  # set by pdstate's plugin in the launching process
    workers = run["workers"]
    assert len({w["pid"] for w in workers}) == 2, workers
    for worker in workers:
        assert worker["backend"] == "TransferBackend.PDSTATE", worker
        assert worker["app_path"] == WORKER_APP
        assert worker["worker_app_loaded"] is True and worker["integration_loaded"] is True
    assert run["served"] == 404  # a worker finished its start-up and answers (FastAPI's 404)


@pytest.mark.slow  # the control: SGLang's own behaviour, as measured (another ~30 s of CPU)
def test_sglangs_own_app_leaves_the_workers_without_pdstate():
    run = _run({"SGLANG_HTTP_SERVER_APP_PATH": SGLANG_APP})
    assert run["app_path"] == SGLANG_APP  # the operator's choice is kept
    workers = run["workers"]
    assert len({w["pid"] for w in workers}) == 2, workers
    for worker in workers:  # each worker's start-up fails: uvicorn stops the server ("failed to start")
        assert worker["backend"] == "ValueError: 'pdstate' is not a valid TransferBackend", worker
        assert worker["worker_app_loaded"] is False and worker["integration_loaded"] is False
    assert "served" not in run


@pytest.mark.parametrize("release", runner.RELEASES)
def test_the_plugin_names_its_app_only_where_sglang_reads_the_setting(release):
    try:
        env = runner.ensure_env(release)
    except runner.EnvUnavailable as exc:
        runner.skip(exc)
    code = (
        "import os\n"
        f"os.environ['PDSTATE_SGLANG_ENV'] = {str(env)!r}\n"
        "os.environ.pop('SGLANG_HTTP_SERVER_APP_PATH', None)\n"
        "from pdstate.devtools.sglang_pair import booted\n"
        "from pdstate.integrations.sglang import plugin\n"
        "print(plugin.route_tokenizer_workers(), os.environ.get('SGLANG_HTTP_SERVER_APP_PATH'))\n"
        "os.environ['SGLANG_HTTP_SERVER_APP_PATH'] = 'operators.app:app'\n"
        "print(plugin.route_tokenizer_workers(), os.environ.get('SGLANG_HTTP_SERVER_APP_PATH'))\n"
    )
    out = run_python(code, timeout_s=120)
    assert out.returncode == 0, out.stderr
    if release == RELEASE:
        assert out.stdout.splitlines() == [f"{WORKER_APP} {WORKER_APP}", "operators.app:app operators.app:app"]
    else:  # 0.5.19 has no such setting: nothing is set
        assert out.stdout.splitlines() == ["None None", "None operators.app:app"]
