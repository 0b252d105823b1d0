"""SGLang's HTTP app for its tokenizer worker processes, with SGLang's plugins loaded first.

SGLang 0.5.23 runs ``--tokenizer-worker-num N`` (N > 1) as N HTTP worker processes (uvicorn's or
Granian's), always spawned, each importing the ASGI app that ``SGLANG_HTTP_SERVER_APP_PATH`` names
(SGLang's default: ``sglang.srt.entrypoints.http_server:app``). No ``load_plugins()`` runs in them,
yet each one's lifespan (``http_server.init_multi_tokenizer``) builds a
``managers.multi_tokenizer_mixin.TokenizerWorker``, whose ``__init__`` resolves
``TransferBackend(get_disagg().disaggregation_transfer_backend)``: with SGLang's app, backend
``pdstate`` is unknown there and the server stops at start.

pdstate's plugin (``plugin.load``) points that setting here unless the operator chose an app.
Importing this module runs SGLang's own ``load_plugins()`` (every plugin of the group, under
``SGLANG_PLUGINS``), then hands over SGLang's ``app`` itself, unchanged.
"""

from __future__ import annotations

from sglang.srt.plugins import load_plugins

load_plugins()

from sglang.srt.entrypoints.http_server import app  # noqa: E402  (after the plugins, as SGLang's own entry points)

__all__ = ["app"]
