"""``pdstate bench``: pdstate against the in-process ceiling and the raw engines, in one run.

For the ``dsv4-flash`` layout (target + NextN draft) and each request length, the variants are
interleaved round-robin in one process run (these machines are shared; ratios, not absolutes):

- ``physical_<k>t`` (paged shm phase): one contiguous copy of the request's byte count with k
  threads, k = 1, 2, 4, ... up to the cores; ``physical``, the best of them, is the limit;
- ``ceiling``: an in-process copy of exactly the regions a request moves (same page ids, same
  descriptors), the best of a per-run ``memmove`` loop and a vectorised numpy gather/scatter;
- ``raw_<engine>``: the native engine (Mooncake, NIXL) writing the same pages and buffers from an
  agent in this process into the pdstate decode worker's registered memory (its own endpoint:
  the same destination process and path as pdstate's), with no pdstate code in the loop;
  ``raw_mooncake`` is Mooncake's spinning sync write, ``raw_mooncake_polled`` the same
  descriptors submitted and polled with sleeps as pdstate's engine does (the faster of the two
  is the reference of the ``mooncake_*_vs_raw`` ratios: ``baselines.raw_mooncake_write``);
  ``raw_nixl_prefill`` is NIXL's same write made inside the prefill worker, from its own pools (the
  pages pdstate sends from: ``baselines.WorkerRawNixl``), since the same native write runs at a
  speed of the agent making it; the faster NIXL row is the ``nixl_*_vs_raw`` reference;
- ``pdstate_<engine>`` (native engines): ``pdstate serve``'s prefill and decode workers
  (``pdstate.worker``, over the agent) as a process pair (``devtools.processes``), from the
  decode's request to the bytes verified (the receiver's ``transfer_s`` plus the decode's
  ``verify_s``). The prefill's synthetic compute (the stand-in for the model's prefill) is inside
  that time: the agent's wire does not carry it back (``compute_s`` is 0). The decode checks the
  request with ``verify="sample"`` (one word per item and the end of every run);
  ``pdstate_<engine>_full_verify`` is the same with every byte read back;
  ``pdstate_<engine>_off`` is a second decode of the same prefill at ``transfer.verify = off``,
  timed without the prefill's synthetic compute (its own record of the request) and without the
  decode's check (run after the time): pdstate's own cost over the raw engine. The parts
  (``transfer_s``, ``copy_s``, ``verify_s``) are kept under ``parts``.

On shm, the embeddable agent (``agent_shm`` / ``agent_shm_digest``, digests off and on) runs in a
phase of its own beside the ceiling and the physical limit: see ``devtools.bench_agent``. The
headline shm ratios (``shm_vs_ceiling``, ``shm_vs_physical``, ``shm_digest_vs_ceiling``) are that
phase's: see ``bench_report.ratios``.

Each native engine runs in its own phase (its pair and native agents alone, the ceiling measured
again beside it): an idle NIXL agent's progress thread still wakes about a thousand times a
second (it spun, a core busy, before ``NixlEngine.progress_delay_us``), which would tax
everything else on a small host.

The scale rows (``devtools.bench_scale``): the agent pair's peak RSS and its growth over 1,000
small requests, and a 2 x 2 agent cluster's aggregate throughput (``mxn``).

Plus planner timings (fully fragmented and fully contiguous 128k-token requests against the
per-run Python loop) and control costs (handshake round trip, an empty transfer, a 1-token
request).

The ratios, summary and output files are ``devtools.bench_report``; the command is ``cmd_bench`` here.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from pdstate.devtools import bench_report, bench_scale
from pdstate.devtools.baselines import (
    ENGINE_OPTIONS,
    ZmqEcho,
    gather_scatter,
    median_range,
    memmove_loop,
    raw_engine,
)
from pdstate.devtools.bench_measure import Side, measure, plan_for, settings, speeds_line, timeit
from pdstate.errors import ExitCode
from pdstate.pools.presets import preset
from pdstate.protocol.lifecycle import PeerState
from pdstate.transfer.planner import plan_request, plan_request_loop
from pdstate.worker import requests as rq

LENGTHS = (2048, 8192, 32768, 131072)
CONTROL_BLOCKS = 5  # the empty transfers and the bare round trips, measured in this many turns each


def bench_planner(runs: int) -> dict:
    side = Side("paged")
    other = Side("paged")
    n_pages = 131072 // 256
    rng = np.random.default_rng(7)
    names = rq.channel_names(side.kv)
    a = rq.allocate(side.pools, names, 131072)
    b = rq.allocate(other.pools, names, 131072)
    frag_s = [rng.permutation(a.lists[0])] + a.lists[1:]
    frag_d = [rng.permutation(b.lists[0])] + b.lists[1:]
    contig = timeit(lambda: plan_request(side.kv, other.kv, a.lists, b.lists), runs * 4)
    frag = timeit(lambda: plan_request(side.kv, other.kv, frag_s, frag_d), runs * 4)
    loop = timeit(lambda: plan_request_loop(side.kv, other.kv, frag_s, frag_d), max(3, runs // 2))
    plan_f = plan_request(side.kv, other.kv, frag_s, frag_d)
    plan_c = plan_request(side.kv, other.kv, a.lists, b.lists)
    return {
        "pages": n_pages,
        "fragmented_ms": statistics.median(frag) * 1e3,
        "contiguous_ms": statistics.median(contig) * 1e3,
        "loop_fragmented_ms": statistics.median(loop) * 1e3,
        "descriptors_fragmented": len(plan_f),
        "descriptors_contiguous": len(plan_c),
        "buffers": len(side.kv.kv_data_ptrs) + sum(len(p) for p in side.kv.state_data_ptrs),
    }


class _Pair(NamedTuple):
    handshake_ms: float
    run: Callable[..., dict]  # run(n, verify="sample") -> the decode's result for one request
    describe: Callable[[], tuple]  # () -> (the decode's wire.KVDesc, its engine endpoint)
    close: Callable[[], None]
    run_off: Callable[[int], dict] | None = None  # run_off(n): the ``off`` decode's request, compute left out
    # prefill_raw(src_lists, dst_lists) -> write() -> seconds: NIXL's own write from the prefill
    # worker's pools into the described decode (``baselines.WorkerRawNixl``)
    prefill_raw: Callable[[list, list], Callable[[], float]] | None = None


def _pdstate_pair(
    engine: str, mode: str, preset_name: str = "dsv4-flash", pids: list | None = None, off: bool = False
) -> _Pair:
    """A prefill and a decode process, the decode registered (their pids appended to ``pids``).

    With ``off``, a second decode process at ``transfer.verify = off`` registers with the same
    prefill (which then takes any level; ``decode_share`` 1: each decode may hold the whole pool,
    one request at a time), and
    ``describe`` names that one (the raw engine then writes into the process the ``off`` row is
    measured on)."""
    from pdstate.devtools.processes import WorkerProcess
    from pdstate.worker.options import WorkerOptions

    s = settings(mode, preset_name)
    eo = ENGINE_OPTIONS.get(engine, {})
    prefill = WorkerProcess(
        WorkerOptions(
            role="prefill",
            pool=s,
            engine=engine,
            engine_options=eo,
            worker_id="bench-prefill",
            decode_share=1.0,
            transfer_verify="off" if off else "sampled",  # the least a decode may ask
        )
    )
    decodes: list = []

    def close() -> None:
        for d in decodes:
            d.close()
        prefill.close()

    try:
        ep = prefill.read_event(180)["endpoint"]
        levels = ["sampled", "off"] if off else ["sampled"]
        ready = []
        for level in levels:
            opts = WorkerOptions(
                role="decode",
                pool=s,
                engine=engine,
                engine_options=eo,
                peer=ep,
                worker_id=f"bench-decode-{level}",
                transfer_verify=level,
            )
            decodes.append(WorkerProcess(opts))
            ev = decodes[-1].read_event(180)
            if ev["event"] != "ready":
                raise RuntimeError(f"{engine}: handshake refused: {ev}")
            ready.append(ev)
    except BaseException:
        close()
        raise
    decode = decodes[0]
    if pids is not None:
        pids += [prefill.pid, *(d.pid for d in decodes)]

    def request(d, n: int, verify: str) -> dict:
        d.send(json.dumps({"cmd": "run", "lengths": [n], "concurrency": 1, "verify": verify}))
        res = d.read_event(300)
        done = d.read_event(60)
        assert done["event"] == "batch_done"
        if not res["verified"]:
            raise RuntimeError(f"{engine}: request of {n} tokens failed: {res['error']}")
        return res

    def run(n: int, verify: str = "sample") -> dict:
        res = request(decode, n, verify)
        # the decode's ``transfer_s`` ends at the agent's verdict; its check of the bytes follows
        return {**res, "transfer_s": res["transfer_s"] + res["verify_s"]}

    def compute_s(room: int) -> float:
        """The prefill's synthetic compute of ``room`` (its finished record; the decode's result
        can come a moment before the prefill, which ends the request at the verdict, records it)."""
        deadline = time.monotonic() + 10
        while True:
            ev = prefill.command({"cmd": "requests"}, "requests", 30)
            for rec in ev["finished"]:
                if rec["room"] == room:
                    return float(rec["compute_s"])
            if time.monotonic() > deadline:
                raise RuntimeError(f"{engine}: the prefill has no record of room {room}")
            time.sleep(0.005)

    def run_off(n: int) -> dict:
        """The ``off`` decode's request (no digests), its time without the prefill's synthetic
        compute (the stand-in for the model, which the raw engine does not run either) and
        without the decode's check of the bytes (it still runs, after the time)."""
        res = request(decodes[1], n, "sample")
        return {**res, "compute_s": compute_s(res["room"])}

    def describe() -> tuple:
        """The decode's KVArgs (``wire.KVDesc``) and engine endpoint, from its register message."""
        from pdstate.protocol import wire

        d = decodes[-1]
        d.send(json.dumps({"cmd": "describe"}))
        reg = wire.decode(bytes.fromhex(d.read_event(60)["register"]))
        return reg.kv, dict(reg.engine.endpoint)

    def prefill_raw(src_lists: list, dst_lists: list) -> Callable[[], float]:
        """NIXL's own write of these pages, from the prefill worker's pools (the pages pdstate
        sends from) into the described decode: prepared now, each call one write, its seconds."""

        def answer(ev: dict, event: str) -> dict:
            if ev.get("event") != event:
                raise RuntimeError(f"{engine}: the prefill's raw write: {ev.get('error', ev)}")
            return ev

        d = decodes[-1]
        d.send(json.dumps({"cmd": "describe"}))
        register = d.read_event(60)["register"]
        lists = {"src": [x.tolist() for x in src_lists], "dst": [x.tolist() for x in dst_lists]}
        prefill.send(json.dumps({"cmd": "raw_prepare", "register": register, **lists}))
        answer(prefill.read_event(120), "raw_prepared")

        def write() -> float:
            prefill.send(json.dumps({"cmd": "raw_write"}))
            return float(answer(prefill.read_event(300), "raw")["seconds"])

        return write

    return _Pair(
        ready[0]["handshake_ms"],
        run,
        describe,
        close,
        run_off if off else None,
        prefill_raw if engine == "nixl" else None,
    )


def _phase(
    mode: str,
    engine: str,
    src: Side,
    dst: Side,
    lengths,
    runs: int,
    results: dict,
    progress,
    preset_name: str = "dsv4-flash",
) -> None:
    """One native engine's variants (the raw engine, serve's worker pair over it), interleaved per
    length, next to the ceiling measured in the same phase (only this phase's processes and
    agents are alive: an idle NIXL agent's progress thread wakes about a thousand times a second,
    which would tax every other variant on a 2-core machine)."""
    progress(f"[{mode}:{engine}] starting a pdstate pair ...")
    hs, run, describe, close, run_off, prefill_raw = _pdstate_pair(
        engine, mode, preset_name, off=engine in ("mooncake", "nixl")
    )
    results.setdefault("handshake_ms", {})[f"{mode}:{engine}"] = hs
    raw, decode_kv = None, None
    try:
        if engine in ("mooncake", "nixl"):
            decode_kv, endpoint = describe()
            setup, raw_close = raw_engine(engine)
            try:
                raw = (setup(src, endpoint), raw_close)
            except BaseException:
                raw_close()
                raise
        for n in lengths:
            plan, a, b = plan_for(src, dst, n)
            variants: dict[str, Callable[[], object]] = {
                "ceiling_memmove": lambda: memmove_loop(plan),
                "ceiling_gather_scatter": gather_scatter(src, dst, a, b),
            }
            if raw is not None:  # the same pages and buffers, in the decode worker's memory (its raw rows)
                variants.update(raw[0](plan_request(src.kv, decode_kv, a.lists, b.lists)))
            if prefill_raw is not None:  # the same write from the prefill worker's own pools
                write = prefill_raw(a.lists, b.lists)
                variants[f"raw_{engine}_prefill"] = lambda write=write: {"transfer_s": write()}
            variants[f"pdstate_{engine}"] = lambda: run(n, "sample")
            variants[f"pdstate_{engine}_full_verify"] = lambda: run(n, "full")
            if run_off is not None:  # transfer.verify = off, the prefill's compute left out
                variants[f"pdstate_{engine}_off"] = lambda: run_off(n)
            times = measure(mode, engine, n, plan, variants, runs, results)
            progress(speeds_line(mode, engine, n, plan, times))
            rq.free(src.pools, a)
            rq.free(dst.pools, b)
    finally:
        close()
        if raw is not None:
            raw[1]()


ERROR_CHARS = 2000  # a recorded phase error's bound (``bench_errors``)


def error_text(exc: BaseException, limit: int = ERROR_CHARS) -> str:
    """``"Type: message"`` on one line: control characters escaped, at most ``limit`` characters
    (a cut one ends with ``... [N chars]``, N the whole text's length)."""
    raw = f"{type(exc).__name__}: {exc}"
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in raw)
    if len(text) <= limit:
        return text
    tail = f" ... [{len(text)} chars]"
    return text[: limit - len(tail)] + tail


@contextlib.contextmanager
def guarded(name: str, results: dict, progress=print):
    """Run one phase: an ``Exception`` it raises is recorded in ``results["bench_errors"]``
    (``{"phase": name, "error": "Type: message"}``, its traceback on stderr) and does not stop the
    phases after it. ``KeyboardInterrupt`` and ``SystemExit`` still end the run."""
    errors = results.setdefault("bench_errors", [])
    try:
        yield
    except Exception as exc:
        errors.append({"phase": name, "error": error_text(exc)})
        progress(f"[{name}] phase failed, the others go on: {errors[-1]['error']}")
        traceback.print_exc(file=sys.stderr)


def run_bench(
    quick: bool, engines: list[str], modes: list[str], progress=print, agent: bool = True, sglang: bool = True
) -> dict:
    """Every phase, each under ``guarded`` (a failing phase is recorded in ``bench_errors`` and the
    others still report); ``bench_errors`` is ``[]`` when every phase ran."""
    from pdstate.transfer.engines.base import EngineUnavailable, engine_class

    runs = 5 if quick else 9
    lengths = LENGTHS
    available = []
    for e in engines:
        try:
            engine_class(e).check_available()
            available.append(e)
        except (EngineUnavailable, AttributeError, ImportError) as exc:
            progress(f"skipping {e}: {exc}")
    results: dict = {
        "lengths": list(lengths),
        "runs": runs,
        "paths": {},
        "modes": modes,
        "engines": available,
        "bench_errors": [],
    }
    progress("planner ...")
    with guarded("planner", results, progress):
        results["planner"] = bench_planner(runs)
    for mode in modes:
        natives = [e for e in available if mode == "paged" and e != "shm"]  # the native engines: paged only
        with_agent = agent and mode == "paged" and "shm" in available  # shm: the agent beside the ceiling
        if not natives and not with_agent:
            continue  # no phase of this mode would use its pools
        progress(f"[{mode}] building in-process pools ...")
        sides: tuple = ()
        with guarded(f"pools:{mode}", results, progress):
            sides = (Side(mode), Side(mode))
        if not sides:
            continue
        src, dst = sides
        for e in natives:
            with guarded(f"{mode}:{e}", results, progress):
                _phase(mode, e, src, dst, lengths, runs, results, progress)
        if with_agent:
            with guarded(f"{mode}:agent", results, progress):
                from pdstate.devtools import bench_agent

                bench_agent.phase(src, dst, lengths, runs, results, progress)
        del src, dst, sides
    if "shm" in available:
        with guarded("mxn", results, progress):
            results["mxn"] = bench_scale.mxn(16 if quick else 32, progress)
    if sglang:  # SGLang's own Mooncake backend against backend pdstate: see devtools.bench_sglang
        with guarded("sglang", results, progress):
            from pdstate.devtools import bench_sglang

            bench_sglang.phase(bench_sglang.RUNS[quick], results, progress)
        with guarded("ranks", results, progress):  # the SGLang ranks' endpoints off / scraped
            from pdstate.devtools import bench_ranks

            bench_ranks.phase(quick, results, progress)
        with guarded("sched", results, progress):  # the scheduler thread's CPU per request and poll()
            from pdstate.devtools import bench_sched

            bench_sched.phase(quick, results, progress)
    progress("control ...")
    with guarded("control", results, progress):
        results["control"] = bench_control(runs * 4)
    results["ratios"] = {}
    with guarded("ratios", results, progress):
        results["ratios"] = bench_report.ratios(results)
    return results


def _handshake_ms(decode, timeout_s: float, again: bool = False) -> float:
    """A decode worker's handshake with its prefill, in ms: the first (``again=False``, waited
    for), or a new one (the decode registers again, the prefill re-validates everything). The
    time is the decode's own (its register sent -> the answer taken); while it runs this thread
    watches the decode's answer count, which it reads without the decode's I/O thread (asking that
    thread every 0.5 ms, as ``prefills()`` does, put this thread's hand-offs inside the time)."""
    peer = decode.opts.peer
    answers = decode.agent.handshakes
    t0 = time.monotonic()
    if again:
        before = answers["accepted"] + answers["rejected"]
        decode.agent.reregister(peer)
        while answers["accepted"] + answers["rejected"] == before and time.monotonic() - t0 < timeout_s:
            time.sleep(0.0005)
    while time.monotonic() - t0 < timeout_s:
        p = decode.agent.prefills().get(peer)
        fresh = not again or (p is not None and p.registered_s_ago <= time.monotonic() - t0)
        if p is not None and p.state is PeerState.ACCEPTED and fresh and p.handshake_s:
            return p.handshake_s * 1e3
        time.sleep(0.0005)
    raise TimeoutError(f"no handshake with {peer} within {timeout_s:g} s")


def bench_control(runs: int) -> dict:
    """Handshake round trips and the control path of a minimal request.

    Handshakes are measured in-process between ``pdstate serve``'s workers on the ``dsv4-flash``
    layout (the decode re-registers; the prefill re-validates the whole report and descriptors
    each time) and, as a first contact, with fresh ``tiny`` decodes. The control overhead
    (``control_overhead_ms``) is an empty transfer (no pages, no state: a request on each side,
    no bytes) between a prefill agent and a decode agent process (``bench_agent.AgentNodes``,
    digests off), the receiver's request sent -> Success. It and the bare ZeroMQ round trip
    (``ZmqEcho``) it is compared with take turns, in ``CONTROL_BLOCKS`` blocks of ``runs`` each,
    so both see the same host (measured one after the other, their ratio swung from 1.6x to 3.1x
    between runs as this VM's load changed). Then a 1-token ``tiny`` request on serve's worker
    pair (1.3 MB of state): its latency, and what is left of it without the time spent on its
    bytes (the prefill's synthetic compute and copy, the decode's verification).
    """
    from pdstate.devtools.bench_agent import AgentNodes, empty_turns
    from pdstate.worker.decode import AgentDecodeWorker
    from pdstate.worker.options import WorkerOptions
    from pdstate.worker.prefill import AgentPrefillWorker

    out: dict = {}
    flash = preset("dsv4-flash")
    with AgentPrefillWorker(WorkerOptions(role="prefill", pool=flash, engine="shm")) as p:
        with AgentDecodeWorker(WorkerOptions(role="decode", pool=flash, engine="shm", peer=p.endpoint)) as d:
            out["first_handshake_flash_ms"] = _handshake_ms(d, 60)
            out["handshake_ms"] = median_range([_handshake_ms(d, 30, again=True) for _ in range(runs)])
    tiny = preset("tiny")
    first = []
    with AgentPrefillWorker(WorkerOptions(role="prefill", pool=tiny, engine="shm")) as p:
        for i in range(5):
            opts = WorkerOptions(role="decode", pool=tiny, engine="shm", peer=p.endpoint, worker_id=f"hs-{i}")
            with AgentDecodeWorker(opts) as d:
                first.append(_handshake_ms(d, 30))
    out["first_handshake_tiny_ms"] = median_range(first)
    _, run, _, close, *_ = _pdstate_pair("shm", "paged", preset_name="tiny")
    try:
        nodes = AgentNodes(settings("paged", "tiny"))
    except BaseException:
        close()
        raise
    total, rest = [], []
    parts: dict[str, list[float]] = {"compute_s": [], "copy_s": [], "verify_s": []}
    try:
        with ZmqEcho() as echo:  # the agent pair's empty transfers and the bare round trip, in turns
            agent_empty, zmq_rt = empty_turns(nodes, echo, CONTROL_BLOCKS, runs)
        for _ in range(3):
            run(1)
        for _ in range(runs * 5):  # serve's pair: a 1-token request
            r = run(1, "sample")
            total.append(r["transfer_s"] * 1e3)
            rest.append((r["transfer_s"] - r["compute_s"] - r["copy_s"] - r["verify_s"]) * 1e3)
            for k in parts:
                parts[k].append(r[k] * 1e3)
    finally:
        nodes.close()
        close()
    out["control_overhead_ms"] = median_range(agent_empty)
    out["zmq_round_trip_ms"] = median_range(zmq_rt)
    out["request_1_token_ms"] = median_range(total)
    out["request_1_token_overhead_ms"] = median_range(rest)
    out["request_1_token_parts_ms"] = {k: median_range(v) for k, v in parts.items()}
    return out


def cmd_bench(args) -> ExitCode:
    """Run the benchmark, write its files; the last stdout line is the summary as one JSON object."""
    from pdstate.worker.base import tune_interpreter

    tune_interpreter()
    say = (lambda *a: None) if args.json else (lambda m: print(m, flush=True))
    r = run_bench(
        args.quick,
        args.engines,
        args.modes,
        progress=say,
        agent=getattr(args, "agent", True),
        sglang=getattr(args, "sglang", True),
    )
    files = bench_report.write_outputs(r, Path(args.out))
    s = bench_report.summary(r)
    if not args.json:
        print()
        print(bench_report.format_table(r))
        print()
        for k, v in s.items():
            print(f"{k}: {v}")
        print("wrote " + ", ".join(str(f) for f in files))
    print(json.dumps(s))
    failed = r.get("bench_errors") or []
    for e in failed:  # after everything is written: the exit status says a phase failed
        print(f"pdstate bench: phase {e['phase']} failed: {e['error']}", file=sys.stderr)
    return ExitCode.FAILED if failed else ExitCode.OK
