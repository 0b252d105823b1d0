"""What differs between SGLang releases on the scheduler-queue path, and the stand-in schedulers.

Imported only by the driver's child processes (``side.py``), after ``boot``. The release's row
(``boot.row()``: ``keyword_api``) picks its way: 0.5.19 has ``get_dsv4_c128_state_indices`` and
passes process groups to the queues; 0.5.23 reads them from ``get_parallel()`` and asks the pool
for its request-state indices.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import numpy as np
import torch
from sglang.srt.disaggregation import utils as disagg_utils
from sglang.srt.disaggregation.base.conn import KVPoll, StateType
from sglang.srt.disaggregation.decode import (
    DecodePreallocQueue,
    DecodeReqToTokenPool,
    DecodeTransferQueue,
    SchedulerDisaggregationDecodeMixin,
)
from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue, SchedulerDisaggregationPrefillMixin
from sglang.srt.disaggregation.utils import KVClassType, ReqToMetadataIdxAllocator, TransferBackend, get_kv_class
from sglang.srt.mem_cache.allocator import paged
from sglang.srt.mem_cache.common import kv_to_page_indices, release_kv_cache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

from pdstate.devtools.sglang_pair import boot, pattern
from pdstate.devtools.sglang_queues import pools as side_pools
from pdstate.devtools.sglang_queues.parallel import group_of

NEW = boot.row().keyword_api  # 0.5.23's internals (``releases``)
HIDDEN_LAYERS = 43
STATES = {KVPoll.Failed: "Failed", KVPoll.Bootstrapping: "Bootstrapping", KVPoll.WaitingForInput: "WaitingForInput",
          KVPoll.Transferring: "Transferring", KVPoll.Success: "Success"}  # fmt: skip
buffers = side_pools.buffers


def poll_name(state) -> str:
    return STATES.get(state, str(state))


class _NaiveAllocKernel:
    """Stands for the paged allocator's triton kernel: SGLang's own pure-torch twin, same arguments."""

    def __getitem__(self, grid):
        def run(prefix_lens, seq_lens, last_loc, free_pages, out_indices, _bs_pow2, page_size):
            paged.alloc_extend_naive(prefix_lens, seq_lens, last_loc, free_pages, out_indices, page_size, "cpu")

        return run


paged.alloc_extend_kernel = _NaiveAllocKernel()


def build_pools(side, req_to_token_pool, *, decode: bool, stage: tuple[int, int] | None = None) -> SimpleNamespace:
    """Real DSV4-Flash-shaped pools of ``side`` (``stage``: a PP stage's layers); the decode holds a
    page first, so its pages differ."""
    return side_pools.build(side, req_to_token_pool, hold_pages=1 if decode else 0, stage=stage)


def stage_layers(pp: tuple[int, int]) -> tuple[int, int] | None:
    """A PP prefill stage's layers as SGLang partitions the model (``None``: one stage)."""
    from sglang.srt.distributed.utils import get_pp_indices

    size, rank = pp
    return None if size == 1 else tuple(get_pp_indices(HIDDEN_LAYERS, rank, size))


def _ps(pp: tuple[int, int] = (1, 0)) -> SimpleNamespace:
    return SimpleNamespace(tp_rank=0, tp_size=1, pp_rank=pp[1], pp_size=pp[0], dp_rank=0, dp_size=1, gpu_id=0)


def _tp_worker(pools) -> SimpleNamespace:
    side = pools.side
    runner = SimpleNamespace(
        kv_cache_dtype_str=side_pools.KV_CACHE_DTYPE, effective_max_total_num_tokens=side.full_tokens,
        effective_logical_max_total_num_tokens=side.full_tokens, swa_max_total_num_tokens=side.swa_tokens,
        max_token_pool_size=side.full_tokens, forward_stream=None, mtp_draft_mamba_pools=(),
    )  # fmt: skip
    return SimpleNamespace(model_runner=runner, is_hybrid_swa=True)


def _tree_cache(pools, req_to_token_pool, args, sched, group):
    """The tree cache a scheduler builds with the radix cache disabled: SWAChunkCache on 0.5.19,
    the unified radix tree (SGLang's own factory) on 0.5.23."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    radix = not args.disable_radix_cache  # a decode radix cache (disaggregation_decode_enable_radix_cache)
    params = CacheInitParams(
        disable=not radix, req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=pools.alloc,
        page_size=pools.side.page_size, sliding_window_size=pools.side.sliding_window,
        chunked_prefill_size=512,
    )  # fmt: skip
    if not NEW:
        from sglang.srt.mem_cache.chunk_cache import SWAChunkCache

        return SWAChunkCache(params)
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache

    params.tp_cache_group = params.attn_cp_cache_group = params.attn_tp_cache_group = group
    params.pp_cache_group = group
    ctx = TreeCacheBuildContext(
        server_args=args, params=params, is_hybrid_swa=True, is_hybrid_ssm=False, enable_hierarchical_cache=False,
        disable_radix_cache=not radix, tp_worker=sched.tp_worker, model_config=sched.model_config, tp_size=1, tp_rank=0,
        tp_group=group_of(group), full_tokens_per_layer=pools.side.full_tokens,
    )  # fmt: skip
    return create_tree_cache(ctx)


class PrefillScheduler(SchedulerDisaggregationPrefillMixin):
    """A prefill scheduler holding only what the bootstrap/inflight queue code reads."""

    def _release_aborted_request(self, req) -> None:
        """0.5.23's failed-transfer path calls the scheduler's abort cleanup: for a request with no
        session, its multimodal inputs go and the tree cache closes its handle as aborted."""
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome

        req.release_mm_inputs_on_abort()
        self.tree_cache.finish(req.cache_request_handle, CacheRequestOutcome.ABORT)


class DecodeScheduler(SchedulerDisaggregationDecodeMixin):
    """A decode scheduler holding only what the prealloc/transfer queue code reads."""


def _batch_result_processor():
    """0.5.23's decode accounts the handoff token's reasoning state through it: its own method, for
    a model with no thinking tokens."""
    from types import MethodType

    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor

    proc = SimpleNamespace(model_config=SimpleNamespace(self_opened_think_start_ids=None, think_end_ids=None))
    proc._maybe_update_reasoning_tokens = MethodType(SchedulerBatchResultProcessor._maybe_update_reasoning_tokens, proc)
    return proc


def _common(sched, pools, args, group, streamer, req_to_token_pool, pp: tuple[int, int] = (1, 0)) -> None:
    sched.server_args = args
    sched.ps = _ps(pp)
    sched.tp_worker = _tp_worker(pools)
    sched.model_config = SimpleNamespace(num_hidden_layers=HIDDEN_LAYERS, hf_text_config=None)
    sched.req_to_token_pool = req_to_token_pool
    sched.token_to_kv_pool_allocator = pools.alloc
    sched.tree_cache = _tree_cache(pools, req_to_token_pool, args, sched, group)
    sched.attn_cp_cpu_group = sched.attn_tp_cpu_group = sched.tp_cpu_group = group
    sched.output_streamer = streamer
    sched.metrics_reporter = SimpleNamespace(enable_metrics=False)
    sched.enable_hicache_storage = False
    sched.enable_hisparse = False
    sched.hisparse_coordinator = None
    sched.enable_decode_hicache = False
    sched.enable_overlap = False
    sched.enable_staging = False
    sched.enable_priority_scheduling = False
    sched.sliding_window_size = pools.side.sliding_window
    sched.waiting_queue = []
    sched.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(pools.side.max_num_reqs + 1)
    sched.disagg_metadata_buffers = pools.meta
    sched.running_batch = SimpleNamespace(reqs=[])
    sched.last_batch = None
    # read by 0.5.23's queues
    sched.kv_shard_widening = 1
    sched.rust_server = None
    sched.processed_tokens_counter = 0
    sched.random_seed = 0
    sched.enable_lora = False
    sched.pool_stats_observer = None
    sched.kv_checksum_computer = None
    sched.scheduler_stage_metrics = None
    sched.batch_result_processor = _batch_result_processor()
    sched.pp_group = group_of(group)


def _case(pools, sched, kv_args, **kw) -> SimpleNamespace:
    aux = list(zip(kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens))
    return SimpleNamespace(
        pools=pools,
        sched=sched,
        kv_args=kv_args,
        aux_bufs=aux,
        cleared=[],
        commits={},
        deferred=set(),
        published={},
        **kw,
    )


def _only_known(cls, kw: dict) -> dict:
    """The keywords of ``kw`` that ``cls.__init__`` takes (the releases' queue constructors differ)."""
    import inspect

    names = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in kw.items() if k in names}


def prefill_queues(side, args, backend: str, port: int, group, host: str, streamer, pp=(1, 0)) -> SimpleNamespace:
    """A prefill rank's queues (``pp``: its PP ``(size, rank)``; the first stage runs the bootstrap server)."""
    tb = TransferBackend(backend)
    server = get_kv_class(tb, KVClassType.BOOTSTRAP_SERVER)(host, port) if pp[1] == 0 else None
    sender = get_kv_class(tb, KVClassType.SENDER)
    if getattr(sender, "supports_host_tensor_indices", False):
        # 0.5.23's Mooncake sender takes pinned host tensors and a CUDA event; with no CUDA,
        # send_kv_chunk's other branch (kv_to_page_indices) serves, as for every other sender.
        sender.supports_host_tensor_indices = False
    rtp = ReqToTokenPool(side.max_num_reqs, side.full_tokens + side.page_size, "cpu", False)
    pools = build_pools(side, rtp, decode=False, stage=stage_layers(pp))
    sched = PrefillScheduler()
    _common(sched, pools, args, group, streamer, rtp, pp)
    sched.disagg_prefill_inflight_queue = []
    sched.disagg_prefill_pending_chunk_rids = set()
    kw = dict(
        token_to_kv_pool=pools.target, draft_token_to_kv_pool=pools.draft,
        req_to_metadata_buffer_idx_allocator=sched.req_to_metadata_buffer_idx_allocator,
        metadata_buffers=pools.meta, tp_rank=0, tp_size=1, gpu_id=0, bootstrap_port=port, gloo_group=group,
        max_total_num_tokens=side.full_tokens, scheduler=sched, pp_rank=pp[1], pp_size=pp[0], transfer_backend=tb,
        scheduler_stage_metrics=None,
    )  # fmt: skip
    sched.disagg_prefill_bootstrap_queue = queue = PrefillBootstrapQueue(**_only_known(PrefillBootstrapQueue, kw))
    # each stage is a child polling alone: the consensus SGLang's PP event loop passes from stage to
    # stage (its senders' polls) is this stage's own poll, the queue polling as a queue of one stage
    queue.pp_size = 1
    kv_args = sched.disagg_prefill_bootstrap_queue.kv_manager.kv_args
    return _case(pools, sched, kv_args, server=server)


def decode_queues(side, args, backend: str, port: int, group, streamer, attn_tp=(1, 0)) -> SimpleNamespace:
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    tb = TransferBackend(backend)
    # one slot pre-allocated beside the rest (unified KV counts its SWA room in request slots)
    rtp = DecodeReqToTokenPool(side.max_num_reqs - 1, side.full_tokens + side.page_size, "cpu", False, 1)
    pools = build_pools(side, rtp, decode=True)
    sched = DecodeScheduler()
    _common(sched, pools, args, group, streamer, rtp)
    sched.spec_algorithm = SpeculativeAlgorithm.from_string(args.speculative_algorithm)
    sched.disagg_decode_prealloc_queue = None
    kw = dict(
        gloo_group=group, req_to_metadata_buffer_idx_allocator=sched.req_to_metadata_buffer_idx_allocator,
        tp_rank=attn_tp[1], metadata_buffers=pools.meta, scheduler=sched, tree_cache=sched.tree_cache,
    )  # fmt: skip
    transfer = DecodeTransferQueue(**_only_known(DecodeTransferQueue, kw))
    sched.disagg_decode_transfer_queue = transfer
    kw = dict(
        req_to_token_pool=rtp, token_to_kv_pool_allocator=pools.alloc, draft_token_to_kv_pool=pools.draft,
        req_to_metadata_buffer_idx_allocator=sched.req_to_metadata_buffer_idx_allocator,
        metadata_buffers=pools.meta, scheduler=sched, transfer_queue=transfer, tree_cache=sched.tree_cache,
        gloo_group=group, tp_rank=attn_tp[1], tp_size=attn_tp[0], dp_size=1, gpu_id=0, bootstrap_port=port,
        max_total_num_tokens=side.full_tokens, pp_rank=0, num_reserved_decode_tokens=8, transfer_backend=tb,
    )  # fmt: skip
    sched.disagg_decode_prealloc_queue = DecodePreallocQueue(**_only_known(DecodePreallocQueue, kw))
    kv_args = sched.disagg_decode_prealloc_queue.kv_manager.kv_args
    case = _case(pools, sched, kv_args)
    _watch_decode(case, transfer)
    return case


def _watch_decode(case, transfer) -> None:
    """Record what the decode itself does to its memory: the aux row as SGLang reads it at commit
    (SGLang zeroes its room word right after), and the C128 slot it resets before a transfer."""
    commit = transfer._commit_transfer_to_req

    def recorded_commit(decode_req):
        index = decode_req.metadata_buffer_index
        case.commits[decode_req.req.bootstrap_room] = {"index": index, "aux": row_digests(case.aux_bufs, index)}
        return commit(decode_req)

    transfer._commit_transfer_to_req = recorded_commit
    defer = getattr(transfer, "_defer_release", None)
    if defer is not None:  # 0.5.23: a failed request's pages held until the prefill acknowledged

        def recorded_defer(decode_req):
            case.deferred.add(decode_req.req.bootstrap_room)
            return defer(decode_req)

        transfer._defer_release = recorded_defer
    prealloc = case.sched.disagg_decode_prealloc_queue
    publish = getattr(prealloc, "_send_kv_metadata", None)  # 0.5.23

    def recorded_publish(decode_req, kv_indices, page_size, state_indices=None, **kw):
        """What the decode names: its pages (past a cached prefix) and ``decode_prefix_len``."""
        case.published[decode_req.req.bootstrap_room] = {
            "named_pages": len(kv_to_page_indices(kv_indices, page_size)),
            "decode_prefix_len": int(kw.get("decode_prefix_len") or 0),
        }
        return publish(decode_req, kv_indices, page_size, state_indices, **kw)

    if publish is not None:
        prealloc._send_kv_metadata = recorded_publish
    target = case.pools.target
    for name in ("clear_c128_req_state", "clear_request_scoped_state"):
        clear = getattr(target, name, None)
        if clear is None:
            continue

        def recorded_clear(slot, *a, _clear=clear, **kw):
            case.cleared.append(int(slot))
            return _clear(slot, *a, **kw)

        setattr(target, name, recorded_clear)


def row_digests(aux_bufs: list[tuple[int, int, int]], index: int) -> list[str]:
    """A digest of row ``index`` of every aux buffer ``(ptr, length, item length)``."""
    out = []
    for ptr, length, item in aux_bufs:
        row = pattern.memory(ptr, length)[index * item : (index + 1) * item]
        out.append(hashlib.sha256(row.tobytes()).hexdigest()[:16])
    return out


def cleared_rows(case) -> dict[tuple[int, int], list[int]]:
    """``(ptr, item length) -> rows`` of the request-state buffers the decode reset for its slots."""
    args, out = case.kv_args, {}
    per_slot = case.pools.target.get_ring_size(128) // 128  # a slot's ring, in items of 128 rows
    for c, st in enumerate(args.state_types):
        if st in (StateType.SWA, side_pools.SWA_RING):
            continue
        for p, i in zip(args.state_data_ptrs[c], args.state_item_lens[c]):
            out[(p, i)] = [slot * per_slot + r for slot in case.cleared for r in range(per_slot)]
    return out


def resolve_waiting(sched, popped: list) -> None:
    """What the event loop does with popped requests before admitting them: the waiting queue and
    its bootstrap resolution (optimistic prefill); admitted ones then leave the queue."""
    sched.waiting_queue.extend(popped)
    sched.resolve_waiting_queue_bootstrap()
    sched.waiting_queue = [r for r in sched.waiting_queue if r not in popped]


def prefill_forward(case, req) -> None:
    """KV for the whole prompt, allocated as a prefill batch does (paged ``alloc_extend``)."""
    sched, n = case.sched, len(req.origin_input_ids)
    assert sched.req_to_token_pool.alloc([req]) is not None, "no request slot"
    t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    locs = sched.token_to_kv_pool_allocator.alloc_extend(
        prefix_lens=t(0), prefix_lens_cpu=t(0), seq_lens=t(n), seq_lens_cpu=t(n), last_loc=t(-1), extend_num_tokens=n
    )
    assert locs is not None, "no KV room"
    sched.req_to_token_pool.write((req.kv.req_pool_idx, slice(0, n)), locs)
    req.kv.kv_allocated_len = n
    req.kv.kv_committed_len = n


def set_extend_range(req, start: int, end: int) -> None:
    """The chunk a forward just computed: ``[start, end)`` of the prompt."""
    if NEW:  # 0.5.23: chunk progress is prefix_len / extend_end
        req.prefix_len, req.extend_end = start, end
    else:
        req.set_extend_range(start, end)


def start_send(req) -> int:
    return req.start_send_idx


def _c128_rows(case, slot: int, tokens: int) -> np.ndarray:
    target = case.pools.target
    if NEW:
        return np.asarray(target.request_state_transfer_indices(slot, tokens))
    return np.asarray(
        disagg_utils.get_dsv4_c128_state_indices(slot, tokens, online=False, ring_size=target.get_ring_size(128))
    )


def _ring_rows(target, slot: int, tokens: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Unified KV: the request slot's SWA ring rows of the window's positions, and the positions
    (``slot * stride + position % stride``, as the queues name them); ``None`` on paged pools."""
    if not getattr(target, "_unified_kv", False):
        return None
    stride = target.unified_swa_ring_size
    positions = np.arange(max(0, tokens - target.unified_swa_window), tokens, dtype=np.int64)
    return slot * stride + positions % stride, positions


def request_items(case, req, room, tokens: int | None = None) -> list:
    """Per buffer of ``buffers(kv_args)``: ``(ptr, item length, {item: key})`` for the request as
    it sits in this side's pools (its own token-pool row, SWA mapping and state slot); ``tokens``:
    its sequence length (its prompt's by default; a running request's grows), ``room``: what the
    keys name."""
    pools, page = case.pools, case.pools.side.page_size
    tokens = len(req.origin_input_ids) if tokens is None else tokens
    slot = int(req.kv.req_pool_idx)
    row = case.sched.req_to_token_pool.req_to_token[slot, :tokens].to(torch.int64)
    window_start = max(0, tokens - pools.target.sliding_window) // page * page
    swa = pools.alloc.translate_loc_from_full_to_swa(row[window_start:tokens])
    ring = _ring_rows(pools.target, slot, tokens)
    if ring is not None:  # SGLang's ring-mode allocator maps no SWA page: nothing of the request there
        swa = swa[:0]
    ns = SimpleNamespace(
        room=room, tokens=tokens, pages=np.asarray(kv_to_page_indices(row, page)),
        window_first_page=window_start // page, swa_pages=np.asarray(kv_to_page_indices(swa, page)),
        c128=_c128_rows(case, slot, tokens), ring=ring,
    )  # fmt: skip
    index = req.metadata_buffer_index if req.metadata_buffer_index >= 0 else 0
    return side_pools.request_items(pools, case.kv_args, ns, index)


def placed(case, req) -> bool:
    """Whether the request still holds its pre-allocated KV (a slot and pages)."""
    return req.kv.req_pool_idx is not None and bool(req.kv.holds_kv)


def receiver_of(sched, req):
    pre, tq = sched.disagg_decode_prealloc_queue, sched.disagg_decode_transfer_queue
    for decode_req in [*pre.queue, *pre.pending_reqs, *tq.queue]:
        if decode_req.req is req:
            return decode_req.kv_receiver
    return None


def release_decode(case, req) -> None:
    """The decode is done with the request: its KV goes back (as when it finishes decoding)."""
    if placed(case, req):
        if NEW:
            # a decode radix cache keeps what it can key of a finished request (its prompt's pages)
            keep = not case.sched.server_args.disable_radix_cache and req.finished_reason is None
            if keep:
                from sglang.srt.managers.schedule_batch import FINISH_LENGTH

                req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
            release_kv_cache(req, case.sched.tree_cache, checkpoint=keep)
        else:
            release_kv_cache(req, case.sched.tree_cache, is_insert=False)
