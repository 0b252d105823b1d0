"""One side of the scheduler-queue driver: ``python -m pdstate.devtools.sglang_queues.side``.

Run only by ``pair.QueuePair`` under the cached SGLang environment (importing ``booted`` changes
process-wide state). One JSON command per stdin line, one ``@@queues {json}`` line per answer:

- ``setup``: publish the side's server args, build its pools (``sglang_pair`` / ``pools``), and
  build SGLang's own queues on a stand-in scheduler; the queues create the manager of
  ``backend`` themselves (the prefill starts the bootstrap server first);
- ``run``: one request through the queues, polled until it leaves them or its deadline passes.
  The prefill fills the request's source items with their patterns once its bootstrap is done
  (that is when a real prefill runs its forward), sends two chunks through ``send_kv_chunk`` and
  polls the inflight queue; the decode polls ``process_decode_queue`` and then checks every byte
  its request's items hold (main KV pages, SWA window pages of target and draft, C4 ring and C128
  rows, the aux row as it was when SGLang read it).

Per case, ``setup`` takes SGLang settings for the managers (``env``: its waiting and bootstrap
timeouts) and, on the decode, SGLang 0.5.23's decode radix cache (``radix``: its own tree; a
finished request is kept in it). Per request: the prefill's forward may take a while (``hold_s``)
and its whole process stop for a while after it sent its last chunk (``stall_after_s`` /
``stall_s``); the decode
may abort the request as the scheduler's ``abort_request`` does (``abort_after_s``, then
polled until its pages are released: 0.5.23 defers that until the prefill acknowledged), wait before
its byte check (``settle_s``), keep its memory (``keep_memory``: a cached prefix stays), and stop
its whole process for a while after its destination was named (``stall_after_s`` / ``stall_s``:
SIGSTOP, a stalled host), then go on; from the release of a request's pages on, an image of the
decode's memory shows what still lands (``after_release_bytes``). A room may be sent again (a
retracted request's rebootstrap); ``rebootstrap`` has the decode dispatch the prefill's recompute
after the request landed, through SGLang's own ``submit_prefill_recompute`` (``POST /generate`` to
the HTTP port the prefill registered: ``setup``'s ``http_port``).
"""

from __future__ import annotations

from pdstate.devtools.sglang_pair import booted  # noqa: F401  (first: the GPU-only stubs and the bare sglang package)

# isort: split

import os
import time
from array import array
from types import SimpleNamespace

import numpy as np

from pdstate.devtools.sglang_pair import boot, pattern
from pdstate.devtools.sglang_pair.cases import Side
from pdstate.devtools.sglang_pair.child import serve
from pdstate.devtools.sglang_queues import compat, parallel

REPLY = "@@queues "
HOST = "127.0.0.1"
POLL_S = 0.0005
CHUNK_TOKENS = 512  # the first chunk (two pages of 256): a non-last send_kv_chunk, then the last one

S = SimpleNamespace(
    role="", backend="", port=0, installed=False, group=None, engine=False, case=None, env_set=[], held={}
)


class Streamer:
    """The scheduler's output streamer: records what the queue code streams (finished or aborted requests)."""

    def __init__(self) -> None:
        self.streamed: list = []

    def stream_output(self, reqs, *args, **kwargs) -> None:
        self.streamed.extend(reqs)


def _gloo_group():
    """A gloo process group of one, so the queues' ``poll_and_all_reduce`` really all-reduces."""
    if S.group is None:
        import torch.distributed as dist

        from pdstate.devtools.sglang_pair.pair import free_port

        dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{free_port()}", rank=0, world_size=1)
        S.group = dist.new_group([0], backend="gloo")
    return S.group


# -- both sides
def setup(
    role: str,
    backend: str,
    side: dict,
    port: int,
    env: dict | None = None,
    radix: bool = False,
    http_port: int | None = None,
    attn_tp: tuple[int, int] = (1, 0),
    pp: tuple[int, int] = (1, 0),
) -> dict:
    """This side's queues, pools and manager for one case (``attn_tp``: the decode rank's
    attention-TP ``(size, rank)``, a child per rank; ``pp``: the prefill stage's PP ``(size, rank)``,
    a child per stage)."""
    S.role, S.backend, S.port = role, backend, port
    for key in S.env_set:  # the previous case's SGLang settings go; this case's are read by its manager
        os.environ.pop(key, None)
    S.env_set = sorted(env or ())
    os.environ.update({k: str(v) for k, v in (env or {}).items()})
    if backend == "pdstate" and not S.installed:
        import pdstate.integrations.sglang as integration

        integration.install()
        S.installed = True
    s = Side.from_json(side)
    args = boot.server_args(
        speculative=s.speculative, page_size=s.page_size, disaggregation_mode=role,
        disaggregation_transfer_backend=backend, disaggregation_bootstrap_port=port, host=HOST,
        chunked_prefill_size=CHUNK_TOKENS, disable_radix_cache=not (radix and role == "decode"),
        **({"disaggregation_decode_enable_radix_cache": True} if radix and role == "decode" else {}),
        **({"port": http_port} if http_port else {}), **({"pp_size": pp[0]} if pp[0] > 1 else {}),
    )  # fmt: skip
    boot.publish(args)
    group = _gloo_group()
    parallel.parallel_context(group, attn_tp, pp, rendezvous=port)
    if backend == "mooncake" and not S.engine:  # as SGLang's scheduler does for its own Mooncake backend
        from sglang.srt.distributed.device_communicators import mooncake_transfer_engine as mte

        mte.init_mooncake_transfer_engine(hostname=HOST, gpu_id=0)
        S.engine = True
    if role == "prefill":
        S.case = compat.prefill_queues(s, args, backend, port, group, HOST, Streamer(), tuple(pp))
    else:
        S.case = compat.decode_queues(s, args, backend, port, group, Streamer(), tuple(attn_tp))
    kv_args = S.case.kv_args
    for _, ptr, length, _ in compat.buffers(kv_args):
        pattern.memory(ptr, length).fill(pattern.SENTINEL if role == "decode" else pattern.FOREIGN)
    return {"state_types": [str(t.value) for t in kv_args.state_types], "buffers": len(compat.buffers(kv_args))}


def outcome_of(req) -> tuple[str, str | None]:
    """A finished request's outcome, as the drivers here and in ``migrate_side`` report it."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    if isinstance(req.finished_reason, FINISH_ABORT):
        return "Failed", str(req.finished_reason.message)
    return "Success", None


def make_request(room: int, tokens: int, mode):
    """SGLang's ``Req`` for ``room``: ``tokens`` prompt tokens, bootstrapped at this side's port
    (the drivers here and in ``migrate_side``)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    ids = array("q", ((room * 7919 + i * 31) % 32000 + 1 for i in range(tokens)))
    params = SamplingParams(max_new_tokens=8)
    params.normalize(None)
    return Req(
        f"room-{room}", "", ids, params, bootstrap_host=HOST, bootstrap_port=S.port, bootstrap_room=room,
        disagg_mode=mode,
    )  # fmt: skip


# -- prefill
def run_prefill(
    room: int, tokens: int, deadline_s: float, hold_s: float = 0.0, stall_after_s: float = 0.0, stall_s: float = 0.0
) -> dict:
    """One request through the prefill's queues (``hold_s``: its forward takes that long;
    ``stall_s``: ``stall_after_s`` after its last chunk was sent, the whole process stops that
    long, ``_stall``; how long it stopped is answered as ``stalled_s``)."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    case, sched = S.case, S.case.sched
    deadline = time.perf_counter() + deadline_s
    req = make_request(room, tokens, DisaggregationMode.PREFILL)
    queue = sched.disagg_prefill_bootstrap_queue
    queue.add(req, 1)
    trace = ["add"]
    while True:  # the bootstrap queue, as the event loop polls it
        popped = queue.pop_bootstrapped()
        compat.resolve_waiting(sched, popped)
        if req in popped:
            trace.append("bootstrapped")
            break
        if req in sched.output_streamer.streamed:  # a bootstrap failure streams the abort
            outcome, failure = outcome_of(req)
            return {"outcome": outcome, "failure": failure, "trace": trace + ["bootstrap failed"]}
        if time.perf_counter() >= deadline:
            return {"outcome": f"timeout ({compat.poll_name(req.disagg_kv_sender.poll())})", "failure": None,
                    "trace": trace}  # fmt: skip
        time.sleep(POLL_S)
    # The forward: KV for the whole prompt, the request's items patterned, the sampled token set
    # (``hold_s``: a forward that long, the scheduler busy meanwhile).
    time.sleep(hold_s)
    compat.prefill_forward(case, req)
    items = compat.request_items(case, req, room)
    for (_, ptr, length, _), (_, item_len, keys) in zip(compat.buffers(case.kv_args), items):
        pattern.write_items(pattern.memory(ptr, length), item_len, keys)
    req.output_ids.append(int(room % 30000) + 7)
    t0 = time.perf_counter()
    first = min(CHUNK_TOKENS, tokens)
    if first < tokens:  # a non-last chunk: the full pages so far
        compat.set_extend_range(req, 0, first)
        sched.send_kv_chunk(req)
        trace.append("chunk")
    compat.set_extend_range(req, compat.start_send(req), tokens)
    sched.disagg_prefill_inflight_queue.append(req)
    sched.send_kv_chunk(req, last_chunk=True)
    trace.append("last chunk")
    stalled_s = None
    if stall_s:
        time.sleep(stall_after_s)  # the fault's place: its copy submitted (held by a stopped decode)
        stop = time.perf_counter()
        _stall(stall_s)
        stalled_s = round(time.perf_counter() - stop, 4)
    aux = compat.row_digests(case.aux_bufs, req.metadata_buffer_index)
    while True:
        done = sched.process_disagg_prefill_inflight_queue()
        if req in done:
            outcome, failure = outcome_of(req)
            ms = (time.perf_counter() - t0) * 1000
            metric = req.disagg_kv_sender.get_transfer_metric() if req.disagg_kv_sender is not None else None
            return {"outcome": outcome, "failure": failure, "trace": trace + ["inflight done"], "aux": aux,
                    "ms": ms if outcome == "Success" else None,
                    "bytes": getattr(metric, "transfer_total_bytes", None), "stalled_s": stalled_s}  # fmt: skip
        if time.perf_counter() >= deadline:
            state = compat.poll_name(req.disagg_kv_sender.poll())
            return {"outcome": f"timeout ({state})", "failure": None, "trace": trace, "aux": aux}
        time.sleep(POLL_S)


# -- decode
def run_decode(
    room: int,
    tokens: int,
    deadline_s: float,
    abort_after_s: float | None = None,
    settle_s: float = 0.0,
    keep_memory: bool = False,
    rebootstrap: bool = False,
    stall_after_s: float | None = None,
    stall_s: float = 0.0,
    check_after_s: float = 0.0,
    hold: bool = False,
) -> dict:
    """One request through the decode's queues (``hold``: a request that arrived is kept, its
    pages held, in ``S.held`` by room, for ``migrate_side`` to run; else released after the check). ``abort_after_s``: that long after its destination
    was named (``send_metadata``), the request is aborted as the scheduler's ``abort_request``
    does for a transfer-queue request (``kv_receiver.abort()``), and the queues are polled on
    until its pages are released (0.5.23: deferred release, on the prefill's acknowledgement or
    its timeout); ``settle_s``: how long to wait before the byte check (a prefill that sends
    late), and no earlier than ``check_after_s`` after the request's arrival. ``stall_after_s``: that long after its destination was named, this whole process is
    stopped for ``stall_s`` (``_stall``: the agent's and the engine's threads too, as a stalled
    host stops a decode), then polled on as before. Times: ``failed_s`` / ``named_s`` /
    ``stalled_s`` / ``resumed_s`` / ``released_s`` from the request's arrival, ``abort_call_ms``
    (the abort itself), ``released_ms`` (abort, else failure, to pages released). Bytes of the
    decode's registered memory (images of it): ``held_bytes`` changed from the stop to the release
    (taken as the queues let the pages go), ``concluded_to_release_bytes`` from the moment the
    receiver itself concluded Failed (``concluded_s``; SGLang may see it later) to the release,
    ``after_release_bytes`` from the release to the byte check, ``settle_s`` later."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode

    case, sched = S.case, S.case.sched
    t0 = time.perf_counter()
    deadline = t0 + deadline_s
    if not keep_memory:
        for _, ptr, length, _ in compat.buffers(case.kv_args):
            pattern.memory(ptr, length).fill(pattern.SENTINEL)
    case.cleared.clear()
    case.commits.clear()
    case.deferred.discard(room)
    case.published.pop(room, None)
    req = make_request(room, tokens, DisaggregationMode.DECODE)
    sched.disagg_decode_prealloc_queue.add(req)
    outcome, failure, times = None, None, {}
    aborted_at = failed_at = last_receiver = image = stalled = concluded = None
    placed = False
    while True:
        sched.process_decode_queue()
        receiver = compat.receiver_of(sched, req)
        last_receiver = receiver or last_receiver
        now = time.perf_counter()
        if "named_s" not in times and receiver is not None and getattr(receiver, "init_time", None) is not None:
            times["named_s"] = round(now - t0, 4)
            resolve = getattr(receiver.kv_mgr, "_resolve_rebootstrap_prefill_url", None)
            if resolve is not None:  # where SGLang's rebootstrap (submit_prefill_recompute) would POST /generate
                times["rebootstrap_url"] = resolve(receiver)
        if stall_after_s is not None and "resumed_s" not in times and "named_s" in times:
            if now - t0 - times["named_s"] >= stall_after_s:
                times["stalled_s"] = round(now - t0, 4)
                stalled = _image(case)
                _stall(stall_s)
                times["resumed_s"] = round(time.perf_counter() - t0, 4)
        if abort_after_s is not None and aborted_at is None and "named_s" in times:
            if now - t0 - times["named_s"] >= abort_after_s:
                aborted_at = time.perf_counter()
                receiver.abort()
                times["abort_call_ms"] = round((time.perf_counter() - aborted_at) * 1000, 2)
        if req in sched.waiting_queue:
            sched.waiting_queue.remove(req)
            outcome, failure = outcome_of(req)
            if rebootstrap:  # retracted: SGLang's own dispatch of the prefill's recompute (POST /generate)
                mgr = sched.disagg_decode_prealloc_queue.kv_manager
                times["rebootstrap_url"] = mgr._resolve_rebootstrap_prefill_url(last_receiver)
                mgr.submit_prefill_recompute(last_receiver, req.build_rebootstrap_payload())
            break
        if req in sched.output_streamer.streamed and outcome is None:
            outcome, failure = outcome_of(req)
            failed_at = time.perf_counter()
            times["failed_s"] = round(failed_at - t0, 4)
            if not placed:  # refused before its pages were allocated: nothing to release
                break
        if receiver is not None:
            meta = _meta_index(sched, req)
            if meta is not None:
                times["meta_index"] = meta
        placed = compat.placed(case, req)
        if outcome is not None and not placed:  # released, by the queues (0.5.23: deferred release)
            released_at = time.perf_counter()
            image = _image(case)
            times["released_ms"] = round((released_at - (aborted_at or failed_at)) * 1000, 2)
            if "resumed_s" in times:
                times["released_s"] = round(released_at - t0, 4)
            break
        if stalled is not None and concluded is None and last_receiver is not None:
            # the receiver's own Failed, its pages not released yet (0.5.19's hold, 0.5.23's deferred
            # release); after the release check, so that the release's image is taken at once
            if getattr(last_receiver, "conclude_state", None) == KVPoll.Failed:
                concluded = _image(case)
                times["concluded_s"] = round(time.perf_counter() - t0, 4)
        if time.perf_counter() >= deadline:
            state = compat.poll_name(receiver.poll()) if receiver is not None else "no receiver"
            if outcome is None:
                outcome, failure = f"timeout ({state})", None
            else:
                times["released_ms"] = None  # still held at the deadline
            if receiver is not None and aborted_at is None:  # as the scheduler's abort_request does
                receiver.abort()
            break
        time.sleep(POLL_S)
    times["deferred"] = room in case.deferred
    time.sleep(max(settle_s, t0 + check_after_s - time.perf_counter()))
    if image is not None:
        times["after_release_bytes"] = _changed(image, _image(case, copy=False))
        if stalled is not None:
            times["held_bytes"] = _changed(stalled, image)
        if concluded is not None:
            times["concluded_to_release_bytes"] = _changed(concluded, image)
    out = {"outcome": outcome, "failure": failure, **times, **case.published.get(room, {})}
    out.update(_check(case, req, room, times.pop("meta_index", None), release=not (hold and outcome == "Success")))
    if hold and outcome == "Success":
        S.held[room] = req
    return out


def _stall(seconds: float) -> None:
    """This process stopped (SIGSTOP: every thread) for ``seconds``; a child continues it."""
    import signal
    import subprocess

    waker = subprocess.Popen(["/bin/sh", "-c", f"sleep {seconds:.3f}; kill -CONT {os.getpid()}"])
    os.kill(os.getpid(), signal.SIGSTOP)
    waker.wait()


def _image(case, copy: bool = True) -> list:
    """Every byte of the decode's registered memory (main KV, state, aux): a copy, or the memory itself."""
    views = [pattern.memory(ptr, length) for _, ptr, length, _ in compat.buffers(case.kv_args)]
    return [view.copy() for view in views] if copy else views


def _changed(before: list, after: list) -> int:
    return sum(int(np.count_nonzero(a != b)) for a, b in zip(before, after))


def _meta_index(sched, req) -> int | None:
    for decode_req in [*sched.disagg_decode_prealloc_queue.queue, *sched.disagg_decode_transfer_queue.queue]:
        if decode_req.req is req and decode_req.metadata_buffer_index is not None:
            if decode_req.metadata_buffer_index >= 0:
                return int(decode_req.metadata_buffer_index)
    return None


def _check(case, req, room: int, meta_index: int | None = None, release: bool = True) -> dict:
    """Every byte of the request's items and of the rest of the decode's registered memory (the
    aux row the request held is the decode's own: SGLang clears it when it lets the request go)."""
    out = {"bytes_checked": 0, "items": 0, "wrong_items": 0, "outside_bytes": 0, "changed_bytes": 0}
    commit = case.commits.get(room)
    row = commit["index"] if commit else meta_index
    out["aux"] = commit["aux"] if commit else None
    placed = compat.placed(case, req)
    items = compat.request_items(case, req, room) if placed else None
    own = compat.cleared_rows(case)  # rows the decode itself reset (C128 state of its slot)
    wrong_by: dict[str, int] = {}  # per kind of state moved: main KV, each StateType, aux (the parent's)
    items_by: dict[str, int] = {}
    for k, (what, ptr, length, item_len) in enumerate(compat.buffers(case.kv_args)):
        view = pattern.memory(ptr, length)
        mask = np.zeros(length, dtype=bool)
        for r in own.get((ptr, item_len), ()):
            mask[r * item_len : (r + 1) * item_len] = True
        if what == "aux":
            if row is not None:
                mask[row * item_len : (row + 1) * item_len] = True
            out["outside_bytes"] += int(np.count_nonzero(view[~mask] != pattern.SENTINEL))
            out["changed_bytes"] += int(np.count_nonzero(view[~mask] != pattern.SENTINEL))
            continue
        if items is None:
            out["changed_bytes"] += int(np.count_nonzero(view[~mask] != pattern.SENTINEL))
            continue
        _, _, keys = items[k]
        wrong = 0
        for index, key in keys.items():
            lo, hi = index * item_len, (index + 1) * item_len
            if not np.array_equal(view[lo:hi], pattern.item_bytes(key, item_len)):
                wrong += 1
            mask[lo:hi] = True
        out["bytes_checked"] += length
        out["items"] += len(keys)
        out["wrong_items"] += wrong
        outside = int(np.count_nonzero(view[~mask] != pattern.SENTINEL))
        out["outside_bytes"] += outside
        if outside:
            out.setdefault("outside_by", {})[f"{what}[{k}]"] = outside
        out["changed_bytes"] += int(np.count_nonzero(view != pattern.SENTINEL)) - sum(
            int(np.count_nonzero(view[r * item_len : (r + 1) * item_len] != pattern.SENTINEL))
            for r in own.get((ptr, item_len), ())
        )
        kind = what if what == "main" else str(case.kv_args.state_types[int(what[len("state") :])].value)
        wrong_by[kind] = wrong_by.get(kind, 0) + wrong
        items_by[kind] = items_by.get(kind, 0) + len(keys)
    out["wrong_by"], out["items_by"] = wrong_by, items_by
    out["placed"] = placed
    if release:
        compat.release_decode(case, req)
    return out


def main() -> None:
    ops = {"setup": setup, "run_prefill": run_prefill, "run_decode": run_decode}
    serve(ops, REPLY, trace_chars=4000)


if __name__ == "__main__":
    main()
