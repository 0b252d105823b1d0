"""Engine errors: each subclasses ``EngineError`` so one ``except EngineError`` catches them all.

Adapters translate their native failures (negative return codes, "ERR" states, native exception
classes) into these in one place each, chained with ``from`` so the native cause stays visible.
"""

from __future__ import annotations

from pdstate.errors import EngineError, EngineUnavailable

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


class EngineStateError(EngineError):
    """A method was called in the wrong lifecycle state (before ``start()``, after ``close()``)."""


class DescriptorOutOfRange(EngineError):
    """A plan descriptor addresses bytes outside every registered region; nothing was moved."""

    def __init__(self, message: str, index: int | None = None, address: int | None = None) -> None:
        super().__init__(message)
        self.index = index
        self.address = address


class InvalidEndpoint(EngineError):
    """A peer endpoint is malformed, for another engine, or unusable from this host."""


class UnknownPeer(EngineError):
    """``submit`` named a peer id that ``connect`` never returned (or that was closed)."""


class TransferTimedOut(EngineError):
    """``wait`` ran past its deadline; the message says "timed out"."""


class NativeEngineError(EngineError):
    """The native library reported a failure: the message names the operation, peer and code."""

    def __init__(self, message: str, code: int | str | None = None) -> None:
        super().__init__(message)
        self.code = code
