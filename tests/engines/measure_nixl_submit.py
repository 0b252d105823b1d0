"""What ``NixlEngine`` adds per request over NIXL's own calls (not collected by pytest).

    UCX_MODULES=^ib .venv/bin/python tests/engines/measure_nixl_submit.py [--descriptors 148] [--bytes 64]

Two ``NixlEngine``s in this process (two agents; UCX moves the bytes with ``cma`` as between two
processes), one plan of ``--descriptors`` scattered descriptors of ``--bytes`` each (148 is what
``pdstate bench`` plans for a DSV4-Flash request of any length). Interleaved, ``--runs`` times:

* ``raw``: ``initialize_xfer`` + ``transfer`` + ``check_xfer_state`` until done +
  ``release_xfer_handle``, both descriptor lists built beforehand (the bench's ``raw_nixl`` row);
* ``engine``: ``submit`` + ``poll`` until done (the plan's checks, the descriptor lists, the same
  native calls).

Prints each one's median, 10th and 90th percentile in microseconds, and the difference of the
medians: the engine's own cost per request. Then each part of the engine's path alone (best of 5
blocks of 200 calls). The destination is checked against the source after the runs.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
import timeit
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.support
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from pdstate.devtools.baselines import raw_nixl_write
from pdstate.pools.memory import BufferSpec, PrivateMemory
from pdstate.transfer.engines.nixl import NixlEngine
from pdstate.transfer.engines.regions import RegionTable, check_plan
from pdstate.transfer.plan import TransferPlan
from tests.support.engines import ENGINE_OPTIONS


def _percentiles(us: list[float]) -> str:
    s = sorted(us)
    return f"median {statistics.median(s):8.1f}  p10 {s[len(s) // 10]:8.1f}  p90 {s[9 * len(s) // 10]:8.1f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--descriptors", type=int, default=148)
    ap.add_argument("--bytes", type=int, default=64, help="bytes per descriptor")
    ap.add_argument("--runs", type=int, default=300)
    args = ap.parse_args()
    n, each = args.descriptors, args.bytes
    span = n * each * 2  # every other slot: no two descriptors touch
    dst_mem, src_mem = PrivateMemory(), PrivateMemory()
    (dst,) = dst_mem.allocate("dst", [BufferSpec("b", (span,), torch.uint8)])
    (src,) = src_mem.allocate("src", [BufferSpec("b", (span,), torch.uint8)])
    src.copy_(torch.from_numpy(np.random.default_rng(1).integers(0, 256, span, dtype=np.uint8)))
    dst.zero_()
    (dst_region,), (src_region,) = dst_mem.regions(), src_mem.regions()
    offsets = np.arange(n, dtype=np.uint64) * np.uint64(2 * each)
    plan = TransferPlan.from_arrays(
        src_region.base_ptr + offsets, dst_region.base_ptr + offsets, np.full(n, each, dtype=np.uint64)
    )
    with NixlEngine(**ENGINE_OPTIONS["nixl"]) as decode, NixlEngine(**ENGINE_OPTIONS["nixl"]) as prefill:
        decode.register(dst_mem.regions())
        prefill.register(src_mem.regions())
        endpoint = decode.endpoint()
        peer = prefill.connect(endpoint)
        agent, remote = prefill.native, str(endpoint["agent_name"])

        def rows(addrs: np.ndarray) -> np.ndarray:  # what the engine builds per submit
            return np.stack([addrs, plan.length, np.zeros_like(addrs)], axis=1).astype(np.uint64)

        raw = raw_nixl_write(agent, remote, plan)

        def engine() -> None:
            handle = prefill.submit(peer, plan)
            while not prefill.poll(handle):
                pass

        for fn in (raw, engine):
            fn()  # warm-up
        us: dict[str, list[float]] = {"raw": [], "engine": []}
        for _ in range(args.runs):
            for name, fn in (("raw", raw), ("engine", engine)):
                t0 = time.perf_counter_ns()
                fn()
                us[name].append((time.perf_counter_ns() - t0) / 1e3)
        print(f"{n} descriptors of {each} bytes, {args.runs} interleaved runs, load {os.getloadavg()[0]:.2f}")
        for name, xs in us.items():
            print(f"  {name:7s} {_percentiles(xs)} us")
        print(f"  engine - raw, medians: {statistics.median(us['engine']) - statistics.median(us['raw']):.1f} us")

        local_table = RegionTable.build(src_mem.regions())
        peer_table = prefill.peer_regions(peer)
        parts = {
            "check_plan (shared base)": lambda: check_plan(plan, local_table, peer_table),
            "descriptor lists, both sides": lambda: (
                agent.get_xfer_descs(rows(plan.src), "DRAM"),
                agent.get_xfer_descs(rows(plan.dst), "DRAM"),
            ),
        }
        for name, fn in parts.items():
            best = min(timeit.repeat(fn, number=200, repeat=5)) / 200
            print(f"  {name:30s} {best * 1e6:6.1f} us")

        got = np.frombuffer((ctypes.c_uint8 * span).from_address(dst_region.base_ptr), dtype=np.uint8)
        want = np.frombuffer((ctypes.c_uint8 * span).from_address(src_region.base_ptr), dtype=np.uint8)
        idx = (offsets[:, None] + np.arange(each, dtype=np.uint64)).ravel().astype(np.int64)
        if not np.array_equal(got[idx], want[idx]):
            raise SystemExit("the destination does not match the source")
        print("  destination checked: every descriptor's bytes match")
    os._exit(0)  # see engines/nixl.py: NIXL may crash in interpreter teardown


if __name__ == "__main__":
    main()
