"""NIXL specifics: bad metadata, name mismatch, and the exit-segfault work-around."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from pdstate.pools.memory import BufferSpec, PrivateMemory
from pdstate.transfer.engines import InvalidEndpoint, NativeEngineError
from pdstate.transfer.engines.nixl import NixlEngine
from tests.support.engines import ENGINE_OPTIONS, require_engine
from tests.support.paths import REPO

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(60)]


@pytest.fixture(scope="module", autouse=True)
def _available() -> None:
    require_engine("nixl")


@pytest.fixture
def decode() -> Iterator[NixlEngine]:
    memory = PrivateMemory()
    memory.allocate("dst", [BufferSpec("b", (1 << 16,), torch.uint8)])
    engine = NixlEngine(**ENGINE_OPTIONS["nixl"])
    engine.start()
    engine.register(memory.regions())
    yield engine
    engine.close()


@pytest.fixture
def prefill() -> Iterator[NixlEngine]:
    engine = NixlEngine(**ENGINE_OPTIONS["nixl"])
    engine.start()
    yield engine
    engine.close()


def test_garbage_metadata_fails_at_connect(decode, prefill) -> None:
    with pytest.raises(NativeEngineError, match=r"^nixl add_remote_agent \(.+\) failed: nixlMismatchError"):
        prefill.connect({**decode.endpoint(), "metadata": b"garbage"})


def test_metadata_of_another_agent_is_refused(decode, prefill) -> None:
    endpoint = decode.endpoint()
    with pytest.raises(InvalidEndpoint, match=f"names agent 'someone-else' but its metadata is '{decode.agent_name}'"):
        prefill.connect({**endpoint, "agent_name": "someone-else"})


def test_agent_names_are_unique_per_start() -> None:
    a, b = NixlEngine(), NixlEngine()
    assert a.agent_name is None  # chosen at start(), from the pid and the engine id
    assert a.endpoint_keys == ("agent_name", "metadata") and b.supports_notify


def test_process_exits_cleanly_with_the_ucx_work_around() -> None:
    """Without UCX_MODULES=^ib this process dies with SIGSEGV at exit (see engines/nixl.py)."""
    script = textwrap.dedent(
        """
        import torch
        from pdstate.transfer.engines.nixl import UCX_ENV_WITHOUT_IB, NixlEngine
        from pdstate.pools.memory import Region
        buf = torch.zeros(4096, dtype=torch.uint8)
        engine = NixlEngine(ucx_env=UCX_ENV_WITHOUT_IB)
        engine.start()
        engine.register([Region("b", buf.data_ptr(), 4096)])
        engine.endpoint()
        engine.close()
        print("closed")
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}  # the engine must set it
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "closed"  # NIXL logs to stdout too


def test_on_done_fires_once_after_the_write_and_at_once_when_ended() -> None:
    """The watcher thread calls back once the WRITE has landed (the bytes are there already);
    a handle that already ended is called back at once, on the caller's thread."""
    import ctypes
    import threading

    import numpy as np

    from pdstate.transfer.plan import TransferPlan

    n = 1 << 20
    memory = PrivateMemory()
    memory.allocate("dst", [BufferSpec("b", (n,), torch.uint8)])
    source = PrivateMemory()
    source.allocate("src", [BufferSpec("b", (n,), torch.uint8)])
    (dst_region,), (src_region,) = memory.regions(), source.regions()
    src = np.frombuffer((ctypes.c_uint8 * n).from_address(src_region.base_ptr), dtype=np.uint8)
    dst = np.frombuffer((ctypes.c_uint8 * n).from_address(dst_region.base_ptr), dtype=np.uint8)
    src[:] = np.arange(n, dtype=np.uint64).astype(np.uint8) ^ 0x5A
    dst[:] = 0
    with NixlEngine(**ENGINE_OPTIONS["nixl"]) as decode, NixlEngine(**ENGINE_OPTIONS["nixl"]) as prefill:
        decode.register([dst_region])
        prefill.register([src_region])
        peer = prefill.connect(decode.endpoint())
        plan = TransferPlan.from_arrays([src_region.base_ptr], [dst_region.base_ptr], [n])
        handle = prefill.submit(peer, plan)
        landed: list[bytes] = []
        threads: list[str] = []
        fired = threading.Event()

        def done() -> None:  # on the watcher thread
            landed.append(dst.tobytes())
            threads.append(threading.current_thread().name)
            fired.set()

        prefill.on_done(handle, done)
        assert fired.wait(10.0)
        assert prefill.poll(handle) is True
        assert landed == [src.tobytes()]
        assert threads in (["pdstate-nixl-watch"], [threading.current_thread().name])  # done at submit already
        later: list[str] = []
        prefill.on_done(handle, lambda: later.append(threading.current_thread().name))
        assert later == [threading.current_thread().name] and len(landed) == 1


def _threads() -> dict[str, tuple[int, int, int]]:
    """This process's threads: ``tid -> (voluntary switches, involuntary switches, CPU ticks)``."""
    out = {}
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        try:
            status = open(f"/proc/{os.getpid()}/task/{task}/status").read().splitlines()
            stat = open(f"/proc/{os.getpid()}/task/{task}/stat").read().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        switches = {k: int(v) for k, v in (line.split(":") for line in status if "ctxt_switches" in line)}
        out[task] = (
            switches["voluntary_ctxt_switches"],
            switches["nonvoluntary_ctxt_switches"],
            int(stat[11]) + int(stat[12]),
        )
    return out


@pytest.mark.parametrize("delay_us", [1000, 50, 0], ids=["default-delay", "sub-ms-delay", "nixl-busy"])
def test_progress_threads_sleep_unless_told_not_to(delay_us: int) -> None:
    """Two connected agents with nothing to move: with the default ``progress_delay_us`` no thread
    of this process runs without ever sleeping; with 0 (NIXL's own setting) their progress
    threads do (the idle-CPU trap in engines/nixl.py). A delay under 1 ms waits 1 ms all the same:
    no thread sleeps more than about a thousand times a second (50 us would be twenty thousand)."""
    memory = PrivateMemory()
    memory.allocate("dst", [BufferSpec("b", (1 << 16,), torch.uint8)])
    options = {**ENGINE_OPTIONS["nixl"], "progress_delay_us": delay_us}
    with NixlEngine(**options) as decode, NixlEngine(**options) as prefill:
        decode.register(memory.regions())
        prefill.connect(decode.endpoint())
        before, t0 = _threads(), time.monotonic()
        threading.Event().wait(1.0)  # the window watched
        after, seconds = _threads(), time.monotonic() - t0
    never_slept = [
        t
        for t, (vol, invol, cpu) in after.items()
        if t in before and vol == before[t][0] and (invol > before[t][1] or cpu > before[t][2])
    ]
    if delay_us:
        assert never_slept == []
        sleeps = [after[t][0] - before[t][0] for t in after if t in before]
        assert max(sleeps) < 2000 * seconds  # NIXL's wait is whole milliseconds
    else:
        assert len(never_slept) >= 2  # one progress thread per agent, always runnable


def test_the_bench_phase_writes_raw_from_the_bench_and_from_the_prefill_worker() -> None:
    """``pdstate bench``'s NIXL phase (on ``tiny``): NIXL's own write from the bench's process
    (``raw_nixl``) and from the prefill worker's pools (``raw_nixl_prefill``), the same plan's
    bytes, beside pdstate's rows; the reference of ``nixl_*_vs_raw`` is the faster of the two."""
    from pdstate.devtools import bench, bench_measure, bench_report

    src, dst = bench_measure.Side("paged", "tiny"), bench_measure.Side("paged", "tiny")
    results: dict = {"paths": {}, "lengths": [300], "modes": ["paged"]}
    bench._phase("paged", "nixl", src, dst, [300], 2, results, lambda m: None, preset_name="tiny")
    rows = {k.split(":", 2)[2]: v["300"] for k, v in results["paths"].items()}
    goal_n = bench_measure.GOAL_RUNS * 2  # the goal rows run rounds of their own
    assert rows["raw_nixl_prefill"]["seconds"]["n"] == rows["pdstate_nixl_off"]["seconds"]["n"] == goal_n
    assert rows["pdstate_nixl"]["seconds"]["n"] == 2
    assert rows["raw_nixl_prefill"]["bytes"] == rows["raw_nixl"]["bytes"] == rows["pdstate_nixl_off"]["bytes"] > 0
    assert rows["raw_nixl_prefill"]["descriptors"] == rows["raw_nixl"]["descriptors"]
    out = bench_report.ratios(results)
    best = min(rows["raw_nixl"]["seconds"]["median"], rows["raw_nixl_prefill"]["seconds"]["median"])
    assert out["nixl_off_vs_raw_by_length"]["300"] == best / rows["pdstate_nixl_off"]["seconds"]["median"]
    assert set(out) >= {"nixl_off_vs_raw_nixl_by_length", "nixl_off_vs_raw_nixl_prefill_by_length"}


def test_a_prefill_worker_answers_a_raw_write_it_cannot_make_and_serves_on() -> None:
    """The prefill worker's raw write (``{"cmd": "raw_prepare"}``, ``{"cmd": "raw_write"}``): a
    write with no plan, or a plan for a register message that does not decode, is answered with
    ``raw_failed`` and its reason, and the worker still answers the next command."""
    import json

    from pdstate.devtools.bench_measure import settings
    from pdstate.devtools.processes import WorkerProcess
    from pdstate.worker.options import WorkerOptions

    opts = WorkerOptions(
        role="prefill", pool=settings("paged", "tiny"), engine="nixl", engine_options=ENGINE_OPTIONS["nixl"]
    )
    prefill = WorkerProcess(opts)
    try:
        assert prefill.read_event(180)["event"] == "listening"
        prefill.send(json.dumps({"cmd": "raw_write"}))
        assert prefill.read_event(30) == {"event": "raw_failed", "error": "RuntimeError: raw nixl: no plan prepared"}
        prefill.send(json.dumps({"cmd": "raw_prepare", "register": "00", "src": [], "dst": []}))
        failed = prefill.read_event(30)
        assert failed["event"] == "raw_failed" and failed["error"].split(":")[0].endswith("Error"), failed
        assert prefill.command({"cmd": "stats"}, "stats")["event"] == "stats"
    finally:
        prefill.close()


_WRITE_CPU = textwrap.dedent(
    """
    import ctypes, json, os
    import numpy as np
    import torch
    from pdstate.pools.memory import Region
    from pdstate.transfer.engines.nixl import NixlEngine
    from pdstate.transfer.plan import TransferPlan

    n, seg = 16 << 20, 256 << 10
    src, dst = torch.ones(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    offs = np.random.default_rng(0).permutation(n // seg) * seg
    s_addr, d_addr = src.data_ptr() + offs, dst.data_ptr() + offs[::-1]

    def cpu_ns():  # every thread of this process
        total = 0
        for tid in os.listdir("/proc/self/task"):
            try:
                total += int(open(f"/proc/self/task/{tid}/schedstat").read().split()[0])
            except OSError:
                pass
        return total

    class iovec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    local = (iovec * len(offs))(*[iovec(int(a), seg) for a in s_addr])
    remote = (iovec * len(offs))(*[iovec(int(a), seg) for a in d_addr])
    libc = ctypes.CDLL(None, use_errno=True)

    def kernel_copy():  # the copy UCX's cma makes, from this thread alone
        assert libc.process_vm_writev(os.getpid(), local, len(offs), remote, len(offs), 0) == n

    with NixlEngine(ucx_env={"UCX_MODULES": "^ib"}) as decode, NixlEngine(ucx_env={"UCX_MODULES": "^ib"}) as prefill:
        decode.register([Region("dst", dst.data_ptr(), n)])
        prefill.register([Region("src", src.data_ptr(), n)])
        peer = prefill.connect(decode.endpoint())
        plan = TransferPlan.from_arrays(s_addr, d_addr, np.full(len(offs), seg))

        def nixl_write():
            handle = prefill.submit(peer, plan)
            while not prefill.poll(handle):
                pass

        cpu = {"nixl": 0, "kernel": 0}
        for i in range(24):
            for name, write in (("nixl", nixl_write), ("kernel", kernel_copy))[:: 1 if i % 2 else -1]:
                dst.zero_()
                c0 = cpu_ns()
                write()
                if i >= 4:
                    cpu[name] += cpu_ns() - c0
                assert bool((dst == 1).all())
        print(json.dumps({"env": os.environ.get("UCX_USE_MT_MUTEX"), **cpu}))
    os._exit(0)
    """
)


def _write_cpu(env: dict[str, str]) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}  # the engine must set it
    proc = subprocess.run(
        [sys.executable, "-c", _WRITE_CPU], cwd=REPO, env={**base, **env}, capture_output=True, text=True, timeout=50
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])  # NIXL logs to stdout too


def test_a_write_costs_the_cpu_of_its_copy_not_a_second_thread_spinning() -> None:
    """UCX's worker lock is a mutex by default here (``UCX_ENV_DEFAULTS``): the caller's thread
    and the agent's progress thread share a WRITE's copy instead of one spinning while the other
    copies (twice the copy's CPU, and on busy cores twice its time). All the process's threads
    together spend on 20 writes of 16 MB (64 descriptors) no more than 1.5x what one
    ``process_vm_writev`` of the same iovecs spends (about 1.05x measured; 2x with
    ``UCX_USE_MT_MUTEX=n``)."""
    got = _write_cpu({})
    assert got["env"] == "y"
    assert got["nixl"] <= 1.5 * got["kernel"], got


def test_the_environment_decides_the_worker_lock_when_it_says() -> None:
    assert _write_cpu({"UCX_USE_MT_MUTEX": "n"})["env"] == "n"
