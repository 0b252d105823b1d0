"""Real SGLang pools for one side, ``KVArgs`` filled by SGLang's own functions, per-request indices.

Imported only by the driver's child processes (``side.py``), after ``boot``. Everything here is
SGLang's own code path: ``DeepSeekV4TokenToKVPool`` and ``SWATokenToKVPoolAllocator`` build the
pools; ``KVArgs`` is filled the way ``disaggregation/prefill.py`` ``_init_kv_manager`` and
``decode.py`` fill it (main KV target then draft, ``MetadataBuffers`` for aux, ``build_kv_layer_ids``,
``setup_state_kv_args``, ``mla_compression_ratios`` on the prefill); the per-request page and
state indices are computed as ``send_kv_chunk`` (prefill) and the decode's pre-allocation do.
Both releases: 0.5.23's request-state indices come from the pool's own
``request_state_transfer_indices`` (0.5.19's from ``get_dsv4_c128_state_indices``), a ring size is
asked for by draft token count, its allocator takes the request-to-token pool, and its
``MetadataBuffers`` the sampling-mask width. ``sglang_queues`` builds its pools here too (its own
request-to-token pool, a sampling mask) and reads their items with ``request_items``.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import torch
from sglang.srt.disaggregation.base.conn import StateType
from sglang.srt.disaggregation.utils import (
    KVClassType,
    MetadataBuffers,
    TransferBackend,
    build_kv_layer_ids,
    get_kv_class,
    setup_state_kv_args,
)
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.common import kv_to_page_indices
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool, get_compress_state_ring_size

from pdstate.devtools.sglang_pair import boot
from pdstate.devtools.sglang_pair.cases import Side

NEW_API = boot.row().keyword_api  # 0.5.23's internals (``releases``)
REQUEST_STATE = boot.state_type("C128_STATE")  # DSV4_REQUEST_STATE in 0.5.23, same wire value
SWA_RING = getattr(StateType, "SWA_RING", None)  # 0.5.23's unified-KV SWA ring rows

HIDDEN_SIZE = 4096  # DeepSeek-V4-Flash's hidden size (the aux hidden-states row)
KV_CACHE_DTYPE = "fp8_e4m3"
DRAFT_TOKENS = 4  # boot.server_args' speculative draft tokens
NEXTN_DRAFT = dict(c4_size=0, c128_size=0, c4_state_pool_size=0, c128_state_pool_size=0, layer_num=1)


def ring_size(ratio: int, speculative: bool) -> int:
    """SGLang's compressed-state ring for ``ratio`` (0.5.23 asks for the draft token count, 0 when
    not speculative; 0.5.19 whether it is speculative)."""
    if NEW_API:
        return get_compress_state_ring_size(ratio, DRAFT_TOKENS if speculative else 0)
    return get_compress_state_ring_size(ratio, is_speculative=speculative)


def _pool_kwargs(side: Side) -> dict:
    slots = side.max_num_reqs + 1
    return dict(
        max_num_reqs=side.max_num_reqs,
        swa_size=side.swa_tokens,
        c4_size=side.full_tokens // 4,
        c128_size=side.full_tokens // 128,
        c4_state_pool_size=side.swa_tokens // side.page_size * ring_size(4, side.speculative),
        c128_state_pool_size=slots * ring_size(128, side.speculative),
        page_size=side.page_size,
        swa_page_size=side.page_size,
        dtype=torch.float8_e4m3fn,
        c4_state_dtype=torch.float32,
        c128_state_dtype=torch.float32,
        qk_nope_head_dim=448,
        qk_rope_head_dim=64,
        indexer_head_dim=128,
        layer_num=len(side.ratios),
        device="cpu",
        enable_memory_saver=False,
        compression_ratios=list(side.ratios),
        sliding_window=side.sliding_window,
        online_mtp_max_draft_tokens=DRAFT_TOKENS if side.speculative else 0,
        num_req_slots=slots,
    )


def req_to_token_pool(side: Side):
    """SGLang's request-to-token pool for ``side`` (0.5.23's allocator asks for one)."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    return ReqToTokenPool(
        size=side.max_num_reqs + 1, max_context_len=side.full_tokens, device="cpu", enable_memory_saver=False
    )


def _labels(pool: DeepSeekV4TokenToKVPool, role: str, stage: tuple[int, int] | None = None) -> tuple[list, list, list]:
    """What each entry of the pool's main-KV, SWA-state and C128-state lists holds (role, layer);
    a PP stage's pool holds its layers ``[start, end)`` only, named by their model-wide ids."""
    ratios = list(pool.compression_ratios)
    start, end = stage or (0, len(ratios))
    layers = range(start, end)
    c4 = [i for i in layers if ratios[i] == 4]
    c128 = [i for i in layers if ratios[i] == 128]
    main = [(role, "c4_kv", i) for i in c4] + [(role, "c4_index", i) for i in c4] + [(role, "c128_kv", i) for i in c128]
    swa = [(role, "swa", i) for i in layers]
    swa += [(role, "c4_state", i) for i in c4] + [(role, "c4_index_state", i) for i in c4]
    return main, swa, [(role, "c128_state", i) for i in c128]


def build(
    side: Side,
    *,
    hold_pages: int = 0,
    req_pool=None,
    sampling_mask_tokens: int = 0,
    stage: tuple[int, int] | None = None,
) -> SimpleNamespace:
    """The pools of ``side`` (the server args they read must be published first): ``target``,
    ``draft`` (or None), ``alloc``, ``meta`` (aux), ``req_pool``, ``labels`` (what each buffer entry
    holds) and ``pad``, pages held so that the decode's pages differ from the prefill's. 0.5.23's
    allocator takes ``req_pool`` (a new one of ``req_to_token_pool`` unless given) and its
    ``MetadataBuffers`` ``sampling_mask_tokens``; ``stage``: a PP stage's layers ``[start, end)``
    (SGLang's ``start_layer`` / ``end_layer``)."""
    kw = _pool_kwargs(side)
    if stage is not None:
        kw.update(start_layer=stage[0], end_layer=stage[1])
    with boot.unified_kv(True) if side.unified else contextlib.nullcontext():
        target = DeepSeekV4TokenToKVPool(**kw)
        draft = None
        if side.draft:
            draft = DeepSeekV4TokenToKVPool(**{**kw, **NEXTN_DRAFT, "compression_ratios": [0]})
    if req_pool is None and NEW_API:
        req_pool = req_to_token_pool(side)
    extra = {"req_to_token_pool": req_pool} if NEW_API else {}
    alloc = SWATokenToKVPoolAllocator(
        side.full_tokens, side.swa_tokens, side.page_size, dtype=torch.float8_e4m3fn, device="cpu",
        kvcache=target, need_sort=False, **extra,
    )  # fmt: skip
    if draft is not None:
        draft.register_mapping(alloc.full_to_swa_index_mapping)
    meta_kw = {"max_sampling_mask_tokens": sampling_mask_tokens} if NEW_API else {}
    meta = MetadataBuffers(side.max_num_reqs + 1, HIDDEN_SIZE, torch.bfloat16, **meta_kw)
    pools = SimpleNamespace(
        side=side, target=target, draft=draft, alloc=alloc, meta=meta, req_pool=req_pool, pad=None, labels={}
    )
    if hold_pages:
        pools.pad = alloc.full_attn_allocator.alloc(hold_pages * side.page_size)
    main, swa, c128 = _labels(target, "target", stage)
    ring, ring_draft, swa_draft = [], [], []
    if draft is not None:
        d_main, d_swa, _ = _labels(draft, "draft")
        main, swa_draft = main + d_main, d_swa
    if side.unified:  # each layer's SWA window is in its ring; the SWA component holds the C4 states
        ring, swa = [n for n in swa if n[1] == "swa"], [n for n in swa if n[1] != "swa"]
        ring_draft, swa_draft = [n for n in swa_draft if n[1] == "swa"], [n for n in swa_draft if n[1] != "swa"]
    pools.labels = {
        "main": main,
        "swa": swa,
        "swa_draft": swa_draft,
        "c128": c128,
        "ring": ring,
        "ring_draft": ring_draft,
    }
    return pools


def kv_args(pools: SimpleNamespace, backend: str, *, prefill: bool):
    """``KVArgs`` as SGLang's ``_init_kv_manager`` fills it for this side."""
    target, draft = pools.target, pools.draft
    args = get_kv_class(TransferBackend(backend), KVClassType.KVARGS)()
    args.engine_rank = 0
    args.pp_rank = 0
    args.system_dp_rank = 0
    args.kv_cache_dtype_str = KV_CACHE_DTYPE
    if prefill:
        args.prefill_start_layer = target.start_layer
        args.prefill_end_layer = getattr(target, "end_layer", None)
        args.mla_compression_ratios = None
    ptrs, lens, items = target.get_contiguous_buf_infos()
    drafts = 0
    if draft is not None:
        d_ptrs, d_lens, d_items = draft.get_contiguous_buf_infos()
        ptrs, lens, items, drafts = ptrs + d_ptrs, lens + d_lens, items + d_items, len(d_ptrs)
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = ptrs, lens, items
    if NEW_API:  # what 0.5.23's schedulers add
        from sglang.srt.disaggregation.utils import get_pd_kv_layout

        args.kv_layout = get_pd_kv_layout(target)
        args.num_draft_entries = drafts
    args.kv_layer_ids = build_kv_layer_ids(
        token_to_kv_pool=target,
        draft_token_to_kv_pool=draft,
        num_draft_entries=drafts,
        num_hidden_layers=len(pools.side.ratios),
    )
    args.page_size = target.page_size
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = pools.meta.get_buf_infos()
    args.ib_device = None
    args.gpu_id = 0
    setup_state_kv_args(args, target, draft, len(pools.side.ratios), req_to_token_pool=pools.req_pool)
    if prefill:
        args.mla_compression_ratios = list(target.compression_ratios)
    return args


def buffers(args) -> list[tuple[str, int, int, int]]:
    """Every registered buffer of ``args``: ``(what, ptr, length, item length)``."""
    out = [("main", p, n, i) for p, n, i in zip(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens)]
    out += [("aux", p, n, i) for p, n, i in zip(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens)]
    for c in range(len(args.state_types)):
        out += [
            (f"state{c}", p, n, i)
            for p, n, i in zip(args.state_data_ptrs[c], args.state_data_lens[c], args.state_item_lens[c])
        ]
    return out


def allocate(pools: SimpleNamespace, args, room: int, tokens: int, slot: int) -> SimpleNamespace:
    """One request's pages, its window's SWA pages (``window_first_page`` on), its C128 row and
    ``state_indices`` (one list per ``StateType`` of ``args``), as SGLang's schedulers compute them."""
    page, alloc, target = pools.side.page_size, pools.alloc, pools.target
    npages = -(-tokens // page)
    locs = alloc.full_attn_allocator.alloc(npages * page)
    if locs is None:
        raise RuntimeError(f"the pool has no room for {tokens} tokens")
    window_start = max(0, tokens - target.sliding_window) // page * page
    swa_locs = alloc.swa_attn_allocator.alloc(-(-(tokens - window_start) // page) * page)
    if swa_locs is None:
        alloc.full_attn_allocator.free(locs)
        raise RuntimeError(f"the SWA pool has no room for a window of {tokens - window_start} tokens")
    alloc.set_full_to_swa_mapping(locs[window_start:tokens], swa_locs[: tokens - window_start])
    swa_pages = kv_to_page_indices(alloc.translate_loc_from_full_to_swa(locs[window_start:tokens]), page)
    if NEW_API:
        c128 = target.request_state_transfer_indices(slot, tokens)
    else:
        from sglang.srt.disaggregation.utils import get_dsv4_c128_state_indices

        c128 = get_dsv4_c128_state_indices(slot, tokens, online=False, ring_size=target.get_ring_size(128))
    req = SimpleNamespace(
        room=room, tokens=tokens, slot=slot, locs=locs, swa_locs=swa_locs,
        pages=kv_to_page_indices(locs[:tokens], page).astype(np.int32), window_first_page=window_start // page,
        swa_pages=np.asarray(swa_pages), c128=np.asarray(c128),
    )  # fmt: skip
    payloads = {StateType.SWA: req.swa_pages, REQUEST_STATE: req.c128}
    req.state_indices = [payloads.get(st) for st in args.state_types]
    return req


def release(pools: SimpleNamespace, req: SimpleNamespace) -> None:
    pools.alloc.full_attn_allocator.free(req.locs)
    pools.alloc.swa_attn_allocator.free(req.swa_locs)


def _name(names: list, j: int, kind: str):
    return names[j] if j < len(names) else (kind, j)


def request_items(pools: SimpleNamespace, args, req: SimpleNamespace, aux_index: int) -> list[tuple[int, int, dict]]:
    """Per buffer of ``buffers(args)``, in that order: ``(ptr, item length, {item: key})``. ``req``
    has ``room``, ``tokens``, ``pages``, ``window_first_page``, ``swa_pages`` and ``c128`` (rows),
    and on unified-KV pools ``ring``: the SWA ring's ``(rows, positions)``."""
    room, labels, out = req.room, pools.labels, []
    for j, (p, i) in enumerate(zip(args.kv_data_ptrs, args.kv_item_lens)):
        name = _name(labels["main"], j, "main")
        out.append((p, i, {int(pg): ("kv", room, name, k, i) for k, pg in enumerate(req.pages)}))
    for j, (p, i) in enumerate(zip(args.aux_data_ptrs, args.aux_item_lens)):
        out.append((p, i, {aux_index: ("aux", room, j, i)}))
    swa_components = rings = 0
    for c, st in enumerate(args.state_types):
        pairs = list(zip(args.state_data_ptrs[c], args.state_item_lens[c]))
        if st == SWA_RING:  # unified KV: the window's rows of the request slot's ring, by position
            names = labels["ring"] if rings == 0 else labels["ring_draft"]
            rings += 1
            rows, positions = req.ring
            for j, (p, i) in enumerate(pairs):
                name = _name(names, j, "ring")
                out.append((p, i, {int(r): ("ring", room, name, int(t), i) for r, t in zip(rows, positions)}))
        elif st == StateType.SWA:
            names = labels["swa"] if swa_components == 0 else labels["swa_draft"]
            swa_components += 1
            for j, (p, i) in enumerate(pairs):
                name = _name(names, j, "swa")
                keys = {
                    int(sp): ("swa", room, name, req.window_first_page + k, i) for k, sp in enumerate(req.swa_pages)
                }
                out.append((p, i, keys))
        elif st == REQUEST_STATE:  # the C128 block being compressed
            block = (req.tokens - 1) // 128
            for j, (p, i) in enumerate(pairs):
                name = _name(labels["c128"], j, "c128")
                out.append((p, i, {int(r): ("c128", room, name, block, i) for r in req.c128}))
        else:  # not in these pools' layouts: nothing of the request is expected there
            out.extend((p, i, {}) for p, i in pairs)
    return out
