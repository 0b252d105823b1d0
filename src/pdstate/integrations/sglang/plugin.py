"""SGLang's own plugin entry point for pdstate: ``pip install pdstate[sglang]`` is the whole set-up.

pdstate's distribution declares, in group ``sglang.srt.plugins`` (SGLang 0.5.19 and 0.5.23)::

    pdstate = "pdstate.integrations.sglang.plugin:load"

SGLang's ``sglang.srt.plugins.load_plugins()`` runs every entry point of that group before it
parses its arguments (``sglang serve``, ``python -m sglang.launch_server``, ``Engine``) and again
at the start of the processes it spawns (schedulers; in 0.5.23 the detokenizer and DP controller too). ``load`` runs
``install()`` there, so ``--disaggregation-transfer-backend pdstate`` is a valid choice and
``get_kv_class`` answers pdstate's classes in each of them, with no wrapper and no import by hand.
``SGLANG_PLUGINS`` (SGLang's comma-separated allow-list) without ``pdstate`` leaves it out.

One kind of process SGLang starts runs no ``load_plugins()``: 0.5.23's tokenizer workers
(``--tokenizer-worker-num N`` > 1), which resolve ``TransferBackend(...)`` in
``TokenizerWorker.__init__`` and import the app that ``SGLANG_HTTP_SERVER_APP_PATH`` names. ``load``
sets that variable, where this SGLang reads it and the operator left it unset, to ``worker_app``
(SGLang's app after SGLang's own ``load_plugins()``); the processes SGLang starts inherit it.
0.5.19 fixes its workers' app: there the KV manager refuses ``--tokenizer-worker-num`` above 1 at
start, in one line (``settings.has_app_path_setting``, ``launch.backend.tokenizer_workers_refusal``).

A failure to install is one log line (SGLang's logger would print a traceback for an exception,
and a plugin must not stop a server that does not use this backend); such a server then refuses
``--disaggregation-transfer-backend pdstate`` as an invalid choice, after that line.
"""

from __future__ import annotations

import logging
import os

from pdstate.errors import SGLangUnavailable
from pdstate.integrations.sglang import install, releases, sglang_release

log = logging.getLogger("pdstate.integrations.sglang")

WORKER_APP = "pdstate.integrations.sglang.worker_app:app"

__all__ = ["load"]


def load() -> None:
    """The ``sglang.srt.plugins`` entry point: register backend ``pdstate`` in this process."""
    release = sglang_release()
    if release is not None and releases.find(release) is None:
        log.warning(
            "pdstate: SGLang %s is not a release pdstate is tested with (%s); registering backend pdstate anyway",
            release,
            ", ".join(releases.versions()),
        )
    try:
        install()
    except SGLangUnavailable as exc:
        log.error("pdstate: backend pdstate not registered: %s", exc)
        return
    route_tokenizer_workers()


def route_tokenizer_workers() -> str | None:
    """Name ``worker_app`` in ``SGLANG_HTTP_SERVER_APP_PATH`` where this SGLang has the setting
    (0.5.23) and the operator left it unset; the value now in force (``None``: no such setting)."""
    from pdstate.integrations.sglang.settings import APP_PATH, has_app_path_setting  # after install()

    if not has_app_path_setting():
        return None
    return os.environ.setdefault(APP_PATH, WORKER_APP)
