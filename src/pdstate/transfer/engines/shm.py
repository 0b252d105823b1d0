"""Same-host shared-memory engine (the embedded default): one CPU copy, no native agent.

The decode side's destination regions must live in shared file mappings (``SharedMemory``
segments under ``/dev/shm``). ``endpoint()`` finds, in ``/proc/self/maps``, the file and file
offset behind every registered region and publishes them; a region that is not a shared file
mapping (e.g. ``PrivateMemory``) is an ``EngineError`` there. The prefill side maps each file
``MAP_SHARED`` in ``connect`` (pre-populating its page tables), translates remote addresses to its
own mapping with numpy (``searchsorted`` over region bases) and copies every descriptor with
``ctypes.memmove`` (``shm_copy``: a large plan split across threads). Submission is synchronous:
the returned handle is already done.

Endpoint::

    {"engine": "shm", "engine_id": str, "boot_id": str, "owner_pid": int,
     "regions": [{"name": str, "base_ptr": int, "nbytes": int, "path": str, "file_offset": int}],
     "challenge": hex, "proofs": {path: hex}}

Ownership: ``connect`` maps nothing until the endpoint proves that the registrant can read every
segment it names. The prefill issues a nonce (``challenge(claimant)``, sent to the decode in the
control protocol's ``challenge`` message); the decode answers with ``prove(nonce, claimant)``:
the nonce, and per segment HMAC-SHA256 under the secret in that segment's header
(``pools.memory.ownership_proof``), added to its endpoint. ``connect`` redeems the nonce (once,
for that claimant) and checks every proof, then the rest (``shm_owner``); the two proof keys are
not part of the stored endpoint, so registering again with a fresh proof keeps the mappings.

Limits, by design: both processes must share a kernel (``boot_id``) and a ``/dev/shm``
(same IPC/mount namespace), else ``connect`` raises. A decode process that crashes cannot be
observed here (writes land in the orphaned file); peer liveness is the control channel's job.
If the owner truncates a segment while it is mapped here, a write into it raises SIGBUS.
"""

from __future__ import annotations

import ctypes
import hmac
import mmap
import os
import stat
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdstate.errors import EngineError, InvalidEndpoint
from pdstate.pools.memory import SEGMENT_NAME_RE as SEGMENT_NAME
from pdstate.pools.memory import SEGMENT_PREFIX, SHM_DIR, ownership_proof, prove_segment, read_segment_secret
from pdstate.transfer.engines.base import Peer, TransferEngine, TransferHandle
from pdstate.transfer.engines.shm_copy import Copier
from pdstate.transfer.engines.shm_owner import Challenges, SegmentClaims, check_file_ranges, segment_owner
from pdstate.transfer.plan import TransferPlan

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
PROOF_KEYS = ("challenge", "proofs", "audience")
MAPS_PATH = "/proc/self/maps"


@dataclass(frozen=True)
class _Mapping:
    start: int
    end: int
    shared: bool
    file_offset: int
    path: str


def _read_maps(maps_path: str = MAPS_PATH) -> list[_Mapping]:
    out = []
    with open(maps_path) as f:
        for line in f:
            parts = line.rstrip("\n").split(maxsplit=5)
            if len(parts) < 6 or not parts[5].startswith("/"):
                continue  # anonymous, [heap], [stack], ...
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append(_Mapping(lo, hi, parts[1][3] == "s", int(parts[2], 16), parts[5]))
    return out


def shared_file_of(base_ptr: int, nbytes: int, maps: list[_Mapping]) -> tuple[str, int]:
    """``(path, file_offset)`` of the shared file mapping(s) covering ``[base_ptr, +nbytes)``.

    Raises ``EngineError`` if the range is not entirely one MAP_SHARED mapping of a live file
    (the kernel may split one mmap into several adjacent entries; those are followed).
    """
    end_ptr = base_ptr + nbytes
    first = next((m for m in maps if m.start <= base_ptr < m.end), None)
    if first is None or not first.shared:
        raise EngineError(
            f"shm engine: 0x{base_ptr:x} (+{nbytes} bytes) is not in a shared file mapping; "
            "decode regions must be SharedMemory segments"
        )
    if first.path.endswith(" (deleted)"):
        raise EngineError(f"shm engine: segment file {first.path} was unlinked; the peer cannot map it")
    cursor, expect_offset = first.end, first.file_offset + (first.end - first.start)
    while cursor < end_ptr:
        nxt = next((m for m in maps if m.start == cursor), None)
        if nxt is None or not nxt.shared or nxt.path != first.path or nxt.file_offset != expect_offset:
            raise EngineError(
                f"shm engine: 0x{base_ptr:x} (+{nbytes} bytes) runs past the shared mapping of {first.path}"
            )
        cursor, expect_offset = nxt.end, nxt.file_offset + (nxt.end - nxt.start)
    return first.path, first.file_offset + (base_ptr - first.start)


def prove_endpoint(endpoint: Mapping[str, Any], nonce: bytes, claimant: str) -> dict:
    """The proof fields answering ``nonce`` for every segment ``endpoint`` names, computed by a
    process that can read those segment files (their owner's uid)."""
    proofs = {}
    for path in sorted({str(r["path"]) for r in endpoint["regions"]}):
        try:
            proof = prove_segment(path, nonce, claimant)
        except OSError:  # gone or unreadable: the prefill says which segment it could not verify
            continue
        if proof is not None:
            proofs[path] = proof.hex()
    return {"challenge": nonce.hex(), "proofs": proofs}


def _read_boot_id() -> str:
    try:
        with open(BOOT_ID_PATH) as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass
class _ShmPeer:
    maps: list[mmap.mmap]
    mapped_base: np.ndarray  # uint64: this process's address of each remote region (table order)
    prefault: _Prefault | None = None


_PAGE = 4096
_PREFAULT_CHUNK = 64 << 20


class _Prefault:
    """Touches one byte per page of the peer's mappings in a background thread, so that the
    handshake does not wait for the page tables of a large pool (MAP_POPULATE took ~80 ms for
    the ~0.8 GB ``dsv4-flash`` decode pools) and the first transfers rarely fault.
    ``stop()`` returns only once the thread no longer reads the mappings."""

    def __init__(self, spans: list[tuple[int, int]]) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(spans,), name="pdstate-shm-prefault", daemon=True)
        self._thread.start()

    def _run(self, spans: list[tuple[int, int]]) -> None:
        for addr, size in spans:
            for off in range(0, size, _PREFAULT_CHUNK):
                if self._stop.is_set():
                    return
                n = min(_PREFAULT_CHUNK, size - off)
                view = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr + off))
                view[::_PAGE].max()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class ShmEngine(TransferEngine):
    """Shared-memory writes within one host.

    ``ShmEngine(populate="background")``: pre-fault this process's page tables for every mapped
    segment after ``connect`` in a background thread (the default), or inside ``connect`` with
    ``MAP_POPULATE`` (``True``), or not at all (``False``; first-touch faults then slow the first
    transfers).

    ``copy_threads``: how many threads copy one large plan (``shm_copy``; default: every core
    this process may use, up to 8; ``1`` keeps every copy on the submitting thread).

    ``submit(..., hash_src=fn)`` (``supports_hashed_copy``): ``fn(src, length)`` returns
    ``(hashers, index)`` and every descriptor's source bytes go to ``hashers[index[k]]`` right
    after they are copied, while still in cache (``shm_copy.Copier.copy_hashed``).
    """

    name = "shm"
    endpoint_keys = ("boot_id",)
    synchronous = True
    proves_ownership = True
    supports_hashed_copy = True

    def __init__(
        self,
        populate: bool | str = "background",
        segment_dir: str = str(SHM_DIR),
        copy_threads: int | None = None,
        copy_delay_s: float = 0.0,
    ) -> None:
        """``copy_delay_s``: fault injection (tests): each copy starts this long after its submit,
        on the submitting thread, as a copy held up by a slow or stalled prefill would."""
        super().__init__()
        self.copy_delay_s = float(copy_delay_s)
        self._copier = Copier(copy_threads)
        self._hash_src = threading.local()  # submit's hash_src, for _submit on the same thread
        self.populate = populate
        self.segment_dir = segment_dir
        self._boot_id = ""
        self._claims = SegmentClaims()  # segment owner -> the one peer that may name it
        self._challenges = Challenges()  # nonces issued to registrants, not yet answered
        self._fields: tuple | None = None  # (regions, the endpoint's fields): where they are mapped from

    def _start(self) -> None:
        self._boot_id = _read_boot_id()

    # decode side: publish the files behind the registered regions
    def _endpoint_fields(self) -> dict:
        key = tuple((r.base_ptr, r.nbytes) for r in self._local.regions)
        if self._fields is None or self._fields[0] != key:  # /proc/self/maps read once (~1.5 ms)
            self._fields = (key, self._read_fields())
        return self._fields[1]

    def _read_fields(self) -> dict:
        maps = _read_maps()
        regions = []
        for r in self._local.regions:
            path, file_offset = shared_file_of(r.base_ptr, r.nbytes, maps)
            regions.append(
                {"name": r.name, "base_ptr": r.base_ptr, "nbytes": r.nbytes, "path": path, "file_offset": file_offset}
            )
        return {"boot_id": self._boot_id, "owner_pid": os.getpid(), "regions": regions}

    def prove(self, nonce: bytes, claimant: str) -> dict:
        return prove_endpoint(self.endpoint(), nonce, claimant)

    # prefill side: ownership first, then map the peer's files
    def challenge(self, claimant: str, holder: str = "") -> bytes:
        with self._lock:
            self._require_started("challenge")
            return self._challenges.issue(claimant, holder)

    def connect(self, endpoint: Mapping[str, Any], owner: str | None = None) -> str:
        with self._lock:
            self._require_started("connect")
            if (
                isinstance(endpoint, Mapping)
                and endpoint.get("engine") == self.name
                and all(k in endpoint for k in ("engine_id", "regions", *self.endpoint_keys))
            ):  # (else the base class names what is wrong)
                endpoint = self._proven(endpoint, owner or "")
            return super().connect(endpoint, owner)

    def _proven(self, endpoint: Mapping[str, Any], claimant: str) -> dict:
        """``endpoint`` without its proof keys, once every segment it names is proven to be the
        claimant's (``InvalidEndpoint`` otherwise; nothing is mapped either way)."""
        rest = {k: v for k, v in endpoint.items() if k not in PROOF_KEYS}
        who = claimant or "the decode"
        nonce_hex, proofs = endpoint.get("challenge"), endpoint.get("proofs")
        if nonce_hex is None:
            raise InvalidEndpoint(
                f"shm endpoint of {who} carries no proof of ownership of its segments "
                "(a decode answers the prefill's challenge with one)"
            )
        try:
            nonce = bytes.fromhex(nonce_hex)
            if not isinstance(proofs, Mapping):
                raise TypeError(f"proofs is a {type(proofs).__name__}, not a map")
            paths = sorted({str(r["path"]) for r in rest["regions"]})
            owner_pid = int(rest.get("owner_pid", -1))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidEndpoint(f"shm endpoint of {who} is malformed: {exc!r}") from exc
        self._challenges.redeem(nonce, claimant)  # used up whatever follows
        audience = endpoint.get("audience")  # the address the decode dialled: bound into each proof
        if audience is not None:
            claimant = f"{claimant}@{audience}"
        for path in paths:
            segment_owner(path, owner_pid, self.segment_dir)  # named by its live creator
            try:
                fd = self._checked_open(path)
            except OSError as exc:
                raise EngineError(f"shm connect to {who}: cannot map segment: {exc}") from exc
            try:
                secret = read_segment_secret(fd)
            finally:
                os.close(fd)
            if secret is None:
                raise InvalidEndpoint(
                    f"shm segment {path} has no ownership header (not made by this version's SharedMemory); "
                    "restart its decode with this version"
                )
            given = proofs.get(path)
            if not isinstance(given, str):
                raise InvalidEndpoint(
                    f"shm segment {path} does not belong to the registering decode: "
                    "its endpoint carries no proof of ownership for it"
                )
            want = ownership_proof(secret, nonce, claimant, path).hex()
            if not hmac.compare_digest(given.encode("utf-8", "replace"), want.encode()):
                raise InvalidEndpoint(
                    f"shm segment {path} does not belong to the registering decode: "
                    "its proof of ownership does not match the segment's secret"
                )
        return rest

    def _connect(self, peer: Peer) -> None:
        theirs = str(peer.endpoint["boot_id"])
        if not theirs or not self._boot_id:  # never skip the same-host check
            raise InvalidEndpoint(
                f"shm engine: {'peer ' + peer.peer_id + ' sent' if not theirs else 'this host has'} no boot id "
                f"({BOOT_ID_PATH}); shared memory needs both sides on one host, which the boot id proves"
            )
        if theirs != self._boot_id:
            raise InvalidEndpoint(
                f"shm engine: peer {peer.peer_id} runs under another kernel (boot id {theirs}); "
                "shared memory needs both sides on one host"
            )
        try:
            by_base: dict[int, Any] = {int(d["base_ptr"]): d for d in peer.endpoint["regions"]}
            owner_pid = int(peer.endpoint.get("owner_pid", -1))
            layout = [
                (r.name, str(by_base[r.base_ptr]["path"]), int(by_base[r.base_ptr]["file_offset"]), r.nbytes)
                for r in peer.regions.regions
            ]
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidEndpoint(f"shm endpoint regions are malformed: {exc!r}") from exc
        # Everything the peer says about its memory is checked before anything is mapped
        # (``shm_owner``): whose segments, live, not another peer's, ranges inside the files.
        check_file_ranges(layout, peer.peer_id)
        owners = {}
        for _, path, _, _ in layout:
            owners.setdefault(segment_owner(path, owner_pid, self.segment_dir), path)
        self._claims.check(peer.peer_id, owners, owners)
        files: dict[str, tuple[mmap.mmap, int]] = {}
        mapped = np.empty(len(peer.regions), dtype=np.uint64)
        try:
            for i, (name, path, file_offset, nbytes) in enumerate(layout):
                if path not in files:
                    files[path] = self._map(path)
                mm, addr = files[path]
                if file_offset + nbytes > len(mm):
                    raise EngineError(
                        f"shm connect to {peer.peer_id}: region {name!r} needs "
                        f"{file_offset + nbytes} bytes of {path}, which has {len(mm)}"
                    )
                mapped[i] = addr + file_offset
        except OSError as exc:
            self._unmap([mm for mm, _ in files.values()])
            raise EngineError(f"shm connect to {peer.peer_id}: cannot map segment: {exc}") from exc
        except BaseException:
            self._unmap([mm for mm, _ in files.values()])
            raise
        self._claims.claim(peer.peer_id, owners)
        peer.native = _ShmPeer([mm for mm, _ in files.values()], mapped)
        if self.populate == "background":
            peer.native.prefault = _Prefault([(addr, len(mm)) for mm, addr in files.values()])

    def _checked_open(self, path: str) -> int:
        """Open a peer-named segment only if it is one of ours: a regular ``pdstate-*`` file directly
        in ``segment_dir``, not a symlink, owned by this user and not accessible to others.

        The endpoint arrives over the control channel; without this check a forged endpoint could
        make the prefill map, and then write into, any file it can open.
        """
        real_dir = os.path.realpath(self.segment_dir)
        if os.path.dirname(path) not in (self.segment_dir, real_dir) or not SEGMENT_NAME.match(os.path.basename(path)):
            raise InvalidEndpoint(
                f"shm endpoint names {path!r}: only {SEGMENT_PREFIX}-* segments in {self.segment_dir} are mapped"
            )
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            os.close(fd)
            raise InvalidEndpoint(
                f"shm segment {path} is not a private regular file of this user "
                f"(uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})"
            )
        return fd

    def _map(self, path: str) -> tuple[mmap.mmap, int]:
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if self.populate is True else 0)
        fd = self._checked_open(path)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise EngineError(f"shm engine: segment {path} is empty")
            mm = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        # the temporary ctypes view is dropped at once, so mm.close() stays possible
        return mm, ctypes.addressof(ctypes.c_char.from_buffer(mm))

    @staticmethod
    def _unmap(maps: list[mmap.mmap]) -> None:
        for mm in maps:
            mm.close()

    def _disconnect(self, peer: Peer) -> None:
        self._claims.release(peer.peer_id)
        if peer.native is not None:
            if peer.native.prefault is not None:
                peer.native.prefault.stop()
            self._unmap(peer.native.maps)
            peer.native = None

    def submit(self, peer_id: str, plan: TransferPlan, notify: bytes = b"", hash_src=None) -> TransferHandle:
        """``TransferEngine.submit``; with ``hash_src``, the copy also feeds the source bytes to
        the hashers it names (see the class)."""
        self._hash_src.fn = hash_src
        try:
            return super().submit(peer_id, plan, notify)
        finally:
            self._hash_src.fn = None

    def _submit(self, peer: Peer, plan: TransferPlan, handle: TransferHandle, notify: bytes) -> None:
        native: _ShmPeer = peer.native
        table = peer.regions
        idx = np.searchsorted(table.base, plan.dst, side="right") - 1
        local_dst = native.mapped_base[idx] + (plan.dst - table.base[idx])
        hash_src = getattr(self._hash_src, "fn", None)
        if self.copy_delay_s > 0:
            time.sleep(self.copy_delay_s)
        if hash_src is None:
            self._copier.copy(local_dst, plan.src, plan.length, plan.total_bytes)
        else:
            streams = hash_src(plan.src, plan.length)
            self._copier.copy_hashed(local_dst, plan.src, plan.length, plan.total_bytes, streams)
        handle.finish()

    def _close(self) -> None:
        try:
            super()._close()
        finally:
            self._copier.close()
