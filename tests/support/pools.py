"""Pools and layout reports for the tests: the ``tiny`` preset, upstream constructor keywords, the
draft's mapping wirings, and reports of real pools cached per settings."""

from __future__ import annotations

import functools
from typing import Any

import torch

from pdstate.pools import DeepSeekV4TokenToKVPool, SWATokenToKVPoolAllocator
from pdstate.pools.kvargs import KVArgs
from pdstate.pools.presets import PoolSettings, WorkerPools, build_worker_pools, preset
from pdstate.pools.reporting import build_report
from pdstate.protocol.report import ErrorInfo, LayoutReport

TINY = preset("tiny")
# The tiny preset with room for a few requests in flight at once (tiny holds ~one 1000-token one).
ROOMY = TINY.with_(full_tokens=16384, swa_tokens=8192, max_num_reqs=16)

# What a ``tiny`` worker's report says of its draft (its ``draft`` factor).
TINY_DRAFT_FACTOR = {
    "layers": 1,
    "layout": "paged",
    "page_size": 256,
    "swa_page_size": 256,
    "sliding_window": 128,
    "ring_size": None,
}

# The constructor keywords of the conformance target (layers [0, 4, 128], speculative), as
# upstream's caller passes them: written out, not derived from the presets.
UPSTREAM_KWARGS: dict[str, Any] = dict(
    max_num_reqs=4,
    swa_size=512,
    c4_size=256,
    c128_size=8,
    c4_state_pool_size=64,
    c128_state_pool_size=1280,
    page_size=256,
    swa_page_size=256,
    dtype="float8_e4m3fn",
    c4_state_dtype="float32",
    c128_state_dtype="float32",
    qk_nope_head_dim=448,
    qk_rope_head_dim=64,
    indexer_head_dim=128,
    layer_num=3,
    device="cpu",
    enable_memory_saver=False,
    compression_ratios=[0, 4, 128],
    sliding_window=128,
    online_mtp_max_draft_tokens=4,
    num_req_slots=5,
    unified_kv=False,
    speculative_num_draft_tokens=4,
)


# The same keywords as SGLang's own constructor takes them (without pdstate's explicit
# global-state keywords, which SGLang reads from its server args).
SGLANG_KWARGS: dict[str, Any] = {
    k: v for k, v in UPSTREAM_KWARGS.items() if k not in ("unified_kv", "speculative_num_draft_tokens")
}


def upstream_kwargs(**changes: Any) -> dict[str, Any]:
    return {**UPSTREAM_KWARGS, **changes}


def draft_changes(ratios: tuple[int, ...] = (0,)) -> dict[str, Any]:
    """What turns the target's keywords into a draft's: no compressed pools, ``ratios`` layers."""
    return dict(
        c4_size=0,
        c128_size=0,
        c4_state_pool_size=0,
        c128_state_pool_size=0,
        layer_num=len(ratios),
        compression_ratios=list(ratios),
    )


WIRINGS = ("shared", "own", "identity", "clone", "view", "none")


def wire_draft(allocator: SWATokenToKVPoolAllocator, draft: DeepSeekV4TokenToKVPool, how: str) -> None:
    """Give ``draft`` the mapping of the target's ``allocator`` as ``how`` says: the same tensor
    (``shared``), an allocator of its own, an identity tensor, a clone, a view, or nothing."""
    m = allocator.full_to_swa_index_mapping
    if how == "shared":
        draft.register_mapping(m)
    elif how == "own":
        SWATokenToKVPoolAllocator(allocator.size_full, allocator.size_swa, allocator.page_size, kvcache=draft)
    elif how == "identity":
        ident = torch.arange(m.numel(), dtype=torch.int64)
        ident[-1] = -1
        draft.register_mapping(ident)
    elif how == "clone":
        draft.register_mapping(m.clone())
    elif how == "view":
        draft.register_mapping(m[:])
    else:
        assert how == "none", f"unknown wiring {how!r}; known: {WIRINGS}"


_KEEP: list[object] = []  # what must outlive its report for the whole session (reports hold pointers)


def keep(obj: object) -> None:
    """Keep ``obj`` (pools whose pointers a report names) alive until the session ends."""
    _KEEP.append(obj)


def kept_pools(settings: PoolSettings) -> WorkerPools:
    """New pools of a worker for ``settings``, kept alive for the session."""
    pools = build_worker_pools(settings)
    keep(pools)
    return pools


@functools.cache
def report_and_kv(settings: PoolSettings) -> tuple[LayoutReport, KVArgs | None]:
    """The layout report and descriptors of a worker's pools for ``settings`` (built once)."""
    pools = kept_pools(settings)
    return build_report(pools.target, pools.draft)


def report_of(settings: PoolSettings) -> LayoutReport:
    return report_and_kv(settings)[0]


def tiny(**changes: Any) -> LayoutReport:
    """The report of a ``tiny`` worker with ``changes`` to its settings."""
    return report_of(TINY.with_(**changes))


def engine_mismatch_error() -> ErrorInfo:
    """The refusal a prefill on ``shm`` answers a decode registering with ``mooncake`` (tiny layout)."""
    from pdstate.protocol import wire
    from pdstate.protocol.handshake import LocalSide, PrefillHandshake

    rep = tiny()
    prefill = PrefillHandshake(LocalSide("p", "1", rep, None, wire.EngineDesc(name="shm", endpoint={})))
    register = wire.Register(
        worker_id="d",
        incarnation="2",
        role="decode",
        report=rep,
        kv=None,
        engine=wire.EngineDesc(name="mooncake", endpoint={}),
    )
    answer = prefill.receive(register)
    assert isinstance(answer, wire.Reject), answer
    return answer.error
