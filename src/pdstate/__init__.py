"""pdstate: disaggregated prefill/decode state transfer for DeepSeek-V4 target + draft pools.

The public API is ``__all__`` below; everything else is internal and may move. Names are imported
on first use (PEP 562), so ``import pdstate.protocol`` stays torch-free: the pool model (torch) is
loaded only when a pool name is asked for.

Layers, each importing only those below it (a test enforces this)::

    cli, devtools        the command line; demo, worker processes, bench
    service              configuration, HTTP API, status, server, probe, preflight
    runtime, agent       workers (control loop, prefill, decode, synthetic content); the
                         embeddable agent over a caller's own pools (beside runtime, not on it)
    transfer             TransferPlan, the descriptor planner, the engines (shm, Mooncake, NIXL)
    pools                the DSV4 memory model: allocator, pools, kvargs, indices, presets, reports
    protocol             facts, reports, compat, wire, handshake, lifecycles (no torch)
    errors               the exception tree, one root: PdStateError

Version notes of the public API:
- 0.1.0: first listed ``__all__`` (names unchanged from the modules they were imported from),
  with the embeddable agent (``PrefillAgent``, ``DecodeAgent``, ``KVSender``, ``KVReceiver``).
  Then, additions only (names of ``__all__`` unchanged), for callers that compute on demand
  (``pdstate serve`` runs on them): ``PrefillAgent(on_request=...)``, ``refuse``, ``peers``,
  ``alive``, ``handshakes`` and ``close(reason)`` (which now says ``Goodbye``);
  ``DecodeAgent.connect``, ``reregister``, ``forget``, ``alive``, ``handshakes``,
  ``receiver(..., redial_gone=...)``, and ``prefills()``'s keys ``error_info``,
  ``fingerprint``, ``handshake_s`` and ``registered_s_ago``; ``KVReceiver.init(seq_len=...)``.
  Then, additions only, for digests beside the copy (wire ``Landed``): ``PrefillAgent(
  landed_piece_bytes=...)`` (default 0, whole chunks), and the receiver's metrics ``landed``
  (notices hashed early) and ``digest_hashing_s`` (all hashing time; ``digest_s`` is now the part
  after ``TransferDone``, the part not hidden).
  Then one behaviour change, to match upstream: ``DeepSeekV4TokenToKVPool``'s PP stage is SGLang
  0.5.19's — ``[start_layer, end_layer)`` when both are given and the ratio list reaches
  ``end_layer``, else the whole ratio list, whatever ``layer_num`` says (it was ``[start_layer,
  start_layer + layer_num)``, ``end_layer`` inclusive, clipped to the list). A caller that gave
  ``start_layer`` or ``layer_num`` alone to build part of a ratio list now passes both bounds;
  ``build_worker_pools`` does, so its presets' layouts are unchanged.
  Then SGLang 0.5.23 beside 0.5.19, one behaviour change and additions:
  ``DeepSeekV4TokenToKVPool(upstream="0.5.19" | "0.5.23")`` (also ``PoolSettings.upstream``,
  ``preset(..., upstream=)`` and the configuration key ``pool.upstream``) builds a release's pools;
  **the default is the newest, 0.5.23**: more compressed-KV rows (capacity), unified-KV C4 states
  by request slot, and 0.5.23's refusals (``SWAGeometryMismatch``, "must share SWA geometry" with
  a three-element tuple; a draft with no mapping gets the seed error ``SWAIndexMappingNotShared``
  where 0.5.19 raised ``DraftMappingMissing``). Pass ``upstream="0.5.19"`` for 0.5.19's. Added:
  ``StateType.DSV4_REQUEST_STATE`` (another name of ``C128_STATE``, value ``"c128_state"``) and
  ``StateType.REQUEST_ROW``; the errors ``KVLayoutMismatch``, ``CompressedMLAPoolMismatch``,
  ``DSparkLayoutMismatch`` and ``AllocationPolicyMismatch`` (SGLang 0.5.23's cross-side
  sentences, raised by ``check_peer`` from the optional report factors of
  ``pdstate.protocol.report.OPTIONAL_FACTOR_NAMES``); ``build_report(..., dspark=,
  allocation_policy=)``; the five new error classes in ``__all__``; and the SGLang plugin entry point (``sglang.srt.plugins``: ``pdstate``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"


# public name -> module that defines it, for every name not in pdstate.errors
_OTHERS: dict[str, str] = {
    "StateType": "pdstate.protocol.facts",
    "KVArgs": "pdstate.protocol.facts",
    "PoolFacts": "pdstate.protocol.facts",
    "MappingIdentity": "pdstate.protocol.facts",
    "LayoutReport": "pdstate.protocol.report",
    "ErrorInfo": "pdstate.protocol.report",
    "check_peer": "pdstate.protocol.compat",
    "compat_errors": "pdstate.protocol.compat",
    "PROTOCOL_VERSION": "pdstate.protocol.wire",
    "DeepSeekV4TokenToKVPool": "pdstate.pools.dsv4",
    "SWATokenToKVPoolAllocator": "pdstate.pools.allocator",
    "ReqToTokenPool": "pdstate.pools.allocator",
    "setup_state_kv_args": "pdstate.pools.kvargs",
    "fill_kv_args": "pdstate.pools.kvargs",
    "build_report": "pdstate.pools.reporting",
    "PoolSettings": "pdstate.pools.presets",
    "preset": "pdstate.pools.presets",
    "build_worker_pools": "pdstate.pools.presets",
    "TransferPlan": "pdstate.transfer.plan",
    "create_engine": "pdstate.transfer.engines.base",
    "PrefillAgent": "pdstate.agent.prefill",
    "DecodeAgent": "pdstate.agent.decode",
    "KVSender": "pdstate.agent.sender",
    "KVReceiver": "pdstate.agent.receiver",
}

__all__ = [
    "__version__",
    "PdStateError",
    "DSV4StateError",
    "DraftNotSWAOnly",
    "UnifiedKVModeMismatch",
    "SWAIndexMappingNotShared",
    "SWARingGeometryMismatch",
    "PagedSWAGeometryMismatch",
    "SWAGeometryMismatch",
    "DraftMappingMissing",
    "CrossSideMismatch",
    "PageSizeMismatch",
    "KVCacheDtypeMismatch",
    "LayoutMismatch",
    "KVLayoutMismatch",
    "CompressedMLAPoolMismatch",
    "DSparkLayoutMismatch",
    "AllocationPolicyMismatch",
    "DescriptorMismatch",
    "PoolConfigError",
    "AllocationError",
    "IndexRefused",
    "PaddingPageIndex",
    "IndexCountMismatch",
    "IndexOutOfRange",
    "ItemLengthMismatch",
    "ProtocolError",
    "VersionMismatch",
    "AuthError",
    "NotRegistered",
    "EngineError",
    "EngineUnavailable",
    "TransferFailed",
    "PeerGone",
    "ConfigError",
    "LocalCheckFailed",
    "error_from_wire",
    "StateType",
    "KVArgs",
    "PoolFacts",
    "MappingIdentity",
    "LayoutReport",
    "ErrorInfo",
    "check_peer",
    "compat_errors",
    "PROTOCOL_VERSION",
    "DeepSeekV4TokenToKVPool",
    "SWATokenToKVPoolAllocator",
    "ReqToTokenPool",
    "setup_state_kv_args",
    "fill_kv_args",
    "build_report",
    "PoolSettings",
    "preset",
    "build_worker_pools",
    "TransferPlan",
    "create_engine",
    "PrefillAgent",
    "DecodeAgent",
    "KVSender",
    "KVReceiver",
]
# every other public name is an error class (or error_from_wire) of pdstate.errors
_WHERE: dict[str, str] = {
    **{name: "pdstate.errors" for name in __all__ if name != "__version__" and name not in _OTHERS},
    **_OTHERS,
}


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'pdstate' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs (the error classes: pdstate.errors); at run time names load on first use
    from pdstate.agent.decode import DecodeAgent
    from pdstate.agent.prefill import PrefillAgent
    from pdstate.agent.receiver import KVReceiver
    from pdstate.agent.sender import KVSender
    from pdstate.pools.allocator import ReqToTokenPool, SWATokenToKVPoolAllocator
    from pdstate.pools.dsv4 import DeepSeekV4TokenToKVPool
    from pdstate.pools.kvargs import fill_kv_args, setup_state_kv_args
    from pdstate.pools.presets import PoolSettings, build_worker_pools, preset
    from pdstate.pools.reporting import build_report
    from pdstate.protocol.compat import check_peer, compat_errors
    from pdstate.protocol.facts import KVArgs, MappingIdentity, PoolFacts, StateType
    from pdstate.protocol.report import ErrorInfo, LayoutReport
    from pdstate.protocol.wire import PROTOCOL_VERSION
    from pdstate.transfer.engines.base import create_engine
    from pdstate.transfer.plan import TransferPlan
