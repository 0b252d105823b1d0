"""pdstate: disaggregated prefill/decode state transfer for DeepSeek-V4 target + draft pools.

The public API is ``__all__`` below; everything else is internal and may move. Names are imported
on first use (PEP 562), so ``import pdstate.protocol`` stays torch-free: the pool model (torch) is
loaded only when a pool name is asked for.

Layers, each importing only those below it (a test enforces this)::

    cli, devtools        the command line; demo, worker processes, bench
    service              serve, probe, preflight
    integrations         serving-engine adapters (SGLang's transfer backend)
    status               a worker's status over HTTP: models, sources, the app
    worker               serve's prefill and decode over the agent (allocation, synthetic content)
    settings             configuration (TOML, environment, --set) and its auth rules
    agent                the embeddable agent over a caller's own pools
    transfer             TransferPlan, the descriptor planner, the engines (shm, Mooncake, NIXL)
    pools                the DSV4 memory model: allocator, pools, kvargs, indices, presets, reports
    protocol             facts, reports, compat, wire, handshake, lifecycles (no torch)
    errors               the exception tree, one root: PdStateError

Version notes of the public API: ``CHANGELOG.md``.
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
    "PeerSnapshot": "pdstate.protocol.peers",
    "DecodeSnapshot": "pdstate.protocol.peers",
    "PrefillSnapshot": "pdstate.protocol.peers",
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
    "PeerSnapshot",
    "DecodeSnapshot",
    "PrefillSnapshot",
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
    from pdstate.protocol.peers import DecodeSnapshot, PeerSnapshot, PrefillSnapshot
    from pdstate.protocol.report import ErrorInfo, LayoutReport
    from pdstate.protocol.wire import PROTOCOL_VERSION
    from pdstate.transfer.engines.base import create_engine
    from pdstate.transfer.plan import TransferPlan
