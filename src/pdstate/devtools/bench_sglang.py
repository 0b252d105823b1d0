"""``pdstate bench``'s sglang phase (on by default, ``--no-sglang`` skips it): SGLang's own Mooncake
backend against backend ``pdstate``, per request, on both sides.

The two-process driver (``devtools.sglang_pair``) runs SGLang's disaggregation code (each release
of ``integrations.sglang.releases`` whose environment is built, oldest first: ``sglang_by_release``) on real
DeepSeek-V4-Flash pools (target + NextN draft, speculative) sized for a 32k-token request: one
prefill child and one decode child, the same pools for both backends. Each backend gets its
managers once (``get_kv_class``: SGLang's ``mooncake`` over TCP, and ``pdstate`` with
``PDSTATE_TRANSFER__ENGINE=mooncake``), one warm-up request, then the backends alternate request by
request, every length in turn, ``runs`` times (``RUNS``: 30 with ``--quick``, 40 without). The
lengths (``BENCH_TOKENS``) start with one page (``ONE_PAGE_TOKENS``: 256 tokens, the pools' page
size, sent as one chunk with its state): SGLang's smallest request, its fixed cost. Each
request is timed on both sides: the prefill's first ``send`` (two chunks, state on the last) to
its sender's ``poll()`` returning Success, and the decode's ``send_metadata`` to its receiver's
``poll()`` returning Success (what the first token waits for; the prefill is told to send before
the metadata goes, so it sends as soon as the metadata reaches it). Both children count the bytes
and descriptors handed to Mooncake's ``TransferEngine`` (``sglang_pair.moved``). The decode
checks every byte after each request, outside the time; a request that does not end in Success
with every byte right fails the phase.

Backend pdstate runs twice: at the default level (``sampled``) and, as ``pdstate@full``, with every
byte digested (its own managers, ``PDSTATE_TRANSFER__VERIFY=full``), interleaved with the others.

Results: ``sglang_mooncake_ms_by_length``, ``sglang_backend_ms_by_length`` and
``sglang_backend_full_ms_by_length`` (the prefill's median ms by length, first release),
``sglang_by_release`` and ``sglang_decode_by_release`` (``{release: {backend: {length: median
ms}}}``, the prefill's and the decode's), ``sglang_ratio_ci95_by_release`` (``{release: {"prefill"
| "decode": {length: [low, high]}}}``: the bootstrap 95% interval of SGLang's median / pdstate's,
``ratio_ci95``), ``sglang_bytes_by_release`` and ``sglang_descriptors_by_release`` (``{release:
{"pdstate" | "mooncake": {length: count}}}``, per request, both children together), ``sglang``
(the runs, min/median/max of both sides, every request's ms, every distinct count, the SGLang ``versions`` the
children imported, and why a backend did not run). The ratios (SGLang's time / pdstate's: above 1
pdstate is faster) are ``bench_report.ratios``': ``sglang_backend_vs_sglang_mooncake_by_length`` /
``_by_release`` (prefill), ``sglang_backend_vs_sglang_mooncake_decode_by_release`` (decode) and
``sglang_backend_full_vs_sglang_mooncake_by_length``. Skipped, saying why, where the SGLang
environment is not built (``make sglang-env``) or Mooncake cannot be imported.
"""

from __future__ import annotations

import statistics

from pdstate.devtools.sglang_pair.cases import BENCH_SIDE, BENCH_TOKENS, Case
from pdstate.devtools.sglang_pair.pair import PDSTATE_ENGINE_ENV, Pair, env_dir, mooncake_missing
from pdstate.integrations.sglang import releases as sglang_releases

# Requests per backend and length (--quick, full), interleaved: 30 make the ratio's bootstrap
# interval decisive (7 left medians of 3 moving by 30%); a --quick phase is about 360 requests a
# release (270 beyond the one-page length's), 1 to 2.5 s each with the decode's byte checks.
RUNS = {True: 30, False: 40}
BACKENDS = {
    "mooncake": "sglang_mooncake_ms_by_length",
    "pdstate": "sglang_backend_ms_by_length",  # at the default level (transfer.verify: sampled)
    "pdstate@full": "sglang_backend_full_ms_by_length",  # every byte digested
}
COMPARED = ("pdstate", "mooncake")  # the backends whose bytes and descriptors the summary carries
SIDES = {"prefill": "send_to_success_ms", "decode": "metadata_to_success_ms"}
DEADLINE_S = 60.0
CASE = Case("bench", "the same pools on both sides, room for 32k tokens", BENCH_SIDE, BENCH_SIDE)
RESAMPLES = 10000  # the bootstrap's resamples
SEED = 37


def ratio_ci95(theirs: list[float], ours: list[float], seed: int = SEED, resamples: int = RESAMPLES) -> list[float]:
    """The bootstrap 95% interval of median(``theirs``) / median(``ours``): ``resamples`` times,
    requests drawn with replacement (the same turns for both when they are as many: the backends
    ran interleaved, turn by turn, so a turn's load is shared), the ratio of the two medians; the
    2.5th and 97.5th percentiles (numpy's linear interpolation). Seeded: the same data give the
    same interval."""
    import numpy as np

    a, b = np.asarray(theirs, dtype=float), np.asarray(ours, dtype=float)
    rng = np.random.default_rng(seed)
    ia = rng.integers(0, len(a), size=(resamples, len(a)))
    ib = ia if len(a) == len(b) else rng.integers(0, len(b), size=(resamples, len(b)))
    ratios = np.median(a[ia], axis=1) / np.median(b[ib], axis=1)
    low, high = np.percentile(ratios, [2.5, 97.5])
    return [float(low), float(high)]


def unavailable() -> str | None:
    """Why the phase cannot run here (no SGLang environment, no Mooncake), else ``None``."""
    target = env_dir()
    if not (target / "sglang").is_dir():
        return f"no SGLang environment at {target} (make sglang-env builds it)"
    return mooncake_missing()


def figures(backend: str, r: dict) -> dict:
    """The request's figures (``SIDES``' ms, ``bytes`` and ``descriptors`` moved by both children),
    or raise when it did not land every byte."""
    pre, dec = r["prefill"], r["decode"]
    ok = pre.get("outcome") == dec.get("outcome") == "Success"
    if not ok or dec["wrong_items"] or dec["outside_bytes"]:
        raise RuntimeError(f"sglang phase: {backend} at {r['tokens']} tokens did not land every byte: {pre} {dec}")
    moved = [side.get("moved") or {} for side in (pre, dec)]
    out = {side: r[key] for side, key in SIDES.items()}
    return out | {k: sum(m.get(k, 0) for m in moved) for k in ("bytes", "descriptors")}


def releases() -> list[str]:
    """The SGLang releases whose environment is built here, oldest first."""
    return [r for r in sglang_releases.versions() if (env_dir(r) / "sglang").is_dir()]


def _measure(pair: Pair, runs: int, lengths: tuple[int, ...], info: dict, progress) -> dict:
    """Each backend's managers and a warm-up, then ``runs`` interleaved turns: each request's
    figures (``figures``) by backend and length."""
    times: dict[str, dict[int, list[dict]]] = {b: {n: [] for n in lengths} for b in BACKENDS}
    for b in BACKENDS:
        progress(f"[sglang] {b}: managers and a warm-up request ...")
        out = pair.run_case(CASE, b, tokens=(lengths[0],), deadline_s=DEADLINE_S)
        if "setup_error" in out:
            raise RuntimeError(f"sglang phase: backend {b} could not be set up: {out['setup_error']}")
        figures(b, out["requests"][0])
        info.setdefault("versions", [])
        if out.get("sglang") and out["sglang"] not in info["versions"]:
            info["versions"].append(out["sglang"])
    for _ in range(runs):
        for n in lengths:
            for b in BACKENDS:
                pair.use(b)
                times[b][n].append(figures(b, pair.request(n, DEADLINE_S, early_send=True)))
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
    decode: dict[str, dict] = {}
    ci95: dict[str, dict] = {}
    moved_bytes: dict[str, dict] = {}
    descriptors: dict[str, dict] = {}
    for release in [None] if pair is not None else releases():
        own = Pair(target=env_dir(release), extra_env=PDSTATE_ENGINE_ENV) if pair is None else pair
        try:
            seen = len(info.get("versions", []))
            times = _measure(own, runs, lengths, info, progress)
        finally:
            if pair is None:
                own.close()
        name = release or (info["versions"][seen] if len(info["versions"]) > seen else "?")
        by_release[name] = {b: _medians(times[b], "prefill") for b in BACKENDS}
        decode[name] = {b: _medians(times[b], "decode") for b in BACKENDS}
        ci95[name] = {side: _ci95(times, side) for side in SIDES}
        for what, into in (("bytes", moved_bytes), ("descriptors", descriptors)):
            into[name] = {b: {str(n): _count(v, what) for n, v in times[b].items()} for b in COMPARED}
        for b in BACKENDS:
            for side, key in (("prefill", "by_release"), ("decode", "decode_by_release")):
                stats = {str(n): _stats([t[side] for t in v]) for n, v in times[b].items()}
                if side == "prefill":
                    info.setdefault(b, stats)  # the first release's, as before
                info.setdefault(key, {}).setdefault(name, {})[b] = stats
            info.setdefault("ms_by_release", {}).setdefault(name, {})[b] = {
                side: {str(n): [t[side] for t in v] for n, v in times[b].items()} for side in SIDES
            }  # every request's, in the order they ran (the intervals' data)
            info.setdefault("moved_by_release", {}).setdefault(name, {})[b] = {
                str(n): {k: sorted({t[k] for t in v}) for k in ("bytes", "descriptors")} for n, v in times[b].items()
            }  # every distinct count seen: one each when identical requests move the same
            progress(
                f"[sglang {name}] {b}: "
                + ", ".join(f"{n} ms {m:.1f} (decode {decode[name][b][n]:.1f})" for n, m in by_release[name][b].items())
            )
    first = next(iter(by_release.values()))
    for b in BACKENDS:
        results[BACKENDS[b]] = first[b]
    results["sglang_by_release"] = by_release
    results["sglang_decode_by_release"] = decode
    results["sglang_ratio_ci95_by_release"] = ci95
    results["sglang_bytes_by_release"] = moved_bytes
    results["sglang_descriptors_by_release"] = descriptors


def _stats(v: list[float]) -> dict:
    return {"min": min(v), "median": statistics.median(v), "max": max(v)}


def _medians(by_length: dict[int, list[dict]], side: str) -> dict[str, float]:
    return {str(n): statistics.median(t[side] for t in v) for n, v in by_length.items()}


def _ci95(times: dict, side: str) -> dict[str, list[float]]:
    """SGLang's Mooncake backend / backend pdstate (default level): the bootstrap interval by length."""
    theirs, ours = times["mooncake"], times["pdstate"]
    return {str(n): ratio_ci95([t[side] for t in theirs[n]], [t[side] for t in ours[n]]) for n in theirs}


def _count(requests: list[dict], what: str) -> int:
    """A count per request: the one every request gave (the median's lower value if they differ)."""
    return statistics.median_low(t[what] for t in requests)
