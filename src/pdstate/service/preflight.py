"""Operator commands: ``check`` (offline preflight of config files), ``serve`` and ``probe``
(implemented in ``pdstate.service.server``)."""

from __future__ import annotations

import sys

FIX_HINTS = {
    "SWAIndexMappingNotShared": (
        "fix: register the allocator's full_to_swa_index_mapping on the draft pool (the same tensor "
        'object, not a clone or a view): set [draft] mapping = "shared"'
    ),
}


def _report_for(path, overrides=()):
    from pdstate.pools.presets import build_worker_pools
    from pdstate.pools.reporting import build_report
    from pdstate.service.config import load_config

    cfg = load_config(path, overrides)
    pools = build_worker_pools(cfg.pool_settings())
    try:
        report, _ = build_report(pools.target, pools.draft)
    finally:
        pools.close()
    return cfg, report


def cmd_check(args) -> int:
    from pdstate.protocol.compat import compat_errors

    loaded = [_report_for(p, args.set) for p in args.configs]
    problems = []
    for path, (cfg, report) in zip(args.configs, loaded):
        print(f"{path}: role={cfg.role} preset={cfg.preset} fingerprint={report.fingerprint}")
        if not report.local_check.ok:
            problems.append((path, report.local_check.error.type, report.local_check.error.message))
    if len(loaded) == 2:
        (c1, r1), (c2, r2) = loaded
        for e in compat_errors(r1, r2, c1.role):
            if not any(e.message == m for _, _, m in problems):
                problems.append(("pair", e.type, e.message))
    if not problems:
        print("compatible" if len(loaded) == 2 else "ok")
        return 0
    for where, typ, msg in problems:
        print(f"{where}: {typ}: {msg}", file=sys.stderr)
        if typ in FIX_HINTS:
            print(f"  {FIX_HINTS[typ]}", file=sys.stderr)
    return 1


def configure_check(c) -> None:
    """The ``check`` subcommand's arguments (``c`` is its argparse parser, made by ``cli``)."""
    c.add_argument("configs", nargs="+", metavar="CONFIG")
    c.add_argument("--set", action="append", default=[], metavar="section.key=value")
    c.set_defaults(func=cmd_check)


def add_commands(sub) -> None:
    configure_check(
        sub.add_parser("check", help="offline preflight: build layout reports from config files and compare")
    )

    from pdstate.service import server as serve  # serve + probe (light to import: torch loads inside cmd_serve)

    serve.add_commands(sub)


def cmd_bench(args) -> int:
    import json
    from pathlib import Path

    from pdstate.devtools import bench
    from pdstate.runtime.common import tune_interpreter

    tune_interpreter()
    say = (lambda *a: None) if args.json else (lambda m: print(m, flush=True))
    r = bench.run_bench(args.quick, args.engines.split(","), args.modes.split(","), progress=say)
    files = bench.write_outputs(r, Path(args.out))
    s = bench.summary(r)
    if not args.json:
        print()
        print(f"{'path':<44} {'tokens':>7} {'GB/s median':>12} {'[min..max]':>16}")
        for path, per_len in sorted(r["paths"].items()):
            for n, v in per_len.items():
                g = v["gbps"]
                span = f"{g['min']:>7.2f}..{g['max']:<7.2f}" if "min" in g else ""
                print(f"{path:<44} {n:>7} {g['median']:>12.2f} {span}")
        print()
        for k, v in s.items():
            print(f"{k}: {v}")
        print("wrote " + ", ".join(str(f) for f in files))
    print(json.dumps(s))
    return 0


def add_bench(sub) -> None:
    b = sub.add_parser("bench", help="measure pdstate against the in-process ceiling and the raw engines")
    b.add_argument("--json", action="store_true", help="last line: one JSON object with the ratios")
    b.add_argument("--out", default="bench-out", help="directory for bench.json and bench.png")
    b.add_argument("--quick", action="store_true", help="fewer runs (about 5 minutes here)")
    b.add_argument("--engines", default="shm,mooncake,nixl")
    b.add_argument("--modes", default="paged,unified")
    b.set_defaults(func=cmd_bench)
