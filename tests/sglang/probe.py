"""Child process of the harness: build real SGLang pools and pdstate's own pools side by side.

Reads a JSON list of scenarios on stdin (see ``scenarios.py``) and prints one JSON object on the
last line of stdout: per scenario, what pdstate reports and fills from the *real* pools, from
pdstate's pools built from the same constructor arguments, and what SGLang's own
``setup_state_kv_args`` fills from the real pools. Run only by ``runner.run_probe``: importing
``booted`` changes process-wide state.

Both releases (0.5.19 and 0.5.23): the child follows the SGLang it imported (``boot.release()``,
reported as ``sglang``); pdstate's own pools are built for that release (``upstream=``), and
SGLang's request-state indices are 0.5.19's ``get_dsv4_c128_state_indices`` or 0.5.23's pool
method ``request_state_transfer_indices``.

Online C128 is read once when SGLang's pool module is imported (``SGLANG_OPT_USE_ONLINE_COMPRESS``,
``SGLANG_EXPERIMENTAL_ONLINE_C128_MTP``), so the caller sets those per process.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import traceback

from pdstate.devtools.sglang_pair import booted  # noqa: F401  (first: sys.path, the GPU-only stubs and the bare sglang package)

# isort: split
import torch
from sglang.srt.disaggregation.base.conn import KVArgs as SglKVArgs
from sglang.srt.disaggregation.utils import setup_state_kv_args as sgl_setup_state_kv_args
from sglang.srt.mem_cache import deepseek_v4_memory_pool as sgl_pool_module
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator as SglAllocator
from sglang.srt.mem_cache.common import kv_to_page_indices
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool as SglPool

from pdstate.devtools.sglang_pair import boot
from pdstate.pools import DeepSeekV4TokenToKVPool, SWATokenToKVPoolAllocator, indices
from pdstate.pools.interface import is_dsv4_pool, pool_view
from pdstate.pools.kvargs import KVArgs, fill_kv_args, setup_state_kv_args
from pdstate.pools.reporting import build_report

RELEASE = boot.release()
NEW_API = boot.row().keyword_api  # 0.5.23's internals (``releases``)
ONLINE_C128 = bool(sgl_pool_module.ONLINE_C128)
# pdstate's pools reproduce the layout of the release asked for (when they take ``upstream``)
UPSTREAM = (
    {"upstream": boot.row().pools}
    if "upstream" in inspect.signature(DeepSeekV4TokenToKVPool.__init__).parameters
    else {}
)


def sglang_c128_indices(pool, slot: int, seq_len: int):
    """SGLang's own request-state (C128) indices for one request, as its schedulers compute them."""
    if NEW_API:
        return pool.request_state_transfer_indices(slot, seq_len)
    from sglang.srt.disaggregation.utils import get_dsv4_c128_state_indices, is_dsv4_c128_online_enabled

    return get_dsv4_c128_state_indices(
        slot, seq_len, online=is_dsv4_c128_online_enabled(), ring_size=pool.get_ring_size(128)
    )


def sglang_allocator(a: dict, page: int, dtype, kvcache, slots: int = 8):
    """SGLang's SWA allocator (0.5.23's takes the request-to-token pool)."""
    extra = {}
    if NEW_API:
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        extra["req_to_token_pool"] = ReqToTokenPool(
            size=slots, max_context_len=a["size_full"], device="cpu", enable_memory_saver=False
        )
    return SglAllocator(
        a["size_full"], a["size_swa"], page, dtype=dtype, device="cpu", kvcache=kvcache, need_sort=False, **extra
    )


ONLINE_C128_MTP = os.environ.get("SGLANG_EXPERIMENTAL_ONLINE_C128_MTP", "").lower() in ("1", "true")


def _error(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "message": str(exc), "mro": [c.__name__ for c in type(exc).__mro__]}


def _outcome(fn) -> dict:
    try:
        return {"ok": True, "value": fn()}
    except Exception as exc:  # the outcome is the point: recorded for the parent to compare
        return {"ok": False, "error": _error(exc)}


def _kvargs_summary(kv) -> dict:
    return {
        "state_types": [str(getattr(t, "value", t)).lower() for t in kv.state_types],
        "ptrs": [list(p) for p in kv.state_data_ptrs],
        "data_lens": [list(x) for x in kv.state_data_lens],
        "item_lens": [list(x) for x in kv.state_item_lens],
    }


def _kwargs(s: dict, *, draft: bool) -> dict:
    kw = dict(s["pool"])
    if draft:
        kw.update(s["draft_pool"])
    return kw


def _real_pool(kw: dict):
    kw = dict(kw)
    for k in ("dtype", "c4_state_dtype", "c128_state_dtype"):
        kw[k] = getattr(torch, kw[k])
    return SglPool(**kw)


def _pdstate_pool(kw: dict, s: dict, name: str, unified: bool):
    return DeepSeekV4TokenToKVPool(
        **kw,
        unified_kv=unified,
        speculative_num_draft_tokens=s["draft_tokens"] if s["speculative"] else None,
        online_c128=ONLINE_C128,
        online_c128_mtp=ONLINE_C128_MTP,
        name=name,
        **UPSTREAM,
    )


def _wire(how: str, target, draft, alloc, make_own_allocator) -> None:
    """Give ``draft`` a mapping as ``how`` says (``alloc`` already registered the target's)."""
    mapping = alloc.full_to_swa_index_mapping
    if draft is None or how == "missing":
        return
    if how == "shared":
        draft.register_mapping(mapping)
    elif how == "own":
        make_own_allocator(draft)
    elif how == "clone":
        draft.register_mapping(mapping.clone())
    elif how == "view":
        draft.register_mapping(mapping[:])
    else:
        raise AssertionError(f"unknown wiring {how}")


def build_pair(s: dict, real: bool):
    """``(target, draft, allocator)``, real SGLang objects or pdstate's, from the same arguments."""
    a, page = s["allocator"], s["pool"]["page_size"]
    has_draft = s["draft"] != "none"
    if real:

        def pool(kw: dict, unified: bool, name: str):
            with boot.unified_kv(unified):
                return _real_pool(kw)

        def allocator(kvcache):
            return sglang_allocator(a, page, getattr(torch, s["pool"]["dtype"]), kvcache)
    else:

        def pool(kw: dict, unified: bool, name: str):
            return _pdstate_pool(kw, s, name, unified)

        def allocator(kvcache):
            return SWATokenToKVPoolAllocator(a["size_full"], a["size_swa"], page, kvcache=kvcache)

    target = pool(_kwargs(s, draft=False), s["unified"], "target")
    draft = pool(_kwargs(s, draft=True), s["draft_unified"], "draft") if has_draft else None
    alloc = allocator(target)
    _wire(s["draft"], target, draft, alloc, allocator)
    if real:  # map two pages as the scheduler would (alloc_extend needs a triton kernel)
        locs = alloc.full_attn_allocator.alloc(2 * page)
        alloc.set_full_to_swa_mapping(locs, alloc.swa_attn_allocator.alloc(2 * page))
    else:
        locs = alloc.alloc(2 * page)
    return target, draft, alloc, locs


def request_indices(pool, alloc, locs) -> dict:
    """Per-request state indices: pdstate's functions over the view vs SGLang's own functions."""
    v, page = pool_view(pool), pool.page_size
    out: dict = {"c128": [], "swa": []}
    if v.c128_ring_size is not None:
        for slot in (0, 1, 3):
            for seq_len in (0, 1, 127, 128, 129, 300, 511, 1000):
                mine = indices.c128_state_indices(slot, seq_len, v.online_c128, v.c128_ring_size)
                theirs = sglang_c128_indices(pool, slot, seq_len)
                out["c128"].append([slot, seq_len, mine.tolist(), [int(x) for x in theirs]])
    if not v.unified_kv:
        for seq_len in (1, 100, 256, 300, 512):
            mine = indices.swa_page_indices(locs, seq_len, v.sliding_window, page, v.mapping)
            start = indices.swa_window_start(seq_len, v.sliding_window, page)
            theirs = kv_to_page_indices(alloc.translate_loc_from_full_to_swa(locs[start:seq_len]), page)
            out["swa"].append([seq_len, mine.tolist(), theirs.tolist()])
    return out


def run_scenario(s: dict) -> dict:
    boot.publish(boot.server_args(speculative=s["speculative"], draft_tokens=s["draft_tokens"]))
    out: dict = {"name": s["name"]}
    real_t, real_d, real_alloc, real_locs = build_pair(s, real=True)
    own_t, own_d, _, _ = build_pair(s, real=False)
    out["classes"] = {
        "target": type(real_t).__module__ + "." + type(real_t).__qualname__,
        "is_dsv4": [is_dsv4_pool(real_t), real_d is None or is_dsv4_pool(real_d)],
        "real_unified": bool(real_t._unified_kv),
    }
    out["report_real"] = _outcome(lambda: build_report(real_t, real_d)[0].model_dump(mode="json"))
    out["report_own"] = _outcome(lambda: build_report(own_t, own_d)[0].model_dump(mode="json"))
    out["pdstate_on_real"] = _outcome(lambda: _kvargs_summary(setup_state_kv_args(KVArgs(), real_t, real_d)))
    out["pdstate_on_own"] = _outcome(lambda: _kvargs_summary(setup_state_kv_args(KVArgs(), own_t, own_d)))

    def sglang_fill():
        kv = SglKVArgs()
        sgl_setup_state_kv_args(kv, real_t, real_d)
        return _kvargs_summary(kv)

    out["sglang_on_real"] = _outcome(sglang_fill)

    def main_kv():
        mine = fill_kv_args(real_t, real_d, check=False)
        return {
            "real": [list(x) for x in real_t.get_contiguous_buf_infos()],
            "pdstate_on_real": [mine.kv_data_ptrs, mine.kv_data_lens, mine.kv_item_lens],
            "own": [list(x) for x in own_t.get_contiguous_buf_infos()[1:]],
        }

    out["main_kv"] = _outcome(main_kv)
    if s["expect"] == "ok":
        out["indices"] = _outcome(lambda: request_indices(real_t, real_alloc, real_locs))
    v = pool_view(real_t)
    out["view"] = {
        "c4_ring_size": v.c4_ring_size,
        "c128_ring_size": v.c128_ring_size,
        "online_c128": v.online_c128,
        "stage": list(v.stage),
        "own_c4_ring_size": own_t.c4_ring_size,
        "own_c128_ring_size": own_t.c128_ring_size,
    }
    return out


def main() -> None:
    scenarios = json.load(sys.stdin)
    results = {"sglang": RELEASE, "online_c128": ONLINE_C128, "online_c128_mtp": ONLINE_C128_MTP, "scenarios": {}}
    for s in scenarios:
        try:
            results["scenarios"][s["name"]] = run_scenario(s)
        except Exception:  # a broken scenario is reported, the others still run
            results["scenarios"][s["name"]] = {"name": s["name"], "crash": traceback.format_exc()}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
