"""Transfer engines: move the bytes of a ``TransferPlan`` from this process to a peer's memory.

``create_engine(name, **options)`` builds one of ``ENGINES`` ("shm", "loopback", "mooncake",
"nixl"); native packages are imported only when their engine is first asked for. The contract
is in ``base.py``; each engine's module documents its endpoint format and traps.
"""

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
from pdstate.transfer.engines.base import (
    ENGINES,
    TransferEngine,
    TransferHandle,
    TransferStatus,
    create_engine,
    engine_class,
)

__all__ = [
    "ENGINES",
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
