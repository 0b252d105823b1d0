"""``pdstate probe URL [URL]``: GET ``/v1/compat`` and ``/readyz`` of running workers and print a
readable report; with two URLs, POST the first one's document to the second's ``/v1/compat/check``.
SGLang ranks' endpoints (``--ranks``, ``--prefill`` / ``--decode``): ``probe_ranks``' pair matrix.

Probe only needs the standard library (httpx when installed), not torch.

The token (``--token-file``, ``PDSTATE_AUTH__TOKEN_FILE``, ``PDSTATE_AUTH__TOKEN``; ``--token``
still works but is visible to every user of the host in ``/proc``) goes only to the URLs given
(and, for ``--prefill`` / ``--decode``, their ranks' ports on the same host); a redirect is never
followed, with or without it: a 3xx is reported as the worker's answer.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from pdstate.errors import ExitCode, ProbeError

TOKEN_ARG_WARNING = (
    "pdstate probe: --token is visible to every user of this host (/proc/PID/cmdline); "
    "use --token-file FILE or PDSTATE_AUTH__TOKEN instead"
)


def probe_token(args: Any, environ: dict[str, str] | None = None) -> str | None:
    """The bearer token for the probe: ``--token-file`` (the token-file rules of ``serve``), else
    ``--token`` (a warning on stderr), else ``PDSTATE_AUTH__TOKEN_FILE``, else
    ``PDSTATE_AUTH__TOKEN``; ``None`` without one. A refused file is a ``ConfigError`` (exit 2)."""
    from pdstate.settings.auth import read_token_file

    env = os.environ if environ is None else environ
    if getattr(args, "token_file", None):
        return read_token_file(args.token_file, key="--token-file").decode()
    if getattr(args, "token", None):
        print(TOKEN_ARG_WARNING, file=sys.stderr)
        return args.token
    if env.get("PDSTATE_AUTH__TOKEN_FILE"):
        return read_token_file(env["PDSTATE_AUTH__TOKEN_FILE"], key="PDSTATE_AUTH__TOKEN_FILE").decode()
    return env.get("PDSTATE_AUTH__TOKEN", "").strip() or None


def _no_redirects_opener():
    import urllib.request

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, req, fp, code, msg, headers, newurl):  # the 3xx comes back as HTTPError
            return None

    return urllib.request.build_opener(NoRedirect)


def http_call(method: str, url: str, body: dict | None = None, token: str | None = None, timeout_s: float = 5.0):
    """``(status, json_or_text)``; raises ``ProbeError`` when the worker cannot be reached. A
    redirect is never followed (httpx: ``follow_redirects=False``; urllib: no redirect handler):
    the token goes to ``url`` alone."""
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        import httpx
    except ImportError:  # pragma: no cover - httpx is a dev dependency
        httpx = None
    if httpx is not None:
        try:
            r = httpx.request(method, url, json=body, headers=headers, timeout=timeout_s, follow_redirects=False)
        except httpx.HTTPError as exc:
            raise ProbeError(f"{method} {url}: {exc}") from None
        status, text = r.status_code, r.text
    else:  # tests/security/test_probe_token.py runs it
        import urllib.error
        import urllib.request

        data = None if body is None else json.dumps(body).encode()
        if data is not None:
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with _no_redirects_opener().open(req, timeout=timeout_s) as resp:
                status, text = resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            status, text = exc.code, exc.read().decode()
        except (urllib.error.URLError, OSError) as exc:
            raise ProbeError(f"{method} {url}: {exc}") from None
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def _short(value: Any, limit: int = 60) -> str:
    s = json.dumps(value) if not isinstance(value, str) else value
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _fmt_error(e: dict | None) -> str:
    """A worker's error as its document gives it, clipped as a worker clips a peer's."""
    from pdstate.protocol.report import MAX_MESSAGE_CHARS, MAX_NAME_CHARS, clip

    return "" if not e else f"{clip(str(e['type']), MAX_NAME_CHARS)}: {clip(str(e['message']), MAX_MESSAGE_CHARS)}"


def ask_worker(base: str, token: str | None, timeout_s: float) -> dict[str, Any]:
    """``{"url", "ready", "compat"}`` of the worker (or rank endpoint) at ``base``, or
    ``{"url", "unreachable": why}``."""
    w: dict[str, Any] = {"url": base}
    try:
        _, ready = http_call("GET", f"{base}/readyz", token=token, timeout_s=timeout_s)
        w["ready"] = ready if isinstance(ready, dict) else {"ready": False, "reason": str(ready)}
        status, doc = http_call("GET", f"{base}/v1/compat", token=token, timeout_s=timeout_s)
        if status != 200 or not isinstance(doc, dict):
            raise ProbeError(f"GET {base}/v1/compat answered {status}: {_short(doc, 200)}")
        w["compat"] = doc
    except ProbeError as exc:
        w["unreachable"] = str(exc)
    return w


def waits_for_a_request(w: dict) -> bool:
    """An SGLang decode rank not ready only for want of a prefill: it dials the prefill of its
    first request (``/readyz``'s check ``peer``), so before any request it is healthy."""
    doc = w.get("compat") or {}
    return bool(doc.get("rank")) and doc.get("role") == "decode" and (w.get("ready") or {}).get("check") == "peer"


def probe(urls: list[str], token: str | None = None, timeout_s: float = 5.0) -> dict:
    """Query each worker; with two, ask the second to check the first. Returns the findings."""
    out: dict[str, Any] = {"workers": [], "pair": None, "ok": True}
    docs = []
    for url in urls:
        w = ask_worker(url.rstrip("/"), token, timeout_s)
        docs.append(w.get("compat"))
        out["ok"] &= "compat" in w and (bool(w.get("ready", {}).get("ready")) or waits_for_a_request(w))
        out["workers"].append(w)
    if len(urls) == 2 and all(docs):
        base = urls[1].rstrip("/")
        try:
            status, verdict = http_call(
                "POST", f"{base}/v1/compat/check", body=docs[0], token=token, timeout_s=timeout_s
            )
            if status != 200 or not isinstance(verdict, dict):
                raise ProbeError(f"POST {base}/v1/compat/check answered {status}: {_short(verdict, 300)}")
            out["pair"] = verdict
            out["ok"] &= bool(verdict["compatible"])
        except ProbeError as exc:
            out["pair"] = {"compatible": False, "errors": [{"type": "ProbeError", "message": str(exc)}]}
            out["ok"] = False
    return out


def format_probe(found: dict) -> str:
    from pdstate.protocol.fixes import fix_line, summarize

    lines = []
    for w in found["workers"]:
        if "unreachable" in w:
            lines.append(f"{w['url']}: UNREACHABLE: {w['unreachable']}")
            continue
        d, r = w["compat"], w.get("ready", {})
        state = "ready" if r.get("ready") else f"NOT READY: {r.get('reason')}"
        lines.append(f"{d['role']:<8} {w['url']}  {state}")
        lines.append(
            f"  worker       {d.get('worker_id')} (incarnation {d.get('incarnation') or 'shown with the token only'}), "
            f"protocol v{d['protocol_version']}, engine {d.get('engine')}, control {d.get('control')}"
        )
        if t := d.get("transport"):
            listens = ", ".join(t.get("listening") or []) or "nothing (no native listener)"
            scope = " (beyond loopback)" if t.get("open") else ""
            lines.append(f"  transport    {t['in_use']} (configured {t['configured']}), listening on {listens}{scope}")
            if t.get("problem"):
                lines.append(f"  transport    PROBLEM: {t['problem']}")
        lines.append(f"  fingerprint  {d['fingerprint']}")
        lay = d.get("layout", {})
        scalars = [
            f"{k}={_short(v, 40)}" for k, v in lay.items() if k not in ("components", "main_kv_item_lens", "draft")
        ]
        lines.append(f"  layout       {' '.join(scalars)}")
        draft = lay.get("draft")
        lines.append(f"  draft        {'none' if not draft else _short(draft, 100)}")
        lines.append(
            f"  components   {len(lay.get('components') or [])} state components, "
            f"{len(lay.get('main_kv_item_lens') or [])} main KV buffers"
        )
        lc = d.get("local_check", {})
        lines.append(f"  local check  {'ok' if lc.get('ok') else 'FAILED: ' + _fmt_error(lc.get('error'))}")
        peers = d.get("peers") or []
        if not peers:
            lines.append("  peers        none")
        for i, p in enumerate(peers):
            label = "  peers        " if i == 0 else "               "
            err = f": {_fmt_error(p.get('error'))}" if p.get("error") else ""
            lines.append(f"{label}{p['id']} {p['state']}{err}")
    pair = found.get("pair")
    if pair is not None:
        if pair["compatible"]:
            waiting = any(waits_for_a_request(w) for w in found["workers"])
            lines.append(
                "pair: compatible, ready to pair (no request has paired them yet)" if waiting else "pair: compatible"
            )
        else:
            lines.append("pair: INCOMPATIBLE")
            for e in pair["errors"]:
                lines.append(f"  - {e['type']}: {summarize(e['type'], e['message'])}")
                # the checking worker's own line (an SGLang rank's in SGLang's words), else pdstate's
                if fix := e.get("fix") if "fix" in e else fix_line(e["type"], e["message"]):
                    lines.append(f"    {fix}")
    return "\n".join(lines)


def cmd_probe(args) -> ExitCode:
    """OK when every worker answered ready (an SGLang decode rank: or waiting for its first
    request) and, with two, the pair is compatible; else FAILED (``cli`` refuses other than one or
    two URLs as a usage error).
    SGLang rank endpoints (``--ranks``, ``--prefill`` / ``--decode``) go to ``probe_ranks`` (``cli``)."""
    if not args.urls:
        print("pdstate probe: give one or two worker URLs, or rank endpoints (--ranks, --prefill, --decode)")
        return ExitCode.CONFIG
    found = probe(args.urls, token=probe_token(args), timeout_s=args.timeout)
    print(json.dumps(found) if args.json else format_probe(found))
    return ExitCode.OK if found["ok"] else ExitCode.FAILED
