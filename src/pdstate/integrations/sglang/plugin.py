"""SGLang's own plugin entry point for pdstate: ``pip install pdstate[sglang]`` is the whole set-up.

pdstate's distribution declares, in group ``sglang.srt.plugins`` (SGLang 0.5.19 and 0.5.23)::

    pdstate = "pdstate.integrations.sglang.plugin:load"

SGLang's ``sglang.srt.plugins.load_plugins()`` runs every entry point of that group before it
parses its arguments (``sglang serve``, ``python -m sglang.launch_server``, ``Engine``) and again
at the start of every process it spawns (schedulers, detokenizer, DP controller). ``load`` runs
``install()`` there, so ``--disaggregation-transfer-backend pdstate`` is a valid choice and
``get_kv_class`` answers pdstate's classes in each of them, with no wrapper and no import by hand.
``SGLANG_PLUGINS`` (SGLang's comma-separated allow-list) without ``pdstate`` leaves it out.

A failure to install is one log line (SGLang's logger would print a traceback for an exception,
and a plugin must not stop a server that does not use this backend); such a server then refuses
``--disaggregation-transfer-backend pdstate`` as an invalid choice, after that line.
"""

from __future__ import annotations

import logging

from pdstate.errors import SGLangUnavailable
from pdstate.integrations.sglang import install, releases, sglang_release

log = logging.getLogger("pdstate.integrations.sglang")

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
