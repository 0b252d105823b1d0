"""``pdstate demo``: N prefill and M decode agent processes on one host (one and one by default),
a handshake between every pair, a batch of requests of mixed lengths routed over the pairs with one
progress line each (full room ids), and a summary table with per-pair counts
(``devtools.cluster``: the processes are ``PrefillAgent`` / ``DecodeAgent`` users whose callers
fill and verify the synthetic content).

Light to import (``pdstate.cli`` does so before parsing argv): the cluster, and torch with it,
loads inside ``run_demo``.
"""

from __future__ import annotations

import json
import sys

from pdstate.devtools.cluster import ROUTERS as ROUTERS  # the --router choices
from pdstate.errors import ExitCode

DEMO_LENGTHS = [100, 128, 255, 256, 257, 1000, 4096, 8191, 16384, 32768]


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} GB"


def run_demo(
    engine: str,
    mode: str,
    preset: str,
    requests: int,
    tokens: list[int] | None,
    concurrency: int,
    draft: bool,
    progress,
    prefills: int = 1,
    decodes: int = 1,
    router: str = "least-loaded",
) -> dict:
    """Spawn ``prefills`` prefill and ``decodes`` decode agent processes (one and one by default),
    shake hands between every pair, run the batch through the router; returns the summary."""
    from pdstate.devtools.baselines import ENGINE_OPTIONS
    from pdstate.devtools.cluster import run_cluster
    from pdstate.pools.presets import preset as get_preset

    settings = get_preset(preset).with_(unified_kv=(mode == "unified"), draft_enabled=draft)
    cap = settings.full_tokens // max(1, concurrency)
    lengths = tokens or [n for n in DEMO_LENGTHS if n <= cap] or [min(DEMO_LENGTHS)]
    batch = [lengths[i % len(lengths)] for i in range(requests)]
    # One host: NIXL's UCX must not load its InfiniBand module here (it crashes at exit without
    # RDMA hardware); Mooncake runs over loopback TCP.
    engine_options = ENGINE_OPTIONS.get(engine, {})
    s = run_cluster(settings, prefills, decodes, engine, engine_options, batch, concurrency, router, progress)
    return {"engine": engine, "mode": mode, "preset": preset, "draft": draft, **s}


def progress_line(done: int, total: int, ev: dict) -> str:
    """One request's line: its full room id (19 digits at most: rooms are 63-bit)."""
    mark = "ok" if ev["verified"] else f"FAILED ({ev['error']['message'] if ev['error'] else '?'})"
    pair = f"{ev['pair']}  " if ev.get("pair") else ""
    return (
        f"  [{done:>4}/{total}] {pair}room {ev['room']:>19}  {ev['seq_len']:>6} tokens  "
        f"{fmt_bytes(ev['bytes']):>10}  {ev['seconds'] * 1e3:7.1f} ms  {mark}"
    )


def summary_table(s: dict) -> str:
    rows = [
        ("requests", s["requests"]),
        ("verified", s["verified"]),
        ("failed", s["failed"]),
        ("bytes", fmt_bytes(s["bytes"])),
        ("descriptors", s["descriptors"]),
        ("seconds", f"{s['seconds']:.3f}"),
        ("GB/s", f"{s['gbps']:.2f}"),
        ("handshake ms", f"{s['handshake_ms']:.2f}"),
        ("leaked pages", "yes" if s["leaked"] else "none"),
    ]
    rule = "+" + "-" * 16 + "+" + "-" * 16 + "+"
    lines = [rule, *(f"| {k:<14} | {str(v):>14} |" for k, v in rows), rule]
    lines += [f"error: {e}" for e in s["errors"]]
    return "\n".join(lines)


def cmd_demo(args) -> ExitCode:
    """OK when every request was verified and no page leaked; FAILED otherwise (or when the pair
    could not be started)."""

    def progress(done: int, total: int, ev: dict) -> None:
        if not args.json:
            print(progress_line(done, total, ev), flush=True)

    if not args.json:
        shape = f"{args.prefills} prefill(s) x {args.decodes} decode(s) ({args.router}), "
        print(
            f"pdstate demo: {shape}preset {args.preset}, {args.mode} mode, "
            f"draft {'on' if not args.no_draft else 'off'}, engine {args.engine}, {args.requests} requests"
        )
    try:
        s = run_demo(
            args.engine,
            args.mode,
            args.preset,
            args.requests,
            args.tokens,
            args.concurrency,
            not args.no_draft,
            progress,
            prefills=args.prefills,
            decodes=args.decodes,
            router=args.router,
        )
    except Exception as exc:
        print(f"demo failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return ExitCode.FAILED
    if args.json:
        print(json.dumps(s))
    else:
        print()
        print(summary_table(s))
        for name, row in s.get("pairs", {}).items():
            print(f"  {name}: {row['verified']}/{row['requests']} verified")
    ok = s["failed"] == 0 and s["verified"] == s["requests"] and not s["leaked"]
    return ExitCode.OK if ok else ExitCode.FAILED
