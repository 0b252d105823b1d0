"""``pdstate bench``'s agent phase: the embeddable agent against the in-process ceiling and the
physical limit, interleaved in one phase (same run, so the ratios are same-run).

On the shm engine and the paged ``dsv4-flash`` layout (target + draft), per request length:

- ``ceiling_memmove`` / ``ceiling_gather_scatter`` (and ``ceiling``, the better): as in every phase;
- ``physical_<k>t`` (and ``physical``, the best): the physical limit, as in the paged shm phase;
  the headline ``shm_vs_physical`` and ``physical_limit_gbps`` come from this phase;
- ``agent_shm`` / ``agent_shm_sampled`` / ``agent_shm_digest``: a ``PrefillAgent`` process and
  three ``DecodeAgent`` processes (``devtools.cluster_node``; ``verify`` ``off``, ``sampled`` (the
  default) and ``full``: every byte), one request at a time, one chunk, interleaved; the cost of
  each level is ``bench_report.verify_cost`` (``verify_cost_by_mode``). The prefill fills its source pages first (the stand-in for prefill compute)
  and hands the whole request to its sender; only then is the decode told. The time is the
  receiver's own: request issued -> Success (its ``success_at_s`` less its
  ``transferring_at_s``), which holds the prefill's submit, the copy, the prefill's digest of
  what it sent (digest on; at ``full`` on shm fused into the copy, at ``sampled`` its block sample
  read right after it, on the submitting thread), ``TransferDone``, and the decode's digest of what landed (digest on). Each
  side's digest time is kept under ``parts`` (``digest_s``: the decode's after ``TransferDone``;
  ``prefill_digest_s``: the prefill's, 0 when fused: its time is in the copy's). The synthetic pattern check of every landed item runs
  after Success, outside the time.
"""

from __future__ import annotations

import json
import queue
import secrets
import time
from collections.abc import Callable

from pdstate.devtools import bench_scale
from pdstate.devtools.baselines import gather_scatter, memmove_loop, physical_copy
from pdstate.devtools.bench_measure import measure, plan_for, settings, speeds_line
from pdstate.worker import requests as rq

ENGINE = "agent"  # the phase's name in ``paths`` (``paged:agent:<variant>``); its engine is shm
LEVELS = ("off", "sampled", "full")
VARIANTS = {"off": "agent_shm", "sampled": "agent_shm_sampled", "full": "agent_shm_digest"}  # per level
WAIT_S = 300.0


class AgentNodes:
    """A prefill agent node and a decode agent node per verification level, hands shaken."""

    def __init__(self, settings, start_timeout_s: float = 180.0) -> None:
        from pdstate.devtools.cluster import NodeProcess
        from pdstate.devtools.cluster_node import settings_to_dict

        self.events: queue.Queue = queue.Queue()
        base = dict(pool=settings_to_dict(settings), engine="shm", engine_options={}, chunks=1)
        self.nodes = []
        try:
            self.prefill = self._start(NodeProcess, dict(base, role="prefill", name="bench-p"))
            self.decodes = {
                level: self._start(
                    NodeProcess, dict(base, role="decode", name=f"bench-d-{level}", digest=level != "off", verify=level)
                )
                for level in LEVELS
            }
            self.handshake_ms: dict[str, float] = {}
            ready = self._await_all([(n, "ready") for n in self.nodes], start_timeout_s)
            self.prefill.address = ready[0]["address"]
            for level, d in self.decodes.items():
                d.send({"op": "connect", "prefill": self.prefill.address})
                ev = self._await(d, "connected", start_timeout_s)
                if ev["error"] is not None:
                    raise RuntimeError(f"agent handshake refused: {ev['error']}")
                self.handshake_ms[level] = ev["handshake_ms"]
        except BaseException:
            self.close()
            raise

    def _start(self, cls, spec: dict):
        node = cls(spec, self.events)
        self.nodes.append(node)
        return node

    def _await(self, node, event: str, timeout_s: float, room: int | None = None) -> dict:
        return self._await_all([(node, event)], timeout_s, room)[0]

    def _await_all(self, wanted: list, timeout_s: float, room: int | None = None) -> list[dict]:
        """The next event of each ``(node, event)`` in ``wanted`` (for ``room`` if given), in that
        order; other events are dropped (one request at a time: nothing else is pending)."""
        got: dict = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < len(wanted):
            try:
                node, ev = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no {[e for _, e in wanted]} within {timeout_s:.0f} s") from None
            if ev is None:
                raise RuntimeError(f"{node.name} exited: {node.stderr_text().strip()[-2000:]}")
            if ev.get("event") == "error":
                raise RuntimeError(f"{node.name}: {ev['message']}")
            key = (node, ev.get("event"))
            if key in wanted and key not in got and (room is None or ev.get("room") == room):
                got[key] = ev
        return [got[k] for k in wanted]

    def run(self, n: int, level: str) -> dict:
        """One request of ``n`` tokens; the receiver's request issued -> Success, and the parts."""
        room, d = secrets.randbits(63), self.decodes[level]
        self.prefill.send({"op": "send", "room": room, "seq_len": n, "announce": True})
        self._await(self.prefill, "queued", WAIT_S, room)
        d.send({"op": "recv", "room": room, "seq_len": n, "prefill": self.prefill.address})
        res, sent = self._await_all([(d, "result"), (self.prefill, "sent")], WAIT_S, room)
        if not res["verified"]:
            raise RuntimeError(f"agent (verify {level}): {n} tokens failed: {res['error']}")
        m = res["metrics"]
        return {
            "transfer_s": m["success_at_s"] - m["transferring_at_s"],
            "digest_s": m.get("digest_s", 0.0),
            "prefill_digest_s": sent["metrics"].get("digest_s", 0.0),
            "copy_s": sent["metrics"].get("transfer_s", 0.0),  # the prefill's: request known -> all landed
        }

    def close(self) -> None:
        for node in self.nodes:
            node.close()


def phase(
    src, dst, lengths, runs: int, results: dict, progress, preset_name: str = "dsv4-flash", memory_requests: int = 1000
) -> None:
    """The agent (at each verification level), the ceiling and the physical limit,
    interleaved per length; then the agent pair's memory (``agent_memory``: the prefill and the
    ``full`` decode, ``bench_scale.worker_memory`` over ``memory_requests`` small requests)."""
    mode = "paged"
    progress(f"[{mode}:{ENGINE}] starting agent nodes ...")
    nodes = AgentNodes(settings(mode, preset_name))
    results.setdefault("handshake_ms", {})[f"{mode}:{ENGINE}"] = nodes.handshake_ms["full"]
    try:
        for n in lengths:
            plan, a, b = plan_for(src, dst, n)
            variants: dict[str, Callable[[], object]] = {
                "ceiling_memmove": lambda: memmove_loop(plan),
                "ceiling_gather_scatter": gather_scatter(src, dst, a, b),
                **{v: (lambda level=level: nodes.run(n, level)) for level, v in VARIANTS.items()},
                **physical_copy(plan.total_bytes),
            }
            times = measure(mode, ENGINE, n, plan, variants, runs, results)
            progress(speeds_line(mode, ENGINE, n, plan, times))
            rq.free(src.pools, a)
            rq.free(dst.pools, b)
        progress(f"[{mode}:{ENGINE}] the agent pair's memory: peak, then {memory_requests} small requests ...")
        pids = [nodes.prefill.proc.pid, nodes.decodes["full"].proc.pid]
        results["agent_memory"] = bench_scale.worker_memory(
            lambda n, _verify: nodes.run(n, "full"), pids, memory_requests
        )
    finally:
        nodes.close()


def empty_turns(nodes: AgentNodes, echo, blocks: int, runs: int) -> tuple[list[float], list[float]]:
    """The control overhead as ``pdstate bench``'s control phase measures it: the agent pair's empty
    transfer (``nodes.run(0, "off")``: no pages, no state, no digest) and ``echo``'s bare ZeroMQ
    round trip (``baselines.ZmqEcho``) in turns, ``blocks`` blocks of ``runs`` each, after a
    warm-up of both; each one's times in ms."""
    echo.round_trips(10)
    for _ in range(5):
        nodes.run(0, "off")
    agent: list[float] = []
    bare: list[float] = []
    for _ in range(blocks):
        agent += [nodes.run(0, "off")["transfer_s"] * 1e3 for _ in range(runs)]
        bare += echo.round_trips(runs)
    return agent, bare


def empty_transfer(blocks: int, runs: int) -> dict:
    """``empty_turns`` alone, on fresh ``tiny`` agent nodes and a fresh echo process (the control
    phase without its handshakes and serve's 1-token request, for comparing trees): each one's
    median, min and max ms and the ratio of the medians (``control_overhead_vs_zmq``)."""
    import statistics

    from pdstate.devtools.baselines import ZmqEcho

    nodes = AgentNodes(settings("paged", "tiny"))
    try:
        with ZmqEcho() as echo:
            agent, bare = empty_turns(nodes, echo, blocks, runs)
    finally:
        nodes.close()
    out = {
        name: {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}
        for name, xs in (("control_overhead_ms", agent), ("zmq_round_trip_ms", bare))
    }
    out["control_overhead_vs_zmq"] = out["control_overhead_ms"]["median"] / out["zmq_round_trip_ms"]["median"]
    return out


def level_costs(rounds: int, lengths: list[int], progress=print) -> dict:
    """The agent pair alone, ``off``/``sampled``/``full`` interleaved (the order reversed every
    other round), ``rounds`` requests each per length after one warm-up each: per length and
    level the median, min and max ms and each side's digest ms (medians), and each level's
    median over ``off``'s - 1 (``sampled_vs_off``, ``full_vs_off``): what ``verify_cost``
    reports, without the phase's ceilings around it."""
    import statistics

    nodes = AgentNodes(settings("paged", "dsv4-flash"))
    out: dict = {}
    try:
        for n in lengths:
            for level in LEVELS:
                nodes.run(n, level)
            runs: dict = {level: [] for level in LEVELS}
            for r in range(rounds):
                for level in LEVELS if r % 2 == 0 else LEVELS[::-1]:
                    runs[level].append(nodes.run(n, level))
            row: dict = {}
            for level, rs in runs.items():
                ms = [x["transfer_s"] * 1e3 for x in rs]
                row[level] = {
                    "median": statistics.median(ms),
                    "min": min(ms),
                    "max": max(ms),
                    "decode_digest_ms": statistics.median(x["digest_s"] * 1e3 for x in rs),
                    "prefill_digest_ms": statistics.median(x["prefill_digest_s"] * 1e3 for x in rs),
                }
            for level in ("sampled", "full"):
                row[f"{level}_vs_off"] = row[level]["median"] / row["off"]["median"] - 1
            out[str(n)] = row
            progress(f"{n} tokens: " + json.dumps(row))
    finally:
        nodes.close()
    return out


if __name__ == "__main__":
    # python -m pdstate.devtools.bench_agent ROUNDS LENGTH...  (level_costs)
    # python -m pdstate.devtools.bench_agent empty BLOCKS RUNS  (empty_transfer: one JSON line)
    import sys

    if sys.argv[1:2] == ["empty"]:
        print(json.dumps(empty_transfer(int(sys.argv[2]), int(sys.argv[3]))))
    else:
        level_costs(int(sys.argv[1]), [int(x) for x in sys.argv[2:]])
