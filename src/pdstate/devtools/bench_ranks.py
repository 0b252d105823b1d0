"""``pdstate bench``'s rank-endpoint measurement (part of the sglang phase, ``--no-sglang`` skips
it): does serving pdstate's HTTP app on each SGLang rank (``http.port``) slow the requests?

On the first SGLang release built here (``bench_sglang.releases``), through SGLang's own scheduler
queues (``devtools.sglang_queues``: a prefill child and a decode child, backend ``pdstate`` with
the Mooncake engine, the sglang phase's pools: room for 32k tokens), blocks of ``RUNS`` requests of ``TOKENS``
tokens alternate, ``BLOCKS`` times: endpoints off (no ``PDSTATE_HTTP__PORT``), then endpoints on
with both ranks scraped (``GET /metrics`` and ``GET /v1/compat`` on each, every ``SCRAPE_S``) for
the whole block. Each block sets the managers up anew and sends one warm-up request first. The
time is the prefill's send -> Success per request.

The load-independent part: what serving the scrapes costs the ranks' own processes (the SGLang
children, whose threads a scheduler shares), not the host. Each block ends with ``DWELL_S`` without
a request (scraped or not): over it, the CPU time (``/proc/<pid>/stat`` utime + stime) of the
prefill and decode processes and of the endpoints' processes (the ranks' children running
``pdstate.status.pushed``). A rank's cost: its CPU in the scraped dwells beyond its rate in the off
dwells, per scrape it served (about 0 with each endpoint in its own process; served by a thread of
the rank, 0.9-1.9 ms measured here). Outside the dwells the requests' own CPU (the decode's byte
checks: hundreds of ms a block, varying by more than the scrapes cost) would drown it.

Results: ``sglang_rank_endpoints`` (release, tokens, per mode min/median/max ms and the runs, the
scrapes made, per mode the CPU ms and window seconds), ``sglang_rank_endpoint_off_ms`` /
``sglang_rank_endpoint_scraped_ms`` (medians), ``sglang_rank_endpoint_cpu_ms_per_scrape``
(``{prefill, decode}``), ``sglang_rank_endpoint_child_cpu_ms_per_scrape`` (the endpoints' processes,
both ranks), ``sglang_rank_endpoint_scrapes`` (``{served, expected}``: expected at one round of the
four GETs per ``SCRAPE_S``); the ratio ``sglang_rank_endpoint_scraped_vs_off`` (scraped / off:
above 1 the endpoints cost time) is ``bench_report.ratios``'.
"""

from __future__ import annotations

import os
import statistics
import threading
import time

TOKENS = 4096
RUNS = {True: 4, False: 8}  # requests per block (--quick, full)
BLOCKS = 2  # off, scraped, off, scraped
SCRAPE_S = 0.05
DEADLINE_S = 10.0
DWELL_S = 2.0  # after each block's requests: this long without a request (scraped or not), its CPU measured
MODES = ("off", "scraped")
ROLES = ("prefill", "decode")
ENDPOINT_MODULE = b"pdstate.status.pushed"  # what a rank's endpoint process runs
PATHS = ("/metrics", "/v1/compat")


def cpu_ms(pid: int) -> float | None:
    """CPU time ``pid`` has spent so far (user + system, all its threads, ended ones included), ms;
    ``None`` once the process has ended and been reaped (its ``/proc`` entry is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


def endpoint_pids(ranks: list[int]) -> list[int]:
    """The processes serving the endpoints of ``ranks`` (their children running ``ENDPOINT_MODULE``)."""
    out = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError):  # not a process, or one that ended meanwhile
            continue
        if ppid in ranks and ENDPOINT_MODULE in cmd:
            out.append(int(name))
    return out


def _cpu(pids: dict[str, int], children: list[int], last: dict[int, float]) -> dict[str, float]:
    """Each role's CPU ms and the endpoints' sum. A process that has ended counts with its last
    reading (``last``: pid -> ms, updated here; 0 if it was never read), so the window does not
    charge it for what it did not run."""

    def read(pid: int) -> float:
        v = cpu_ms(pid)
        if v is not None:
            last[pid] = v
        return last.get(pid, 0.0)

    out = {role: read(pid) for role, pid in pids.items()}
    out["endpoint"] = sum(read(pid) for pid in children)
    return out


def _scrape(ports: list[int], stop: threading.Event, count: list[int]) -> None:
    import httpx

    with httpx.Client(timeout=5.0) as client:
        while not stop.is_set():
            for port in ports:
                for path in PATHS:
                    client.get(f"http://127.0.0.1:{port}{path}").raise_for_status()
                    count[0] += 1
            stop.wait(SCRAPE_S)


def _block(pair, mode: str, runs: int, times: list[float], scrapes: list[int], cpu: dict) -> None:
    from pdstate.devtools.bench_sglang import CASE
    from pdstate.devtools.sglang_pair.pair import free_port

    ports = {role: free_port() for role in ROLES}
    role_env = {r: {"PDSTATE_HTTP__PORT": str(p)} for r, p in ports.items()} if mode == "scraped" else None
    out = pair.setup(CASE, "pdstate", role_env=role_env)
    if "setup_error" in out:
        raise RuntimeError(f"rank endpoints ({mode}): the pair could not be set up: {out['setup_error']}")
    _ms(pair, mode)  # warm-up
    pids = {role: getattr(pair, role).proc.pid for role in ROLES}
    children = endpoint_pids(list(pids.values()))
    stop, thread = threading.Event(), None
    if mode == "scraped":
        thread = threading.Thread(target=_scrape, args=(list(ports.values()), stop, scrapes), daemon=True)
        thread.start()
    try:
        for _ in range(runs):
            times.append(_ms(pair, mode))
            if thread is not None and not thread.is_alive():
                raise RuntimeError(f"rank endpoints: scraping ports {sorted(ports.values())} failed")
        last: dict[int, float] = {}
        before, served, t0 = _cpu(pids, children, last), scrapes[0], time.monotonic()
        time.sleep(DWELL_S)
    finally:
        stop.set()
        if thread is not None:
            thread.join(10.0)
    after = _cpu(pids, children, last)
    cpu["wall_s"] = cpu.get("wall_s", 0.0) + time.monotonic() - t0
    cpu["scrapes"] = cpu.get("scrapes", 0) + scrapes[0] - served
    for k, v in after.items():
        cpu[k] = cpu.get(k, 0.0) + v - before[k]


def _ms(pair, mode: str) -> float:
    r = pair.request(TOKENS, DEADLINE_S)
    if not r["prefill"].get("outcome") == r["decode"].get("outcome") == "Success" or r["send_to_success_ms"] is None:
        raise RuntimeError(f"rank endpoints ({mode}): a request did not end in Success: {r}")
    return r["send_to_success_ms"]


def measure(pair, runs: int, progress=print) -> dict:
    """The blocks on ``pair`` (a ``QueuePair`` started with ``PDSTATE_ENGINE_ENV``): ms per mode."""
    times: dict[str, list[float]] = {m: [] for m in MODES}
    scrapes = [0]
    cpu: dict[str, dict] = {m: {} for m in MODES}
    for i in range(BLOCKS):
        for mode in MODES:
            progress(f"[sglang rank endpoints] block {i + 1}/{BLOCKS}, {mode}: {runs} x {TOKENS} tokens ...")
            _block(pair, mode, runs, times[mode], scrapes, cpu[mode])
    return {"times": times, "scrapes": scrapes[0], "cpu": cpu}


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
    off, on = out["cpu"]["off"], out["cpu"]["scraped"]
    for mode, c in out["cpu"].items():
        info[mode]["cpu_ms"] = {k: c[k] for k in ("prefill", "decode", "endpoint")}
        info[mode]["window_s"] = c["wall_s"]
    n = on["scrapes"]
    expected = round(len(PATHS) * len(ROLES) * on["wall_s"] / SCRAPE_S)  # one round per SCRAPE_S at best
    results["sglang_rank_endpoint_scrapes"] = {"served": n, "expected": expected}
    results["sglang_rank_endpoint_cpu_ms_per_scrape"] = {r: _extra(on, off, r, n / len(ROLES)) for r in ROLES}
    results["sglang_rank_endpoint_child_cpu_ms_per_scrape"] = on["endpoint"] / n if n else None


def _extra(on: dict, off: dict, key: str, scrapes: float) -> float | None:
    """``key``'s CPU in the scraped windows beyond its off-window rate over as long, per scrape it served."""
    if not scrapes or not off["wall_s"]:
        return None
    return (on[key] - off[key] * on["wall_s"] / off["wall_s"]) / scrapes
