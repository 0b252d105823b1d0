"""Quick throughput check of every available engine (not collected by pytest).

    .venv/bin/python tests/engines/measure_engines.py [--page-kib 64] [--payload-mib 64]

For each page size, ``payload / page`` pages are picked at random (no repeats) from a pool on
each side, so descriptors are scattered on both sides, as in a KV-cache transfer. A decode
process (spawned) owns the destination pool; the prefill side (this process) writes into it.
The baseline is the same scattered copy within one process (``ctypes.memmove`` per page) and
one contiguous copy. Each figure is the median of ``--runs`` after one warm-up; the decode
process checks a digest of the received pages against the source after the last run.
GB/s = payload bytes / 1e9 / s.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.support
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from pdstate.pools.memory import BufferSpec, PrivateMemory, SharedMemory
from pdstate.transfer.engines import EngineUnavailable, create_engine, engine_class
from pdstate.transfer.plan import TransferPlan
from tests.support.engines import ENGINE_OPTIONS, proven


def _digest(pool: torch.Tensor, pages: np.ndarray, page_bytes: int) -> str:
    view = pool.view(-1, page_bytes)
    return hashlib.blake2b(view[torch.from_numpy(pages)].numpy().tobytes(), digest_size=16).hexdigest()


def decode_main(conn, engine: str, pool_bytes: int) -> None:
    memory = SharedMemory() if engine == "shm" else PrivateMemory()
    (pool,) = memory.allocate("pool", [BufferSpec("b", (pool_bytes,), torch.uint8)])
    pool.fill_(0)
    eng = create_engine(engine, **ENGINE_OPTIONS[engine])
    eng.start()
    eng.register(memory.regions())
    conn.send((eng.endpoint(), pool.data_ptr()))
    while True:
        cmd = conn.recv()
        if cmd is None:
            break
        pages, page_bytes = cmd
        conn.send(_digest(pool, pages, page_bytes))
    eng.close()
    memory.close()
    os._exit(0)  # NIXL/UCX may crash in interpreter teardown


def timed(fn, runs: int) -> float:
    fn()  # warm-up (first touch, connection setup)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page-kib", type=int, nargs="+", default=[64, 4])
    ap.add_argument("--payload-mib", type=int, default=64)
    ap.add_argument("--pool-mib", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--engines", default="shm,mooncake,nixl")
    args = ap.parse_args()
    payload, pool_bytes = args.payload_mib << 20, args.pool_mib << 20
    rng = np.random.default_rng(0)

    src_mem = PrivateMemory()
    (src,) = src_mem.allocate("src", [BufferSpec("b", (pool_bytes,), torch.uint8)])
    src.numpy()[:] = rng.integers(0, 256, pool_bytes, dtype=np.uint8)
    (local_dst,) = src_mem.allocate("dst", [BufferSpec("b", (pool_bytes,), torch.uint8)])
    local_dst.fill_(0)

    def gbps(seconds: float) -> str:
        return f"{payload / 1e9 / seconds:7.2f} GB/s"

    def scatter(page_bytes: int) -> tuple[np.ndarray, np.ndarray]:
        n = payload // page_bytes
        return (
            rng.choice(pool_bytes // page_bytes, n, replace=False),
            rng.choice(pool_bytes // page_bytes, n, replace=False),
        )

    print(f"payload {args.payload_mib} MiB, pools {args.pool_mib} MiB, median of {args.runs}")
    contig = timed(lambda: ctypes.memmove(local_dst.data_ptr(), src.data_ptr(), payload), args.runs)
    print(f"  baseline memcpy, contiguous, same process        {gbps(contig)}")
    plans = {}
    for kib in args.page_kib:
        page_bytes = kib << 10
        s_pages, d_pages = scatter(page_bytes)
        plans[kib] = (s_pages, d_pages)
        pairs = list(
            zip(
                (src.data_ptr() + s_pages * page_bytes).tolist(), (local_dst.data_ptr() + d_pages * page_bytes).tolist()
            )
        )

        def copy_pages(pairs=pairs, page_bytes=page_bytes) -> None:
            for s, d in pairs:
                ctypes.memmove(d, s, page_bytes)

        t = timed(copy_pages, args.runs)
        print(
            f"  baseline memmove per page, {kib:3d} KiB x {len(pairs):5d}, same process {gbps(t)}"
            f"  ({t / len(pairs) * 1e6:.2f} us/desc)"
        )

    ctx = mp.get_context("spawn")
    for name in args.engines.split(","):
        try:
            engine_class(name)
        except EngineUnavailable as exc:
            print(f"  {name}: unavailable ({exc})")
            continue
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=decode_main, args=(child, name, pool_bytes), daemon=True)
        proc.start()
        endpoint, dst_base = conn.recv()
        eng = create_engine(name, **ENGINE_OPTIONS[name])
        eng.start()
        eng.register(src_mem.regions())
        peer = eng.connect(proven(eng, endpoint))
        for kib, (s_pages, d_pages) in plans.items():
            page_bytes = kib << 10
            plan = TransferPlan.from_arrays(
                src.data_ptr() + s_pages.astype(np.uint64) * page_bytes,
                dst_base + d_pages.astype(np.uint64) * page_bytes,
                np.full(len(s_pages), page_bytes),
            )
            t = timed(lambda: eng.wait(eng.submit(peer, plan), 60.0), args.runs)
            conn.send((d_pages, page_bytes))
            ok = conn.recv() == _digest(src, s_pages, page_bytes)
            print(
                f"  {name:8s} {kib:3d} KiB x {len(s_pages):5d} scattered pages        {gbps(t)}"
                f"  ({t / len(s_pages) * 1e6:.2f} us/desc){'' if ok else '  DIGEST MISMATCH'}"
            )
        eng.close()
        conn.send(None)
        proc.join(30)
    sys.stdout.flush()
    os._exit(0)  # see engines/nixl.py: NIXL may crash in interpreter teardown


if __name__ == "__main__":
    main()
