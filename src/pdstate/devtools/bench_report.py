"""What ``pdstate bench`` makes of its measurements (``bench.run_bench``'s result): the ratios, the
one-line summary, ``bench.json`` and ``bench.png``, the console table; and the command itself.

Light to import (``pdstate.cli`` does so before parsing argv): the benchmark, and torch with it,
load inside ``cmd_bench``.
"""

from __future__ import annotations

import json
from pathlib import Path

from pdstate.errors import ExitCode


def ratios(r: dict) -> dict:
    """Per length: ceiling / pdstate (shm), raw engine / pdstate (native engines), each within its
    own phase; in the agent phase, ceiling / agent and today's worker path / agent (above 1: the
    agent is faster), digests off (``agent_*``) and on (``agent_digest_*``); in the sglang phase,
    SGLang's Mooncake backend / backend pdstate (above 1: pdstate is faster). The keys without
    ``_by_length`` are the 32k-token values."""
    out: dict = {}
    paths = r["paths"]

    def med(path: str, n: int) -> float | None:
        v = paths.get(path, {}).get(str(n))
        return None if v is None else v["seconds"]["median"]

    for n in r["lengths"]:
        for mode in r["modes"]:
            sfx = "" if mode == "paged" else f"_{mode}"
            c = med(f"{mode}:shm:ceiling", n)
            for variant, key in (
                ("pdstate_shm", "shm_vs_ceiling"),
                ("pdstate_shm_full_verify", "shm_full_verify_vs_ceiling"),
            ):
                pd = med(f"{mode}:shm:{variant}", n)
                if pd and c:
                    out.setdefault(f"{key}{sfx}_by_length", {})[str(n)] = c / pd
        for e in ("mooncake", "nixl"):
            raw = med(f"paged:{e}:raw_{e}", n)
            for variant, key in (
                (f"pdstate_{e}", f"{e}_vs_raw"),
                (f"pdstate_{e}_full_verify", f"{e}_full_verify_vs_raw"),
            ):
                pd = med(f"paged:{e}:{variant}", n)
                if pd and raw:
                    out.setdefault(f"{key}_by_length", {})[str(n)] = raw / pd
        c, worker = med("paged:agent:ceiling", n), med("paged:agent:pdstate_shm", n)
        for variant, key in (("agent_shm", "agent"), ("agent_shm_digest", "agent_digest")):
            ag = med(f"paged:agent:{variant}", n)
            if ag and c:
                out.setdefault(f"{key}_vs_ceiling_by_length", {})[str(n)] = c / ag
            if ag and worker:
                out.setdefault(f"{key}_vs_worker_by_length", {})[str(n)] = worker / ag
    for n, sgl in r.get("sglang_mooncake_ms_by_length", {}).items():  # the sglang phase (--sglang)
        ours = r.get("sglang_backend_ms_by_length", {}).get(n)
        if ours:
            out.setdefault("sglang_backend_vs_sglang_mooncake_by_length", {})[n] = sgl / ours
    for key in [k[: -len("_by_length")] for k in list(out)]:
        out[key] = out[f"{key}_by_length"].get("32768")
    return out


NAMED_RATIOS = (
    "shm_vs_ceiling",
    "mooncake_vs_raw",
    "nixl_vs_raw",
    "agent_vs_ceiling",
    "agent_digest_vs_ceiling",
    "agent_vs_worker",
    "agent_digest_vs_worker",
)


def agent_digest_ms(r: dict) -> dict:
    """Per length, each side's digest time in the agent phase (digest on): ms, median."""
    parts = r.get("parts", {})
    out: dict = {}
    for side, part in (("decode", "digest_s"), ("prefill", "prefill_digest_s")):
        for n, v in parts.get(f"paged:agent:agent_shm_digest:{part}", {}).items():
            out.setdefault(n, {})[side] = v["median"] * 1e3
    return out


def summary(r: dict) -> dict:
    return {
        "ratios": {k: r["ratios"].get(k) for k in NAMED_RATIOS}
        | {k: v for k, v in r["ratios"].items() if k not in NAMED_RATIOS},
        "agent_digest_ms_p50_by_length": agent_digest_ms(r),
        "plan_fragmented_128k_ms": r["planner"]["fragmented_ms"],
        "plan_contiguous_128k_ms": r["planner"]["contiguous_ms"],
        "plan_speedup_vs_loop": r["planner"]["loop_fragmented_ms"] / r["planner"]["fragmented_ms"],
        "handshake_ms_p50": r["control"]["handshake_ms"]["median"],
        "control_overhead_ms_p50": r["control"]["control_overhead_ms"]["median"],
        "request_1_token_ms_p50": r["control"]["request_1_token_ms"]["median"],
        "request_1_token_overhead_ms_p50": r["control"]["request_1_token_overhead_ms"]["median"],
        "zmq_round_trip_ms_p50": r["control"].get("zmq_round_trip_ms", {}).get("median"),
        "first_handshake_flash_ms": r["control"]["first_handshake_flash_ms"],
        "descriptors_contiguous_128k": r["planner"]["descriptors_contiguous"],
        "descriptors_fragmented_128k": r["planner"]["descriptors_fragmented"],
    } | {k: r[k] for k in ("sglang_mooncake_ms_by_length", "sglang_backend_ms_by_length") if k in r}


COLORS = {
    ("paged", "shm"): "tab:blue",
    ("unified", "shm"): "tab:cyan",
    ("paged", "mooncake"): "tab:green",
    ("paged", "nixl"): "tab:red",
    ("paged", "agent"): "tab:orange",
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
    fig, ax = plt.subplots(figsize=(8, 5))
    for path, per_len in sorted(r["paths"].items()):
        mode, engine, variant = path.split(":", 2)
        if variant in ("ceiling_memmove", "ceiling_gather_scatter") or (
            engine != "shm" and variant in ("ceiling", "pdstate_shm")
        ):
            continue  # one ceiling per mode and one shm path (the shm phase's); the others are in bench.json
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
    for path, per_len in sorted(r["paths"].items()):
        for n, v in per_len.items():
            g = v["gbps"]
            span = f"{g['min']:>7.2f}..{g['max']:<7.2f}" if "min" in g else ""
            lines.append(f"{path:<44} {n:>7} {g['median']:>12.2f} {span}")
    return "\n".join(lines)


def cmd_bench(args) -> ExitCode:
    """Run the benchmark, write its files; the last stdout line is the summary as one JSON object."""
    from pdstate.devtools import bench
    from pdstate.runtime.worker import tune_interpreter

    tune_interpreter()
    say = (lambda *a: None) if args.json else (lambda m: print(m, flush=True))
    r = bench.run_bench(
        args.quick,
        args.engines,
        args.modes,
        progress=say,
        agent=getattr(args, "agent", True),
        sglang=getattr(args, "sglang", False),
    )
    files = write_outputs(r, Path(args.out))
    s = summary(r)
    if not args.json:
        print()
        print(format_table(r))
        print()
        for k, v in s.items():
            print(f"{k}: {v}")
        print("wrote " + ", ".join(str(f) for f in files))
    print(json.dumps(s))
    return ExitCode.OK
