"""The baselines ``pdstate bench`` measures pdstate against, kept apart from the benchmark's driver:
the physical copy limit (one contiguous copy of the same byte count, 1..N threads), the
in-process copy of a plan's regions (per-run ``memmove``, numpy gather/scatter), the native
engines writing the same descriptors with nothing of pdstate in the loop, and a bare ZeroMQ round
trip between two processes (the floor under any control message exchange).
"""

from __future__ import annotations

import ctypes
import statistics
import time
from collections.abc import Callable

import numpy as np

from pdstate.transfer.plan import TransferPlan

# same-host engine settings (NIXL: no UCX IB modules, see engines/nixl.py; Mooncake on loopback)
ENGINE_OPTIONS = {"nixl": {"ucx_env": {"UCX_MODULES": "^ib"}}, "mooncake": {"host": "127.0.0.1"}}


def median_range(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def thread_counts(cores: int) -> list[int]:
    """1, 2, 4, ... up to ``cores``, and ``cores`` itself: the thread counts the limit tries."""
    out, k = [], 1
    while k < cores:
        out.append(k)
        k *= 2
    return out + [cores]


class _ContiguousCopy:
    """One ``memmove`` of ``src`` into ``dst`` (numpy buffers it keeps alive) in ``k`` equal shares,
    the calling thread copying the first and ``pool``'s threads the others at once."""

    def __init__(self, src: np.ndarray, dst: np.ndarray, k: int, pool) -> None:
        from pdstate.transfer.engines.shm_copy import split_descriptors

        self.src, self.dst, self.pool = src, dst, pool
        u64 = np.uint64
        whole = (np.array([dst.ctypes.data], u64), np.array([src.ctypes.data], u64), np.array([src.nbytes], u64))
        self.shares = [(d[0], s[0], n[0]) for d, s, n in split_descriptors(*whole, k)]

    def __call__(self) -> None:
        (d0, s0, n0), *rest = self.shares
        futures = [self.pool.submit(ctypes.memmove, d, s, n) for d, s, n in rest]
        ctypes.memmove(d0, s0, n0)
        for f in futures:
            f.result()


def physical_copy(nbytes: int, cores: int | None = None) -> dict[str, Callable[[], None]]:
    """``physical_<k>t``: one contiguous ``memmove`` of ``nbytes`` between two buffers of this
    process (touched beforehand), split into ``k`` equal shares copied by ``k`` threads at once,
    for ``k`` in ``thread_counts(cores)`` (default: the cores this process may use). The best of
    them is the physical limit for that byte count: no descriptors, no planning, no process."""
    from concurrent.futures import ThreadPoolExecutor

    from pdstate.transfer.engines.shm_copy import host_cores

    counts = thread_counts(cores or host_cores())
    src = np.full(nbytes, 1, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    pool = ThreadPoolExecutor(max(counts) - 1) if max(counts) > 1 else None
    return {f"physical_{k}t": _ContiguousCopy(src, dst, k, pool) for k in counts}


def memmove_loop(plan: TransferPlan) -> None:
    mv = ctypes.memmove
    for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist()):
        mv(d, s, n)


def gather_scatter(src, dst, a, b) -> Callable[[], None]:
    from pdstate.transfer.planner import channels_of
    from pdstate.worker.synth import item_matrix

    ops = []
    for sc, dc, si, di in zip(channels_of(src.kv), channels_of(dst.kv), a.lists, b.lists):
        if si.size == 0:
            continue
        for j in range(len(sc.ptrs)):
            item = int(sc.items[j])
            ops.append(
                (
                    item_matrix(int(sc.ptrs[j]), int(sc.lens[j]), item),
                    item_matrix(int(dc.ptrs[j]), int(dc.lens[j]), item),
                    si,
                    di,
                )
            )

    def run() -> None:
        for sm, dm, si, di in ops:
            dm[di] = sm[si]

    return run


def raw_engine(name: str):
    """A native agent in this process writing into another process's registered memory: returns
    ``(setup(src, endpoint) -> prepare, close)``; ``endpoint`` is the destination engine's (the
    pdstate decode worker's own, so raw and pdstate write into the same process over the same
    path). ``prepare(plan)`` turns a plan into the native calls' own arguments (outside any
    timing) and returns the raw rows, ``{row: run()}``: the native API alone writing them, no
    pdstate code in the loop. Mooncake has two (``RAW_MOONCAKE_ROWS``): its spinning sync write
    and the same descriptors submitted one by one and polled, sleeping, as pdstate's engine
    waits (the faster one is the reference, ``bench_report.ratios``); NIXL has one."""
    from pdstate.transfer.engines.base import create_engine

    src_eng = create_engine(name, **ENGINE_OPTIONS[name])

    def setup(src, endpoint: dict) -> Callable[[TransferPlan], dict[str, Callable[[], None]]]:
        src_eng.start()
        src_eng.register(src.pools.memory.regions())
        src_eng.connect(endpoint)  # the agents' own handshake (metadata, sessions)
        if name == "mooncake":
            native, session = src_eng.native, str(endpoint["session_id"])
            sync_row, polled_row = RAW_MOONCAKE_ROWS
            return lambda plan: {
                sync_row: raw_mooncake_write(native, session, plan, polled=False),
                polled_row: raw_mooncake_write(native, session, plan, polled=True),
            }

        agent, remote_name = src_eng.native, str(endpoint["agent_name"])
        return lambda plan: {f"raw_{name}": raw_nixl_write(agent, remote_name, plan)}

    def close() -> None:
        src_eng.close()

    return setup, close


# the raw Mooncake rows: ``batch_transfer_sync_write`` (spins until the window ends), and
# ``transfer_submit_write`` per descriptor + ``transfer_check_status`` with sleeps (how
# ``MooncakeEngine`` waits)
RAW_MOONCAKE_ROWS = ("raw_mooncake", "raw_mooncake_polled")


def raw_mooncake_write(native, session: str, plan: TransferPlan, polled: bool = True) -> Callable[[], None]:
    """Mooncake's own WRITE of ``plan`` from ``native`` (a ``mooncake.engine.TransferEngine``) to
    ``session``, in windows of ``MAX_BATCH_DESCRIPTORS`` with every argument list built now. The
    returned call writes and waits for every window in turn: ``polled`` submits each descriptor
    (``transfer_submit_write``), then checks them in order (``transfer_check_status``, which frees
    an ended one), sleeping between checks 20 us doubling up to 0.2 ms, the engine's own pauses;
    otherwise one ``batch_transfer_sync_write`` per window, which spins until it ends. (The bench's
    raw rows, and ``tests/engines/measure_mooncake_write.py``'s.)"""
    from pdstate.transfer.engines.mooncake import BAD_BATCH, MAX_BATCH_DESCRIPTORS, POLL_FIRST_S, POLL_INTERVAL_S

    windows = [(c.src.tolist(), c.dst.tolist(), c.length.tolist()) for c in plan.chunks(MAX_BATCH_DESCRIPTORS)]
    if not polled:

        def run_sync() -> None:
            for s_, d_, n_ in windows:
                rc = native.batch_transfer_sync_write(session, s_, d_, n_)
                if rc < 0:
                    raise RuntimeError(f"raw mooncake write failed: {rc}")

        return run_sync

    windows = [list(zip(*w)) for w in windows]  # (src, dst, length) per descriptor

    def run_polled() -> None:
        submit, check, sleep = native.transfer_submit_write, native.transfer_check_status, time.sleep
        for window in windows:
            ids = [submit(session, s_, d_, n_) for s_, d_, n_ in window]
            pause, failed = POLL_FIRST_S, 0
            for batch in ids:
                if batch <= 0 or batch == BAD_BATCH:  # refused at submission
                    failed += 1
                    continue
                rc = check(batch)
                while rc == 0:
                    sleep(pause)
                    pause = min(pause * 2, POLL_INTERVAL_S)
                    rc = check(batch)
                failed += rc < 0
            if failed:
                raise RuntimeError(f"raw mooncake polled write failed: {failed} descriptors")

    return run_polled


def raw_nixl_write(agent, remote_name: str, plan: TransferPlan) -> Callable[[], None]:
    """NIXL's own WRITE of ``plan`` from ``agent`` (a native ``nixl_agent``) to ``remote_name``,
    both descriptor lists built now: the returned call initialises, transfers, waits for and
    releases one transfer (the raw row's, and ``tests/engines/measure_nixl_submit.py``'s)."""

    def rows(addr):
        r = np.zeros((len(plan), 3), dtype=np.uint64)
        r[:, 0], r[:, 1] = addr, plan.length
        return r

    local = agent.get_xfer_descs(rows(plan.src), "DRAM")
    remote = agent.get_xfer_descs(rows(plan.dst), "DRAM")

    def run() -> None:
        x = agent.initialize_xfer("WRITE", local, remote, remote_name)
        state = agent.transfer(x)
        while state == "PROC":
            state = agent.check_xfer_state(x)
        agent.release_xfer_handle(x)
        if state != "DONE":
            raise RuntimeError(f"raw nixl write ended in {state}")

    return run


class WorkerRawNixl:
    """The raw NIXL row written from inside a worker process (``devtools.processes``' prefill, the
    bench's ``raw_nixl_prefill``): NIXL's own write, as ``raw_nixl_write``, from an agent of its own
    over the worker's pools, that is from the very pages pdstate's prefill sends from, into a
    decode's registered memory. The same native write runs up to 2-3x faster or slower from one
    agent than from another, often steadily over a run (docs/performance.md, "NIXL at 8k"): this
    row is a second writer, from the pages pdstate sends, beside the bench process's."""

    def __init__(self, pools, kv_args) -> None:
        self.pools, self.kv_args = pools, kv_args
        self.engine = None
        self.run: Callable[[], None] | None = None

    def prepare(self, register_hex: str, src_lists: list[list[int]], dst_lists: list[list[int]]) -> dict:
        """Plan the pages ``src_lists`` of this worker into the pages ``dst_lists`` of the decode
        whose encoded register message (``{"cmd": "describe"}``'s) is ``register_hex``; the
        first call also starts the agent, registers the pools and connects to that decode."""
        from pdstate.protocol import wire
        from pdstate.transfer.engines.base import create_engine
        from pdstate.transfer.planner import plan_request

        reg = wire.decode(bytes.fromhex(register_hex))
        endpoint = dict(reg.engine.endpoint)
        if self.engine is None:
            self.engine = create_engine("nixl", **ENGINE_OPTIONS["nixl"])
            self.engine.start()
            self.engine.register(self.pools.memory.regions())
            self.engine.connect(endpoint)
        src = [np.asarray(x, dtype=np.int64) for x in src_lists]
        dst = [np.asarray(x, dtype=np.int64) for x in dst_lists]
        plan = plan_request(self.kv_args, reg.kv, src, dst)
        self.run = raw_nixl_write(self.engine.native, str(endpoint["agent_name"]), plan)
        return {"bytes": plan.total_bytes, "descriptors": len(plan)}

    def write(self) -> float:
        """One write of the prepared plan, in seconds (``RuntimeError`` unless it ended DONE)."""
        if self.run is None:
            raise RuntimeError("raw nixl: no plan prepared")
        t0 = time.perf_counter()
        self.run()
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


_ECHO_SERVER = """
import sys, zmq
ctx = zmq.Context(); r = ctx.socket(zmq.ROUTER); r.setsockopt(zmq.LINGER, 0)
print(r.bind_to_random_port("tcp://127.0.0.1"), flush=True)
poller = zmq.Poller(); poller.register(r, zmq.POLLIN)
while True:
    if dict(poller.poll(250)):
        ident, m = r.recv_multipart()
        if m == b"stop":
            break
        r.send_multipart([ident, m])
"""


class ZmqEcho:
    """The floor under any control message exchange here: a bare ZeroMQ DEALER/ROUTER echo of a
    200-byte message between this process and another, each side sleeping in a poller between
    messages as the workers do (on a VM, waking a sleeping thread is most of the cost). The echo
    process lives until ``close``, so its round trips can be measured in blocks between blocks of
    another measurement (both then see the same host)."""

    def __init__(self) -> None:
        import subprocess
        import sys

        import zmq

        self._proc = subprocess.Popen([sys.executable, "-c", _ECHO_SERVER], stdout=subprocess.PIPE, text=True)
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.connect(f"tcp://127.0.0.1:{int(self._proc.stdout.readline())}")
        except BaseException:
            self.close()
            raise
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)

    def round_trips(self, n: int) -> list[float]:
        """``n`` round trips, in ms, each after 1 ms idle (as a worker between requests)."""
        xs = []
        for _ in range(n):
            time.sleep(0.001)
            t0 = time.perf_counter()
            self._sock.send(b"x" * 200)
            if not dict(self._poller.poll(5000)):
                raise RuntimeError("no echo from the ZeroMQ echo process within 5 s")
            self._sock.recv()
            xs.append((time.perf_counter() - t0) * 1e3)
        return xs

    def close(self) -> None:
        import subprocess

        try:
            self._sock.send(b"stop")
        except Exception:  # never connected, or already closed
            pass
        self._sock.close(0)
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()

    def __enter__(self) -> ZmqEcho:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def zmq_round_trip(runs: int) -> dict:
    """``ZmqEcho``'s round trip: ``runs`` of them after 10 to warm up."""
    with ZmqEcho() as echo:
        echo.round_trips(10)
        return median_range(echo.round_trips(runs))
