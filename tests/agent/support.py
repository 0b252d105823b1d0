"""Helpers of the agent tests: sides over pdstate's pools, byte images, a prefill child process."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdstate.pools.kvargs import fill_kv_args
from pdstate.pools.memory import BufferSpec, PrivateMemory, SharedMemory
from pdstate.pools.presets import build_worker_pools, preset

SRC = Path(__file__).resolve().parents[2] / "src"
PEER = Path(__file__).with_name("peer.py")
AUX_SLOTS, AUX_ITEMS = 16, (64, 8)  # two aux buffers, 64- and 8-byte items
# The decodes' segments live in a directory of their own: a stale-segment sweep run by another
# process on this host (possibly in another PID namespace) never sees them there.
SHM_DIR = Path(f"/dev/shm/agent-tests-{os.getpid()}")


def settings(name: str = "tiny", **changes):
    s = preset(name)
    if name == "tiny":
        s = s.with_(full_tokens=4096, swa_tokens=1024)  # 16 main pages: room for 8 chunks
    return s.with_(**changes) if changes else s


@dataclass
class Side:
    pools: object
    kv_args: object
    memory: object

    def close(self) -> None:
        self.memory.close()


def make_side(
    shared: bool, name: str = "tiny", check: bool = True, aux: bool = True, device: str = "cpu", **changes
) -> Side:
    """A side's pools (in /dev/shm with ``shared``, else private memory on ``device``), its
    KVArgs and, with ``aux``, two aux buffers."""
    import torch

    if shared:
        SHM_DIR.mkdir(mode=0o700, exist_ok=True)
    mem = SharedMemory(SHM_DIR) if shared else PrivateMemory(device)
    pools = build_worker_pools(settings(name, **changes), memory=mem)
    kv = fill_kv_args(pools.target, pools.draft, check=check)
    if aux:
        bufs = mem.allocate(
            "aux", [BufferSpec(f"aux{i}", (AUX_SLOTS, n), torch.uint8) for i, n in enumerate(AUX_ITEMS)]
        )
        kv.aux_data_ptrs = [b.data_ptr() for b in bufs]
        kv.aux_data_lens = [b.numel() for b in bufs]
        kv.aux_item_lens = list(AUX_ITEMS)
    return Side(pools, kv, mem)


def buffers(kv) -> list[tuple[int, int, int]]:
    """``(ptr, nbytes, item)`` of every buffer: main KV, each component, aux."""
    out = list(zip(kv.kv_data_ptrs, kv.kv_data_lens, kv.kv_item_lens))
    for p, n, i in zip(kv.state_data_ptrs, kv.state_data_lens, kv.state_item_lens):
        out += zip(p, n, i)
    out += zip(kv.aux_data_ptrs, kv.aux_data_lens, kv.aux_item_lens)
    return out


def view(ptr: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(ptr))


def fill(kv, seed: int, device: str = "cpu") -> None:
    """Every buffer filled with seeded random bytes (the same on any side of the same layout);
    buffers on a GPU (``device``) are written there, from the same bytes."""
    for j, (p, n, _) in enumerate(buffers(kv)):
        data = np.random.default_rng([seed, j]).integers(0, 256, n, dtype=np.uint8)
        if device == "cpu":
            view(p, n)[:] = data
        else:
            device_view(p, n, device).copy_(torch_of(data).to(device))


def torch_of(a: np.ndarray):
    import torch

    return torch.from_numpy(a)


class _CudaSpan:
    def __init__(self, ptr: int, n: int) -> None:
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def device_view(ptr: int, n: int, device: str):
    """The ``n`` bytes at device address ``ptr`` as a uint8 tensor on ``device`` (no copy)."""
    import torch

    return torch.as_tensor(_CudaSpan(ptr, n), device=device)


def snapshot(kv) -> list[np.ndarray]:
    return [view(p, n).copy() for p, n, _ in buffers(kv)]


def channels(kv) -> list[list[int]]:
    """Buffer numbers (into ``buffers(kv)``) of each channel: main KV, each component, aux."""
    out, k = [], 0
    for count in [len(kv.kv_data_ptrs), *(len(p) for p in kv.state_data_ptrs), len(kv.aux_data_ptrs)]:
        out.append(list(range(k, k + count)))
        k += count
    return out


def capacity(kv, channel: int) -> int:
    bufs = buffers(kv)
    return min(bufs[j][1] // bufs[j][2] for j in channels(kv)[channel])


def expected(
    before: list[np.ndarray], src: list[np.ndarray], kv, moves: list[tuple[int, list, list]]
) -> list[np.ndarray]:
    """The destination image after ``moves`` = ``[(channel, src indices, dst indices)]``."""
    out = [b.copy() for b in before]
    bufs = buffers(kv)
    for ch, si, di in moves:
        for j in channels(kv)[ch]:
            item = bufs[j][2]
            for s, d in zip(si, di):
                out[j][d * item : (d + 1) * item] = src[j][s * item : (s + 1) * item]
    return out


def assert_images_equal(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for j, (g, w) in enumerate(zip(got, want)):
        if not np.array_equal(g, w):
            bad = np.flatnonzero(g != w)
            raise AssertionError(f"buffer {j}: {bad.size} bytes differ, first at offset {int(bad[0])}")


def pick(rng, cap: int, k: int, lo: int = 1) -> list[int]:
    return sorted(rng.choice(np.arange(lo, cap), size=k, replace=False).tolist()) if k else []


class PrefillProcess:
    """A prefill agent in a child process, driven by JSON lines (see ``peer.py``)."""

    def __init__(self, seed: int, **options) -> None:
        env = dict(os.environ, PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), json.dumps({"seed": seed, "segment_dir": str(SHM_DIR), **options})],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        hello = self._read(60)
        self.address, self.pid = hello["address"], hello["pid"]

    def _read(self, timeout_s: float) -> dict:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise TimeoutError(f"prefill child said nothing within {timeout_s} s")
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"prefill child exited with {self.proc.wait()}")
            return json.loads(line)

    def ask(self, timeout_s: float = 30, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(15)
            except Exception:
                self.kill()


@contextmanager
def loopback_agents(p: Side, d: Side, hooks=None) -> Iterator[tuple]:
    """A ``PrefillAgent`` over side ``p`` and a ``DecodeAgent`` over side ``d`` (loopback engine;
    the prefill's under ``hooks``, ``tests.support.hooked``, when given); at the end both agents
    close, then both sides."""
    from pdstate.agent import DecodeAgent, PrefillAgent

    engine = {"engine": "loopback"} if hooks is None else {"engine": hooks.engine, "engine_options": hooks.options()}
    pa = PrefillAgent(p.kv_args, (p.pools.target, p.pools.draft), **engine)
    da = DecodeAgent(d.kv_args, (d.pools.target, d.pools.draft), engine="loopback")
    try:
        yield pa, da
    finally:
        da.close()
        pa.close()
        p.close()
        d.close()
