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
- neither side knows the other (no request has paired them yet: a decode rank dials the prefill
  of its first request): the decode's document is posted to the prefill's ``/v1/compat/check``,
  the handshake's own checks. ``ready to pair``: it would be accepted; ``mismatch (factor)``: it
  would be refused (the message and the fix below the matrix, in the prefill rank's words);
  ``silent``: the check could not be asked;
- ``unreachable``: a rank's endpoint did not answer.

Exit status (``VERDICT``): 0 when every rank answered and is healthy (ready, or a decode rank
waiting for its first request), no cell is refused or mismatched, and every decode rank has an
accepted prefill or one ready to pair; 1 otherwise.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlparse, urlunparse

from pdstate.errors import ExitCode, ProbeError

VERDICT = (
    "exit status: 0 every rank answered, none refused or mismatched, and every decode rank has an accepted "
    "prefill or one ready to pair (matching layouts before any request); 1 a rank unreachable or unhealthy, a "
    "pair refused or mismatched, or a decode rank with no prefill to pair with; 2 bad arguments"
)
SERVED = ("accepted", "ready")  # the cells that serve a decode rank
FAILING = ("rejected", "mismatch", "unreachable")  # the cells that fail the probe

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


def pair_check(decode: dict, prefill: dict, token: str | None, timeout_s: float) -> dict:
    """A silent cell asked: the decode's document posted to the prefill's ``/v1/compat/check``.
    ``ready`` (compatible), ``mismatch`` with the first error's ``factor``, ``error`` and every
    error (``errors``, each with the prefill rank's ``fix``), or ``silent`` when it did not answer."""
    from pdstate.logs import refusal_factor
    from pdstate.service.probe import http_call

    try:
        status, verdict = http_call(
            "POST", f"{prefill['url']}/v1/compat/check", body=decode["compat"], token=token, timeout_s=timeout_s
        )
    except ProbeError:
        return {"state": "silent"}
    if status != 200 or not isinstance(verdict, dict):
        return {"state": "silent"}
    errors = [e for e in verdict.get("errors") or () if isinstance(e, dict) and "type" in e and "message" in e]
    if verdict.get("compatible") and not errors:
        return {"state": "ready"}
    if not errors:
        return {"state": "silent"}
    first = errors[0]
    return {"state": "mismatch", "factor": refusal_factor(first["type"], first["message"]), "error": first,
            "errors": errors}  # fmt: skip


def healthy(w: dict) -> bool:
    """A rank answered, its local check passed, and it is ready, or a decode rank not ready only
    for want of a prefill (``peer``: it dials the prefill of its first request)."""
    if "compat" not in w or not (w["compat"].get("local_check") or {}).get("ok", True):
        return False
    r = w.get("ready") or {}
    return bool(r.get("ready")) or (w["role"] == "decode" and r.get("check") == "peer")


def probe_ranks(urls: list[str], token: str | None = None, timeout_s: float = 5.0, hints: list | None = None) -> dict:
    """Every rank asked (``hints``: per URL, ``(role, rank)`` or ``None``); the matrix by decode
    rank, then prefill rank (a silent cell checked: ``pair_check``); ``ok`` as the exit status says."""
    hints = hints or [None] * len(urls)
    ranks = [_ask(u.rstrip("/"), token, timeout_s, h) for u, h in zip(urls, hints)]
    by_role: dict[str, list[dict]] = {"prefill": [], "decode": [], "unknown": []}
    for w in ranks:
        by_role[w["role"] if w["role"] in ("prefill", "decode") else "unknown"].append(w)
    matrix = [[cell(d, p) for p in by_role["prefill"]] for d in by_role["decode"]]
    for d, row in zip(by_role["decode"], matrix):
        for i, (p, c) in enumerate(zip(by_role["prefill"], row)):
            if c["state"] == "silent":
                row[i] = pair_check(d, p, token, timeout_s)
    served = [any(c["state"] in SERVED for c in row) for row in matrix]
    failing = any(c["state"] in FAILING for row in matrix for c in row)
    ok = (
        bool(by_role["decode"]) and all(served) and not failing and not by_role["unknown"]
        and all(healthy(w) for w in ranks)
    )  # fmt: skip
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
            cells.append(f"{CELL_TEXT.get(c['state'], c['state']).format(factor=c.get('factor') or '?'):<{width}}")
            for e in c.get("errors") or ([c["error"]] if c["state"] == "rejected" and c.get("error") else []):
                notes.append(f"{_label(d)} / {_label(p)}: {e['type']}: {summarize(e['type'], e['message'])}")
                if e.get("fix"):
                    notes.append(f"  {e['fix']}")
        lines.append((f"{_label(d):<12}" + "".join(cells)).rstrip())
    lines += [""] + notes if notes else []
    lines += verdict_lines(found)
    return "\n".join(lines)


CELL_TEXT = {"rejected": "refused ({factor})", "mismatch": "mismatch ({factor})", "ready": "ready to pair"}


def verdict_lines(found: dict) -> list[str]:
    """The last lines: what fails the probe (a rank not healthy but for a refusal, which its cell
    shows), else whether the decode ranks are paired or ready to pair."""
    rows = list(zip(found["decodes"], found["matrix"]))
    named = found["prefills"] + found["decodes"]
    out = []
    for w in named:
        why = w.get("ready") or {}
        if "compat" in w and not healthy(w) and why.get("check") != "handshake":
            out.append(f"NOT HEALTHY: {_label(w)} ({why.get('reason')})")
    if not found["decodes"]:
        return [*out, "no decode rank answered"]
    missing = [_label(d) for d, row in rows if not any(c["state"] in SERVED for c in row)]
    if missing:
        out.append(f"NO accepted prefill and none ready to pair: {', '.join(missing)}")
    failing = any(c["state"] in FAILING for _, row in rows for c in row)
    if failing or found["unreachable"] or any("compat" not in w for w in named):
        out.append("FAILED: a rank unreachable, or a pair refused or mismatched (above)")
    if out:
        return out
    if all(any(c["state"] == "accepted" for c in row) for _, row in rows):
        return ["every decode rank has an accepted prefill"]
    return [
        "ready to pair: every decode rank has an accepted prefill or a matching one (no request has paired them yet)"
    ]


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
