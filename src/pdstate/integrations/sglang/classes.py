"""The classes ``get_kv_class`` returns for ``TransferBackend.PDSTATE``, built on first install.

They subclass SGLang's ``Common*`` classes (hence its ``BaseKV*``), so they can only be defined
once SGLang is importable: ``build_classes`` imports their modules and caches what it got.

* MANAGER: ``manager.build_manager()``, ``PdStateKVManager`` (one per rank, a pdstate agent over the rank's memory);
* SENDER / RECEIVER: ``PdStateKVSender`` / ``PdStateKVReceiver`` (``sender`` / ``receiver``) (one per request);
* BOOTSTRAP_SERVER: SGLang's own ``CommonKVBootstrapServer``, unchanged (its routes are what
  routers and gateways talk to), under pdstate's name.
"""

from __future__ import annotations

import functools


@functools.cache
def build_classes() -> dict[str, type]:
    """pdstate's classes by ``KVClassType`` member name (MANAGER, SENDER, RECEIVER, BOOTSTRAP_SERVER)."""
    from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer

    from pdstate.integrations.sglang.manager import build_manager
    from pdstate.integrations.sglang.receiver import build_receiver
    from pdstate.integrations.sglang.sender import build_sender

    bootstrap = type(
        "PdStateKVBootstrapServer",
        (CommonKVBootstrapServer,),
        {
            "__module__": __name__,
            "__qualname__": "PdStateKVBootstrapServer",
            "__doc__": "SGLang's bootstrap server (its routes, its registration format), as pdstate's backend.",
        },
    )
    return {
        "MANAGER": build_manager(),
        "SENDER": build_sender(),
        "RECEIVER": build_receiver(),
        "BOOTSTRAP_SERVER": bootstrap,
    }
