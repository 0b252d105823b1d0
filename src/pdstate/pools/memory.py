"""How pool tensors are allocated: private process memory, or one named shared-memory segment.

A pool first computes the list of its buffers (label, shape, dtype) and then asks a ``Memory`` for
all of them at once. ``PrivateMemory`` returns ordinary zeroed tensors. ``SharedMemory`` lays them
out in a single file under ``/dev/shm`` (owner-only permissions), so that another process on the
same host can map the segment and write into the buffers by offset: this is what the ``shm``
transfer engine does. Each buffer starts on a 4 KiB boundary so every dtype view is aligned.

Every segment file starts with a ``SEGMENT_HEADER_BYTES`` header that holds a random secret,
written by the creator before the segment gets its name; the buffers follow it. Only processes
that can read the file (its owner's uid: the file is ``0600``) learn the secret, so a keyed
digest of it (``ownership_proof``) proves to a prefill that the registrant can read the segment:
a peer of another uid, in another container without this ``/dev/shm``, or on the network cannot
name a segment it does not own.

The segment is removed by ``close()``; segments left behind by a crashed owner are removed by
``sweep_stale_segments()`` (called on start by serve's workers), which tells a dead owner from
a live one by the ``flock`` every owner holds on its segments for its lifetime (not by PID, which
means nothing across PID namespaces and is reused). ``allocate`` refuses, with one line naming
the bytes, a ``/dev/shm`` too small for the segment instead of letting the first write SIGBUS.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import hmac
import math
import mmap
import os
import re
import secrets
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from pdstate.errors import AllocationError

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "pdstate"
ALIGN_BYTES = 4096
SEGMENT_NAME_RE = re.compile(rf"^{SEGMENT_PREFIX}-(\d+)-([0-9a-f]+)-[\w.-]+$")
# Segments whose owner holds the liveness lock carry a 16-hex-digit nonce; an 8-digit one is a
# segment of an older pdstate (no lock), judged by its PID as that version did, so that a mixed
# host (a rolling upgrade) does not lose an old decode's live segments.
NONCE_BYTES = 8
LEGACY_NONCE_HEX = 8
# The segment header: magic, then the ownership secret; the rest of the page is zeros and the
# buffers start after it (so they stay 4 KiB aligned and no buffer covers the secret).
SEGMENT_HEADER_BYTES = ALIGN_BYTES
SEGMENT_MAGIC = b"PDSTSEG1"
SECRET_BYTES = 32
PROOF_CONTEXT = b"pdstate shm ownership proof v1"


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
    """Tensors in this process's memory; one zeroed arena per ``allocate`` call (on ``device``:
    ``"cpu"``, or a GPU's memory, e.g. ``"cuda:0"``, as a serving engine's pools are)."""

    def __init__(self, device: str = "cpu") -> None:
        self._arenas: list[tuple[str, torch.Tensor]] = []
        self.device = device

    def allocate(self, name: str, specs: Sequence[BufferSpec]) -> list[torch.Tensor]:
        offsets, total = _layout(specs)
        arena = torch.zeros(total, dtype=torch.uint8, device=self.device)
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


# madvise(MADV_POPULATE_WRITE) (Linux 5.14): fault every page in writable, or fail with EFAULT
# instead of a later SIGBUS when the tmpfs is full. Python exposes the constant from 3.13 on.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
# A staged segment (".pdstate-...", before its rename) with no owner is swept only once it is this
# old: between ``open(O_CREAT)`` and ``flock`` a live owner does not hold the lock yet.
STAGED_GRACE_S = 30.0


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def shm_free_bytes(directory: Path | str = SHM_DIR) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def shm_space_error(directory: Path | str, name: str, need: int, free: int) -> AllocationError:
    """The one-line refusal when ``directory`` (a tmpfs) cannot hold a segment of ``need`` bytes."""
    return AllocationError(
        f"{directory} has {free} bytes free ({_mib(free)}) but the {name!r} segment needs {need} bytes "
        f"({_mib(need)}); give {directory} more room: docker run --shm-size=SIZE, compose shm_size: SIZE, "
        f"k8s an emptyDir {{medium: Memory, sizeLimit: SIZE}} mounted at {directory}"
    )


class SharedMemory:
    """Tensors inside named ``/dev/shm`` segments another process can map.

    Segment names are ``pdstate-<owner pid>-<nonce>-<name>``; files are created ``0600`` and
    pre-faulted (first-touch faults on tmpfs run at a fraction of memcpy speed). Each file is a
    ``SEGMENT_HEADER_BYTES`` header (magic and a random ownership secret) followed by the buffers;
    ``segments`` and ``regions`` describe the buffers' part only.

    Liveness: the owner holds an exclusive ``flock`` on each of its segment files for as long as
    it lives (the lock goes with its last open descriptor, so the kernel drops it when the process
    dies, however it dies). ``sweep_stale_segments`` deletes only segments whose lock it can take.
    This holds across PID namespaces (containers sharing one ``/dev/shm``) and PID reuse; the PID
    in the name is for people only. A segment is created under a staging name, locked, sized and
    populated, then renamed, so a segment name never exists unlocked while its owner lives.

    Space: ``allocate`` checks the free space of the directory first and populates the pages
    (``MADV_POPULATE_WRITE``, or ``posix_fallocate``) before returning, so a ``/dev/shm`` that is
    too small is an ``AllocationError`` naming the bytes needed and free, never a SIGBUS later.
    """

    def __init__(self, directory: Path | str = SHM_DIR, prefault: bool = True) -> None:
        self._dir = Path(directory)
        self._prefault = prefault
        self._nonce = secrets.token_hex(NONCE_BYTES)
        self._segments: list[Segment] = []
        self._maps: list[mmap.mmap] = []
        self._tensors: list[torch.Tensor] = []
        self._locks: list[int] = []  # one open, flock-ed descriptor per segment: the liveness proof

    def allocate(self, name: str, specs: Sequence[BufferSpec]) -> list[torch.Tensor]:
        offsets, arena_bytes = _layout(specs)
        total = SEGMENT_HEADER_BYTES + arena_bytes
        free = shm_free_bytes(self._dir)
        if total > free:
            raise shm_space_error(self._dir, name, total, free)
        seg_name = f"{SEGMENT_PREFIX}-{os.getpid()}-{self._nonce}-{name}"
        path = self._dir / seg_name
        staged = self._dir / f".{seg_name}"
        fd = os.open(staged, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        mm = None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, total)
            mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self._populate(fd, mm, name, total)
            mm[: len(SEGMENT_MAGIC) + SECRET_BYTES] = SEGMENT_MAGIC + secrets.token_bytes(SECRET_BYTES)
            os.rename(staged, path)
        except BaseException:
            if mm is not None:
                mm.close()
            os.close(fd)
            for p in (staged, path):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
            raise
        arena = torch.frombuffer(mm, dtype=torch.uint8, offset=SEGMENT_HEADER_BYTES)
        self._locks.append(fd)
        self._maps.append(mm)
        self._tensors.append(arena)
        self._segments.append(Segment(seg_name, str(path), arena_bytes, arena.data_ptr()))
        return _carve(arena, specs, offsets)

    def _populate(self, fd: int, mm: mmap.mmap, name: str, total: int) -> None:
        """Back every page now (zeros), or raise the space error."""
        if self._prefault:
            try:
                mm.madvise(MADV_POPULATE_WRITE)
                return
            except OSError as exc:
                if exc.errno in (errno.EFAULT, errno.ENOMEM, errno.ENOSPC):
                    raise shm_space_error(self._dir, name, total, shm_free_bytes(self._dir)) from None
                if exc.errno != errno.EINVAL:  # EINVAL: a kernel before 5.14; reserve, then touch
                    raise
        try:
            os.posix_fallocate(fd, 0, total)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise shm_space_error(self._dir, name, total, shm_free_bytes(self._dir)) from None
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
        if self._prefault:
            torch.frombuffer(mm, dtype=torch.uint8).zero_()

    @property
    def segments(self) -> list[Segment]:
        return list(self._segments)

    def regions(self) -> list[Region]:
        return [Region(s.name, s.base_ptr, s.nbytes) for s in self._segments]

    def close(self) -> None:
        """Unlink every segment this object created, then drop their locks. Tensors stay valid
        until collected."""
        for seg in self._segments:
            try:
                os.unlink(seg.path)
            except FileNotFoundError:
                pass
        for fd in self._locks:
            os.close(fd)
        self._locks.clear()
        self._segments.clear()

    def __enter__(self) -> SharedMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_segment_secret(fd: int) -> bytes | None:
    """The ownership secret in the header of the open segment ``fd`` (None: no pdstate header)."""
    head = os.pread(fd, len(SEGMENT_MAGIC) + SECRET_BYTES, 0)
    if len(head) != len(SEGMENT_MAGIC) + SECRET_BYTES or not head.startswith(SEGMENT_MAGIC):
        return None
    return head[len(SEGMENT_MAGIC) :]


def ownership_proof(secret: bytes, nonce: bytes, claimant: str, segment: str) -> bytes:
    """HMAC-SHA256 under the segment's secret of the prefill's challenge ``nonce``, the claimant
    (``worker_id/incarnation``) and the segment's file name: fresh per challenge, useless to
    another claimant, another segment or another prefill incarnation."""
    msg = b"\0".join((PROOF_CONTEXT, nonce, claimant.encode(), os.path.basename(segment).encode()))
    return hmac.new(secret, msg, hashlib.sha256).digest()


def prove_segment(path: str, nonce: bytes, claimant: str) -> bytes | None:
    """The proof for the segment at ``path``, read by a process that can read the file (its
    owner's uid); None when it has no header."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        secret = read_segment_secret(fd)
    finally:
        os.close(fd)
    return None if secret is None else ownership_proof(secret, nonce, claimant, path)


def _legacy_pid_alive(pid: int) -> bool:
    """How pdstate before the liveness lock told a live owner (wrong across PID namespaces)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def owner_alive(path: Path | str) -> bool:
    """Whether some process holds the segment's owner lock (``True`` also when it cannot be told:
    the file is gone, not ours, or cannot be opened: only a provably dead owner counts as dead)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def sweep_stale_segments(directory: Path | str = SHM_DIR) -> list[str]:
    """Remove pdstate segments owned by this user whose owner is provably gone: nobody holds the
    lock its owner took for its lifetime (see ``SharedMemory``). Staged segments (a creation that
    died before its rename) go once they are ``STAGED_GRACE_S`` old.

    Returns the names removed. Live owners' segments, whatever their PID namespace, and other
    users' segments are kept. Opening a segment here, as a peer's engine does, never takes a lock.
    """
    removed: list[str] = []
    d = Path(directory)
    if not d.is_dir():
        return removed
    uid = os.getuid()
    for entry in sorted(d.iterdir()):
        name = entry.name
        staged = name.startswith(".")
        m = SEGMENT_NAME_RE.match(name[1:] if staged else name)
        if m is None:
            continue
        try:
            fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:  # gone, a symlink, or another user's 0600 file
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                continue
            if staged and time.time() - st.st_mtime < STAGED_GRACE_S:
                continue
            if len(m.group(2)) == LEGACY_NONCE_HEX and _legacy_pid_alive(int(m.group(1))):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its owner is alive
            try:
                if os.stat(entry, follow_symlinks=False).st_ino != st.st_ino:
                    continue  # the name was reused meanwhile
                os.unlink(entry)
            except FileNotFoundError:
                continue
            removed.append(name)
        finally:
            os.close(fd)
    return removed
