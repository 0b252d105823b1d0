"""``pdstate bench``: pdstate against the in-process ceiling and the raw engines, in one run.

For the ``dsv4-flash`` layout (target + NextN draft) and each request length, the variants are
interleaved round-robin in one process run (these machines are shared; ratios, not absolutes):

- ``ceiling``: an in-process copy of exactly the regions a request moves (same page ids, same
  descriptors), the best of a per-run ``memmove`` loop and a vectorised numpy gather/scatter;
- ``raw_<engine>``: the native engine (Mooncake, NIXL) writing the same descriptor list between
  two of its own agents, with no pdstate code in the loop;
- ``pdstate_<engine>``: a real prefill and decode process pair, from ``TransferRequest`` sent to
  ``TransferDone`` received and verified (decode-side wall time per request), less the time the
  prefill spent synthesising the request's state (``TransferDone.compute_s``: the stand-in for the
  model's prefill compute, which precedes any transfer in a real deployment). The same time with
  the synthetic compute included is kept as ``pdstate_<engine>_incl_compute``.

Plus planner timings (fully fragmented and fully contiguous 128k-token requests against the
per-run Python loop) and control costs (handshake round trip, an empty-ish request).
"""

from __future__ import annotations

import ctypes
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np

from pdstate.layout import build_report
from pdstate.planner import TransferPlan, plan_request, plan_request_loop
from pdstate.presets import build_worker_pools, preset
from pdstate.runtime import requests as rq

LENGTHS = (2048, 8192, 32768, 131072)
CAPACITY = 131072 + 4 * 256


def _median_range(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _settings(mode: str):
    return preset("dsv4-flash").with_(unified_kv=(mode == "unified"), full_tokens=CAPACITY, max_num_reqs=2)


class _Side:
    def __init__(self, mode: str) -> None:
        self.pools = build_worker_pools(_settings(mode))
        _, self.kv = build_report(self.pools.target, self.pools.draft)
        for t in self.pools.target.buffers.values():
            t.view(-1)[:] = 0  # first touch outside any timing


def _plan_for(src: _Side, dst: _Side, n: int) -> tuple[TransferPlan, rq.Allocation, rq.Allocation]:
    a = rq.allocate(src.pools, rq.channel_names(src.kv), n)
    b = rq.allocate(dst.pools, rq.channel_names(dst.kv), n)
    return plan_request(src.kv, dst.kv, a.lists, b.lists), a, b


def _memmove_loop(plan: TransferPlan) -> None:
    mv = ctypes.memmove
    for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist()):
        mv(d, s, n)


def _gather_scatter(src: _Side, dst: _Side, a: rq.Allocation, b: rq.Allocation) -> Callable[[], None]:
    from pdstate.planner import channels_of
    from pdstate.runtime.synth import _item_matrix

    ops = []
    for sc, dc, si, di in zip(channels_of(src.kv), channels_of(dst.kv), a.lists, b.lists):
        if si.size == 0:
            continue
        for j in range(len(sc.ptrs)):
            item = int(sc.items[j])
            ops.append((_item_matrix(int(sc.ptrs[j]), int(sc.lens[j]), item),
                        _item_matrix(int(dc.ptrs[j]), int(dc.lens[j]), item), si, di))

    def run() -> None:
        for sm, dm, si, di in ops:
            dm[di] = sm[si]
    return run


def _timeit(fn: Callable[[], object], runs: int) -> list[float]:
    fn()
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench_planner(runs: int) -> dict:
    side = _Side("paged")
    other = _Side("paged")
    n_pages = 131072 // 256
    rng = np.random.default_rng(7)
    names = rq.channel_names(side.kv)
    a = rq.allocate(side.pools, names, 131072)
    b = rq.allocate(other.pools, names, 131072)
    frag_s = [rng.permutation(a.lists[0])] + a.lists[1:]
    frag_d = [rng.permutation(b.lists[0])] + b.lists[1:]
    contig = _timeit(lambda: plan_request(side.kv, other.kv, a.lists, b.lists), runs * 4)
    frag = _timeit(lambda: plan_request(side.kv, other.kv, frag_s, frag_d), runs * 4)
    loop = _timeit(lambda: plan_request_loop(side.kv, other.kv, frag_s, frag_d), max(3, runs // 2))
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


def _raw_engine(name: str):
    """Two native agents in this process writing a plan; returns ``(setup(src, dst), run(plan))``."""
    from pdstate.engines.base import create_engine

    opts = {"mooncake": {"host": "127.0.0.1"}, "nixl": {}}[name]
    dst_eng = create_engine(name, **opts)
    src_eng = create_engine(name, **opts)

    def setup(src: _Side, dst: _Side) -> Callable[[TransferPlan], None]:
        dst_eng.start()
        dst_eng.register(dst.pools.memory.regions())
        src_eng.start()
        src_eng.register(src.pools.memory.regions())
        peer = src_eng.connect(dst_eng.endpoint())

        def run(plan: TransferPlan) -> None:
            src_eng.wait(src_eng.submit(peer, plan), 120)
        return run

    def close() -> None:
        for e in (src_eng, dst_eng):
            e.close()
    return setup, close


def _pdstate_pair(engine: str, mode: str):
    from pdstate.procs import WorkerProcess
    from pdstate.runtime.common import WorkerOptions

    s = _settings(mode)
    prefill = WorkerProcess(WorkerOptions(role="prefill", pool=s, engine=engine, worker_id="bench-prefill"))
    ep = prefill.read_event(180)["endpoint"]
    decode = WorkerProcess(WorkerOptions(role="decode", pool=s, engine=engine, peer=ep, worker_id="bench-decode"))
    ev = decode.read_event(180)
    if ev["event"] != "ready":
        prefill.close()
        decode.close()
        raise RuntimeError(f"{engine}: handshake refused: {ev}")

    def run(n: int) -> dict:
        decode.send(json.dumps({"cmd": "run", "lengths": [n], "concurrency": 1}))
        res = decode.read_event(300)
        done = decode.read_event(60)
        assert done["event"] == "batch_done"
        if not res["verified"]:
            raise RuntimeError(f"{engine}: request of {n} tokens failed: {res['error']}")
        return res

    def close() -> None:
        decode.close()
        prefill.close()
    return ev["handshake_ms"], run, close


def run_bench(quick: bool, engines: list[str], modes: list[str], progress=print) -> dict:
    from pdstate.engines.base import EngineUnavailable, engine_class

    runs = 5
    lengths = LENGTHS
    available = []
    for e in engines:
        try:
            engine_class(e).check_available()
            available.append(e)
        except (EngineUnavailable, AttributeError, ImportError) as exc:
            progress(f"skipping {e}: {exc}")
    results: dict = {"lengths": list(lengths), "runs": runs, "paths": {}, "modes": modes}
    progress("planner ...")
    results["planner"] = bench_planner(runs)
    for mode in modes:
        progress(f"[{mode}] building in-process pools ...")
        src, dst = _Side(mode), _Side(mode)
        raws = {}
        for e in available:
            if e in ("mooncake", "nixl") and mode == "paged":
                setup, close = _raw_engine(e)
                raws[e] = (setup(src, dst), close)
        pairs = {}
        for e in available:
            if mode == "paged" or e == "shm":
                progress(f"[{mode}] starting pdstate pair on {e} ...")
                pairs[e] = _pdstate_pair(e, mode)
        for n in lengths:
            plan, a, b = _plan_for(src, dst, n)
            gs = _gather_scatter(src, dst, a, b)
            variants: dict[str, Callable[[], object]] = {
                "ceiling_memmove": lambda: _memmove_loop(plan),
                "ceiling_gather_scatter": gs,
            }
            for e, (run, _) in raws.items():
                variants[f"raw_{e}"] = (lambda r=run: r(plan))
            for e, (_, run, _) in pairs.items():
                variants[f"pdstate_{e}"] = (lambda r=run: r(n))
            times: dict[str, list[float]] = {k: [] for k in variants}
            times.update({f"pdstate_{e}_incl_compute": [] for e in pairs})
            for k, fn in variants.items():
                fn()  # warm-up
            for _ in range(runs):
                for k, fn in variants.items():  # interleaved
                    t0 = time.perf_counter()
                    out = fn()
                    if isinstance(out, dict):
                        times[f"{k}_incl_compute"].append(out["seconds"])
                        dt = out["seconds"] - out.get("compute_s", 0.0)
                    else:
                        dt = time.perf_counter() - t0
                    times[k].append(dt)
            for k, ts in times.items():
                gbps = [plan.total_bytes / t / 1e9 for t in ts]
                results["paths"].setdefault(f"{mode}:{k}", {})[str(n)] = {
                    "bytes": plan.total_bytes, "descriptors": len(plan), "seconds": _median_range(ts),
                    "gbps": _median_range(gbps)}
            ceil = max(statistics.median(times["ceiling_memmove"]), 1e-12)
            ceil_gs = max(statistics.median(times["ceiling_gather_scatter"]), 1e-12)
            results["paths"].setdefault(f"{mode}:ceiling", {})[str(n)] = {
                "bytes": plan.total_bytes, "seconds_median": min(ceil, ceil_gs),
                "gbps_median": plan.total_bytes / min(ceil, ceil_gs) / 1e9}
            progress(f"[{mode}] {n:>6} tokens: {plan.total_bytes / 1e6:8.1f} MB, {len(plan)} descriptors: " + ", ".join(
                f"{k} {plan.total_bytes / statistics.median(v) / 1e9:.2f} GB/s" for k, v in times.items()))
            rq.free(src.pools, a)
            rq.free(dst.pools, b)
        results.setdefault("handshake_ms", {})
        for e, (hs, _, close) in pairs.items():
            results["handshake_ms"][f"{mode}:{e}"] = hs
            close()
        for _, close in raws.values():
            close()
    results["control"] = bench_control(runs * 4)
    results["ratios"] = ratios(results)
    return results


def bench_control(runs: int) -> dict:
    """Handshake round trips and a minimal request, in-process workers on loopback.

    Handshakes are measured on the ``dsv4-flash`` layout (the decode re-registers; the prefill
    re-validates the whole report and descriptors each time) and, as a first contact, with fresh
    ``tiny`` decodes. The control overhead is a 1-token request on ``tiny`` (one page and the
    state slots) less the prefill's synthetic compute.
    """
    from pdstate.runtime.common import WorkerOptions
    from pdstate.runtime.decode import DecodeWorker
    from pdstate.runtime.prefill import PrefillWorker

    out: dict = {}
    flash = preset("dsv4-flash")
    p = PrefillWorker(WorkerOptions(role="prefill", pool=flash, engine="shm")).start()
    try:
        d = DecodeWorker(WorkerOptions(role="decode", pool=flash, engine="shm", peer=p.endpoint)).start()
        d.wait_ready(60)
        out["first_handshake_flash_ms"] = d.handshake_s * 1e3
        hs = [d.rehandshake(30) * 1e3 for _ in range(runs)]
        out["handshake_ms"] = _median_range(hs)
        d.stop()
    finally:
        p.stop()
    tiny = preset("tiny")
    p = PrefillWorker(WorkerOptions(role="prefill", pool=tiny, engine="shm")).start()
    first, overhead, overhead_total = [], [], []
    try:
        for i in range(5):
            d = DecodeWorker(WorkerOptions(role="decode", pool=tiny, engine="shm", peer=p.endpoint,
                                           worker_id=f"hs-{i}")).start()
            d.wait_ready(30)
            first.append(d.handshake_s * 1e3)
            if i == 0:
                d.transfer(1)
                for _ in range(runs):
                    r = d.transfer(1)
                    overhead_total.append(r.seconds * 1e3)
                    overhead.append((r.seconds - r.compute_s - r.copy_s) * 1e3)
            d.stop()
    finally:
        p.stop()
    out["first_handshake_tiny_ms"] = _median_range(first)
    out["request_1_token_ms"] = _median_range(overhead_total)
    out["control_overhead_ms"] = _median_range(overhead)
    return out


def ratios(r: dict) -> dict:
    out: dict = {}
    paths = r["paths"]

    def med(path: str, n: int) -> float | None:
        v = paths.get(path, {}).get(str(n))
        return None if v is None else v.get("seconds", {}).get("median", v.get("seconds_median"))

    for n in r["lengths"]:
        c = med("paged:ceiling", n)
        for e in ("shm", "mooncake", "nixl"):
            pd = med(f"paged:pdstate_{e}", n)
            if e == "shm" and pd and c:
                out.setdefault("shm_vs_ceiling_by_length", {})[str(n)] = c / pd
            raw = med(f"paged:raw_{e}", n)
            if pd and raw:
                out.setdefault(f"{e}_vs_raw_by_length", {})[str(n)] = raw / pd
    for key in ("shm_vs_ceiling", "mooncake_vs_raw", "nixl_vs_raw"):
        out[key] = out.get(f"{key}_by_length", {}).get("32768")
    return out


def summary(r: dict) -> dict:
    return {
        "ratios": {k: r["ratios"].get(k) for k in ("shm_vs_ceiling", "mooncake_vs_raw", "nixl_vs_raw")}
        | {k: v for k, v in r["ratios"].items() if k.endswith("_by_length")},
        "plan_fragmented_128k_ms": r["planner"]["fragmented_ms"],
        "plan_contiguous_128k_ms": r["planner"]["contiguous_ms"],
        "plan_speedup_vs_loop": r["planner"]["loop_fragmented_ms"] / r["planner"]["fragmented_ms"],
        "handshake_ms_p50": r["control"]["handshake_ms"]["median"],
        "control_overhead_ms_p50": r["control"]["control_overhead_ms"]["median"],
        "request_1_token_ms_p50": r["control"]["request_1_token_ms"]["median"],
        "first_handshake_flash_ms": r["control"]["first_handshake_flash_ms"],
        "descriptors_contiguous_128k": r["planner"]["descriptors_contiguous"],
        "descriptors_fragmented_128k": r["planner"]["descriptors_fragmented"],
    }


def write_outputs(r: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "bench.json"]
    written[0].write_text(json.dumps(r, indent=2, sort_keys=True) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for path, per_len in sorted(r["paths"].items()):
        xs = [int(n) for n in per_len]
        ys = [v["gbps"]["median"] if "gbps" in v else v["gbps_median"] for v in per_len.values()]
        ax.plot(xs, ys, marker="o", label=path)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("request length (tokens)")
    ax.set_ylabel("GB/s (median)")
    ax.set_title("dsv4-flash request state: throughput by path")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "bench.png", dpi=110)
    written.append(out_dir / "bench.png")
    return written
