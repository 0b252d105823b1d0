"""Real DSV4-Flash-shaped SGLang pools for one side, on SGLang 0.5.19 or 0.5.23.

Imported only by the driver's child processes, after ``boot``. The pools are the same as
``devtools.sglang_pair`` builds (``cases.Side``: 43 layers, C4/C128 alternating, an optional NextN
draft sharing the target's SWA mapping); what differs per release is how a ring size is asked
for, the allocator's request-pool argument and ``MetadataBuffers``' sampling-mask width. The
queues fill ``KVArgs`` themselves; ``request_items`` says what every item of a request holds.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import torch
from sglang.srt.disaggregation.base.conn import StateType
from sglang.srt.disaggregation.utils import MetadataBuffers
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool, get_compress_state_ring_size

HIDDEN_SIZE = 4096  # DeepSeek-V4-Flash's hidden size (the aux hidden-states row)
KV_CACHE_DTYPE = "fp8_e4m3"
DRAFT_TOKENS = 4  # boot.server_args' speculative draft tokens
NEXTN_DRAFT = dict(c4_size=0, c128_size=0, c4_state_pool_size=0, c128_state_pool_size=0, layer_num=1)
_RING_TAKES_TOKENS = "num_draft_tokens" in inspect.signature(get_compress_state_ring_size).parameters
REQUEST_STATE = {t for name, t in StateType.__members__.items() if name in ("C128_STATE", "DSV4_REQUEST_STATE")}


def ring_size(ratio: int, speculative: bool) -> int:
    if _RING_TAKES_TOKENS:  # 0.5.23: the draft token count
        return get_compress_state_ring_size(ratio, DRAFT_TOKENS if speculative else 0)
    return get_compress_state_ring_size(ratio, is_speculative=speculative)


def _pool_kwargs(side) -> dict:
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


def _labels(ratios, role: str) -> tuple[list, list, list]:
    """What each entry of a pool's main-KV, SWA-state and request-state lists holds (role, kind, layer)."""
    c4 = [i for i, r in enumerate(ratios) if r == 4]
    c128 = [i for i, r in enumerate(ratios) if r == 128]
    main = [(role, "c4_kv", i) for i in c4] + [(role, "c4_index", i) for i in c4] + [(role, "c128_kv", i) for i in c128]
    swa = [(role, "swa", i) for i in range(len(ratios))]
    swa += [(role, "c4_state", i) for i in c4] + [(role, "c4_index_state", i) for i in c4]
    return main, swa, [(role, "c128_state", i) for i in c128]


def build(side, req_to_token_pool, *, hold_pages: int = 0) -> SimpleNamespace:
    """The pools of ``side`` (its server args published first): ``target``, ``draft`` (or None),
    ``alloc``, ``meta`` (aux), ``labels``; ``hold_pages`` pages are taken first, so that the
    decode's pages differ from the prefill's."""
    kw = _pool_kwargs(side)
    target = DeepSeekV4TokenToKVPool(**kw)
    draft = DeepSeekV4TokenToKVPool(**{**kw, **NEXTN_DRAFT, "compression_ratios": [0]}) if side.draft else None
    extra = {}
    if "req_to_token_pool" in inspect.signature(SWATokenToKVPoolAllocator.__init__).parameters:
        extra["req_to_token_pool"] = req_to_token_pool
    alloc = SWATokenToKVPoolAllocator(
        side.full_tokens, side.swa_tokens, side.page_size, dtype=torch.float8_e4m3fn, device="cpu",
        kvcache=target, need_sort=False, **extra,
    )  # fmt: skip
    if draft is not None:
        draft.register_mapping(alloc.full_to_swa_index_mapping)
    meta_kw = {}
    if "max_sampling_mask_tokens" in inspect.signature(MetadataBuffers.__init__).parameters:
        meta_kw["max_sampling_mask_tokens"] = 16
    meta = MetadataBuffers(side.max_num_reqs + 1, HIDDEN_SIZE, torch.bfloat16, **meta_kw)
    pad = alloc.full_attn_allocator.alloc(hold_pages * side.page_size) if hold_pages else None
    main, swa, c128 = _labels(list(side.ratios), "target")
    swa_draft = []
    if draft is not None:
        d_main, swa_draft, _ = _labels([0], "draft")
        main = main + d_main
    labels = {"main": main, "swa": swa, "swa_draft": swa_draft, "c128": c128}
    return SimpleNamespace(side=side, target=target, draft=draft, alloc=alloc, meta=meta, pad=pad, labels=labels)


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


def _name(names: list, j: int, kind: str):
    return names[j] if j < len(names) else (kind, j)


def request_items(pools, args, req, aux_index: int) -> list[tuple[int, int, dict]]:
    """Per buffer of ``buffers(args)``, in that order: ``(ptr, item length, {item: key})``. ``req``
    has ``room``, ``tokens``, ``pages``, ``window_first_page``, ``swa_pages`` and ``c128`` (rows)."""
    room, labels, out = req.room, pools.labels, []
    for j, (p, i) in enumerate(zip(args.kv_data_ptrs, args.kv_item_lens)):
        name = _name(labels["main"], j, "main")
        out.append((p, i, {int(pg): ("kv", room, name, k, i) for k, pg in enumerate(req.pages)}))
    for j, (p, i) in enumerate(zip(args.aux_data_ptrs, args.aux_item_lens)):
        out.append((p, i, {aux_index: ("aux", room, j, i)}))
    swa_components = 0
    for c, st in enumerate(args.state_types):
        pairs = list(zip(args.state_data_ptrs[c], args.state_item_lens[c]))
        if st == StateType.SWA:
            names = labels["swa"] if swa_components == 0 else labels["swa_draft"]
            swa_components += 1
            for j, (p, i) in enumerate(pairs):
                name = _name(names, j, "swa")
                keys = {
                    int(sp): ("swa", room, name, req.window_first_page + k, i) for k, sp in enumerate(req.swa_pages)
                }
                out.append((p, i, keys))
        elif st in REQUEST_STATE:  # the C128 block being compressed
            block = (req.tokens - 1) // 128
            for j, (p, i) in enumerate(pairs):
                name = _name(labels["c128"], j, "c128")
                out.append((p, i, {int(r): ("c128", room, name, block, i) for r in req.c128}))
        else:  # not in these pools' layouts: nothing of the request is expected there
            out.extend((p, i, {}) for p, i in pairs)
    return out
