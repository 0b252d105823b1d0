"""``pdstate bench``'s measuring kit, shared by its phases (``devtools.bench``, ``devtools.bench_agent``):
the in-process pools of one side, one request's plan between two sides, and the interleaved timing
of a length's variants with its rows under ``paths`` and ``parts``."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from pdstate.devtools.baselines import median_range
from pdstate.pools.presets import build_worker_pools, preset
from pdstate.pools.reporting import build_report
from pdstate.transfer.plan import TransferPlan
from pdstate.transfer.planner import plan_request
from pdstate.worker import requests as rq

CAPACITY = 131072 + 4 * 256
PARTS = ("transfer_s", "copy_s", "verify_s", "digest_s", "prefill_digest_s")
# The rows an engine goal is read on (``ratios.mooncake_off_vs_raw``, ``ratios.nixl_off_vs_raw``: the faster raw row over
# pdstate at ``off``). After the phase's interleaved rounds they run ``GOAL_RUNS`` rounds per run
# alone, request by request, their order reversed every round, and their figures are those rounds'
# only (their turns in the phase's rounds keep the other rows' order as it was). Why: with five
# samples a row (a quick run) the ratio of two medians swung from 0.52 to 1.06 between runs of
# the same code, and inside the phase's rounds the ``off`` row follows every other variant:
# measured in that order (9 rounds), its copy took 22-104 ms at 8k where the sampled row's took
# 22-41 in the same rounds, while alone with the raw rows it took the raw rows' time. The
# extra rounds cost a quick Mooncake phase about 20 s at load 5 (a minute at load 12-15).
GOAL_ROWS = {
    "mooncake": ("raw_mooncake", "raw_mooncake_polled", "pdstate_mooncake_off"),
    "nixl": ("raw_nixl", "raw_nixl_prefill", "pdstate_nixl_off"),
}
GOAL_RUNS = 5


def settings(mode: str, preset_name: str = "dsv4-flash"):
    if preset_name != "dsv4-flash":
        return preset(preset_name).with_(unified_kv=(mode == "unified"))
    return preset("dsv4-flash").with_(unified_kv=(mode == "unified"), full_tokens=CAPACITY, max_num_reqs=2)


class Side:
    def __init__(self, mode: str, preset_name: str = "dsv4-flash") -> None:
        self.pools = build_worker_pools(settings(mode, preset_name))
        _, self.kv = build_report(self.pools.target, self.pools.draft)
        for t in self.pools.target.buffers.values():
            t.view(-1)[:] = 0  # first touch outside any timing


def plan_for(src: Side, dst: Side, n: int) -> tuple[TransferPlan, rq.Allocation, rq.Allocation]:
    a = rq.allocate(src.pools, rq.channel_names(src.kv), n)
    b = rq.allocate(dst.pools, rq.channel_names(dst.kv), n)
    return plan_request(src.kv, dst.kv, a.lists, b.lists), a, b


def timeit(fn: Callable[[], object], runs: int) -> list[float]:
    fn()
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def speeds_line(mode: str, engine: str, n: int, plan: TransferPlan, times: dict[str, list[float]]) -> str:
    """One progress line: the request's size and each variant's median GB/s."""
    return (
        f"[{mode}:{engine}] {n:>6} tokens: {plan.total_bytes / 1e6:8.1f} MB, {len(plan)} descriptors: "
        + ", ".join(f"{k} {plan.total_bytes / statistics.median(v) / 1e9:.2f}" for k, v in times.items())
        + " GB/s"
    )


def measure(mode: str, engine: str, n: int, plan: TransferPlan, variants: dict, runs: int, results: dict) -> dict:
    """Warm every variant up, run them interleaved ``runs`` times (then ``engine``'s goal rows,
    ``GOAL_ROWS``, ``GOAL_RUNS * runs`` rounds on their own, which alone give their figures), and
    record each one's row under
    ``paths`` (plus the phase's ``ceiling``: the better of the two in-process copies) and its parts
    under ``parts``. A variant that returns a dict reports its own time: ``transfer_s`` less
    ``compute_s`` (the prefill's synthetic compute, where there is one); the other parts it names
    (``copy_s``, ``verify_s``, ``digest_s``, ``prefill_digest_s``) are kept. Returns the times."""
    times: dict[str, list[float]] = {k: [] for k in variants}
    extra: dict[str, list[float]] = {}

    goal = [k for k in GOAL_ROWS.get(engine, ()) if k in variants]
    goal = goal if len(goal) > 1 else []

    def sample(k: str, keep: bool = True) -> None:
        t0 = time.perf_counter()
        out = variants[k]()
        if not keep:
            return
        if isinstance(out, dict):
            # request sent -> TransferDone received and verified, less the prefill's
            # synthetic compute (the model's prefill, which precedes any transfer)
            dt = out["transfer_s"] - out.get("compute_s", 0.0)
            for part in PARTS:
                if part in out:
                    extra.setdefault(f"{k}:{part}", []).append(out[part])
        else:
            dt = time.perf_counter() - t0
        times[k].append(dt)

    for fn in variants.values():
        fn()  # warm-up
    for _ in range(runs):
        for k in variants:  # interleaved
            sample(k, keep=k not in goal)
    for r in range(GOAL_RUNS * runs if goal else 0):  # the goal's rows alone, order reversed every round
        for k in goal if r % 2 == 0 else goal[::-1]:
            sample(k)
    ceiling = min(statistics.median(times["ceiling_memmove"]), statistics.median(times["ceiling_gather_scatter"]))
    row = results["paths"]
    for k, ts in times.items():
        row.setdefault(f"{mode}:{engine}:{k}", {})[str(n)] = {
            "bytes": plan.total_bytes,
            "descriptors": len(plan),
            "seconds": median_range(ts),
            "gbps": median_range([plan.total_bytes / t / 1e9 for t in ts]),
        }
    best = {"ceiling": ceiling}
    physical = {k: statistics.median(ts) for k, ts in times.items() if k.startswith("physical_")}
    if physical:  # the physical limit: the best thread count's median (``baselines.physical_copy``)
        best["physical"] = min(physical.values())
    for name, t in best.items():
        row.setdefault(f"{mode}:{engine}:{name}", {})[str(n)] = {
            "bytes": plan.total_bytes,
            "descriptors": len(plan),
            "seconds": {"median": t},
            "gbps": {"median": plan.total_bytes / t / 1e9},
        }
    for k, ts in extra.items():
        results.setdefault("parts", {}).setdefault(f"{mode}:{engine}:{k}", {})[str(n)] = median_range(ts)
    return times
