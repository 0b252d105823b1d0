"""``pdstate probe --ranks URL...`` (or ``--prefill URL --prefill-ranks N --decode URL
--decode-ranks M``): the pair matrix of SGLang ranks running backend pdstate.

Each rank's endpoint (``integrations.sglang.endpoint``) is asked ``/readyz`` and ``/v1/compat``;
its role comes from its document. A decode rank lists the prefill agents it dialled by address
(a prefill rank's ``control``), a prefill rank the decodes that registered by worker id (a decode
rank's ``worker_id``), so each (decode, prefill) cell is read from both sides:

- ``accepted``: either side lists the other as accepted;
- ``refused (factor)``: either side lists the other as rejected (the factor the refusal names;
  the message and the fix are printed below the matrix);
- ``gone`` / ``pending``: as either side lists the other;
- ``silent``: neither side knows the other (no request has paired them yet, or they cannot reach
  each other); ``unreachable``: a rank's endpoint did not answer.

Exit status 0 only when every decode rank has an accepted prefill; 1 otherwise.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlparse, urlunparse

from pdstate.errors import ExitCode

ORDER = ("accepted", "rejected", "gone", "pending")  # what a cell shows when the two sides differ


def rank_urls(base: str, count: int) -> list[str]:
    """``count`` rank endpoints from ``base`` (rank 0's URL): ports ``base``'s + 0 .. count - 1."""
    u = urlparse(base.rstrip("/"))
    if u.port is None:
        raise ValueError(f"{base}: a rank endpoint's base URL needs its port (http.port), e.g. http://host:30100")
    host = u.hostname if ":" not in (u.hostname or "") else f"[{u.hostname}]"
    return [urlunparse(u._replace(netloc=f"{host}:{u.port + i}")) for i in range(count)]


def _ask(url: str, token: str | None, timeout_s: float, hint: tuple[str, int] | None = None) -> dict[str, Any]:
    """One rank's answers; ``hint``: the role and rank it was named as (``--prefill``, ``--decode``),
    what places it in the matrix when it does not answer."""
    from pdstate.service.probe import ask_worker

    w = ask_worker(url, token, timeout_s)
    w["role"], w["rank"] = hint if hint else (None, None)
    if "compat" in w:
        doc = w["compat"]
        w["role"], w["rank"] = doc.get("role"), (doc.get("rank") or {}).get("rank", w["rank"])
    return w


def _listed(doc: dict, peer_id: str) -> dict | None:
    return next((p for p in doc.get("peers") or () if p.get("id") == peer_id), None)


def cell(decode: dict, prefill: dict) -> dict:
    """The (decode rank, prefill rank) cell: ``state`` and, when refused, ``factor`` and ``error``."""
    if "compat" not in decode or "compat" not in prefill:
        return {"state": "unreachable"}
    d, p = decode["compat"], prefill["compat"]
    seen = [x for x in (_listed(d, p.get("control") or "-"), _listed(p, d.get("worker_id") or "-")) if x]
    if not seen:
        return {"state": "silent"}
    best = min(seen, key=lambda x: ORDER.index(x["state"]) if x["state"] in ORDER else len(ORDER))
    out = {"state": best["state"]}
    refused = next((x for x in seen if x["state"] == "rejected" and x.get("error")), None)
    if best["state"] == "rejected" and refused is not None:
        out.update(factor=refused.get("factor"), error=refused["error"])
    return out


def probe_ranks(urls: list[str], token: str | None = None, timeout_s: float = 5.0, hints: list | None = None) -> dict:
    """Every rank asked (``hints``: per URL, ``(role, rank)`` or ``None``); the matrix by decode
    rank, then prefill rank; ``ok`` as the exit status says."""
    hints = hints or [None] * len(urls)
    ranks = [_ask(u.rstrip("/"), token, timeout_s, h) for u, h in zip(urls, hints)]
    by_role: dict[str, list[dict]] = {"prefill": [], "decode": [], "unknown": []}
    for w in ranks:
        by_role[w["role"] if w["role"] in ("prefill", "decode") else "unknown"].append(w)
    matrix = [[cell(d, p) for p in by_role["prefill"]] for d in by_role["decode"]]
    served = [any(c["state"] == "accepted" for c in row) for row in matrix]
    ok = bool(by_role["decode"]) and all(served) and not by_role["unknown"]
    return {
        "prefills": by_role["prefill"], "decodes": by_role["decode"], "unreachable": by_role["unknown"],
        "matrix": matrix, "ok": ok,
    }  # fmt: skip


def _label(w: dict) -> str:
    return f"{w['role']} {w['rank'] if w['rank'] is not None else '?'}"


def _transport(doc: dict) -> str:
    t = doc.get("transport")
    if not isinstance(t, dict):
        return str(t or doc.get("engine") or "?")
    in_use = t.get("in_use") or ""
    return f"{t.get('engine')}/{in_use}" if in_use and in_use != t.get("engine") else str(t.get("engine"))


def _line(w: dict) -> str:
    if "compat" not in w:
        return f"{_label(w):<10} {w['url']}  UNREACHABLE: {w['unreachable']}"
    d, r = w["compat"], w.get("ready", {})
    place = d.get("rank") or {}
    where = (
        f"tp {place['tp_rank']}/{place['tp_size']} pp {place['pp_rank']}/{place['pp_size']} "
        f"dp {place['dp_rank']}/{place['dp_size']}, sglang {place.get('sglang')}"
        if place
        else "not an SGLang rank"
    )
    state = "ready" if r.get("ready") else f"NOT READY: {r.get('reason')}"
    return f"{_label(w):<10} {w['url']}  {where}, fingerprint {d['fingerprint'][:12]}, {_transport(d)}; {state}"


def format_ranks(found: dict) -> str:
    from pdstate.protocol.fixes import summarize

    lines = [_line(w) for w in found["prefills"] + found["decodes"]]
    lines += [f"{w['url']}: UNREACHABLE: {w['unreachable']}" for w in found["unreachable"]]
    heads = [_label(p) for p in found["prefills"]]
    width = max([22] + [len(h) + 2 for h in heads])
    lines.append("")
    lines.append((f"{'':<12}" + "".join(f"{h:<{width}}" for h in heads)).rstrip())
    notes = []
    for d, row in zip(found["decodes"], found["matrix"]):
        cells = []
        for p, c in zip(found["prefills"], row):
            text = c["state"] if c["state"] != "rejected" else f"refused ({c.get('factor') or '?'})"
            cells.append(f"{text:<{width}}")
            if c["state"] == "rejected" and c.get("error"):
                e = c["error"]
                notes.append(f"{_label(d)} / {_label(p)}: {e['type']}: {summarize(e['type'], e['message'])}")
                if e.get("fix"):
                    notes.append(f"  {e['fix']}")
        lines.append((f"{_label(d):<12}" + "".join(cells)).rstrip())
    lines += [""] + notes if notes else []
    missing = [
        _label(d) for d, row in zip(found["decodes"], found["matrix"]) if not any(c["state"] == "accepted" for c in row)
    ]
    if not found["decodes"]:
        lines.append("no decode rank answered")
    elif missing:
        lines.append(f"NO accepted prefill: {', '.join(missing)}")
    else:
        lines.append("every decode rank has an accepted prefill")
    return "\n".join(lines)


def cmd_probe_ranks(args) -> ExitCode:
    urls = list(args.ranks or ())
    hints: list = [None] * len(urls)
    try:
        for role, base, count in (
            ("prefill", args.prefill, args.prefill_ranks),
            ("decode", args.decode, args.decode_ranks),
        ):
            if base:
                named = rank_urls(base, count)
                urls += named
                hints += [(role, i) for i in range(len(named))]
    except ValueError as exc:
        print(f"pdstate probe: {exc}")
        return ExitCode.CONFIG
    from pdstate.service.probe import probe_token

    found = probe_ranks(urls, token=probe_token(args), timeout_s=args.timeout, hints=hints)
    print(json.dumps(found) if args.json else format_ranks(found))
    return ExitCode.OK if found["ok"] else ExitCode.FAILED
