"""Child process of the harness: pdstate's SGLang backend driven in SGLang's call order, in one process.

Either release (0.5.19 or 0.5.23): the child follows the SGLang it imported (``boot.release()``):
0.5.23's senders are made with keywords only, its request-state indices come from the pool.

Both sides live here: real SGLang DSV4 pools (target + NextN draft, one allocator each), ``KVArgs``
filled by SGLang's own functions (as ``_init_kv_manager`` fills them), SGLang's bootstrap server,
and pdstate's manager, sender and receiver classes from ``get_kv_class`` over the ``loopback``
engine (``PDSTATE_TRANSFER__ENGINE=loopback``, set by the parent). Reads the case names as a JSON
list on stdin; prints one JSON object on the last line of stdout. Run only by ``runner.run_probe``:
importing ``booted`` changes process-wide state.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys
import time
import traceback

from pdstate.devtools.sglang_pair import booted  # noqa: F401  (first: the GPU-only stubs and the bare sglang package)

# isort: split
import numpy as np
import torch

from pdstate.agent.common import end_io_thread_as_a_crash
from pdstate.devtools.sglang_pair import boot

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import probe
import scenarios

from tests.support.images import SENTINEL

ROOM_OK, ROOM_BAD = 1001, 1002
SEQ_LEN = 300  # two 256-token pages: two chunks, state with the second
DEADLINE_S = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT = _free_port()
_SCOPES: list = []


def _args(speculative: bool):
    return boot.server_args(
        speculative=speculative,
        host="127.0.0.1",
        disaggregation_bootstrap_port=PORT,
        disaggregation_transfer_backend="pdstate",
    )


NEW_API = boot.row().keyword_api  # 0.5.23's internals (``releases``)


def _context() -> None:
    """The parallel context a scheduler rank has (tp = cp = dp = pp = 1), without torch.distributed."""
    if not _SCOPES:
        boot.parallel_context()
        _SCOPES.append(True)


def _wider(**values) -> dict:
    """Parallel overrides for a wider attention TP / PP (0.5.23 validates the whole topology)."""
    if NEW_API:
        width = values.get("attn_tp_size", 1) * values.get("attn_cp_size", 1)
        if width > 1:  # the whole TP group is attention TP (x CP) here; this rank's place in it
            rank = values.get("attn_cp_rank", 0) * values.get("attn_tp_size", 1) + values.get("attn_tp_rank", 0)
            values.update(tp_size=width, moe_tp_size=width, tp_rank=rank)
        if "pp_size" in values:
            values.setdefault("pp_group", _StagesGroup(values["pp_size"]))
    return values


class _StagesGroup:
    """The PP group of stages built one after another in this process: what 0.5.23's prefill
    manager does with it for pp > 1 (its consensus store broadcasts rank 0's address)."""

    def __init__(self, size: int) -> None:
        self.world_size, self.rank_in_group = size, 0
        self.is_first_rank, self.is_last_rank = True, size == 1
        self._sent = None

    def broadcast_object(self, obj, src: int = 0):
        if obj is not None:
            self._sent = obj
        return self._sent


def new_sender(cls, mgr, addr: str, room: int, rank: int = 0):
    """A sender as the running release's prefill makes it."""
    if NEW_API:
        return cls(mgr=mgr, bootstrap_addr=addr, bootstrap_room=room, req_has_disagg_prefill_dp_rank=False)
    return cls(mgr=mgr, bootstrap_addr=addr, bootstrap_room=room, dest_tp_ranks=[rank], pp_rank=0)


def build_side(speculative: bool, shift_pages: int, own_draft_mapping: bool = False, unified: bool = False):
    """Real pools, SGLang-filled ``KVArgs`` and the request's indices, as one scheduler has them."""
    from sglang.srt.disaggregation.base.conn import KVArgs, StateType
    from sglang.srt.disaggregation.utils import build_kv_layer_ids, setup_state_kv_args
    from sglang.srt.mem_cache.common import kv_to_page_indices

    boot.publish(_args(speculative))
    s = scenarios.scenario("side", speculative=speculative, unified=unified)
    with boot.unified_kv(unified):
        target = probe._real_pool(probe._kwargs(s, draft=False))
        draft = probe._real_pool(probe._kwargs(s, draft=True))
    page = target.page_size
    a = s["allocator"]
    alloc = probe.sglang_allocator(a, page, target.dtype, target)
    draft.register_mapping(alloc.full_to_swa_index_mapping)  # upstream's wiring: one mapping object
    if shift_pages:  # the decode's pages are not the prefill's
        alloc.full_attn_allocator.alloc(shift_pages * page)
    locs = alloc.full_attn_allocator.alloc(2 * page)
    swa_locs = alloc.swa_attn_allocator.alloc(2 * page)
    if shift_pages:
        swa_locs = torch.cat([swa_locs[page:], swa_locs[:page]])
    alloc.set_full_to_swa_mapping(locs, swa_locs)
    meta = boot.metadata_buffers(8, 16, torch.float32)
    boot.publish(_args(True))

    kv = KVArgs()
    kv.engine_rank, kv.pp_rank, kv.system_dp_rank = 0, 0, 0
    kv.kv_cache_dtype_str = str(target.dtype).removeprefix("torch.")
    kv.prefill_start_layer, kv.prefill_end_layer = 0, None
    ptrs, lens, items = target.get_contiguous_buf_infos()
    d_ptrs, d_lens, d_items = draft.get_contiguous_buf_infos()
    kv.kv_data_ptrs, kv.kv_data_lens, kv.kv_item_lens = ptrs + d_ptrs, lens + d_lens, items + d_items
    if NEW_API:  # what 0.5.23's schedulers add
        from sglang.srt.disaggregation.utils import get_pd_kv_layout

        kv.kv_layout, kv.num_draft_entries = get_pd_kv_layout(target), len(d_ptrs)
    kv.kv_layer_ids = build_kv_layer_ids(
        token_to_kv_pool=target, draft_token_to_kv_pool=draft, num_draft_entries=len(d_ptrs), num_hidden_layers=3
    )
    kv.page_size = page
    kv.aux_data_ptrs, kv.aux_data_lens, kv.aux_item_lens = meta.get_buf_infos()
    kv.ib_device, kv.gpu_id = None, 0
    setup_state_kv_args(kv, target, draft, 3, req_to_token_pool=getattr(alloc, "req_to_token_pool", None))
    kv.mla_compression_ratios = list(target.compression_ratios)
    if own_draft_mapping:  # rewired after SGLang filled the KVArgs: the pool pair now has the seed error
        draft.register_mapping(alloc.full_to_swa_index_mapping.clone())

    slot = 1 + shift_pages
    window_start = (max(0, SEQ_LEN - target.sliding_window) // page) * page
    swa = kv_to_page_indices(alloc.translate_loc_from_full_to_swa(locs[window_start:SEQ_LEN]), page)

    def ring_rows():  # the unified-KV SWA ring: slot * stride + position % stride, the window's positions
        stride = target.unified_swa_ring_size
        positions = np.arange(max(0, SEQ_LEN - target.unified_swa_window), SEQ_LEN, dtype=np.int64)
        return slot * stride + positions % stride

    payloads = {
        StateType.SWA: lambda: swa,
        StateType.SWA_RING: ring_rows,
        boot.state_type("C128_STATE"): lambda: probe.sglang_c128_indices(target, slot, SEQ_LEN),
    }
    state = [np.asarray(payloads[t](), dtype=np.int64) for t in kv.state_types]
    pages = np.asarray(kv_to_page_indices(locs[:SEQ_LEN], page), dtype=np.int64)
    return dict(pools=(target, draft, alloc, meta), kv=kv, pages=pages, state=state, aux=slot)


def _view(ptr: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(int(ptr)))


def _buffers(kv):
    """``(channel, ptrs, lens, items)``: main KV, each state component, aux."""
    out = [("main", kv.kv_data_ptrs, kv.kv_data_lens, kv.kv_item_lens)]
    for t, p, n, i in zip(kv.state_types, kv.state_data_ptrs, kv.state_data_lens, kv.state_item_lens):
        out.append((str(getattr(t, "value", t)), p, n, i))
    out.append(("aux", kv.aux_data_ptrs, kv.aux_data_lens, kv.aux_item_lens))
    return out


def fill(side: dict, seed: int | None) -> None:
    rng = np.random.default_rng(seed)
    for _, ptrs, lens, _ in _buffers(side["kv"]):
        for p, n in zip(ptrs, lens):
            v = _view(p, n)
            v[:] = SENTINEL if seed is None else rng.integers(0, 256, n, dtype=np.uint8)


def expected(src: dict, dst: dict) -> list[np.ndarray]:
    """Every destination buffer as it must be: sentinels, plus each moved item where it lands."""
    lists = [(src["pages"], dst["pages"])] + list(zip(src["state"], dst["state"])) + [([src["aux"]], [dst["aux"]])]
    out = []
    for (_, sp, _, items), (_, _, dl, _), (si, di) in zip(_buffers(src["kv"]), _buffers(dst["kv"]), lists):
        for s_ptr, d_len, item in zip(sp, dl, items):
            want = np.full(d_len, SENTINEL, dtype=np.uint8)
            for a, b in zip(si, di):
                want[b * item : (b + 1) * item] = _view(s_ptr + a * item, item)
            out.append(want)
    return out


def landed(dst: dict) -> list[np.ndarray]:
    return [_view(p, n).copy() for _, ptrs, lens, _ in _buffers(dst["kv"]) for p, n in zip(ptrs, lens)]


def _wait(fn, what: str):
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        v = fn()
        if v is not None:
            return v
        time.sleep(0.002)
    raise TimeoutError(f"{what} within {DEADLINE_S} s")


def _exc(obj) -> dict:
    try:
        obj.failure_exception()
    except Exception as exc:  # the point: what SGLang's scheduler would log
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None, "message": None}


class Harness:
    def __init__(self) -> None:
        import pdstate.integrations.sglang as integration

        integration.install()  # before get_kv_class is imported by name
        from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class
        from sglang.srt.runtime_context import get_server_args

        backend = TransferBackend("pdstate")
        self.cls = {k: get_kv_class(backend, getattr(KVClassType, k)) for k in ("MANAGER", "SENDER", "RECEIVER")}
        self.mode = DisaggregationMode
        self.prefill = build_side(True, 0)
        self.decode = build_side(True, 1)
        self.bad = build_side(False, 1)
        self.seed = build_side(True, 1, own_draft_mapping=True)
        _context()  # after the last publish of the server args
        self.server = get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER)(host="127.0.0.1", port=PORT)
        args = get_server_args()
        self.pm = self.cls["MANAGER"](self.prefill["kv"], DisaggregationMode.PREFILL, args, True)
        self.dm = self.cls["MANAGER"](self.decode["kv"], DisaggregationMode.DECODE, args, True)
        self.bm = self.cls["MANAGER"](self.bad["kv"], DisaggregationMode.DECODE, args, True)
        self.sm = self.cls["MANAGER"](self.seed["kv"], DisaggregationMode.DECODE, args, True)
        self.addr = f"127.0.0.1:{PORT}"

    def pair(self, mgr, dst: dict, room: int, sender_late: bool = False):
        """SGLang's order: both made, decode resolves + inits, decode publishes, prefill inits + sends.
        ``sender_late``: the prefill makes its sender only once the decode is past bootstrapping."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        src = self.prefill

        def make_sender():
            return new_sender(self.cls["SENDER"], self.pm, self.addr, room)

        sender = None if sender_late else make_sender()
        recv = self.cls["RECEIVER"](mgr=mgr, bootstrap_addr=self.addr, bootstrap_room=room)
        trace = {"sender_first": None if sender is None else int(sender.poll()), "receiver_first": int(recv.poll())}
        _wait(lambda: mgr.try_ensure_parallel_info(self.addr) or None, "prefill parallel info")
        recv.init(0)
        t0 = time.monotonic()
        trace["receiver_bootstrapped"] = int(
            _wait(lambda: p if (p := recv.poll()) != KVPoll.Bootstrapping else None, "decode bootstrap")
        )
        if trace["receiver_bootstrapped"] == KVPoll.WaitingForInput:
            recv.send_metadata(dst["pages"].astype(np.int32), dst["aux"], [s.astype(np.int32) for s in dst["state"]], 0)
        if sender is None:
            time.sleep(0.05)  # the refusal reaches the prefill before its sender exists
            sender = make_sender()
        trace["sender_bootstrapped"] = int(
            _wait(lambda: p if (p := sender.poll()) != KVPoll.Bootstrapping else None, "prefill bootstrap")
        )
        if trace["sender_bootstrapped"] == KVPoll.WaitingForInput:
            sender.init(len(src["pages"]), src["aux"])
            sender.send(src["pages"][:1].astype(np.int32), None)
            trace["after_first_chunk"] = int(sender.poll())
            sender.send(src["pages"][1:].astype(np.int32), [s.astype(np.int32) for s in src["state"]])
        done = (KVPoll.Success, KVPoll.Failed)
        trace["sender"] = int(_wait(lambda: p if (p := sender.poll()) in done else None, "prefill end"))
        trace["receiver"] = int(_wait(lambda: p if (p := recv.poll()) in done else None, "decode end"))
        trace["both_ended_s"] = round(time.monotonic() - t0, 4)
        trace["sender_error"], trace["receiver_error"] = _exc(sender), _exc(recv)
        trace["metric"] = {k: v for k, v in vars(sender.get_transfer_metric()).items()}
        return trace


def case_ok(h: Harness) -> dict:
    import inspect

    from sglang.srt.disaggregation.common import conn as common

    fill(h.prefill, seed=7)
    fill(h.decode, seed=None)
    sent = []  # SGLang's own ZMQ messages to a prefill rank (0.5.23's receiver registration goes there)
    base = common.CommonKVReceiver
    saved = {
        n: base.__dict__[n] for n in ("_send_bootstrap_message", "_connect_to_bootstrap_server") if n in base.__dict__
    }
    for name in saved:
        setattr(base, name, lambda *a, _n=name, **kw: sent.append(_n))
    try:
        trace = h.pair(h.dm, h.decode, ROOM_OK)
    finally:
        for name, fn in saved.items():
            setattr(base, name, fn)
    trace["sglang_zmq_calls"] = sent
    trace["sender_params"] = list(inspect.signature(h.cls["SENDER"].__init__).parameters)[1:]
    want, got = expected(h.prefill, h.decode), landed(h.decode)
    trace["buffers"] = len(want)
    trace["bytes_differing"] = int(sum(int((w != g).sum()) for w, g in zip(want, got)))
    trace["bytes_moved"] = int(sum(int((w != SENTINEL).sum()) for w in want))
    trace["channels"] = [name for name, *_ in _buffers(h.decode["kv"])]
    return trace


def case_early(h: Harness) -> dict:
    """A receiver whose prefill accepted its agent already (a first request shook hands) answers
    WaitingForInput right after ``init``, while the decode agent's thread, held here, has not
    made its agent receiver yet; the destination named then follows that step, and the request
    ends in Success with every byte where SGLang put it."""
    import threading

    from sglang.srt.disaggregation.base.conn import KVPoll

    first = h.pair(h.dm, h.decode, 8001)  # the handshake (and a request over it)
    fill(h.prefill, seed=11)
    fill(h.decode, seed=None)
    src, dst, room = h.prefill, h.decode, 8002
    sender = new_sender(h.cls["SENDER"], h.pm, h.addr, room)
    recv = h.cls["RECEIVER"](mgr=h.dm, bootstrap_addr=h.addr, bootstrap_room=room)
    held, release = threading.Event(), threading.Event()
    h.dm.agent.post(lambda: (held.set(), release.wait(DEADLINE_S)))
    trace = {"first": [first["sender"], first["receiver"]]}
    try:
        _wait(lambda: held.is_set() or None, "the decode agent's thread held")
        recv.init(0)
        trace["after_init"] = int(recv.poll())
        recv.send_metadata(dst["pages"].astype(np.int32), dst["aux"], [s.astype(np.int32) for s in dst["state"]], 0)
        trace["after_metadata"] = int(recv.poll())
    finally:
        release.set()
    _wait(lambda: sender.poll() == KVPoll.WaitingForInput or None, "prefill bootstrap")
    sender.init(len(src["pages"]), src["aux"])
    sender.send(src["pages"].astype(np.int32), [s.astype(np.int32) for s in src["state"]])
    done = (KVPoll.Success, KVPoll.Failed)
    trace["sender"] = int(_wait(lambda: p if (p := sender.poll()) in done else None, "prefill end"))
    trace["receiver"] = int(_wait(lambda: p if (p := recv.poll()) in done else None, "decode end"))
    trace["sender_error"], trace["receiver_error"] = _exc(sender), _exc(recv)
    want, got = expected(src, dst), landed(dst)
    trace["bytes_differing"] = int(sum(int((w != g).sum()) for w, g in zip(want, got)))
    return trace


def _reset_items(side: dict, lists: list) -> None:
    """Sentinels back into the items ``lists`` names (main-KV pages, each state component, aux)."""
    for (_, ptrs, lens, items), idx in zip(_buffers(side["kv"]), lists):
        for ptr, n, item in zip(ptrs, lens, items):
            view = _view(ptr, n)
            for i in idx:
                view[int(i) * item : (int(i) + 1) * item] = SENTINEL


def case_prefix(h: Harness) -> dict:
    """SGLang 0.5.23's decode radix cache: the decode holds the request's first page already
    (``decode_prefix_len=256``) and names only the pages past it, and the SWA window from there
    (as its ``_pre_alloc`` / ``_swa_payload`` compute them); the prefill's scheduler sends every page
    as with no prefix. First a full transfer; then the suffix's items are reset and the room is sent
    again with the prefix: the decode ends byte-equal to the full transfer, with fewer bytes moved."""
    from sglang.srt.disaggregation.base.conn import StateType

    fill(h.prefill, seed=17)
    fill(h.decode, seed=None)
    full = h.pair(h.dm, h.decode, 4101)
    full_image = landed(h.decode)
    page = h.decode["kv"].page_size
    prefix = page
    kv = h.decode["kv"]
    swa_window_first = (max(prefix, SEQ_LEN - h.decode["pools"][0].sliding_window) // page) * page
    whole_window_first = (max(0, SEQ_LEN - h.decode["pools"][0].sliding_window) // page) * page
    drop_swa = (swa_window_first - whole_window_first) // page
    state = [lst[drop_swa:] if t == StateType.SWA else lst for t, lst in zip(kv.state_types, h.decode["state"])]
    suffix = dict(h.decode, pages=h.decode["pages"][prefix // page :], state=state)
    _reset_items(h.decode, [suffix["pages"], *state, [suffix["aux"]]])
    reset_image = landed(h.decode)
    again = h.pair(h.dm, suffix, 4102)
    got = landed(h.decode)
    return {
        "full": {k: full[k] for k in ("sender", "receiver")},
        "prefix": {k: again[k] for k in ("sender", "receiver", "receiver_error", "sender_error")},
        "bytes_full": full["metric"]["transfer_total_bytes"],
        "bytes_prefix": again["metric"]["transfer_total_bytes"],
        "pages_full": len(h.decode["pages"]),
        "pages_prefix": len(suffix["pages"]),
        "swa_pages_dropped": drop_swa,
        "reset_bytes": int(sum(int((a != b).sum()) for a, b in zip(full_image, reset_image))),
        "bytes_differing_from_full": int(sum(int((a != b).sum()) for a, b in zip(full_image, got))),
    }


def case_prefill_complete(h: Harness) -> dict:
    """0.5.23's ``--disaggregation-decode-allocation-policy prefill_complete``: SGLang's own manager
    refuses DSV4's state components at start, for every backend, with one line; the role switch
    is refused by SGLang's own check from the class attribute."""
    from sglang.srt.runtime_context import get_disagg, get_server_args

    out = {"supports_role_switch": h.cls["MANAGER"].supports_role_switch}
    if not NEW_API:
        return {**out, "policy": None}
    with get_disagg().override(disaggregation_decode_allocation_policy="prefill_complete"):
        try:
            mgr = h.cls["MANAGER"](h.decode["kv"], h.mode.DECODE, get_server_args(), True)
        except Exception as exc:  # the point: the refusal at start
            return {**out, "policy": "prefill_complete", "error": {"type": type(exc).__name__, "message": str(exc)}}
    mgr.close()
    return {**out, "policy": "prefill_complete", "error": None}


def case_ok_unified(h: Harness) -> dict:
    """Unified-KV pools on both sides (the SWA ring components instead of SWA pages)."""
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
    from sglang.srt.runtime_context import get_disagg, get_server_args

    src, dst = build_side(True, 0, unified=True), build_side(True, 1, unified=True)
    _context()
    port = _free_port()  # a bootstrap server of its own: the prefill's rank entry is this prefill's
    get_kv_class(TransferBackend("pdstate"), KVClassType.BOOTSTRAP_SERVER)(host="127.0.0.1", port=port)
    with get_disagg().override(disaggregation_bootstrap_port=port):
        pm = h.cls["MANAGER"](src["kv"], h.mode.PREFILL, get_server_args(), True)
    dm = h.cls["MANAGER"](dst["kv"], h.mode.DECODE, get_server_args(), True)
    saved = (h.prefill, h.pm, h.addr)
    h.prefill, h.pm, h.addr = src, pm, f"127.0.0.1:{port}"
    try:
        fill(src, seed=9)
        fill(dst, seed=None)
        trace = h.pair(dm, dst, 4001)
        want, got = expected(src, dst), landed(dst)
        trace["bytes_differing"] = int(sum(int((w != g).sum()) for w, g in zip(want, got)))
        trace["channels"] = [name for name, *_ in _buffers(dst["kv"])]
        return trace
    finally:
        (h.prefill, h.pm, h.addr) = saved
        dm.close()
        pm.close()


def case_mismatch(h: Harness) -> dict:
    fill(h.bad, seed=None)
    trace = h.pair(h.bm, h.bad, ROOM_BAD)
    trace["bytes_written"] = int(sum(int((g != SENTINEL).sum()) for g in landed(h.bad)))
    return trace


def case_mismatch_sender_late(h: Harness) -> dict:
    fill(h.bad, seed=None)
    trace = h.pair(h.bm, h.bad, ROOM_BAD + 1, sender_late=True)
    trace["bytes_written"] = int(sum(int((g != SENTINEL).sum()) for g in landed(h.bad)))
    return trace


def case_seed(h: Harness) -> dict:
    fill(h.seed, seed=None)
    trace = h.pair(h.sm, h.seed, ROOM_BAD + 2)
    trace["bytes_written"] = int(sum(int((g != SENTINEL).sum()) for g in landed(h.seed)))
    return trace


def _two_prefill_ranks(h: Harness, rank_attr: str, parallel) -> tuple:
    """Two prefill ranks behind one bootstrap server (each named by ``rank_attr`` on its kv args,
    built under ``parallel(rank)``) and a decode manager: ``(ranks, managers, decode manager, addr)``."""
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
    from sglang.srt.runtime_context import get_disagg, get_parallel, get_server_args

    port = _free_port()
    ranks = [build_side(True, 0), build_side(True, 0)]
    _context()
    get_kv_class(TransferBackend("pdstate"), KVClassType.BOOTSTRAP_SERVER)(host="127.0.0.1", port=port)
    managers = []
    with get_disagg().override(disaggregation_bootstrap_port=port):
        for r, side in enumerate(ranks):
            setattr(side["kv"], rank_attr, r)
            with get_parallel().override(**parallel(r)):
                managers.append(h.cls["MANAGER"](side["kv"], h.mode.PREFILL, get_server_args(), True))
    dm = h.cls["MANAGER"](h.decode["kv"], h.mode.DECODE, get_server_args(), True)
    return ranks, managers, dm, f"127.0.0.1:{port}"


def case_tp_dummy(h: Harness) -> dict:
    """A prefill of attention TP 2 feeding a decode of TP 1 (SGLang's MLA mapping): prefill rank 0
    sends, rank 1 completes as a dummy and moves nothing."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    room = 2001
    ranks, managers, dm, addr = _two_prefill_ranks(h, "engine_rank", lambda r: _wider(attn_tp_size=2, attn_tp_rank=r))
    try:
        for seed, side in enumerate(ranks, start=11):
            fill(side, seed=seed)
        fill(h.decode, seed=None)
        senders = [new_sender(h.cls["SENDER"], m, addr, room, r) for r, m in enumerate(managers)]
        recv = h.cls["RECEIVER"](mgr=dm, bootstrap_addr=addr, bootstrap_room=room)
        _wait(lambda: dm.try_ensure_parallel_info(addr) or None, "prefill parallel info")
        recv.init(0)
        trace = {"dummies": [bool(i.get("is_dummy")) for i in recv.bootstrap_infos]}
        trace["receiver_bootstrapped"] = int(
            _wait(lambda: p if (p := recv.poll()) != KVPoll.Bootstrapping else None, "decode bootstrap")
        )
        dst = h.decode
        recv.send_metadata(dst["pages"].astype(np.int32), dst["aux"], [x.astype(np.int32) for x in dst["state"]], 0)
        for sender, side in zip(senders, ranks):
            _wait(lambda s=sender: s.poll() == KVPoll.WaitingForInput or None, "prefill bootstrap")
            sender.init(len(side["pages"]), side["aux"])
            sender.send(side["pages"][:1].astype(np.int32), None)
            sender.send(side["pages"][1:].astype(np.int32), [x.astype(np.int32) for x in side["state"]])
        done = (KVPoll.Success, KVPoll.Failed)
        trace["senders"] = [
            int(_wait(lambda s=s: p if (p := s.poll()) in done else None, "prefill end")) for s in senders
        ]
        trace["receiver"] = int(_wait(lambda: p if (p := recv.poll()) in done else None, "decode end"))
        trace["receiver_error"] = _exc(recv)
        want, got = expected(ranks[0], dst), landed(dst)
        trace["bytes_differing"] = int(sum(int((w != g).sum()) for w, g in zip(want, got)))
        trace["sent_bytes"] = [int(s.get_transfer_metric().transfer_total_bytes or 0) for s in senders]
        return trace
    finally:
        for m in (dm, *managers):
            m.close()


def case_prefill_dp(h: Harness) -> dict:
    """A prefill with DP attention (two DP ranks of attention TP 1, one bootstrap server) feeding a
    decode of DP 1: the room's prefill DP rank (here 1, as a router names it) picks the prefill
    rank through SGLang's own ``/route``; only that rank's bytes land."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    if not NEW_API:  # 0.5.19 reads the DP width from process globals set once per process here
        return {"skipped": "0.5.19"}
    room = 2101
    # 0.5.23 validates the whole topology: DP 2 x attention TP 1 is a TP group of 2
    ranks, managers, dm, addr = _two_prefill_ranks(
        h,
        "system_dp_rank",
        lambda r: dict(attn_dp_size=2, attn_dp_rank=r, dp_size=2, dp_rank=r, tp_size=2, tp_rank=r, moe_tp_size=2),
    )
    try:
        for seed, side in enumerate(ranks, start=21):
            fill(side, seed=seed)
        fill(h.decode, seed=None)
        sender = new_sender(h.cls["SENDER"], managers[1], addr, room)
        recv = h.cls["RECEIVER"](mgr=dm, bootstrap_addr=addr, bootstrap_room=room)
        _wait(lambda: dm.try_ensure_parallel_info(addr) or None, "prefill parallel info")
        recv.init(1)
        trace = {
            "agents": [m.agent_port for m in managers],
            "routed": [int(i["rank_port"]) for i in recv.bootstrap_infos],
        }
        trace["receiver_bootstrapped"] = int(
            _wait(lambda: p if (p := recv.poll()) != KVPoll.Bootstrapping else None, "decode bootstrap")
        )
        dst, src = h.decode, ranks[1]
        recv.send_metadata(dst["pages"].astype(np.int32), dst["aux"], [x.astype(np.int32) for x in dst["state"]], 0)
        _wait(lambda: sender.poll() == KVPoll.WaitingForInput or None, "prefill bootstrap")
        sender.init(len(src["pages"]), src["aux"])
        sender.send(src["pages"][:1].astype(np.int32), None)
        sender.send(src["pages"][1:].astype(np.int32), [x.astype(np.int32) for x in src["state"]])
        done = (KVPoll.Success, KVPoll.Failed)
        trace["sender"] = int(_wait(lambda: p if (p := sender.poll()) in done else None, "prefill end"))
        trace["receiver"] = int(_wait(lambda: p if (p := recv.poll()) in done else None, "decode end"))
        trace["receiver_error"] = _exc(recv)
        want, got = expected(src, dst), landed(dst)
        trace["bytes_differing"] = int(sum(int((w != g).sum()) for w, g in zip(want, got)))
        return trace
    finally:
        for m in (dm, *managers):
            m.close()


def case_decode_tp_wider(h: Harness) -> dict:
    """A decode of attention TP 2 facing the prefill of TP 1: SGLang maps both decode ranks to
    prefill rank 0 (``required_dst_info_num`` 2); each asks under a room of its own."""
    from sglang.srt.runtime_context import get_parallel, get_server_args

    out: dict = {"receivers": [], "rooms": []}
    for rank in (0, 1):
        h.decode["kv"].engine_rank = rank
        with get_parallel().override(**_wider(attn_tp_size=2, attn_tp_rank=rank)):
            dm = h.cls["MANAGER"](h.decode["kv"], h.mode.DECODE, get_server_args(), True)
        try:
            recv = h.cls["RECEIVER"](mgr=dm, bootstrap_addr=h.addr, bootstrap_room=3001)
            _wait(lambda dm=dm: dm.try_ensure_parallel_info(h.addr) or None, "prefill parallel info")
            recv.init(0)
            out["receivers"].append(int(recv.poll()))
            out["rooms"].append(recv.agent_rooms)
            out["required_dst_info_num"] = recv.required_dst_info_num
            recv.abort()
        finally:
            dm.close()
    h.decode["kv"].engine_rank = 0
    return out


def _refused_at_start(h: Harness, side: str, **widths) -> dict:
    """The manager of ``side`` ("prefill" / "decode") built under ``widths``: the error it stops with."""
    from sglang.srt.runtime_context import get_parallel, get_server_args

    mode = h.mode.PREFILL if side == "prefill" else h.mode.DECODE
    with get_parallel().override(**_wider(**widths)):
        try:
            h.cls["MANAGER"](getattr(h, side)["kv"], mode, get_server_args(), True)
        except ValueError as exc:
            return {"error": str(exc)}
    return {"error": None}


def case_pp_refused(h: Harness) -> dict:
    """What stays refused of pipeline parallelism stops the manager at construction, saying so: a
    prefill stage with a draft model (these sides have one), and a decode of two stages."""
    return {
        "prefill_with_draft": _refused_at_start(h, "prefill", pp_size=2)["error"],
        "decode": _refused_at_start(h, "decode", pp_size=2)["error"],
    }


def _refused_under(h: Harness, env: dict[str, str]) -> dict:
    """A prefill rank's manager built under the environment ``env`` (restored after): the error it
    stops with, as ``Type: message`` (``refused``; None when it started)."""
    from sglang.srt.runtime_context import get_server_args

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        h.cls["MANAGER"](h.prefill["kv"], h.mode.PREFILL, get_server_args(), True).close()
    except Exception as exc:
        return {"refused": f"{type(exc).__name__}: {exc}"}
    finally:
        for k, v in saved.items():
            os.environ.pop(k)
            if v is not None:
                os.environ[k] = v
    return {"refused": None}


def case_auth_refused(h: Harness) -> dict:
    """A prefill rank SGLang advertises beyond loopback (``SGLANG_HOST_IP``), with no token and no
    opt-out: its manager stops at construction, with one line."""
    return _refused_under(h, {"SGLANG_HOST_IP": "10.1.2.3"})


def case_rdma_fallback_refused(h: Harness) -> dict:
    """A prefill rank configured for Mooncake over RDMA on a host without an RDMA device (Mooncake
    then runs on TCP by itself): its manager stops at construction, saying why."""
    return _refused_under(
        h,
        {
            "PDSTATE_TRANSFER__ENGINE": "mooncake",
            "PDSTATE_TRANSFER__MOONCAKE__PROTOCOL": "rdma",
            "PDSTATE_TRANSFER__MOONCAKE__ALLOW_OPEN_LISTENER": "true",
        },
    )


def case_io_thread_ends(h: Harness) -> dict:
    """The prefill agent's I/O thread ends while a request is in bootstrap: the prefill's request
    fails at once saying so, and the decode's when that prefill stops answering heartbeats."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
    from sglang.srt.runtime_context import get_disagg, get_server_args

    src, dst = build_side(True, 0), build_side(True, 1)
    _context()
    port = _free_port()
    get_kv_class(TransferBackend("pdstate"), KVClassType.BOOTSTRAP_SERVER)(host="127.0.0.1", port=port)
    os.environ.update(PDSTATE_CONTROL__HEARTBEAT_INTERVAL_S="0.1", PDSTATE_CONTROL__PEER_TIMEOUT_S="0.5")
    try:
        with get_disagg().override(disaggregation_bootstrap_port=port):
            pm = h.cls["MANAGER"](src["kv"], h.mode.PREFILL, get_server_args(), True)
        dm = h.cls["MANAGER"](dst["kv"], h.mode.DECODE, get_server_args(), True)
    finally:
        for k in ("PDSTATE_CONTROL__HEARTBEAT_INTERVAL_S", "PDSTATE_CONTROL__PEER_TIMEOUT_S"):
            os.environ.pop(k)
    addr = f"127.0.0.1:{port}"
    try:
        sender = new_sender(h.cls["SENDER"], pm, addr, 6001)
        recv = h.cls["RECEIVER"](mgr=dm, bootstrap_addr=addr, bootstrap_room=6001)
        _wait(lambda: dm.try_ensure_parallel_info(addr) or None, "prefill parallel info")
        recv.init(0)
        _wait(lambda: recv.poll() == KVPoll.WaitingForInput or None, "decode bootstrap")
        assert end_io_thread_as_a_crash(pm.agent), "the I/O thread did not end"
        assert not pm.agent.alive and not pm.agent.closed
        trace = {"sender": int(sender.poll()), "sender_error": _exc(sender)}
        trace["receiver"] = int(_wait(lambda: p if (p := recv.poll()) == KVPoll.Failed else None, "decode failure"))
        trace["receiver_error"] = _exc(recv)
        return trace
    finally:
        dm.close()
        pm.close()  # its thread is gone: close() still closes its sockets and engine


def case_cp_refused(h: Harness) -> dict:
    """Context parallelism stops the rank's manager at construction, saying so."""
    return _refused_at_start(h, "decode", attn_cp_size=2)


class _Workers:
    """The server's arguments with ``tokenizer_worker_num`` 2 (0.5.23 seals its record)."""

    tokenizer_worker_num = 2

    def __init__(self, server_args):
        self.server_args = server_args

    def __getattr__(self, name):
        return getattr(self.server_args, name)


def case_tokenizer_workers(h: Harness) -> dict:
    """A prefill rank's manager on a server of 2 tokenizer workers: 0.5.19 (no
    SGLANG_HTTP_SERVER_APP_PATH) stops it at construction, saying so; 0.5.23 starts it."""
    from sglang.srt.runtime_context import get_server_args

    server_args = _Workers(get_server_args())
    out = {"tokenizer_worker_num": server_args.tokenizer_worker_num, "error": None}
    try:
        h.cls["MANAGER"](h.prefill["kv"], h.mode.PREFILL, server_args, True).close()
    except ValueError as exc:
        out["error"] = str(exc)
    return out


def case_hooks(h: Harness) -> dict:
    """What the running release's schedulers call beyond ``BaseKV*`` (0.5.23: the sender's chunking
    and prefix hooks, the receiver's abort notification and clear, the manager's teardown) runs
    without SGLang's ZMQ messages and without raising."""
    from sglang.srt.disaggregation.common import conn as common
    from sglang.srt.runtime_context import get_server_args

    out: dict = {}
    sent = []
    base = common.CommonKVReceiver
    saved = {n: base.__dict__[n] for n in ("_send_bootstrap_message", "_send_abort_notification") if n in base.__dict__}
    for name in saved:
        setattr(base, name, lambda *a, _n=name, **kw: sent.append(_n))
    try:
        sender = new_sender(h.cls["SENDER"], h.pm, h.addr, 7001)
        recv = h.cls["RECEIVER"](mgr=h.dm, bootstrap_addr=h.addr, bootstrap_room=7001)
        _wait(lambda: h.dm.try_ensure_parallel_info(h.addr) or None, "prefill parallel info")
        recv.init(0)
        for name, call in (
            ("max_transfer_tokens", lambda: sender.get_max_transfer_tokens()),
            ("decode_prefix_len", lambda: sender.pop_decode_prefix_len()),
            ("should_send", lambda: sender.should_send_kv_chunk(0, True)),
            ("mark_prefill_complete", lambda: sender.mark_prefill_complete()),
            ("ensure_abort_notified", lambda: recv.ensure_abort_notified(force_arm=True)),
            ("receiver_abort", lambda: recv.abort()),
            ("receiver_clear", lambda: recv.clear()),
            ("sender_abort", lambda: sender.abort()),
            ("sender_clear", lambda: sender.clear()),
        ):
            try:
                out[name] = {"ok": True, "value": call()}
            except AttributeError as exc:  # a hook this release does not have
                out[name] = {"ok": None, "error": str(exc)}
            except Exception as exc:
                out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        for name, fn in saved.items():
            setattr(base, name, fn)
    out["sglang_zmq_calls"] = sent
    side = build_side(True, 0)  # held: the manager finds its pools among the live objects
    mgr = h.cls["MANAGER"](side["kv"], h.mode.DECODE, get_server_args(), True)
    out["deferred_release"] = bool(getattr(mgr, "enable_deferred_decode_kv_release", False))
    out["supports_deferred"] = mgr.supports_deferred_decode_kv_release
    # the agents' own timeouts: backstops past SGLang's waiting / bootstrap timeouts (300 s by default)
    out["agent_timeouts"] = [mgr.agent.transfer_timeout_s, h.pm.agent.bootstrap_timeout_s]
    mgr.teardown()
    out["torn_down"] = mgr.agent.closed
    return out


CASES = {
    "hooks": case_hooks,
    "cp_refused": case_cp_refused,
    "tokenizer_workers": case_tokenizer_workers,
    "io_thread_ends": case_io_thread_ends,
    "pp_refused": case_pp_refused,
    "auth_refused": case_auth_refused,
    "rdma_fallback_refused": case_rdma_fallback_refused,
    "ok_unified": case_ok_unified,
    "prefix": case_prefix,
    "prefill_complete": case_prefill_complete,
    "prefill_dp": case_prefill_dp,
    "decode_tp_wider": case_decode_tp_wider,
    "tp_dummy": case_tp_dummy,
    "ok": case_ok,
    "early": case_early,
    "mismatch": case_mismatch,
    "mismatch_sender_late": case_mismatch_sender_late,
    "seed": case_seed,
}


def main() -> None:
    names = json.load(sys.stdin)
    results: dict = {}
    try:
        h = Harness()
    except Exception:
        print(json.dumps({"setup": {"ok": False, "error": traceback.format_exc()}}))
        return
    for name in names:
        try:
            results[name] = {"ok": True, **CASES[name](h)}
        except Exception:
            results[name] = {"ok": False, "error": traceback.format_exc()}
    for m in (h.sm, h.bm, h.dm, h.pm):
        m.close()
    results["sglang"] = {"ok": True, "release": boot.release()}
    print(json.dumps(results, default=str))


if __name__ == "__main__":
    main()
