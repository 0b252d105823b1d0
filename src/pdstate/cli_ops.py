"""Operator commands: ``check`` (offline preflight of config files)."""

from __future__ import annotations

import sys

FIX_HINTS = {
    "SWAIndexMappingNotShared": (
        "fix: register the allocator's full_to_swa_index_mapping on the draft pool (the same tensor "
        "object, not a clone or a view): set [draft] mapping = \"shared\""
    ),
}


def _report_for(path, overrides=()):
    from pdstate.config import load_config
    from pdstate.layout import build_report
    from pdstate.presets import build_worker_pools

    cfg = load_config(path, overrides)
    pools = build_worker_pools(cfg.pool_settings())
    try:
        report, _ = build_report(pools.target, pools.draft)
    finally:
        pools.close()
    return cfg, report


def cmd_check(args) -> int:
    from pdstate.compat import compat_errors

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


def add_commands(sub) -> None:
    c = sub.add_parser("check", help="offline preflight: build layout reports from config files and compare")
    c.add_argument("configs", nargs="+", metavar="CONFIG")
    c.add_argument("--set", action="append", default=[], metavar="section.key=value")
    c.set_defaults(func=cmd_check)
