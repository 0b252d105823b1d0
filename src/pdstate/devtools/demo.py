"""``pdstate demo``: a prefill and a decode worker process on one host, a handshake, a batch of
requests of mixed lengths with one progress line each (full room ids: the ones
``/v1/transfers/{room}`` and the workers' logs name), and a summary table. With ``--prefills N``
or ``--decodes M`` above 1 it runs an N x M cluster of agent processes with a router instead
(``devtools.cluster``); the summary then adds per-pair counts.

Light to import (``pdstate.cli`` does so before parsing argv): the workers, and torch with them,
load inside ``run_demo``.
"""

from __future__ import annotations

import json
import sys
import time

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
    token: bytes | None = None,
    prefills: int = 1,
    decodes: int = 1,
    router: str = "least-loaded",
) -> dict:
    """Spawn a prefill and a decode process, handshake, run the batch; returns the summary. With
    more than one prefill or decode: an N x M cluster of agents and a router (no ``token``)."""
    from pdstate.devtools.baselines import ENGINE_OPTIONS
    from pdstate.pools.presets import preset as get_preset

    settings = get_preset(preset).with_(unified_kv=(mode == "unified"), draft_enabled=draft)
    cap = settings.full_tokens // max(1, concurrency)
    lengths = tokens or [n for n in DEMO_LENGTHS if n <= cap] or [min(DEMO_LENGTHS)]
    batch = [lengths[i % len(lengths)] for i in range(requests)]
    # One host: NIXL's UCX must not load its InfiniBand module here (it crashes at exit without
    # RDMA hardware); Mooncake runs over loopback TCP.
    engine_options = ENGINE_OPTIONS.get(engine, {})
    if prefills > 1 or decodes > 1:
        from pdstate.devtools.cluster import run_cluster

        s = run_cluster(settings, prefills, decodes, engine, engine_options, batch, concurrency, router, progress)
        return {"engine": engine, "mode": mode, "preset": preset, "draft": draft, **s}
    from pdstate.devtools.processes import WorkerProcess
    from pdstate.runtime.options import WorkerOptions

    base = dict(
        pool=settings, engine=engine, engine_options=engine_options, token=token, max_inflight=max(64, concurrency)
    )
    prefill = WorkerProcess(WorkerOptions(role="prefill", worker_id="prefill-0", **base))
    decode = None
    try:
        ev = prefill.read_event(120)
        decode = WorkerProcess(WorkerOptions(role="decode", worker_id="decode-0", peer=ev["endpoint"], **base))
        ev = decode.read_event(120)
        if ev["event"] != "ready":
            raise RuntimeError(f"handshake refused: {ev['type']}: {ev['message']}")
        handshake_ms = ev["handshake_ms"]
        free_before = ev["free"]
        decode.send(json.dumps({"cmd": "run", "lengths": batch, "concurrency": concurrency}))
        t0 = time.perf_counter()
        results = []
        while True:
            ev = decode.read_event(300)
            if ev["event"] == "batch_done":
                break
            results.append(ev)
            progress(len(results), len(batch), ev)
        seconds = time.perf_counter() - t0
        free_after = ev["free"]
    finally:
        rcs = [w.close() for w in (decode, prefill) if w is not None]
    verified = sum(1 for r in results if r["status"] == "success" and r["verified"])
    nbytes = sum(r["bytes"] for r in results)
    return {
        "engine": engine,
        "mode": mode,
        "preset": preset,
        "draft": draft,
        "requests": len(batch),
        "verified": verified,
        "failed": len(results) - verified,
        "bytes": nbytes,
        "seconds": seconds,
        "gbps": nbytes / seconds / 1e9 if seconds > 0 else 0.0,
        "handshake_ms": handshake_ms,
        "descriptors": sum(r["descriptors"] for r in results),
        "leaked": free_before != free_after,
        "worker_exit_codes": rcs,
        "errors": sorted({r["error"]["message"] for r in results if r.get("error")})[:5],
    }


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

    cluster = args.prefills > 1 or args.decodes > 1
    if not args.json:
        shape = f"{args.prefills} prefills x {args.decodes} decodes ({args.router}), " if cluster else ""
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
