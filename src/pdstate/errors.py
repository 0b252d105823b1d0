"""Exception hierarchy.

Every error a user can meet is a class named for what went wrong. Classes that mirror an upstream
failure subclass the upstream type (``RuntimeError``) so existing ``except`` clauses still catch
them, and build the upstream sentence once, character for character: users grep for it.

``error_from_wire(type_name, message)`` rebuilds an error received from a peer, so the rejected
side raises the same class with the same message as the side that refused it.
"""

from __future__ import annotations


class PdStateError(Exception):
    """Base class of errors defined by pdstate that have no upstream counterpart."""


# --- the five upstream target/draft checks (setup_state_kv_args) -------------------------------


class DSV4StateError(RuntimeError):
    """Base of the upstream ``setup_state_kv_args`` refusals (all ``RuntimeError`` upstream)."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message if message is not None else self.default_message())

    @classmethod
    def default_message(cls) -> str:
        raise TypeError(f"{cls.__name__} needs arguments to build its message")


class DraftNotSWAOnly(DSV4StateError):
    """The draft pool has a compressed layer (or no layers at all)."""

    @classmethod
    def default_message(cls) -> str:
        return "DSV4 draft state transfer expects SWA-only NextN layers"


class UnifiedKVModeMismatch(DSV4StateError):
    """One pool of the pair is unified-KV, the other paged."""

    @classmethod
    def default_message(cls) -> str:
        return "DSV4 target and draft pools must use the same unified-KV mode"


class SWAIndexMappingNotShared(DSV4StateError):
    """Paged mode: the draft does not hold the very same mapping tensor object as the target."""

    @classmethod
    def default_message(cls) -> str:
        return "DSV4 target and draft pools must share the SWA index mapping"


class SWARingGeometryMismatch(DSV4StateError):
    """Unified mode: ``(window, ring_size, ring_pages)`` differ between target and draft."""

    @staticmethod
    def build(target: tuple, draft: tuple) -> "SWARingGeometryMismatch":
        return SWARingGeometryMismatch(
            "DSV4 target and draft pools must share SWA ring geometry: "
            f"target={tuple(target)}, draft={tuple(draft)}"
        )


class PagedSWAGeometryMismatch(DSV4StateError):
    """Paged mode: ``(page_size, sliding_window)`` differ between target and draft."""

    @staticmethod
    def build(target: tuple, draft: tuple) -> "PagedSWAGeometryMismatch":
        return PagedSWAGeometryMismatch(
            "DSV4 target and draft pools must share paged SWA geometry: "
            f"target={tuple(target)}, draft={tuple(draft)}"
        )


class DraftMappingMissing(DSV4StateError, AttributeError):
    """Paged mode: the draft never registered a mapping (upstream: a bare ``AttributeError``)."""

    @classmethod
    def default_message(cls) -> str:
        return "'DeepSeekV4TokenToKVPool' object has no attribute 'full_to_swa_index_mapping'"


# --- upstream cross-side sentences -----------------------------------------------------------


class CrossSideMismatch(RuntimeError):
    """Base of the refusals that compare the prefill side with the decode side."""


class PageSizeMismatch(CrossSideMismatch):
    @staticmethod
    def build(prefill: object, decode: object) -> "PageSizeMismatch":
        return PageSizeMismatch(
            f"Page size mismatch: prefill server has page_size={prefill}, but decode server has "
            f"page_size={decode}. Both servers must use the same --page-size value."
        )


class KVCacheDtypeMismatch(CrossSideMismatch):
    @staticmethod
    def build(prefill: object, decode: object) -> "KVCacheDtypeMismatch":
        return KVCacheDtypeMismatch(
            f"KV cache dtype mismatch: prefill server has kv_cache_dtype={prefill}, but decode "
            f"server has kv_cache_dtype={decode}. Both servers must use the same "
            "--kv-cache-dtype value."
        )


class LayoutMismatch(CrossSideMismatch):
    """Any other layout factor differs; the message names the factor and both values."""

    @staticmethod
    def build(factor: str, prefill: object, decode: object) -> "LayoutMismatch":
        return LayoutMismatch(
            f"DSV4 layout mismatch on {factor}: prefill server has {factor}={prefill!r}, but "
            f"decode server has {factor}={decode!r}. Both servers must build the same state layout."
        )


class DescriptorMismatch(CrossSideMismatch):
    """The peer's registered buffers cannot pair with ours (counts, item lengths, ranges)."""


# --- pool construction ------------------------------------------------------------------------


class PoolConfigError(ValueError, PdStateError):
    """A pool cannot be built with these arguments."""


class OnlineC128MTPUnsupported(AssertionError, PdStateError):
    """Upstream asserts this when online C128 meets speculative decoding without the MTP option."""

    def __init__(self) -> None:
        super().__init__("online c128 does not support MTP")


class AllocationError(PdStateError):
    """The allocator has no room, or was asked to free what it does not hold."""


# --- per-request checks -----------------------------------------------------------------------


class IndexError_(PdStateError):
    """Base for refused index lists. (Named with a trailing underscore: not the builtin.)"""


class PaddingPageIndex(IndexError_):
    """A sliding-window slot maps to 0: the transfer would silently copy the padding page."""


class IndexCountMismatch(IndexError_):
    """Prefill and decode index lists of one component have different lengths."""


class IndexOutOfRange(IndexError_):
    """An index is negative or addresses past the end of its registered buffer."""


class ItemLengthMismatch(IndexError_):
    """A buffer's item length differs between the two sides."""


# --- protocol, engines, runtime ---------------------------------------------------------------


class ProtocolError(PdStateError):
    """A control frame could not be decoded or validated."""


class VersionMismatch(ProtocolError):
    pass


class AuthError(PdStateError):
    """A control message carried no auth tag or a wrong one."""


class EngineError(PdStateError):
    """A transfer engine failed; the message says which operation and the engine's own code."""


class EngineUnavailable(EngineError, ImportError):
    """An optional engine package is not installed; the message names the extra."""


class TransferFailed(PdStateError):
    """A request ended FAILED; ``reason`` says why."""


class PeerGone(PdStateError):
    """The peer stopped answering heartbeats or restarted with a new incarnation."""


class ConfigError(ValueError, PdStateError):
    """The worker configuration is invalid; the message names the key."""


_WIRE_TYPES: dict[str, type[BaseException]] = {
    cls.__name__: cls
    for cls in (
        DraftNotSWAOnly,
        UnifiedKVModeMismatch,
        SWAIndexMappingNotShared,
        SWARingGeometryMismatch,
        PagedSWAGeometryMismatch,
        DraftMappingMissing,
        PageSizeMismatch,
        KVCacheDtypeMismatch,
        LayoutMismatch,
        DescriptorMismatch,
        ProtocolError,
        VersionMismatch,
        AuthError,
        EngineError,
        TransferFailed,
        PeerGone,
        PaddingPageIndex,
        IndexCountMismatch,
        IndexOutOfRange,
        ItemLengthMismatch,
    )
}


def _wire_class(type_name: str) -> type[BaseException] | None:
    """A known class by name: the table above, or any subclass of ``PdStateError`` (engines'
    error classes included, once their module is imported)."""
    cls = _WIRE_TYPES.get(type_name)
    if cls is not None:
        return cls
    stack = [PdStateError, RuntimeError]
    while stack:
        c = stack.pop()
        if c.__name__ == type_name and c.__module__.startswith("pdstate"):
            return c
        stack.extend(c.__subclasses__())
    return None


def error_from_wire(type_name: str, message: str) -> BaseException:
    """Rebuild an error a peer reported: the same class where known, else ``RuntimeError``.

    Classes whose constructor does not take a single message fall back to ``RuntimeError``.
    """
    cls = _wire_class(type_name) or RuntimeError
    try:
        return cls(message)
    except TypeError:
        return RuntimeError(f"{type_name}: {message}")
