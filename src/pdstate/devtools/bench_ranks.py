"""``pdstate bench``'s rank-endpoint measurement (part of the sglang phase, ``--no-sglang`` skips
it): does serving pdstate's HTTP app on each SGLang rank (``http.port``) slow the requests?

On the first SGLang release built here (``bench_sglang.releases``), through SGLang's own scheduler
queues (``devtools.sglang_queues``: a prefill child and a decode child, backend ``pdstate`` with
the Mooncake engine, the sglang phase's pools: room for 32k tokens), blocks of ``RUNS`` requests of ``TOKENS``
tokens alternate, ``BLOCKS`` times: endpoints off (no ``PDSTATE_HTTP__PORT``), then endpoints on
with both ranks scraped (``GET /metrics`` and ``GET /v1/compat`` on each, every ``SCRAPE_S``) for
the whole block. Each block sets the managers up anew and sends one warm-up request first. The
time is the prefill's send -> Success per request.

Results: ``sglang_rank_endpoints`` (release, tokens, per mode min/median/max ms and the runs, the
scrapes made), ``sglang_rank_endpoint_off_ms`` / ``sglang_rank_endpoint_scraped_ms`` (medians); the
ratio ``sglang_rank_endpoint_scraped_vs_off`` (scraped / off: above 1 the endpoints cost time) is
``bench_report.ratios``'.
"""

from __future__ import annotations

import statistics
import threading

TOKENS = 4096
RUNS = {True: 4, False: 8}  # requests per block (--quick, full)
BLOCKS = 2  # off, scraped, off, scraped
SCRAPE_S = 0.05
DEADLINE_S = 10.0
MODES = ("off", "scraped")


def _scrape(ports: list[int], stop: threading.Event, count: list[int]) -> None:
    import httpx

    with httpx.Client(timeout=5.0) as client:
        while not stop.is_set():
            for port in ports:
                for path in ("/metrics", "/v1/compat"):
                    client.get(f"http://127.0.0.1:{port}{path}").raise_for_status()
                    count[0] += 1
            stop.wait(SCRAPE_S)


def _block(pair, mode: str, runs: int, times: list[float], scrapes: list[int]) -> None:
    from pdstate.devtools.bench_sglang import CASE
    from pdstate.devtools.sglang_pair.pair import free_port

    ports = {role: free_port() for role in ("prefill", "decode")}
    role_env = {r: {"PDSTATE_HTTP__PORT": str(p)} for r, p in ports.items()} if mode == "scraped" else None
    out = pair.setup(CASE, "pdstate", role_env=role_env)
    if "setup_error" in out:
        raise RuntimeError(f"rank endpoints ({mode}): the pair could not be set up: {out['setup_error']}")
    _ms(pair, mode)  # warm-up
    stop, thread = threading.Event(), None
    if mode == "scraped":
        thread = threading.Thread(target=_scrape, args=(list(ports.values()), stop, scrapes), daemon=True)
        thread.start()
    try:
        for _ in range(runs):
            times.append(_ms(pair, mode))
            if thread is not None and not thread.is_alive():
                raise RuntimeError(f"rank endpoints: scraping ports {sorted(ports.values())} failed")
    finally:
        stop.set()
        if thread is not None:
            thread.join(10.0)


def _ms(pair, mode: str) -> float:
    r = pair.request(TOKENS, DEADLINE_S)
    if not r["prefill"].get("outcome") == r["decode"].get("outcome") == "Success" or r["send_to_success_ms"] is None:
        raise RuntimeError(f"rank endpoints ({mode}): a request did not end in Success: {r}")
    return r["send_to_success_ms"]


def measure(pair, runs: int, progress=print) -> dict:
    """The blocks on ``pair`` (a ``QueuePair`` started with ``PDSTATE_ENGINE_ENV``): ms per mode."""
    times: dict[str, list[float]] = {m: [] for m in MODES}
    scrapes = [0]
    for i in range(BLOCKS):
        for mode in MODES:
            progress(f"[sglang rank endpoints] block {i + 1}/{BLOCKS}, {mode}: {runs} x {TOKENS} tokens ...")
            _block(pair, mode, runs, times[mode], scrapes)
    return {"times": times, "scrapes": scrapes[0]}


def phase(quick: bool, results: dict, progress=print) -> None:
    """Measure and store this module's keys in ``results`` (see the docstring); skipped, saying
    why, where the sglang phase cannot run."""
    from pdstate.devtools import bench_sglang

    why = bench_sglang.unavailable()
    info: dict = {"tokens": TOKENS, "runs": RUNS[quick] * BLOCKS, "scrape_s": SCRAPE_S}
    results["sglang_rank_endpoints"] = info
    if why:
        info["skipped"] = why
        return
    from pdstate.devtools.sglang_pair.pair import PDSTATE_ENGINE_ENV, env_dir
    from pdstate.devtools.sglang_queues.pair import QueuePair

    release = bench_sglang.releases()[0]
    with QueuePair(env_dir(release), extra_env=PDSTATE_ENGINE_ENV) as pair:
        out = measure(pair, RUNS[quick], progress)
    store(results, release, out)
    off, on = results["sglang_rank_endpoint_off_ms"], results["sglang_rank_endpoint_scraped_ms"]
    progress(f"[sglang {release}] rank endpoints: off {off:.1f} ms, scraped {on:.1f} ms (median)")


def store(results: dict, release: str, out: dict) -> None:
    """``measure``'s ``out`` into ``results``' keys."""
    info = results.setdefault("sglang_rank_endpoints", {"tokens": TOKENS})
    info.update(release=release, http_requests=out["scrapes"])
    for mode, v in out["times"].items():
        info[mode] = {"min": min(v), "median": statistics.median(v), "max": max(v), "ms": v}
        results[f"sglang_rank_endpoint_{mode}_ms"] = statistics.median(v)
