"""Measure decode -> decode migration in ``pdstate serve`` on this host (not a test: run it).

    PYTHONPATH=src python -m tests.integration.measure_migration [--rounds 7] [--engine shm]
        [--lengths 2048,8192,32768] [--set KEY=VALUE ...]

One prefill and two decodes, ``dsv4-flash`` (target + NextN draft), real processes on 127.0.0.1.
Per round and length (interleaved: every length once a round, the direction alternating): a
request lands on one decode and is kept running (``hold``, 2 synthetic decode steps), then moves
to the other (``POST /v1/migrations``); the migration's own record gives its downtime (paused on
the source -> verified and running on the target, as the source saw it) and its bytes. Beside it,
the prefill -> decode transfer of the same request (``seconds`` of ``POST /v1/transfers``: asked
-> verified, the prefill's synthetic compute included), and the target's own record of the
migration (``transfer_s``: asked -> the agent's verdict; ``verify_s``: its ``checks.verify``). A
warm-up round (the first handshake each way) is not recorded. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import httpx

from tests.support.services import Services, ready, wait_for


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "n": len(xs)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1, help="rounds run first and not recorded (handshakes)")
    ap.add_argument("--engine", default="shm")
    ap.add_argument("--lengths", default="2048,8192,32768")
    ap.add_argument("--set", action="append", default=[], dest="extra")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    common = ["preset=dsv4-flash", f"transfer.engine={a.engine}", "http.port=0", *a.extra]
    out: dict = {"engine": a.engine, "settings": common, "load_before": os.getloadavg()}
    down: dict[int, list[float]] = {n: [] for n in lengths}
    landed: dict[int, list[float]] = {n: [] for n in lengths}
    moved: dict[int, int] = {}
    parts: dict[int, dict[str, list[float]]] = {n: {"transfer_s": [], "verify_s": []} for n in lengths}
    with Services() as sv, httpx.Client(timeout=300) as http:
        _, control = sv.prefill(*common)
        d = [sv.start("decode", [f"control.peer={control}", "control.request_deadline_s=120", *common]) for _ in "ab"]
        for s in d:
            wait_for(lambda s=s: ready(http, s.url), 120, "decode ready")
        room = 1
        for r in range(-a.warmup, a.rounds):
            for n in lengths:
                src, dst = (d[0], d[1]) if r % 2 == 0 else (d[1], d[0])
                room += 1
                t = http.post(f"{src.url}/v1/transfers", json={"tokens": n, "room": room, "hold": True, "steps": 2})
                assert t.status_code == 200 and t.json()["held"], t.text
                m = http.post(f"{src.url}/v1/migrations", json={"room": room, "to": dst.url})
                assert m.status_code == 200, m.text
                on_target = http.get(f"{dst.url}/v1/transfers/{room}").json()
                if r >= 0:
                    landed[n].append(t.json()["seconds"])
                    down[n].append(m.json()["downtime_s"])
                    for k in parts[n]:
                        parts[n][k].append(on_target[k])
                moved[n] = m.json()["bytes"]
                assert http.delete(f"{dst.url}/v1/requests/{room}").status_code == 200
    out["load_after"] = os.getloadavg()
    out["by_length"] = {
        n: {
            "bytes": moved[n],
            "downtime_ms": {k: v * 1e3 if k != "n" else v for k, v in _stats(down[n]).items()},
            "prefill_transfer_ms": {k: v * 1e3 if k != "n" else v for k, v in _stats(landed[n]).items()},
            # the target's own record: asked -> verdict (handshake answer, copy, digests), then its check
            **{f"target_{k[:-2]}_ms_median": statistics.median(v) * 1e3 for k, v in parts[n].items()},
        }
        for n in lengths
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
