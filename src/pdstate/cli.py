"""``pdstate`` command line: demo | check | serve | probe | bench."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from pdstate.errors import ConfigError

DEMO_LENGTHS = [100, 128, 255, 256, 257, 1000, 4096, 8191, 16384, 32768]


def _fmt_bytes(n: float) -> str:
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
) -> dict:
    """Spawn a prefill and a decode process, handshake, run the batch; returns the summary."""
    from pdstate.devtools.processes import WorkerProcess
    from pdstate.pools.presets import preset as get_preset
    from pdstate.runtime.common import WorkerOptions

    settings = get_preset(preset).with_(unified_kv=(mode == "unified"), draft_enabled=draft)
    cap = settings.full_tokens // max(1, concurrency)
    lengths = tokens or [n for n in DEMO_LENGTHS if n <= cap] or [min(DEMO_LENGTHS)]
    batch = [lengths[i % len(lengths)] for i in range(requests)]
    # One host: NIXL's UCX must not load its InfiniBand module here (it crashes at exit without
    # RDMA hardware); Mooncake runs over loopback TCP.
    engine_options = {"nixl": {"ucx_env": {"UCX_MODULES": "^ib"}}, "mooncake": {"host": "127.0.0.1"}}.get(engine, {})
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


def cmd_demo(args) -> int:
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else None

    def progress(done, total, ev):
        if args.json:
            return
        mark = "ok" if ev["verified"] else f"FAILED ({ev['error']['message'] if ev['error'] else '?'})"
        print(
            f"  [{done:>4}/{total}] room {ev['room'] % 10**6:06d}  {ev['seq_len']:>6} tokens  "
            f"{_fmt_bytes(ev['bytes']):>10}  {ev['seconds'] * 1e3:7.1f} ms  {mark}",
            flush=True,
        )

    if not args.json:
        print(
            f"pdstate demo: preset {args.preset}, {args.mode} mode, draft {'on' if not args.no_draft else 'off'}, "
            f"engine {args.engine}, {args.requests} requests"
        )
    try:
        s = run_demo(
            args.engine, args.mode, args.preset, args.requests, tokens, args.concurrency, not args.no_draft, progress
        )
    except Exception as exc:
        print(f"demo failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(s))
    else:
        rows = [
            ("requests", s["requests"]),
            ("verified", s["verified"]),
            ("failed", s["failed"]),
            ("bytes", _fmt_bytes(s["bytes"])),
            ("descriptors", s["descriptors"]),
            ("seconds", f"{s['seconds']:.3f}"),
            ("GB/s", f"{s['gbps']:.2f}"),
            ("handshake ms", f"{s['handshake_ms']:.2f}"),
            ("leaked pages", "yes" if s["leaked"] else "none"),
        ]
        print()
        print("+" + "-" * 16 + "+" + "-" * 16 + "+")
        for k, v in rows:
            print(f"| {k:<14} | {str(v):>14} |")
        print("+" + "-" * 16 + "+" + "-" * 16 + "+")
        for e in s["errors"]:
            print(f"error: {e}")
    return 0 if s["failed"] == 0 and s["verified"] == s["requests"] and not s["leaked"] else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdstate", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="run a prefill+decode pair and verify a batch of transfers")
    d.add_argument("--engine", choices=["shm", "mooncake", "nixl"], default="shm")
    d.add_argument("--mode", choices=["paged", "unified"], default="paged")
    d.add_argument("--preset", default="dsv4-flash")
    d.add_argument("--requests", type=int, default=24)
    d.add_argument("--tokens", default="", help="comma-separated prompt lengths (cycled)")
    d.add_argument("--concurrency", type=int, default=4)
    d.add_argument("--no-draft", action="store_true", help="run without the NextN draft pool")
    d.add_argument("--json", action="store_true", help="print one JSON summary object")
    d.set_defaults(func=cmd_demo)

    from pdstate.service import preflight as cli_ops

    cli_ops.add_commands(sub)
    cli_ops.add_bench(sub)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"pdstate: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
