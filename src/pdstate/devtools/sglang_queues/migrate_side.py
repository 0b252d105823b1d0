"""A decode child of the migration driver: ``python -m pdstate.devtools.sglang_queues.migrate_side``.

The scheduler-queue side (``side``: ``setup``, ``run_prefill``, ``run_decode``; the prefill child
runs this module too) plus the commands that run a request in a decode's running batch and move
it to another decode (SGLang 0.5.23, backend ``pdstate``; ``integrations.sglang.migrate``):

- ``adopt``: a request ``run_decode(hold=True)`` kept enters the running batch (the stand-in
  scheduler's ``running_batch.reqs``), as the decode loop's prebuilt batch does;
- ``steps``: decode steps of a running request: each takes its next token's KV slot through the
  allocator's own ``alloc_decode`` (page, SWA mapping), writes it into the token pool, writes
  the step's bytes (the new token's main-KV page, its SWA page or ring row, every request-state
  row: patterns keyed by room and step, ``pattern``) and appends an output token;
- ``serve_source``: this decode's ``PrefillAgent`` over its own memory (its address answered);
- ``connect``: the target's agent shakes hands with a source (accepted, or refused with the
  source's error) before anything is paused or allocated;
- ``migrate_out`` (source): the request leaves the running batch (paused), its rows and its aux
  row are sent by the source agent once the target asks for them, until the target verified;
- ``migrate_in`` (target): the request enters this decode's own ``DecodePreallocQueue`` (its
  rows allocated there) with a ``MigrationReceiver``, its queues are polled until the transfer
  queue committed it, and it enters the running batch (resumed);
- ``release`` (source): its rows go back as when a request leaves a decode; nothing of this
  decode's memory may change after;
- ``digests``: per item of a request (keyed as ``compat.request_items`` keys it), the digest of
  its bytes where it lies in this decode; and the bytes outside the request's items that are not
  the sentinel.

Times are ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every process of a host).
"""

from __future__ import annotations

from pdstate.devtools.sglang_pair import booted  # noqa: F401  (first: the GPU-only stubs and the bare sglang package)

# isort: split

import hashlib
import time

import numpy as np
import torch

from pdstate.devtools.sglang_pair import pattern
from pdstate.devtools.sglang_pair.child import serve
from pdstate.devtools.sglang_queues import compat, side
from pdstate.devtools.sglang_queues.side import S
from pdstate.integrations.sglang import migrate

POLL_S = 0.0005
M: dict = {"agent": None, "aux": {}}


def _naive_alloc_decode() -> None:
    """The paged allocator's decode kernel (triton) stands for SGLang's own pure-torch twin."""
    from sglang.srt.mem_cache.allocator import paged

    class Kernel:
        def __getitem__(self, grid):
            def run(seq_lens, last_loc, free_pages, out_indices, _bs_pow2, page_size):
                n = paged.get_num_new_pages(seq_lens=seq_lens.cpu(), page_size=page_size, decode=True)
                paged.alloc_decode_naive(seq_lens, last_loc, free_pages, out_indices, page_size, n)

            return run

    paged.alloc_decode_kernel = Kernel()


_naive_alloc_decode()


def setup(**kw) -> dict:
    """``side.setup``; a previous case's held requests and source agent go."""
    S.held.clear()
    M["aux"].clear()
    if M["agent"] is not None:
        M["agent"].close()
        M["agent"] = None
    return side.setup(**kw)


def _held(room: int):
    req = S.held.get(room)
    if req is None:
        raise KeyError(f"room {room}: no request of that room runs here")
    return req


def adopt(room: int) -> dict:
    req = _held(room)
    S.case.sched.running_batch.reqs.append(req)
    return {
        "prompt": list(req.origin_input_ids),
        "output_ids": list(req.output_ids),
        "seq_len": migrate.seq_len_of(req),
    }


def _next_token(room: int, n: int) -> int:
    return (room * 7919 + n * 104729) % 32000 + 1


def _step(case, req, room: int, step: int) -> None:
    sched, pools = case.sched, case.pools
    seq = migrate.seq_len_of(req)
    slot = int(req.kv.req_pool_idx)
    last = int(sched.req_to_token_pool.req_to_token[slot, seq - 1])
    t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    loc = pools.alloc.alloc_decode(seq_lens=t(seq + 1), seq_lens_cpu=t(seq + 1), last_loc=t(last))
    if loc is None:
        raise RuntimeError(f"room {room}: no KV room for decode step {step}")
    sched.req_to_token_pool.write((slot, slice(seq, seq + 1)), loc)
    req.kv.kv_allocated_len = req.kv.kv_committed_len = seq + 1
    page = pools.side.page_size
    items = compat.request_items(case, req, (room, "step", step), tokens=seq + 1)
    for (_, ptr, length, item_len), (_, _, keys) in zip(compat.buffers(case.kv_args), items):
        touched = {i: k for i, k in keys.items() if _touched(k, seq, page)}
        pattern.write_items(pattern.memory(ptr, length), item_len, touched)
    req.output_ids.append(_next_token(room, len(req.output_ids)))


def _touched(key: tuple, position: int, page: int) -> bool:
    """Whether a decode step at ``position`` writes the item of ``key``: the new token's main-KV
    page and SWA page (``kv`` / ``swa``: by page of the sequence), its ring row (by position),
    every request-state row; never the aux row."""
    kind = key[0]
    if kind in ("kv", "swa"):
        return key[3] == position // page
    if kind == "ring":
        return key[3] == position
    return kind != "aux"


def steps(room: int, n: int) -> dict:
    """``n`` decode steps of the running request of ``room`` (in this decode's running batch)."""
    req = _held(room)
    if req not in S.case.sched.running_batch.reqs:
        raise RuntimeError(f"room {room} is not in the running batch")
    for _ in range(n):
        _step(S.case, req, room, len(req.output_ids))
    return {"output_ids": list(req.output_ids), "seq_len": migrate.seq_len_of(req)}


def serve_source() -> dict:
    if M["agent"] is None:
        M["agent"] = migrate.source_agent(S.case.sched.disagg_decode_prealloc_queue.kv_manager)
    return {"address": M["agent"].address}


def connect(source: str, deadline_s: float) -> dict:
    """The target's agent (its manager's) shakes hands with the source: ``state`` and ``error``."""
    agent = S.case.sched.disagg_decode_prealloc_queue.kv_manager.agent
    agent.connect(source)
    deadline = time.monotonic() + deadline_s
    while True:
        snap = agent.prefills().get(source)
        state = str(getattr(snap, "state", None))
        if snap is not None and snap.error is not None:
            return {"state": state, "error": f"{snap.error.type}: {snap.error.message}"}
        if snap is not None and "accept" in state.lower():
            return {"state": state, "error": None}
        if time.monotonic() >= deadline:
            return {"state": f"timeout ({state})", "error": None}
        time.sleep(0.005)


def source_view() -> dict:
    """What the source agent knows of its decodes (accepted) and of the ones it refused."""
    agent = M["agent"]
    return {
        "decodes": [str(d.worker_id) for d in agent.decodes()],
        "peers": [{"state": str(p.state), "error": None if p.error is None else p.error.type} for p in agent.peers()],
    }


def migrate_out(room: int, deadline_s: float) -> dict:
    """Pause the running request of ``room`` and send its rows until the target verified them."""
    from pdstate.protocol.lifecycle import RequestState

    case, sched = S.case, S.case.sched
    req = _held(room)
    paused_at = time.monotonic()
    sched.running_batch.reqs.remove(req)
    seq_len = migrate.seq_len_of(req)
    pools = (case.pools.target, case.pools.alloc, case.pools.side.sliding_window)
    pages, state = migrate.source_indices(
        case.kv_args, pools, sched.req_to_token_pool.req_to_token, int(req.kv.req_pool_idx), seq_len
    )
    aux = migrate.boundary_aux(case.pools.meta, sched.req_to_metadata_buffer_idx_allocator, req)
    M["aux"][room] = aux
    sender = M["agent"].sender(room, len(pages), aux_index=aux)
    sent_at = None
    deadline = paused_at + deadline_s
    while True:
        s = sender.poll()
        if s is RequestState.WAITING_FOR_INPUT and sent_at is None:
            sender.send(pages, state)
            sent_at = time.monotonic()
        if s.terminal or time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    error = sender.failure_exception()
    if not s.terminal:  # the request stays whole here: the sender is aborted, nothing released
        sender.abort("migration deadline passed")
    if s is not RequestState.SUCCESS:  # back into the running batch, whole
        sched.running_batch.reqs.append(req)
        _free_aux(room)
    metrics = sender.metrics
    return {
        "outcome": s.name, "failure": None if error is None else f"{type(error).__name__}: {error}",
        "paused_at": paused_at, "sent_at": sent_at, "verified_at": time.monotonic(), "seq_len": seq_len,
        "pages": len(pages), "bytes": metrics.get("bytes"), "metrics": {k: v for k, v in metrics.items()
                                                                        if isinstance(v, int | float | str)},
    }  # fmt: skip


def _free_aux(room: int) -> None:
    index = M["aux"].pop(room, None)
    if index is not None:
        S.case.pools.meta.clear_slot(index)
        S.case.sched.req_to_metadata_buffer_idx_allocator.free(index)


def _until_running(sched, req, deadline: float, timed_out) -> tuple[str, str | None]:
    """Poll the decode queues until ``req`` is ready and then in the running batch (its outcome),
    SGLang streamed it out (failed: outcome and failure), or ``deadline`` passed (``timed_out()``)."""
    while True:
        sched.process_decode_queue()
        if req in sched.waiting_queue:
            sched.waiting_queue.remove(req)
            req.pd_rebootstrap_in_progress = False  # as the prebuilt batch's ``process_prebuilt`` does
            sched.running_batch.reqs.append(req)
            return side.outcome_of(req)[0], None
        if req in sched.output_streamer.streamed:
            return side.outcome_of(req)
        if time.monotonic() >= deadline:
            return timed_out(), None
        time.sleep(POLL_S)


def migrate_in(source: str, room: int, prompt: list, output_ids: list, deadline_s: float) -> dict:
    """The request (``prompt`` and ``output_ids`` as on the source) through this decode's queues
    from ``source``, then into its running batch."""
    from sglang.srt.disaggregation.decode import DecodeRequest
    from sglang.srt.disaggregation.utils import DisaggregationMode

    case, sched = S.case, S.case.sched
    for _, ptr, length, _ in compat.buffers(case.kv_args):
        pattern.memory(ptr, length).fill(pattern.SENTINEL)
    case.cleared.clear()
    req = side.make_request(room, len(prompt), DisaggregationMode.DECODE)
    req.origin_input_ids = list(prompt)
    req.output_ids = list(output_ids)
    migrate.target_request(req)
    seq_len = migrate.seq_len_of(req) + 1  # the boundary token is back once committed
    prealloc = sched.disagg_decode_prealloc_queue
    receiver = migrate.build_receiver()(prealloc.kv_manager, source, room, seq_len)
    decode_req = DecodeRequest(req=req, kv_receiver=receiver)
    prealloc.queue.append(decode_req)
    t0 = time.monotonic()
    outcome, failure = _until_running(
        sched, req, t0 + deadline_s, lambda: f"timeout ({compat.poll_name(receiver.poll())})"
    )
    resumed_at = time.monotonic()
    S.held[room] = req
    return {
        "outcome": outcome, "failure": failure, "resumed_at": resumed_at, "queued_at": t0,
        "output_ids": list(req.output_ids), "seq_len": migrate.seq_len_of(req),
        "running": req in sched.running_batch.reqs, "bytes": receiver.metrics.get("bytes"),
        "verify": receiver.metrics.get("verify"),
    }  # fmt: skip


def retract(room: int, deadline_s: float) -> dict:
    """SGLang's retraction with recompute of the running request of ``room`` (the control): out of
    the running batch, its KV released as ``retract_decode`` releases it (``release_req``, no host
    backup: DSV4 recomputes), re-added as the scheduler re-adds a retracted request
    (``DecodePreallocQueue.add(is_retracted=True)``: a rebootstrap, its prefill's recompute
    dispatched by SGLang's ``submit_prefill_recompute``); then polled until it is back in the
    running batch."""
    from sglang.srt.managers.schedule_batch import release_req

    sched = S.case.sched
    req = _held(room)
    retracted_at = time.monotonic()
    sched.running_batch.reqs.remove(req)
    output_ids = list(req.output_ids)
    release_req(
        req=req, remaing_req_count=0, req_to_token_pool=sched.req_to_token_pool,
        token_to_kv_pool_allocator=sched.token_to_kv_pool_allocator, tree_cache=sched.tree_cache,
        hisparse_coordinator=None, offload_kv=False,
    )  # fmt: skip
    sched.disagg_decode_prealloc_queue.add(req, is_retracted=True)
    outcome, failure = _until_running(sched, req, retracted_at + deadline_s, lambda: "timeout")
    return {
        "outcome": outcome, "failure": failure, "retracted_at": retracted_at, "resumed_at": time.monotonic(),
        "output_ids_kept": list(req.output_ids) == output_ids, "seq_len": migrate.seq_len_of(req),
    }  # fmt: skip


def _images() -> list:
    return [pattern.memory(ptr, length).copy() for _, ptr, length, _ in compat.buffers(S.case.kv_args)]


def _changed(before: list, after: list) -> int:
    return sum(int(np.count_nonzero(a != b)) for a, b in zip(before, after))


def release(room: int, settle_s: float = 0.2, watch: bool = True) -> dict:
    """The request leaves this decode (a migrated one: its rows go back as when it finishes);
    answers the free pages before and after, and (``watch``) the bytes of this decode's memory
    that changed in ``settle_s`` after the release (two images of it: skipped when measuring)."""
    case, sched = S.case, S.case.sched
    req = S.held.pop(room)
    if req in sched.running_batch.reqs:
        raise RuntimeError(f"room {room} still runs here: pause it first")
    alloc = case.pools.alloc
    before = (int(alloc.full_attn_allocator.available_size()), int(alloc.swa_attn_allocator.available_size()))
    slots_before = int(sched.req_to_token_pool.available_size())
    pages = int(req.kv.kv_allocated_len)
    compat.release_decode(case, req)
    _free_aux(room)
    image = _images() if watch else None
    time.sleep(settle_s)
    after = (int(alloc.full_attn_allocator.available_size()), int(alloc.swa_attn_allocator.available_size()))
    return {
        "full_free": [before[0], after[0]],
        "swa_free": [before[1], after[1]],
        "tokens": pages,
        "slots_free": [slots_before, int(sched.req_to_token_pool.available_size())],
        "after_release_bytes": _changed(image, _images()) if watch else None,
    }


def finish(room: int) -> dict:
    """The running request of ``room`` finishes here: out of the running batch, its rows released."""
    req = _held(room)
    if req in S.case.sched.running_batch.reqs:
        S.case.sched.running_batch.reqs.remove(req)
    return release(room, settle_s=0.0, watch=False)


def digests(room: int) -> dict:
    """``{key: digest}`` of every item of the request of ``room`` where it lies here (keys as
    ``compat.request_items`` names them, with the room as given: the same on every decode, and
    the item's rank among the items of its key), and
    ``outside_bytes``: bytes of this decode's main-KV and state buffers outside those items (and
    outside the request-state rows the decode itself reset) that are not the sentinel."""
    case, req = S.case, _held(room)
    seq = migrate.seq_len_of(req)
    items = compat.request_items(case, req, room, tokens=seq)
    own = compat.cleared_rows(case)
    out: dict = {}
    by_kind: dict = {}
    outside = 0
    for (what, ptr, length, item_len), (_, _, keys) in zip(compat.buffers(case.kv_args), items):
        if what == "aux":
            continue
        view = pattern.memory(ptr, length)
        mask = np.zeros(length, dtype=bool)
        for r in own.get((ptr, item_len), ()):
            mask[r * item_len : (r + 1) * item_len] = True
        seen: dict = {}
        for index, key in keys.items():  # items sharing a key (a buffer's request-state rows): by order
            lo, hi = index * item_len, (index + 1) * item_len
            mask[lo:hi] = True
            nth = seen[key] = seen.get(key, -1) + 1
            out[repr((*key, nth))] = hashlib.blake2b(view[lo:hi].tobytes(), digest_size=12).hexdigest()
            by_kind[key[0]] = by_kind.get(key[0], 0) + 1
        outside += int(np.count_nonzero(view[~mask] != pattern.SENTINEL))
    return {"items": out, "by_kind": by_kind, "outside_bytes": outside, "seq_len": seq,
            "output_ids": list(req.output_ids)}  # fmt: skip


def main() -> None:
    ops = {
        "setup": setup, "run_prefill": side.run_prefill, "run_decode": side.run_decode, "adopt": adopt,
        "steps": steps, "serve_source": serve_source, "connect": connect, "source_view": source_view,
        "migrate_out": migrate_out, "migrate_in": migrate_in, "release": release, "digests": digests,
        "retract": retract, "finish": finish,
    }  # fmt: skip
    serve(ops, side.REPLY, trace_chars=4000)


if __name__ == "__main__":
    main()
