"""``pdstate bench``'s scheduler-thread measurement (part of the sglang phase, ``--no-sglang`` skips
it): what a transfer backend's classes cost the SGLang scheduler thread per request.

SGLang calls a backend's sender and receiver on its scheduler thread (the one that runs the model)
and polls every request in flight on every iteration. On each SGLang release built here
(``bench_sglang.releases``), a prefill child and a decode child (``devtools.sglang_pair.sched``)
run batches of ``n`` requests of ``TOKENS`` tokens at once (``IN_FLIGHT``: 1, 16, 64; at least
``PER_ROUND`` requests per round: 16 batches of one), both sides
driving them in their scheduler's order (sender: made, polled, ``init`` and two chunks at
``WaitingForInput``, polled to ``Success``; receiver: made, ``init``, polled, ``send_metadata`` at
``WaitingForInput``, polled to ``Success``), one sweep over the live requests per iteration
(``sched.ITERATION_S`` apart). Every call into the backend's classes is timed with the calling
thread's CPU clock (``time.thread_time_ns``): the backend's own threads are not counted, its
scheduler-thread work is. Backend ``pdstate`` (Mooncake engine) and SGLang's ``mooncake`` (TCP) on
the same pools, one warm-up batch each, then batches alternate backend by backend, every ``n`` in
turn, ``ROUNDS`` times. Every destination item of every request is checked after its batch; a
request that does not end in ``Success`` with every item right fails the measurement.

Results:
- ``sglang_scheduler_cpu_us_per_request_by_release``: ``{release: {backend: {"1": µs, "16": µs,
  "64": µs}}}``: per request, the CPU of all its calls on both sides (the constructor, ``init``,
  ``send`` per chunk or ``send_metadata``, every ``poll``), the round's mean, median over the rounds;
- ``sglang_poll_us_by_release``: ``{release: {backend: µs}}``: the median of one ``poll()`` call,
  both sides, every batch;
- ``sglang_sched``: the details (per release, backend and ``n``: the rounds' min/median/max, each
  side's share and its calls', polls per request; the median poll per side).
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from pdstate.devtools.sglang_pair.cases import BASE, Case
from pdstate.devtools.sglang_pair.pair import PDSTATE_ENGINE_ENV, Pair, env_dir

IN_FLIGHT = (1, 16, 64)
ROUNDS = {True: 3, False: 7}  # batches per backend and ``n`` (--quick, full)
BACKENDS = ("pdstate", "mooncake")
TOKENS = 512  # two pages of 256: two chunks, a one-page SWA window, a C128 state row
DEADLINE_S = 60.0
SLACK_S = 60.0  # what a child may take beyond a batch's deadline to answer (the byte checks)
PER_ROUND = 16  # requests at least per backend, ``n`` and round (1 in flight: 16 batches one after another)
WARM_UP = 4  # requests in each backend's first batch (not counted)
# Room for 64 requests of TOKENS at once on each side (and the decode's held page): 128 pages, 64
# window pages, 64 request slots (the prefill's 0..63, the decode's 1..64)
SCHED_SIDE = replace(BASE, full_tokens=33792, swa_tokens=17408, max_num_reqs=max(IN_FLIGHT))
CASE = Case("sched", "the same pools on both sides, room for 64 requests in flight", SCHED_SIDE, SCHED_SIDE)
CPU_KEY = "sglang_scheduler_cpu_us_per_request_by_release"
POLL_KEY = "sglang_poll_us_by_release"


class SchedPair(Pair):
    """A prefill child and a decode child running ``sglang_pair.sched`` (``side``'s commands and its own)."""

    MODULE = "pdstate.devtools.sglang_pair.sched"

    def batch(self, n: int, deadline_s: float = DEADLINE_S) -> dict:
        """``n`` requests at once on both sides; ``{"prefill": answer, "decode": answer}`` (raises
        unless every request ended in ``Success`` with every destination item right)."""
        rooms = list(range(self.room + 1, self.room + n + 1))
        self.room += n
        self.prefill.tell("sched_prefill", rooms=rooms, tokens=TOKENS, deadline_s=deadline_s)
        dec = self.decode.call("sched_decode", deadline_s + SLACK_S, rooms=rooms, tokens=TOKENS, deadline_s=deadline_s)
        pre = self.prefill.answer(deadline_s + SLACK_S)
        out = {"prefill": pre, "decode": dec}
        for role, a in out.items():
            if not a["ok"]:
                raise RuntimeError(
                    f"scheduler measurement: the {role} child failed: {a['error']}\n{a.get('trace', '')}"
                )
            if a["outcomes"] != {"Success": n}:
                raise RuntimeError(f"scheduler measurement: {role}: {a['outcomes']} of {n}: {a['failures']}")
        if dec["wrong_items"]:
            raise RuntimeError(f"scheduler measurement: {dec['wrong_items']} destination items wrong")
        return out


def batches(n: int) -> int:
    """Batches of ``n`` per backend and round: at least ``PER_ROUND`` requests (one batch of 16 or 64)."""
    return max(1, PER_ROUND // n)


def _spread(v: list[float]) -> dict:
    return {"min": min(v), "median": statistics.median(v), "max": max(v)}


def measure(pair: SchedPair, rounds: int, in_flight: tuple[int, ...], progress=print) -> dict:
    """Both backends set up on ``pair`` (a warm-up batch each), then ``rounds`` interleaved batches
    of every ``n``: ``{"release", "cpu_us": {backend: {n: [per round]}}, "parts", "poll_ns"}``."""
    release = None
    for b in BACKENDS:
        progress(f"[sglang scheduler] {b}: managers and a warm-up batch ...")
        p, d = pair.setup(CASE, b)
        if not (p["ok"] and d["ok"]):
            raise RuntimeError(
                f"scheduler measurement: backend {b} could not be set up: {p.get('error') or d.get('error')}"
            )
        release = release or p.get("sglang")
        pair.batch(WARM_UP)
    cpu = {b: {n: [] for n in in_flight} for b in BACKENDS}
    parts = {b: {n: {"prefill": {}, "decode": {}, "polls": [], "kinds": {}} for n in in_flight} for b in BACKENDS}
    polls = {b: {"prefill": [], "decode": []} for b in BACKENDS}
    for k in range(rounds):
        for n in in_flight:
            progress(f"[sglang scheduler] round {k + 1}/{rounds}: {n} in flight ...")
            for b in BACKENDS:
                pair.use(b)
                outs = [pair.batch(n) for _ in range(batches(n))]
                reqs = n * len(outs)
                total = sum(sum(o[role]["cpu_ns"]) for o in outs for role in ("prefill", "decode"))
                cpu[b][n].append(total / reqs / 1000)
                part = parts[b][n]
                for role in ("prefill", "decode"):
                    for call in outs[0][role]["by_call_ns"]:
                        ns = sum(o[role]["by_call_ns"][call] for o in outs)
                        part[role].setdefault(call, []).append(ns / reqs / 1000)
                    for o in outs:
                        polls[b][role] += o[role]["poll_ns"]
                        for kind, (count, ns) in o[role].get("poll_kinds", {}).items():
                            got = part["kinds"].setdefault(role, {}).setdefault(kind, [0, 0])
                            got[0], got[1] = got[0] + count, got[1] + ns
                part["polls"].append(
                    sum(len(o[role]["poll_ns"]) for o in outs for role in ("prefill", "decode")) / reqs
                )
    return {"release": release, "cpu_us": cpu, "parts": parts, "poll_ns": polls}


def store(results: dict, measured: dict) -> None:
    """The keys of one release's ``measure`` in ``results`` (see the module's docstring)."""
    release, cpu = measured["release"] or "?", measured["cpu_us"]
    by = results.setdefault(CPU_KEY, {}).setdefault(release, {})
    polls = results.setdefault(POLL_KEY, {}).setdefault(release, {})
    info = results.setdefault("sglang_sched", {"tokens": TOKENS, "by_release": {}})
    detail = info["by_release"].setdefault(release, {})
    for b, by_n in cpu.items():
        by[b] = {str(n): statistics.median(v) for n, v in by_n.items()}
        every = measured["poll_ns"][b]["prefill"] + measured["poll_ns"][b]["decode"]
        polls[b] = statistics.median(every) / 1000
        detail[b] = {
            "cpu_us_per_request": {str(n): _spread(v) for n, v in by_n.items()},
            "by_side_and_call_us": {
                str(n): {
                    role: {call: statistics.median(v) for call, v in part[role].items()}
                    for role in ("prefill", "decode")
                }
                for n, part in measured["parts"][b].items()
            },
            "polls_per_request": {str(n): statistics.median(p["polls"]) for n, p in measured["parts"][b].items()},
            # every round's polls by what they answered: the request's previous answer (steady) or a
            # new one ("to <state>"): how many a request, and their mean CPU
            "polls_by_kind": {
                str(n): {
                    role: {
                        kind: {
                            "per_request": count / (len(p["polls"]) * n * batches(n)),
                            "mean_us": ns / count / 1000 if count else None,
                        }
                        for kind, (count, ns) in kinds.items()
                    }
                    for role, kinds in p["kinds"].items()
                }
                for n, p in measured["parts"][b].items()
            },
            "poll_us_by_side": {role: statistics.median(v) / 1000 for role, v in measured["poll_ns"][b].items() if v},
            "polls": len(every),
        }


def phase(
    quick: bool,
    results: dict,
    progress=print,
    *,
    in_flight: tuple[int, ...] = IN_FLIGHT,
    rounds: int | None = None,
    releases: list[str] | None = None,
) -> None:
    """Measure on every SGLang release built here (``releases``: these only) and store the keys in
    ``results``; both keys ``None`` where the phase cannot run (saying why in ``sglang_sched``)."""
    from pdstate.devtools import bench_sglang

    results.setdefault(CPU_KEY, None)
    results.setdefault(POLL_KEY, None)
    why = bench_sglang.unavailable()
    if why:
        progress(f"skipping the sglang scheduler measurement: {why}")
        results["sglang_sched"] = {"skipped": why}
        return
    for release in releases or bench_sglang.releases():
        with SchedPair(target=env_dir(release), extra_env=PDSTATE_ENGINE_ENV) as pair:
            measured = measure(pair, rounds or ROUNDS[quick], in_flight, progress)
        if results.get(CPU_KEY) is None:
            results[CPU_KEY], results[POLL_KEY] = {}, {}
        store(results, measured)
        name = measured["release"]
        for b in BACKENDS:
            cpu = results[CPU_KEY][name][b]
            progress(
                f"[sglang scheduler {name}] {b}: "
                + ", ".join(f"{n} in flight {us:.0f} µs/request" for n, us in cpu.items())
                + f"; poll {results[POLL_KEY][name][b]:.1f} µs"
            )
