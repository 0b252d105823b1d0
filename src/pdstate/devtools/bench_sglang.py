"""``pdstate bench``'s sglang phase (on by default, ``--no-sglang`` skips it): SGLang's own Mooncake
backend against backend ``pdstate``, per request.

The two-process driver (``devtools.sglang_pair``) runs SGLang's disaggregation code (each release
of ``integrations.sglang.releases`` whose environment is built, oldest first: ``sglang_by_release``) on real
DeepSeek-V4-Flash pools (target + NextN draft, speculative) sized for a 32k-token request: one
prefill child and one decode child, the same pools for both backends. Each backend gets its
managers once (``get_kv_class``: SGLang's ``mooncake`` over TCP, and ``pdstate`` with
``PDSTATE_TRANSFER__ENGINE=mooncake``), one warm-up request, then the backends alternate request by
request, every length in turn, ``runs`` times. The time is the prefill's: the first ``send`` of a
request (two chunks, state on the last) to its sender's ``poll()`` returning Success. The decode
checks every byte after each request, outside the time; a request that does not end in Success
with every byte right fails the phase.

Backend pdstate runs twice: at the default level (``sampled``) and, as ``pdstate@full``, with every
byte digested (its own managers, ``PDSTATE_TRANSFER__VERIFY=full``), interleaved with the others.

Results: ``sglang_mooncake_ms_by_length``, ``sglang_backend_ms_by_length`` and
``sglang_backend_full_ms_by_length`` (median ms by length), ``sglang`` (the runs, min/median/max,
the SGLang ``versions`` the children imported, and why a backend did not run). The ratios
``sglang_backend_vs_sglang_mooncake_by_length`` and ``sglang_backend_full_vs_sglang_mooncake_by_length``
(SGLang's time / pdstate's: above 1 pdstate is faster) are ``bench_report.ratios``'. Skipped, saying why, where the SGLang environment is not
built (``make sglang-env``) or Mooncake cannot be imported.
"""

from __future__ import annotations

import statistics

from pdstate.devtools.sglang_pair.cases import BENCH_SIDE, BENCH_TOKENS, Case
from pdstate.devtools.sglang_pair.pair import PDSTATE_ENGINE_ENV, Pair, env_dir, mooncake_missing
from pdstate.integrations.sglang import releases as sglang_releases

RUNS = {True: 7, False: 11}  # requests per backend and length (--quick, full): medians of 3 moved by 30%
BACKENDS = {
    "mooncake": "sglang_mooncake_ms_by_length",
    "pdstate": "sglang_backend_ms_by_length",  # at the default level (transfer.verify: sampled)
    "pdstate@full": "sglang_backend_full_ms_by_length",  # every byte digested
}
DEADLINE_S = 60.0
CASE = Case("bench", "the same pools on both sides, room for 32k tokens", BENCH_SIDE, BENCH_SIDE)


def unavailable() -> str | None:
    """Why the phase cannot run here (no SGLang environment, no Mooncake), else ``None``."""
    target = env_dir()
    if not (target / "sglang").is_dir():
        return f"no SGLang environment at {target} (make sglang-env builds it)"
    return mooncake_missing()


def _check(backend: str, r: dict) -> float:
    pre, dec = r["prefill"], r["decode"]
    ok = pre.get("outcome") == dec.get("outcome") == "Success"
    if not ok or dec["wrong_items"] or dec["outside_bytes"]:
        raise RuntimeError(f"sglang phase: {backend} at {r['tokens']} tokens did not land every byte: {pre} {dec}")
    return r["send_to_success_ms"]


def releases() -> list[str]:
    """The SGLang releases whose environment is built here, oldest first."""
    return [r for r in sglang_releases.versions() if (env_dir(r) / "sglang").is_dir()]


def _measure(pair: Pair, runs: int, lengths: tuple[int, ...], info: dict, progress) -> dict:
    """Each backend's managers and a warm-up, then ``runs`` interleaved turns: ms by backend and length."""
    times: dict[str, dict[int, list[float]]] = {b: {n: [] for n in lengths} for b in BACKENDS}
    for b in BACKENDS:
        progress(f"[sglang] {b}: managers and a warm-up request ...")
        out = pair.run_case(CASE, b, tokens=(lengths[0],), deadline_s=DEADLINE_S)
        if "setup_error" in out:
            raise RuntimeError(f"sglang phase: backend {b} could not be set up: {out['setup_error']}")
        _check(b, out["requests"][0])
        info.setdefault("versions", [])
        if out.get("sglang") and out["sglang"] not in info["versions"]:
            info["versions"].append(out["sglang"])
    for _ in range(runs):
        for n in lengths:
            for b in BACKENDS:
                pair.use(b)
                times[b][n].append(_check(b, pair.request(n, DEADLINE_S)))
    return times


def phase(
    runs: int, results: dict, progress=print, lengths: tuple[int, ...] = BENCH_TOKENS, pair: Pair | None = None
) -> None:
    """Measure and store the phase's keys in ``results`` (see the module's docstring), on every
    SGLang release built here (``sglang_by_release``; the top-level keys are the first's); ``pair``:
    child processes to reuse (one release; started with ``PDSTATE_ENGINE_ENV``)."""
    info: dict = {"lengths": list(lengths), "runs": runs, "skipped": {}}
    results["sglang"] = info
    why = unavailable()
    if why:
        progress(f"skipping the sglang phase: {why}")
        info["skipped"]["phase"] = why
        return
    by_release: dict[str, dict] = {}
    for release in [None] if pair is not None else releases():
        own = Pair(target=env_dir(release), extra_env=PDSTATE_ENGINE_ENV) if pair is None else pair
        try:
            seen = len(info.get("versions", []))
            times = _measure(own, runs, lengths, info, progress)
        finally:
            if pair is None:
                own.close()
        name = release or (info["versions"][seen] if len(info["versions"]) > seen else "?")
        by_release[name] = {b: {str(n): statistics.median(v) for n, v in times[b].items()} for b in BACKENDS}
        for b in BACKENDS:
            stats = {
                str(n): {"min": min(v), "median": statistics.median(v), "max": max(v)} for n, v in times[b].items()
            }
            info.setdefault(b, stats)  # the first release's, as before
            info.setdefault("by_release", {}).setdefault(name, {})[b] = stats
            progress(f"[sglang {name}] {b}: " + ", ".join(f"{n} ms {m:.1f}" for n, m in by_release[name][b].items()))
    first = next(iter(by_release.values()))
    for b in BACKENDS:
        results[BACKENDS[b]] = first[b]
    results["sglang_by_release"] = by_release
