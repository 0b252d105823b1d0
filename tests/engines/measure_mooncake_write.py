"""Mooncake's own writes against ``MooncakeEngine``'s, per request (not collected by pytest).

    .venv/bin/python tests/engines/measure_mooncake_write.py [--descriptors 148] [--kib 256]

Two ``MooncakeEngine``s in this process (TCP on 127.0.0.1, as between two processes), one plan of
``--descriptors`` scattered descriptors of ``--kib`` KiB each. Interleaved, ``--runs`` times:

* ``raw_sync``: ``batch_transfer_sync_write`` per window, the argument lists built beforehand
  (the bench's ``raw_mooncake`` row: it spins until each window ends);
* ``raw_polled``: ``transfer_submit_write`` per descriptor + ``transfer_check_status``, sleeping
  20 us doubling up to 0.2 ms (the bench's ``raw_mooncake_polled`` row, the engine's own waits);
* ``engine``: ``submit`` + ``wait`` (the plan's checks, the worker thread, the same native calls).

Both raw rows are ``devtools.baselines.raw_mooncake_write``, as in ``pdstate bench``. Prints each
one's median, 10th and 90th percentile in milliseconds and the load; the destination is checked
against the source after the runs.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.support
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from pdstate.devtools.baselines import raw_mooncake_write
from pdstate.pools.memory import BufferSpec, PrivateMemory
from pdstate.transfer.engines.mooncake import MooncakeEngine
from pdstate.transfer.plan import TransferPlan
from tests.support.engines import ENGINE_OPTIONS


def _percentiles(ms: list[float]) -> str:
    s = sorted(ms)
    return f"median {statistics.median(s):8.2f}  p10 {s[len(s) // 10]:8.2f}  p90 {s[9 * len(s) // 10]:8.2f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--descriptors", type=int, default=148)
    ap.add_argument("--kib", type=int, default=256, help="KiB per descriptor")
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args()
    n, each = args.descriptors, args.kib * 1024
    span = n * each * 2  # every other slot: no two descriptors touch
    dst_mem, src_mem = PrivateMemory(), PrivateMemory()
    (dst,) = dst_mem.allocate("dst", [BufferSpec("b", (span,), torch.uint8)])
    (src,) = src_mem.allocate("src", [BufferSpec("b", (span,), torch.uint8)])
    src.copy_(torch.from_numpy(np.random.default_rng(1).integers(0, 256, span, dtype=np.uint8)))
    (dst_region,), (src_region,) = dst_mem.regions(), src_mem.regions()
    offsets = np.random.default_rng(2).permutation(n).astype(np.uint64) * np.uint64(2 * each)
    plan = TransferPlan.from_arrays(
        src_region.base_ptr + offsets, dst_region.base_ptr + offsets, np.full(n, each, dtype=np.uint64)
    )
    with (
        MooncakeEngine(**ENGINE_OPTIONS["mooncake"]) as decode,
        MooncakeEngine(**ENGINE_OPTIONS["mooncake"]) as prefill,
    ):
        decode.register(dst_mem.regions())
        prefill.register(src_mem.regions())
        endpoint = decode.endpoint()
        peer = prefill.connect(endpoint)
        session = str(endpoint["session_id"])
        variants = {
            "raw_sync": raw_mooncake_write(prefill.native, session, plan, polled=False),
            "raw_polled": raw_mooncake_write(prefill.native, session, plan, polled=True),
            "engine": lambda: prefill.wait(prefill.submit(peer, plan), 60.0),
        }
        for fn in variants.values():
            fn()  # warm-up
        ms: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.runs):
            for name, fn in variants.items():
                t0 = time.perf_counter_ns()
                fn()
                ms[name].append((time.perf_counter_ns() - t0) / 1e6)
        print(f"{n} descriptors of {each} bytes, {args.runs} interleaved runs, load {os.getloadavg()[0]:.2f}")
        for name, xs in ms.items():
            print(f"  {name:10s} {_percentiles(xs)} ms  {plan.total_bytes / statistics.median(xs) / 1e6:.2f} GB/s")
        got = np.frombuffer((ctypes.c_uint8 * span).from_address(dst_region.base_ptr), dtype=np.uint8)
        want = np.frombuffer((ctypes.c_uint8 * span).from_address(src_region.base_ptr), dtype=np.uint8)
        idx = (offsets[:, None] + np.arange(each, dtype=np.uint64)).ravel().astype(np.int64)
        if not np.array_equal(got[idx], want[idx]):
            raise SystemExit("the destination does not match the source")
        print("  destination checked: every descriptor's bytes match")


if __name__ == "__main__":
    main()
