"""The classes ``get_kv_class`` returns for ``TransferBackend.PDSTATE``, built on first install.

They subclass SGLang's ``BaseKVManager``, ``BaseKVSender``, ``BaseKVReceiver`` and
``BaseKVBootstrapServer``, so they can only be defined once SGLang is importable: ``build_classes``
imports it and caches what it built. Until the adapter over ``pdstate.agent`` lands, constructing
any of them raises ``NotImplementedError`` saying so, before any resource is taken; every abstract
method is present, so the classes themselves are complete subclasses.
"""

from __future__ import annotations

import functools

PENDING = (
    "pdstate's SGLang transfer backend is registered, but its {what} is not implemented yet: "
    "use another --disaggregation-transfer-backend for now"
)


def _pending(what: str, name: str):
    def method(self, *args, **kwargs):
        raise NotImplementedError(PENDING.format(what=what))

    method.__name__ = method.__qualname__ = name
    return method


@functools.cache
def build_classes() -> dict[str, type]:
    """pdstate's classes by ``KVClassType`` member name (MANAGER, SENDER, RECEIVER, BOOTSTRAP_SERVER)."""
    from sglang.srt.disaggregation.base import conn

    def make(base: type, name: str, what: str) -> type:
        namespace = {"__module__": __name__, "__qualname__": name, "__init__": _pending(what, "__init__")}
        for attr in getattr(base, "__abstractmethods__", ()):
            namespace[attr] = _pending(what, attr)
        namespace["__doc__"] = f"pdstate's {what} for SGLang (a subclass of ``{base.__name__}``)."
        return type(name, (base,), namespace)

    return {
        "MANAGER": make(conn.BaseKVManager, "PdStateKVManager", "KV manager"),
        "SENDER": make(conn.BaseKVSender, "PdStateKVSender", "KV sender"),
        "RECEIVER": make(conn.BaseKVReceiver, "PdStateKVReceiver", "KV receiver"),
        "BOOTSTRAP_SERVER": make(conn.BaseKVBootstrapServer, "PdStateKVBootstrapServer", "bootstrap server"),
    }
