"""pdstate as SGLang's disaggregation transfer backend (``--disaggregation-transfer-backend pdstate``).

SGLang has no registry for transfer backends: its ``TransferBackend`` enum, the
``DISAGG_TRANSFER_BACKEND_CHOICES`` list its argument parser validates against, and
``get_kv_class`` are closed. ``install()`` opens them in the calling process, idempotently:

- ``sglang.srt.disaggregation.utils.TransferBackend`` gains the member ``PDSTATE = "pdstate"``
  (``TransferBackend("pdstate") is TransferBackend.PDSTATE``);
- ``sglang.srt.server_args.DISAGG_TRANSFER_BACKEND_CHOICES`` gains ``"pdstate"`` in place (the
  list object ``ServerArgs``' argument metadata and ``argparse`` hold);
- ``get_kv_class`` is wrapped in ``sglang.srt.disaggregation.utils`` and in every loaded
  ``sglang.*`` module that imported it by name (``disaggregation.prefill``,
  ``disaggregation.decode``, ``managers.disagg_service``); modules imported later take the wrapped
  function from ``utils``. For ``TransferBackend.PDSTATE`` it returns pdstate's manager, sender,
  receiver and bootstrap-server classes (subclasses of SGLang's ``BaseKV*``); ``KVARGS`` and every
  other backend stay SGLang's.

SGLang is imported only inside ``install()``, never when this package is imported; where it (or
one of the names above) is missing, ``install()`` raises ``SGLangUnavailable`` naming it.

SGLang runs its schedulers in *spawned* processes, which do not inherit these patches. SGLang
itself calls ``install()`` in each of them: pdstate's distribution declares the entry point
``pdstate`` in SGLang's plugin group ``sglang.srt.plugins`` (``plugin.load``), which SGLang's
``load_plugins()`` runs before it parses arguments and at the start of every process it spawns.
An embedding that builds SGLang's managers itself calls ``load_plugins()`` (or ``install()``).
SGLang 0.5.23's tokenizer workers (``--tokenizer-worker-num`` > 1) run no ``load_plugins()``: the
plugin names ``worker_app`` (SGLang's app after SGLang's ``load_plugins()``) in
``SGLANG_HTTP_SERVER_APP_PATH``, the app those workers import (``plugin``).

Packaging: the extra ``pdstate[sglang]`` is an empty marker. It deliberately does not require the
``sglang`` wheel, whose dependencies pull a CUDA build of torch; SGLang itself is the user's own
install (``SUPPORTED_RELEASES``: the releases this adapter is tested against).

The classes are a thin adapter over ``pdstate.agent`` (``classes``: one manager per rank with its
agent, a sender / receiver per request, SGLang's own bootstrap server); README, "Using pdstate
from SGLang", says what they support.
"""

from __future__ import annotations

import threading
from importlib import metadata

from pdstate.integrations.sglang import registry
from pdstate.integrations.sglang.registry import BACKEND, MEMBER, SUPPORTED_RELEASES

_lock = threading.Lock()
_installed = False


def install() -> None:
    """Register pdstate as SGLang's transfer backend ``"pdstate"`` in this process (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        registry.register()
        _installed = True


def is_installed() -> bool:
    """Whether ``install()`` has completed in this process."""
    return _installed


def sglang_release() -> str | None:
    """The installed SGLang's version (its distribution's metadata), ``None`` without one."""
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


__all__ = ["BACKEND", "MEMBER", "SUPPORTED_RELEASES", "install", "is_installed", "sglang_release"]
