"""How pool tensors are allocated: private process memory, or one named shared-memory segment.

A pool first computes the list of its buffers (label, shape, dtype) and then asks a ``Memory`` for
all of them at once. ``PrivateMemory`` returns ordinary zeroed tensors. ``SharedMemory`` lays them
out in a single file under ``/dev/shm`` (owner-only permissions), so that another process on the
same host can map the segment and write into the buffers by offset: this is what the ``shm``
transfer engine does. Each buffer starts on a 4 KiB boundary so every dtype view is aligned.

The segment is removed by ``close()``; segments left behind by a crashed owner are removed by
``sweep_stale_segments()`` (called on start by the worker runtime).
"""

from __future__ import annotations

import math
import mmap
import os
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "pdstate"
ALIGN_BYTES = 4096
SEGMENT_NAME_RE = re.compile(rf"^{SEGMENT_PREFIX}-(\d+)-[0-9a-f]+-[\w.-]+$")


@dataclass(frozen=True)
class BufferSpec:
    label: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Region:
    """A registered memory region: what an engine registers and a peer addresses."""

    name: str
    base_ptr: int
    nbytes: int


class Memory(Protocol):
    def allocate(self, name: str, specs: Sequence[BufferSpec]) -> list[torch.Tensor]: ...

    def regions(self) -> list[Region]: ...

    def close(self) -> None: ...


def _layout(specs: Sequence[BufferSpec]) -> tuple[list[int], int]:
    offsets, cursor = [], 0
    for spec in specs:
        offsets.append(cursor)
        cursor += -(-spec.nbytes // ALIGN_BYTES) * ALIGN_BYTES
    return offsets, max(cursor, ALIGN_BYTES)


def _carve(arena: torch.Tensor, specs: Sequence[BufferSpec], offsets: list[int]) -> list[torch.Tensor]:
    out = []
    for spec, off in zip(specs, offsets):
        flat = arena[off : off + spec.nbytes]
        out.append(flat.view(spec.dtype).view(spec.shape))
    return out


class PrivateMemory:
    """Tensors in this process's memory; one zeroed arena per ``allocate`` call."""

    def __init__(self) -> None:
        self._arenas: list[tuple[str, torch.Tensor]] = []

    def allocate(self, name: str, specs: Sequence[BufferSpec]) -> list[torch.Tensor]:
        offsets, total = _layout(specs)
        arena = torch.zeros(total, dtype=torch.uint8)
        self._arenas.append((name, arena))
        return _carve(arena, specs, offsets)

    def regions(self) -> list[Region]:
        return [Region(n, a.data_ptr(), a.numel()) for n, a in self._arenas]

    def close(self) -> None:
        self._arenas.clear()


@dataclass(frozen=True)
class Segment:
    name: str
    path: str
    nbytes: int
    base_ptr: int


class SharedMemory:
    """Tensors inside named ``/dev/shm`` segments another process can map.

    Segment names are ``pdstate-<owner pid>-<nonce>-<name>``; files are created ``0600`` and
    pre-faulted (first-touch faults on tmpfs run at a fraction of memcpy speed).
    """

    def __init__(self, directory: Path | str = SHM_DIR, prefault: bool = True) -> None:
        self._dir = Path(directory)
        self._prefault = prefault
        self._nonce = secrets.token_hex(4)
        self._segments: list[Segment] = []
        self._maps: list[mmap.mmap] = []
        self._tensors: list[torch.Tensor] = []

    def allocate(self, name: str, specs: Sequence[BufferSpec]) -> list[torch.Tensor]:
        offsets, total = _layout(specs)
        seg_name = f"{SEGMENT_PREFIX}-{os.getpid()}-{self._nonce}-{name}"
        path = self._dir / seg_name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, total)
            mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        arena = torch.frombuffer(mm, dtype=torch.uint8)
        if self._prefault:
            arena.zero_()
        self._maps.append(mm)
        self._tensors.append(arena)
        self._segments.append(Segment(seg_name, str(path), total, arena.data_ptr()))
        return _carve(arena, specs, offsets)

    @property
    def segments(self) -> list[Segment]:
        return list(self._segments)

    def regions(self) -> list[Region]:
        return [Region(s.name, s.base_ptr, s.nbytes) for s in self._segments]

    def close(self) -> None:
        """Unlink every segment this object created. Tensors stay valid until collected."""
        for seg in self._segments:
            try:
                os.unlink(seg.path)
            except FileNotFoundError:
                pass
        self._segments.clear()

    def __enter__(self) -> SharedMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_segments(directory: Path | str = SHM_DIR) -> list[str]:
    """Remove pdstate segments owned by this user whose creating process is gone.

    Returns the names removed. Segments of live processes, and other users' segments, are kept.
    """
    removed = []
    d = Path(directory)
    if not d.is_dir():
        return removed
    uid = os.getuid()
    for entry in d.iterdir():
        m = SEGMENT_NAME_RE.match(entry.name)
        if not m:
            continue
        try:
            if entry.stat().st_uid != uid or _pid_alive(int(m.group(1))):
                continue
            entry.unlink()
            removed.append(entry.name)
        except FileNotFoundError:
            continue
    return removed
