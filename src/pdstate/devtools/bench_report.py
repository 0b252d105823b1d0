"""What ``pdstate bench`` makes of its measurements (``bench.run_bench``'s result): the ratios, the
one-line summary, ``bench.json``, ``bench.md`` (the README's performance tables, from this one
run) and ``bench.png``, the console table (``pdstate bench`` itself is ``bench.cmd_bench``).

``python -m pdstate.devtools.bench_report bench-out/bench.json`` prints the tables of a saved run
again (``devtools.bench_tables``).

Light to import: no benchmark, no torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from pdstate.errors import ExitCode

# each native engine's raw rows (``baselines.raw_engine``): its ``*_vs_raw`` ratios take the faster
# one per length, the best a caller does with that engine alone
RAW_ROWS = {"mooncake": ("raw_mooncake", "raw_mooncake_polled"), "nixl": ("raw_nixl", "raw_nixl_prefill")}


def ratios(r: dict) -> dict:
    """Per length, each within its own phase:

    - the headline shm keys measure the agent (``pdstate serve``'s path and an engine's), in the
      agent phase: ``shm_vs_ceiling`` (= ``agent_vs_ceiling``), ``shm_vs_physical`` and
      ``shm_digest_vs_ceiling`` (= ``agent_digest_vs_ceiling``);
    - raw engine / serve's worker pair for the native engines (``<engine>_vs_raw``,
      ``<engine>_full_verify_vs_raw``, ``<engine>_off_vs_raw``), the raw engine being its faster
      raw row per length (``RAW_ROWS``: Mooncake's spinning sync write or its submitted and
      polled write, whichever was faster; NIXL's write from the bench's process or from the
      prefill worker's; each one's own ratio to ``off`` is kept as
      ``<engine>_off_vs_<row>``); in the sglang phase, SGLang's Mooncake backend / backend
      pdstate (above 1: pdstate is faster; ``..._by_release``: the prefill's send -> Success,
      ``sglang_backend_vs_sglang_mooncake_decode_by_release``: the decode's metadata -> Success),
      and the SGLang ranks' endpoints scraped / off (``sglang_rank_endpoint_scraped_vs_off``,
      above 1: they cost time).

    The keys without ``_by_length`` are the 32k-token values."""
    out: dict = {}
    paths = r.get("paths") or {}

    def med(path: str, n: int) -> float | None:
        v = paths.get(path, {}).get(str(n))
        return None if v is None else v["seconds"]["median"]

    for n in r.get("lengths") or []:
        for e in ("mooncake", "nixl"):
            rows = {row: med(f"paged:{e}:{row}", n) for row in RAW_ROWS[e]}
            raw = min((t for t in rows.values() if t), default=None)  # the raw engine at its best
            for variant, key in (
                (f"pdstate_{e}", f"{e}_vs_raw"),
                (f"pdstate_{e}_full_verify", f"{e}_full_verify_vs_raw"),
                (f"pdstate_{e}_off", f"{e}_off_vs_raw"),  # transfer.verify off, compute left out
            ):
                pd = med(f"paged:{e}:{variant}", n)
                if pd and raw:
                    out.setdefault(f"{key}_by_length", {})[str(n)] = raw / pd
            off = med(f"paged:{e}:pdstate_{e}_off", n)
            for row, t in rows.items() if len(rows) > 1 else ():  # each raw row on its own, the details
                if off and t:
                    out.setdefault(f"{e}_off_vs_{row}_by_length", {})[str(n)] = t / off
        c = med("paged:agent:ceiling", n)
        for variant, key in (
            ("agent_shm", "agent"),
            ("agent_shm_sampled", "agent_sampled"),
            ("agent_shm_digest", "agent_digest"),
        ):
            ag = med(f"paged:agent:{variant}", n)
            if ag and c:
                out.setdefault(f"{key}_vs_ceiling_by_length", {})[str(n)] = c / ag
        phys, ag = med("paged:agent:physical", n), med("paged:agent:agent_shm", n)
        if phys and ag:
            out.setdefault("shm_vs_physical_by_length", {})[str(n)] = phys / ag
    for alias, key in (("shm_vs_ceiling", "agent_vs_ceiling"), ("shm_digest_vs_ceiling", "agent_digest_vs_ceiling")):
        if f"{key}_by_length" in out:  # the headline names, for the agent path
            out[f"{alias}_by_length"] = out[f"{key}_by_length"]
    for n, sgl in r.get("sglang_mooncake_ms_by_length", {}).items():  # the sglang phase
        for mine, key in (
            ("sglang_backend_ms_by_length", "sglang_backend_vs_sglang_mooncake_by_length"),
            ("sglang_backend_full_ms_by_length", "sglang_backend_full_vs_sglang_mooncake_by_length"),
        ):
            ours = r.get(mine, {}).get(n)
            if ours:
                out.setdefault(key, {})[n] = sgl / ours
    for key in [k[: -len("_by_length")] for k in list(out)]:
        out[key] = out[f"{key}_by_length"].get("32768")
    for release, by in r.get("sglang_by_release", {}).items():  # SGLang's time / pdstate's, per release
        for mine, key in (
            ("pdstate", "sglang_backend_vs_sglang_mooncake"),
            ("pdstate@full", "sglang_backend_full_vs_sglang_mooncake"),
        ):
            ratio = {n: sgl / by[mine][n] for n, sgl in by.get("mooncake", {}).items() if by.get(mine, {}).get(n)}
            out.setdefault(f"{key}_by_release", {})[release] = ratio
    for release, by in r.get("sglang_decode_by_release", {}).items():  # the decode's metadata -> Success
        mine = by.get("pdstate", {})
        ratio = {n: sgl / mine[n] for n, sgl in by.get("mooncake", {}).items() if mine.get(n)}
        out.setdefault("sglang_backend_vs_sglang_mooncake_decode_by_release", {})[release] = ratio
    off, on = r.get("sglang_rank_endpoint_off_ms"), r.get("sglang_rank_endpoint_scraped_ms")
    if off and on:  # the rank endpoints scraped / off (devtools.bench_ranks): above 1 they cost time
        out["sglang_rank_endpoint_scraped_vs_off"] = on / off
    limit = physical_limit(r)
    if r.get("mxn") and limit["gbps"]:
        out["mxn_vs_physical"] = r["mxn"]["gbps"] / limit["gbps"]
    return out


def verify_cost(r: dict) -> dict:
    """``verify_cost_by_mode``: per level (``sampled``, ``full``) and length, the agent's median
    time at that level / its median with ``off`` - 1 (agent phase, interleaved runs)."""
    paths, out = r.get("paths", {}), {}
    off = paths.get("paged:agent:agent_shm", {})
    for level, variant in (("sampled", "agent_shm_sampled"), ("full", "agent_shm_digest")):
        for n, row in paths.get(f"paged:agent:{variant}", {}).items():
            if n in off:
                base = off[n]["seconds"]["median"]
                out.setdefault(level, {})[n] = row["seconds"]["median"] / base - 1
    return out


def physical_phase(r: dict) -> str | None:
    """The phase that measures the physical limit: the agent's (``None`` when it did not run)."""
    return "agent" if "paged:agent:physical" in r.get("paths", {}) else None


def physical_limit(r: dict, n: int = 32768) -> dict:
    """The physical copy limit at ``n`` tokens' bytes (``physical_phase``): GB/s and the thread
    count that reached it."""
    paths, phase = r.get("paths", {}), physical_phase(r)
    row = paths.get(f"paged:{phase}:physical", {}).get(str(n))
    if row is None:
        return {"gbps": None, "threads": None}
    per_k = {
        int(k.rsplit("_", 1)[1][:-1]): v[str(n)]["seconds"]["median"]
        for k, v in paths.items()
        if k.startswith(f"paged:{phase}:physical_") and str(n) in v
    }
    return {"gbps": row["gbps"]["median"], "threads": min(per_k, key=per_k.get) if per_k else None}


NAMED_RATIOS = (
    "shm_vs_ceiling",
    "shm_vs_ceiling_by_length",
    "shm_vs_physical",
    "shm_digest_vs_ceiling",
    "mxn_vs_physical",
    "mooncake_vs_raw",
    "nixl_vs_raw",
    "agent_vs_ceiling",
    "agent_digest_vs_ceiling",
    "sglang_backend_vs_sglang_mooncake",
    "sglang_backend_vs_sglang_mooncake_by_length",
    "sglang_backend_full_vs_sglang_mooncake",
    "sglang_backend_full_vs_sglang_mooncake_by_length",
    "sglang_backend_vs_sglang_mooncake_by_release",
    "sglang_backend_vs_sglang_mooncake_decode_by_release",
    "sglang_rank_endpoint_scraped_vs_off",
)

RESULT_KEYS = (  # top-level ``results`` keys the summary carries as they are (null where not measured)
    "sglang_mooncake_ms_by_length",
    "sglang_backend_ms_by_length",
    "sglang_backend_full_ms_by_length",
    "sglang_rank_endpoint_off_ms",
    "sglang_rank_endpoint_scraped_ms",
    "sglang_rank_endpoint_cpu_ms_per_scrape",
    "sglang_rank_endpoint_child_cpu_ms_per_scrape",
    "sglang_rank_endpoint_scrapes",
    "sglang_scheduler_cpu_us_per_request_by_release",
    "sglang_poll_us_by_release",
    "sglang_ratio_ci95_by_release",
    "sglang_bytes_by_release",
    "sglang_descriptors_by_release",
    "bench_errors",
)


def agent_digest_ms(r: dict) -> dict:
    """Per length, each side's digest time in the agent phase (digest on): ms, median."""
    parts = r.get("parts", {})
    out: dict = {}
    for side, part in (("decode", "digest_s"), ("prefill", "prefill_digest_s")):
        for n, v in parts.get(f"paged:agent:agent_shm_digest:{part}", {}).items():
            out.setdefault(n, {})[side] = v["median"] * 1e3
    return out


def _median(section: dict, key: str) -> float | None:
    v = section.get(key)
    return v.get("median") if isinstance(v, dict) else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summary(r: dict) -> dict:
    """The one-line summary: every key in every summary, ``null`` where its phase did not run
    (or failed: ``bench_errors`` says which)."""
    rat, planner, control = r.get("ratios") or {}, r.get("planner") or {}, r.get("control") or {}
    return (
        {
            "ratios": {k: rat.get(k) for k in NAMED_RATIOS} | {k: v for k, v in rat.items() if k not in NAMED_RATIOS},
            "agent_digest_ms_p50_by_length": agent_digest_ms(r),
            "verify_cost_by_mode": verify_cost(r),
            "sglang_versions": (r.get("sglang") or {}).get("versions", []),
            "plan_fragmented_128k_ms": planner.get("fragmented_ms"),
            "plan_contiguous_128k_ms": planner.get("contiguous_ms"),
            "plan_speedup_vs_loop": _ratio(planner.get("loop_fragmented_ms"), planner.get("fragmented_ms")),
            "handshake_ms_p50": _median(control, "handshake_ms"),
            "control_overhead_ms_p50": _median(control, "control_overhead_ms"),
            "request_1_token_ms_p50": _median(control, "request_1_token_ms"),
            "request_1_token_overhead_ms_p50": _median(control, "request_1_token_overhead_ms"),
            "zmq_round_trip_ms_p50": _median(control, "zmq_round_trip_ms"),
            "first_handshake_flash_ms": control.get("first_handshake_flash_ms"),
            "descriptors_contiguous_128k": planner.get("descriptors_contiguous"),
            "descriptors_fragmented_128k": planner.get("descriptors_fragmented"),
        }
        | scale_summary(r)
        | {k: r.get(k) for k in RESULT_KEYS}
    )


def scale_summary(r: dict) -> dict:
    """The physical limit, control path against ZeroMQ, the M x N row and memory (null if not run)."""
    limit = physical_limit(r)
    c = r.get("control") or {}
    ctl, zmq = _median(c, "control_overhead_ms"), _median(c, "zmq_round_trip_ms")
    mxn, mem = r.get("mxn") or {}, r.get("agent_memory") or {}
    return {
        "physical_limit_gbps": limit["gbps"],
        "physical_limit_threads": limit["threads"],
        "physical_limit_gbps_by_length": {
            n: v["gbps"]["median"] for n, v in r.get("paths", {}).get(f"paged:{physical_phase(r)}:physical", {}).items()
        },
        "control_overhead_vs_zmq": _ratio(ctl, zmq) if ctl else None,
        "mxn_2x2_gbps": mxn.get("gbps"),
        "mxn_2x2": mxn or None,
        "peak_rss_mb": mem.get("peak_rss_mb"),
        "rss_growth_mb": mem.get("rss_growth_mb"),
        "rss_anon_growth_mb": mem.get("anon_growth_mb"),
        "rss_growth_requests": mem.get("requests"),
    }


COLORS = {
    ("paged", "mooncake"): "tab:green",
    ("paged", "nixl"): "tab:red",
    ("paged", "agent"): "tab:orange",
}


def write_outputs(r: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    from pdstate.devtools.bench_tables import markdown

    written = [out_dir / "bench.json", out_dir / "bench.md"]
    written[0].write_text(json.dumps(r, indent=2, sort_keys=True) + "\n")
    written[1].write_text(markdown(r, summary_or_none(r)))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    fig, ax = plt.subplots(figsize=(8, 5))
    for path, per_len in sorted((r.get("paths") or {}).items()):
        mode, engine, variant = path.split(":", 2)
        if variant in ("ceiling_memmove", "ceiling_gather_scatter") or (engine != "agent" and variant == "ceiling"):
            continue  # one ceiling (the agent phase's); the others are in bench.json
        pts = sorted((int(n), v["gbps"]["median"]) for n, v in per_len.items())
        style = "--" if variant.endswith(("full_verify", "digest")) else (":" if variant.startswith("raw") else "-")
        label = f"{mode}: {'ceiling (in-process copy)' if variant == 'ceiling' else variant}"
        color = (
            ("black" if mode == "paged" else "grey")
            if variant == "ceiling"
            else COLORS.get((mode, engine), "tab:purple")
        )
        ax.plot([x for x, _ in pts], [y for _, y in pts], style, color=color, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("request length (tokens)")
    ax.set_ylabel("GB/s (median)")
    ax.set_title("dsv4-flash request state: throughput by path")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "bench.png", dpi=110)
    written.append(out_dir / "bench.png")
    return written


def format_table(r: dict) -> str:
    """Every measured path: median GB/s per request length, and the range over the runs."""
    lines = [f"{'path':<44} {'tokens':>7} {'GB/s median':>12} {'[min..max]':>16}"]
    for path, per_len in sorted((r.get("paths") or {}).items()):
        for n, v in per_len.items():
            g = v["gbps"]
            span = f"{g['min']:>7.2f}..{g['max']:<7.2f}" if "min" in g else ""
            lines.append(f"{path:<44} {n:>7} {g['median']:>12.2f} {span}")
    return "\n".join(lines)


def summary_or_none(r: dict) -> dict | None:
    """``summary(r)``, or None for a result without the sections a summary needs."""
    try:
        return summary(r)
    except (KeyError, TypeError, ZeroDivisionError):
        return None


def main(argv: list[str] | None = None) -> int:
    """``python -m pdstate.devtools.bench_report BENCH_JSON``: print the run's tables again."""
    import sys

    from pdstate.devtools.bench_tables import markdown

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m pdstate.devtools.bench_report bench-out/bench.json", file=sys.stderr)
        return int(ExitCode.CONFIG)
    try:
        r = json.loads(Path(args[0]).read_text())
    except (OSError, ValueError) as exc:
        print(f"bench_report: cannot read {args[0]}: {exc}", file=sys.stderr)
        return int(ExitCode.FAILED)
    print(markdown(r, summary_or_none(r)), end="")
    return int(ExitCode.OK)


if __name__ == "__main__":
    raise SystemExit(main())
