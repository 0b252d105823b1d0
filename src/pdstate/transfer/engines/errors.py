"""Engine errors, re-exported from ``pdstate.errors`` (where every error class lives).

Adapters translate their native failures (negative return codes, "ERR" states, native exception
classes) into these in one place each, chained with ``from`` so the native cause stays visible.
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

__all__ = [
    "EngineError",
    "EngineUnavailable",
    "EngineStateError",
    "DescriptorOutOfRange",
    "InvalidEndpoint",
    "UnknownPeer",
    "TransferTimedOut",
    "NativeEngineError",
]
