"""The README's performance tables, rendered from one ``pdstate bench`` run (``bench.json``):
the ratios per request length, the throughput of the main paths with their range over the runs,
the single figures (physical limit, control path against a bare ZeroMQ round trip, the M x N
row, memory, planner, handshake), and last the cost model fitted from the run and its projection
(``devtools.cost_model``). Rows whose measurement did not run are left out.

``pdstate bench`` writes them to ``bench.md``; ``python -m pdstate.devtools.bench_report
bench-out/bench.json`` prints them again from a saved run.
"""

from __future__ import annotations

RATIO_ROWS = (
    ("shm_vs_physical", "shm end to end (agent) / physical limit"),
    ("shm_vs_ceiling", "shm end to end (agent) / ceiling"),
    ("agent_sampled_vs_ceiling", "agent, sampled digests (the default) / ceiling"),
    ("shm_digest_vs_ceiling", "agent, every byte digested (full) / ceiling"),
    ("mooncake_vs_raw", "Mooncake end to end / raw Mooncake"),
    ("mooncake_full_verify_vs_raw", "Mooncake, every byte verified / raw"),
    ("nixl_vs_raw", "NIXL end to end / raw NIXL"),
    ("nixl_full_verify_vs_raw", "NIXL, every byte verified / raw"),
)

GBPS_ROWS = (
    ("paged:agent:physical", "physical limit (one contiguous copy, best thread count)"),
    ("paged:agent:ceiling", "ceiling (in-process copy of the same regions, 1 thread)"),
    ("paged:agent:agent_shm", "shm end to end (agent), digests off"),
    ("paged:agent:agent_shm_sampled", "agent, sampled digests (the default)"),
    ("paged:agent:agent_shm_digest", "agent, every byte digested (full)"),
)


def _label(n: str) -> str:
    k = int(n)
    return f"{k // 1024}k" if k % 1024 == 0 else str(k)


def _lengths(r: dict) -> list[str]:
    if r.get("lengths"):
        return [str(n) for n in r["lengths"]]
    seen = {n for per_len in r.get("paths", {}).values() for n in per_len}
    return sorted(seen, key=int)


def _num(v, fmt: str = "{:.2f}") -> str:
    return "–" if v is None else fmt.format(v)


def ratio_table(r: dict) -> list[str]:
    ratios, lengths = r.get("ratios", {}), _lengths(r)
    rows = [(label, ratios[f"{key}_by_length"]) for key, label in RATIO_ROWS if f"{key}_by_length" in ratios]
    if not rows:
        return []
    out = ["| ratio (medians, one run) | " + " | ".join(_label(n) for n in lengths) + " |"]
    out.append("|---" * (len(lengths) + 1) + "|")
    for label, per in rows:
        out.append(f"| {label} | " + " | ".join(_num(per.get(n)) for n in lengths) + " |")
    return out


def gbps_table(r: dict) -> list[str]:
    paths, lengths = r.get("paths", {}), _lengths(r)
    rows = [(label, paths[p]) for p, label in GBPS_ROWS if p in paths]
    if not rows:
        return []
    out = ["| GB/s, median (min–max over the runs) | " + " | ".join(_label(n) for n in lengths) + " |"]
    out.append("|---" * (len(lengths) + 1) + "|")
    for label, per_len in rows:
        cells = []
        for n in lengths:
            g = per_len.get(n, {}).get("gbps")
            if g is None:
                cells.append("–")
            elif "min" in g:
                cells.append(f"{g['median']:.2f} ({g['min']:.2f}–{g['max']:.2f})")
            else:
                cells.append(f"{g['median']:.2f}")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out


def figures_table(s: dict | None) -> list[str]:
    """The single figures, from ``bench_report.summary``."""
    if not s:
        return []
    rows = []
    if s.get("physical_limit_gbps") is not None:
        rows.append(
            (
                "physical limit at 32k (`physical_limit_gbps`)",
                f"{s['physical_limit_gbps']:.2f} GB/s with "
                f"{s['physical_limit_threads']} thread(s); shm end to end (agent) reaches "
                f"{_num(s['ratios'].get('shm_vs_physical'))} of it",
            )
        )
    if s.get("control_overhead_ms_p50") is not None:
        rows.append(
            (
                "empty transfer (agent) p50 / bare ZeroMQ round trip p50",
                f"{s['control_overhead_ms_p50']:.2f} ms / "
                f"{_num(s.get('zmq_round_trip_ms_p50'))} ms = {_num(s.get('control_overhead_vs_zmq'))}x",
            )
        )
    if s.get("mxn_2x2_gbps") is not None:
        m = s["mxn_2x2"]
        rows.append(
            (
                "2 prefills x 2 decodes, aggregate (`mxn_2x2_gbps`)",
                f"{m['gbps']:.2f} GB/s over {m['requests']} "
                f"requests of {m['request_tokens']} tokens = {_num(s['ratios'].get('mxn_vs_physical'))} x the "
                "physical limit",
            )
        )
    if s.get("peak_rss_mb") is not None:
        rows.append(
            ("dsv4-flash agent pair: peak RSS (`peak_rss_mb`)", f"{s['peak_rss_mb']:.0f} MB (prefill + decode)")
        )
        rows.append(
            (
                f"agent pair: RSS growth over {s['rss_growth_requests']} requests (`rss_growth_mb`)",
                f"{s['rss_growth_mb']:+.1f} MB ({s['rss_anon_growth_mb']:+.1f} MB private)",
            )
        )
    if s.get("plan_fragmented_128k_ms") is not None:
        rows.append(
            (
                "planning a 128k request, fragmented / contiguous",
                f"{s['plan_fragmented_128k_ms']:.2f} ms / "
                f"{s['plan_contiguous_128k_ms']:.2f} ms ({s['plan_speedup_vs_loop']:.0f}x the Python loop)",
            )
        )
    if s.get("handshake_ms_p50") is not None:
        rows.append(
            (
                "re-handshake p50 / first handshake",
                f"{s['handshake_ms_p50']:.2f} ms / {s['first_handshake_flash_ms']:.2f} ms",
            )
        )
    if s.get("request_1_token_ms_p50") is not None:
        rows.append(
            (
                "1-token request p50 (its overhead beyond its bytes)",
                f"{s['request_1_token_ms_p50']:.2f} ms ({s['request_1_token_overhead_ms_p50']:.2f} ms)",
            )
        )
    if not rows:
        return []
    return ["| figure | value |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]


def verify_table(s: dict | None) -> list[str]:
    """What each verification level costs the agent over ``off`` (``verify_cost_by_mode``)."""
    cost = (s or {}).get("verify_cost_by_mode") or {}
    lengths = sorted({n for per in cost.values() for n in per}, key=int)
    if not lengths:
        return []
    out = [
        "| verification cost: time / time with `off` - 1 (agent, medians) | "
        + " | ".join(_label(n) for n in lengths)
        + " |"
    ]
    out.append("|---" * (len(lengths) + 1) + "|")
    for level in ("sampled", "full"):
        if level in cost:
            cells = [_num(None if cost[level].get(n) is None else 100 * cost[level][n], "{:+.1f}%") for n in lengths]
            out.append(f"| `{level}` | " + " | ".join(cells) + " |")
    return out


def sglang_table(r: dict) -> list[str]:
    """The sglang phase's rows, one table per SGLang release measured (``sglang_by_release``):
    per-request send -> Success, SGLang's Mooncake backend and backend pdstate at the default
    level and at ``full``, and the ratios; where measured, the decode's metadata -> Success, the
    ratios' bootstrap 95% intervals, and the bytes and descriptors each backend moved a request."""
    by = r.get("sglang_by_release")
    if not by:  # a run from before the releases were kept apart: the top-level keys
        versions = ", ".join((r.get("sglang") or {}).get("versions") or ["0.5.19"])
        keys = ("sglang_mooncake_ms_by_length", "sglang_backend_ms_by_length", "sglang_backend_full_ms_by_length")
        by = {versions: dict(zip(("mooncake", "pdstate", "pdstate@full"), (r.get(k) or {} for k in keys)))}
    out: list[str] = []
    for release, times in by.items():
        table = _sglang_rows(
            release, times.get("mooncake") or {}, times.get("pdstate") or {}, times.get("pdstate@full") or {}
        )
        if table:
            ours = times.get("pdstate") or {}
            table += _sglang_more_rows(
                r, release, [n for n in sorted(times.get("mooncake") or {}, key=int) if n in ours]
            )
        out += ([""] if out and table else []) + table
    return out


def _sglang_more_rows(r: dict, release: str, lengths: list[str]) -> list[str]:
    """The decode's medians and ratio, the intervals, and the counts moved (what was measured)."""
    decode = (r.get("sglang_decode_by_release") or {}).get(release) or {}
    ci = (r.get("sglang_ratio_ci95_by_release") or {}).get(release) or {}
    moved = [(w, (r.get(f"sglang_{w}_by_release") or {}).get(release) or {}) for w in ("bytes", "descriptors")]
    out: list[str] = []

    def row(label: str, values: dict, fmt) -> None:
        if values and all(n in values for n in lengths):
            out.append(f"| {label} | " + " | ".join(fmt(values[n]) for n in lengths) + " |")

    theirs, ours = decode.get("mooncake") or {}, decode.get("pdstate") or {}
    row("decode, metadata -> Success: SGLang's own Mooncake backend", theirs, "{:.1f}".format)
    row("decode, metadata -> Success: backend pdstate (`sampled`)", ours, "{:.1f}".format)
    if theirs and all(ours.get(n) for n in lengths):
        row("ratio, decode (above 1: pdstate faster)", {n: theirs[n] / ours[n] for n in lengths}, "{:.2f}".format)
    for side in ("prefill", "decode"):
        row(f"ratio's bootstrap 95% interval, {side}", ci.get(side) or {}, lambda v: f"{v[0]:.2f}-{v[1]:.2f}")
    for what, by in moved:
        for backend, name in (("mooncake", "SGLang's own Mooncake backend"), ("pdstate", "backend pdstate")):
            row(f"{what} moved a request, {name}", by.get(backend) or {}, "{:,}".format)
    return out


def _sglang_rows(release: str, theirs: dict, ours: dict, full: dict) -> list[str]:
    lengths = [n for n in sorted(theirs, key=int) if n in ours]
    if not lengths:
        return []
    head = f"| SGLang {release}, send -> Success, ms (median) | " + " | ".join(_label(n) for n in lengths) + " |"
    out = [
        head,
        "|---" * (len(lengths) + 1) + "|",
        "| SGLang's own Mooncake backend | " + " | ".join(f"{theirs[n]:.1f}" for n in lengths) + " |",
        "| backend pdstate (Mooncake engine, `sampled`) | " + " | ".join(f"{ours[n]:.1f}" for n in lengths) + " |",
    ]
    if all(n in full for n in lengths):
        out.append("| backend pdstate, `full` | " + " | ".join(f"{full[n]:.1f}" for n in lengths) + " |")
    out.append(
        "| ratio, `sampled` (above 1: pdstate faster) | "
        + " | ".join(f"{theirs[n] / ours[n]:.2f}" for n in lengths)
        + " |"
    )
    if all(n in full for n in lengths):
        out.append("| ratio, `full` | " + " | ".join(f"{theirs[n] / full[n]:.2f}" for n in lengths) + " |")
    return out


def rank_endpoint_table(r: dict) -> list[str]:
    """The SGLang ranks' endpoints off against on and scraped (``devtools.bench_ranks``):
    send -> Success per request, ms."""
    info = r.get("sglang_rank_endpoints") or {}
    if "off" not in info or "scraped" not in info:
        return []
    off, on = info["off"], info["scraped"]
    out = [
        f"| SGLang {info.get('release', '?')} rank endpoints, {_label(str(info['tokens']))} tokens, send -> Success, ms"
        " | median | min | max | requests |",
        "|---|---|---|---|---|",
    ]
    for name, row in (("endpoints off", off), ("endpoints on, scraped every 50 ms", on)):
        out.append(f"| {name} | {row['median']:.1f} | {row['min']:.1f} | {row['max']:.1f} | {len(row['ms'])} |")
    out.append(f"| ratio scraped / off (above 1: slower) | {on['median'] / off['median']:.2f} | | | |")
    return out + _rank_cpu_rows(r)


def _rank_cpu_rows(r: dict) -> list[str]:
    """The endpoints' CPU per scrape in the dwells without requests (``bench_ranks.store``)."""
    cpu, child = r.get("sglang_rank_endpoint_cpu_ms_per_scrape"), r.get("sglang_rank_endpoint_child_cpu_ms_per_scrape")
    if not cpu or None in cpu.values() or child is None:
        return []
    n = r["sglang_rank_endpoint_scrapes"]
    return [
        f"| {role} rank's own CPU per scrape it served, ms (no request running) | {cpu[role]:.2f} | | | |"
        for role in ("prefill", "decode")
    ] + [
        f"| the endpoints' processes' CPU per scrape, ms | {child:.2f} | | | |",
        f"| scrapes served / expected (no request running) | {n['served']} / {n['expected']} | | | |",
    ]


def cost_model_table(r: dict) -> list[str]:
    """The cost model fitted from this run and its projection (``devtools.cost_model``)."""
    from pdstate.devtools import cost_model

    text = cost_model.markdown(r)
    return text.rstrip("\n").split("\n") if text else []


def markdown(r: dict, s: dict | None) -> str:
    """Every table with data in it, blank-line separated, ending with a newline."""
    tables = (
        ratio_table(r),
        gbps_table(r),
        verify_table(s),
        figures_table(s),
        sglang_table(r),
        rank_endpoint_table(r),
        cost_model_table(r),
    )
    blocks = [t for t in tables if t]
    return "\n\n".join("\n".join(t) for t in blocks) + "\n"
