"""The whole exception tree, one root: ``PdStateError``.

Every error a user can meet is a class named for what went wrong, defined here and nowhere else.
Classes that mirror an upstream failure keep upstream's name and sentence (built once, character
for character: users grep for it) and take upstream's type as a mixin base (``RuntimeError``,
``AttributeError``, ``ValueError``, ...), so existing ``except`` clauses still catch them.

On the wire an error travels as its class name and message. ``error_from_wire(type_name,
message)`` is the one way to rebuild it: the same class where the name is in ``WIRE_TYPES`` (every
class of this module, so it does not depend on which modules happen to be imported), else a plain
``RemoteError`` that keeps the name. Protocol meaning is carried by the type (``NotRegistered``),
never by the text.
"""

from __future__ import annotations

import ast
import enum
import sys


class ExitCode(enum.IntEnum):
    """Every ``pdstate`` command's exit status (README lists them)."""

    OK = 0
    FAILED = 1  # the command ran and its answer is "no": a check found problems, a transfer failed
    CONFIG = 2  # bad arguments or configuration (argparse's own usage errors are 2 as well)
    LOCAL_CHECK = 3  # the worker's own target/draft pair fails setup_state_kv_args
    REFUSED = 4  # the peer refused the handshake


class PdStateError(Exception):
    """The root: every error pdstate raises on purpose is an instance of this class."""


# --- the five upstream target/draft checks (setup_state_kv_args) -------------------------------


class DSV4StateError(PdStateError, RuntimeError):
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
    def build(target: tuple, draft: tuple) -> SWARingGeometryMismatch:
        return SWARingGeometryMismatch(
            f"DSV4 target and draft pools must share SWA ring geometry: target={tuple(target)}, draft={tuple(draft)}"
        )


class PagedSWAGeometryMismatch(DSV4StateError):
    """Paged mode: ``(page_size, sliding_window)`` differ between target and draft."""

    @staticmethod
    def build(target: tuple, draft: tuple) -> PagedSWAGeometryMismatch:
        return PagedSWAGeometryMismatch(
            f"DSV4 target and draft pools must share paged SWA geometry: target={tuple(target)}, draft={tuple(draft)}"
        )


class SWAGeometryMismatch(PagedSWAGeometryMismatch):
    """Paged mode, SGLang 0.5.23's wording: ``(page_size, sliding_window, third)`` differ, where
    the target's third is its request-window capacity (``None`` without one) and the draft's its
    per-request SWA ring size (``None`` without one)."""

    @staticmethod
    def build(target: tuple, draft: tuple) -> SWAGeometryMismatch:
        return SWAGeometryMismatch(
            f"DSV4 target and draft pools must share SWA geometry: target={tuple(target)}, draft={tuple(draft)}"
        )


class DraftMappingMissing(DSV4StateError, AttributeError):
    """Paged mode: the draft never registered a mapping (upstream: a bare ``AttributeError``)."""

    @classmethod
    def default_message(cls) -> str:
        return "'DeepSeekV4TokenToKVPool' object has no attribute 'full_to_swa_index_mapping'"


# --- upstream cross-side sentences -----------------------------------------------------------


def _stated(sentence: str, message: str) -> tuple[str | None, tuple[object, object]] | None:
    """``(factor, (prefill, decode))`` of ``message`` written from ``sentence``, else ``None``."""
    factor = message[len(sentence.partition("{factor}")[0]) :].partition(":")[0] if "{factor}" in sentence else None
    lead, mid, tail = sentence.format(prefill="\0", decode="\0", factor=factor).split("\0", 2)
    ok = message.startswith(lead) and message.endswith(tail) and len(message) >= len(lead) + len(tail)
    prefill, sep, decode = message[len(lead) : len(message) - len(tail)].rpartition(mid) if ok else ("", "", "")
    if not sep:
        return None
    try:
        return factor, (ast.literal_eval(prefill), ast.literal_eval(decode))
    except Exception:  # values that are no literals (a dtype's name) stay texts
        return factor, (prefill, decode)


class CrossSideMismatch(PdStateError, RuntimeError):
    """Base of the refusals that compare the prefill side with the decode side. ``factor``: the layout
    factor it is about (``pdstate.protocol.factors``); ``prefill``, ``decode``: the values its ``SENTENCE`` states."""

    factor: str | None = None
    SENTENCE: str | None = None

    def __init__(self, message: str, *, factor: str | None = None, values: tuple[object, object] | None = None) -> None:
        super().__init__(message)  # rebuilt from the wire's text, it reads its factor and values back from it
        stated = (factor, values) if values is not None else self.SENTENCE and _stated(self.SENTENCE, message)
        factor, (self.prefill, self.decode) = stated or (None, (None, None))
        self.factor = factor or type(self).factor

    @classmethod
    def build(cls, prefill: object, decode: object):
        return cls(cls.SENTENCE.format(prefill=prefill, decode=decode), values=(prefill, decode))


class PageSizeMismatch(CrossSideMismatch):
    factor = "page_size"
    SENTENCE = (
        "Page size mismatch: prefill server has page_size={prefill}, but decode server has "
        "page_size={decode}. Both servers must use the same --page-size value."
    )


class KVCacheDtypeMismatch(CrossSideMismatch):
    factor = "kv_dtype"
    SENTENCE = (
        "KV cache dtype mismatch: prefill server has kv_cache_dtype={prefill}, but decode "
        "server has kv_cache_dtype={decode}. Both servers must use the same --kv-cache-dtype value."
    )


class LayoutMismatch(CrossSideMismatch):
    """Any other layout factor differs; the message names the factor and both values."""

    SENTENCE = (
        "DSV4 layout mismatch on {factor}: prefill server has {factor}={prefill}, but "
        "decode server has {factor}={decode}. Both servers must build the same state layout."
    )

    @classmethod
    def build(cls, factor: str, prefill: object, decode: object) -> LayoutMismatch:
        text = cls.SENTENCE.format(factor=factor, prefill=repr(prefill), decode=repr(decode))
        return cls(text, factor=factor, values=(prefill, decode))


class KVLayoutMismatch(CrossSideMismatch):
    """The main or compressed KV byte layouts differ (SGLang 0.5.23's decode refuses at lookup)."""

    factor = "kv_layout"
    SENTENCE = (
        "KV layout mismatch: prefill server has kv_layout={prefill}, but decode server has kv_layout={decode}. "
        "Both servers must use the same --dsv4-attn-backend and SGLANG_DSV4_KV_LAYOUT."
    )


class CompressedMLAPoolMismatch(CrossSideMismatch, ValueError):
    """One side registers the compressed-MLA fp8 two-pool layout and the other one pool per layer
    (SGLang 0.5.23 raises this ``ValueError`` when it slices the regions)."""

    factor = "kv_fp8_two_pool"

    @staticmethod
    def build(prefill: int, decode: int, single: int, two: int) -> CompressedMLAPoolMismatch:
        return CompressedMLAPoolMismatch(
            f"PD peers disagree on the compressed-MLA KV layout: prefill registered {prefill} regions, decode "
            f"{decode} ({single} is one pool per layer, {two} is the fp8 two-pool). "
            "SGLANG_DSV4_UNIFIED_KV_FP8 must be set the same on both sides."
        )


class DSparkLayoutMismatch(CrossSideMismatch):
    """The DeepSeek-V4.1 DSpark transfer layouts differ (SGLang 0.5.23's decode refuses at lookup)."""

    factor = "dspark"

    @staticmethod
    def build(fields: list[str]) -> DSparkLayoutMismatch:
        return DSparkLayoutMismatch(
            f"DeepSeek-V4.1 DSpark PD layout mismatch ({', '.join(fields)}): both servers must enable DSpark "
            "with the same block size and target/draft KV layout. Upgrade both servers together."
        )


class AllocationPolicyMismatch(CrossSideMismatch):
    """The decode allocation policies differ (SGLang 0.5.23 fails each request with this reason)."""

    factor = "allocation_policy"
    SENTENCE = (
        "Disaggregation decode allocation policy mismatch: prefill={prefill}, decode={decode}. "
        "Set --disaggregation-decode-allocation-policy identically on both roles."
    )


class DescriptorMismatch(CrossSideMismatch):
    """The peer's registered buffers cannot pair with ours (counts, item lengths, ranges)."""


# --- pool construction ------------------------------------------------------------------------


class PoolConfigError(PdStateError, ValueError):
    """A pool cannot be built with these arguments."""


class OnlineC128MTPUnsupported(PdStateError, AssertionError):
    """Upstream asserts this when online C128 meets speculative decoding without the MTP option."""

    def __init__(self) -> None:
        super().__init__("online c128 does not support MTP")


class AllocationError(PdStateError):
    """The allocator has no room, or was asked to free what it does not hold."""


# --- per-request checks -----------------------------------------------------------------------


class IndexRefused(PdStateError):
    """Base for refused index lists (not the builtin ``IndexError``)."""


class PaddingPageIndex(IndexRefused):
    """A sliding-window slot maps to 0: the transfer would silently copy the padding page."""


class IndexCountMismatch(IndexRefused):
    """Prefill and decode index lists of one component have different lengths."""


class IndexOutOfRange(IndexRefused):
    """An index is negative or addresses past the end of its registered buffer."""


class ItemLengthMismatch(IndexRefused):
    """A buffer's item length differs between the two sides."""


# --- protocol, engines, workers ---------------------------------------------------------------


class ProtocolError(PdStateError):
    """A control frame could not be decoded or validated."""


class VerifyLevelRefused(ProtocolError):
    """A decode asked a verification level below the prefill's ``transfer.verify``."""


class VersionMismatch(ProtocolError):
    """The peer speaks another protocol version."""


class NotRegistered(ProtocolError):
    """A heartbeat or request came from a peer this worker has not accepted (or has forgotten):
    the sender should register again."""

    def __init__(self, message: str = "not registered: send a register message first") -> None:
        super().__init__(message)


class WorkerIdInUse(ProtocolError):
    """A register reused the ``worker_id`` of a decode that is still accepted and reachable: the
    newcomer is refused and the live decode is left as it was (a new incarnation of a decode is
    accepted once its old one is gone)."""


class IllegalTransition(PdStateError, RuntimeError):
    """A lifecycle move that its transition table does not allow (a bug, never a peer's doing)."""


class LocalCheckFailed(PdStateError, RuntimeError):
    """Raised at start when the worker's own target/draft pair fails ``setup_state_kv_args``."""


class AuthError(PdStateError):
    """A control message carried no auth tag or a wrong one."""


class EngineError(PdStateError):
    """A transfer engine failed; the message says which operation and the engine's own code."""


class EngineUnavailable(EngineError, ImportError):
    """An optional engine package is not installed; the message names the extra."""


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


class TransferFailed(PdStateError):
    """A request ended FAILED; ``reason`` says why."""


class PeerGone(PdStateError):
    """The peer stopped answering heartbeats or restarted with a new incarnation."""


class ConfigError(PdStateError, ValueError):
    """The worker configuration is invalid; the message names the key."""


class SGLangArgsError(ConfigError):
    """An SGLang launch string (or its source) cannot be read or does not describe a DSV4 server."""


class SGLangArgsParseError(SGLangArgsError):
    """What SGLang's own argument parser would stop a launch with (``sglang serve: error: ...``);
    ``pdstate check --sglang`` reports it as a launch error of that side."""


class DocumentValueError(PdStateError, ValueError):
    """A posted document holds a value no worker reports (the message never quotes it)."""


class ProbeError(PdStateError):
    """``pdstate probe`` could not reach a worker or read its answer."""


class RemoteError(PdStateError, RuntimeError):
    """A peer reported an error whose class this version does not know; ``type_name`` keeps it."""

    def __init__(self, message: str, type_name: str = "RemoteError") -> None:
        super().__init__(message)
        self.type_name = type_name


class TransferAborted(TransferFailed):
    """A request was aborted by its decode or its prefill; no write of it lands afterwards."""


class DigestMismatch(TransferFailed):
    """The bytes that landed on the decode do not hash to what the prefill sent."""


class PrefillBusy(TransferFailed):
    """A prefill refused a request because ``max_inflight`` requests are in flight; the decode may
    ask again (``pdstate serve``'s decode does, backing off, until the request's deadline)."""


class AgentClosed(PdStateError):
    """A call on an agent (or one of its senders/receivers) after ``close()``."""


class RoomInFlight(ProtocolError, ValueError):
    """A request names a room that already has a request in flight on this worker (a decode's
    ``submit``, or a decode asking a prefill for a room it is computing)."""


class TooManyPrefills(PeerGone, ValueError):
    """A decode of ``pdstate serve`` already holds links to its most prefills, each with requests
    in flight: a request naming yet another prefill fails at once."""


class AgentTimeout(PdStateError, TimeoutError):
    """A worker waited for its agent (an answer, a verdict, a fence) past its deadline."""


class UnknownRoom(PdStateError, LookupError):
    """A call names a room this worker holds no running request for (``pdstate serve``'s decode:
    releasing, stepping or migrating a request it does not hold)."""


class SGLangUnavailable(PdStateError, ImportError):
    """``pdstate.integrations.sglang.install()`` could not find SGLang, or a module or attribute of
    it that the transfer-backend registration needs; the message names what is missing."""


def _classes() -> dict[str, type[BaseException]]:
    module = sys.modules[__name__]
    return {
        name: obj
        for name, obj in vars(module).items()
        if isinstance(obj, type) and issubclass(obj, PdStateError) and obj.__module__ == __name__
    }


# Every class defined above, by name: the wire's error kinds (complete at import of this module).
WIRE_TYPES: dict[str, type[BaseException]] = _classes()


def error_from_wire(type_name: str, message: str) -> PdStateError:
    """Rebuild an error a peer reported: the same class with the same message where the name is
    known, else ``RemoteError`` keeping the name (also for a class whose constructor does not take
    a single message)."""
    cls = WIRE_TYPES.get(type_name)
    if cls is not None:
        try:
            return cls(message)
        except TypeError:
            pass
    return RemoteError(message, type_name)
