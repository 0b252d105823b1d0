"""Transfer engines: move the bytes of a ``TransferPlan`` from this process to a peer's memory.

``create_engine(name, **options)`` builds one of ``ENGINES`` ("shm", "loopback", "mooncake",
"nixl"; ``registry.py``: each engine's class and traits); native packages are imported only when
their engine is first asked for. The contract is in ``base.py``; each engine's module documents its
endpoint format and traps. The registry's names load with this package; the contract's
(``create_engine``, ``TransferEngine``...) on first use, so reading the registry costs no numpy or torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pdstate.errors import (
    DescriptorOutOfRange,
    EngineError,
    EngineStateError,
    EngineUnavailable,
    InvalidEndpoint,
    NativeEngineError,
    TransferTimedOut,
    UnknownPeer,
)
from pdstate.transfer.engines.registry import (
    ENGINES,
    EngineEntry,
    engine_entry,
    engine_names,
    register_engine,
    unregister_engine,
)

_FROM_BASE = ("TransferEngine", "TransferHandle", "TransferStatus", "create_engine", "engine_class")

__all__ = [
    "ENGINES",
    "EngineEntry",
    "engine_entry",
    "engine_names",
    "register_engine",
    "unregister_engine",
    "TransferEngine",
    "TransferHandle",
    "TransferStatus",
    "create_engine",
    "engine_class",
    "DescriptorOutOfRange",
    "EngineError",
    "EngineStateError",
    "EngineUnavailable",
    "InvalidEndpoint",
    "NativeEngineError",
    "TransferTimedOut",
    "UnknownPeer",
]


def __getattr__(name: str):
    if name in _FROM_BASE:
        value = getattr(importlib.import_module("pdstate.transfer.engines.base"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pdstate.transfer.engines' has no attribute {name!r}")


if TYPE_CHECKING:
    from pdstate.transfer.engines.base import (
        TransferEngine,
        TransferHandle,
        TransferStatus,
        create_engine,
        engine_class,
    )
