"""Which shared-memory segments a decode may name in its shm endpoint, and where in them.

Everything a decode publishes about its memory (segment paths, file offsets, sizes) arrives over
the control channel; the prefill maps those files and writes where the decode's requests say. So
before any segment is mapped the prefill checks what it can verify on its own:

* the name is a ``pdstate-<pid>-<nonce>-<name>`` segment directly in the segment directory whose
  ``<pid>`` is the endpoint's ``owner_pid`` (segments are named by the process that creates them);
* the segment has a live owner: its creator holds the ``flock`` it keeps for its lifetime
  (``pools.memory``; segments of an older pdstate, 8-hex-digit nonce, have no lock and are
  exempt);
* the segment's owner (``<pid>-<nonce>``) is not claimed by another connected peer: the first
  live peer that mapped a ``SharedMemory``'s segments owns them until it is disconnected, so one
  decode can never name another decode's pools;
* every region's file range is non-negative, lies inside the file and overlaps no other
  region's range of the same file.

A process of the same uid could write another decode's segment files directly; what this rules
out is the prefill writing for it (a confused deputy), and a forged offset sending its writes
outside the mapping (memory corruption or SIGSEGV in the prefill).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from pdstate.errors import InvalidEndpoint
from pdstate.pools.memory import LEGACY_NONCE_HEX, SEGMENT_NAME_RE, SEGMENT_PREFIX, owner_alive


def segment_owner(path: str, owner_pid: int, segment_dir: str) -> str:
    """The owner key ``<pid>-<nonce>`` of a segment a peer named."""
    m = SEGMENT_NAME_RE.match(os.path.basename(path))
    if m is None or os.path.dirname(path) not in (segment_dir, os.path.realpath(segment_dir)):
        raise InvalidEndpoint(
            f"shm endpoint names {path!r}: only {SEGMENT_PREFIX}-* segments in {segment_dir} are mapped"
        )
    pid, nonce = int(m.group(1)), m.group(2)
    if pid != owner_pid:
        raise InvalidEndpoint(
            f"shm segment {path} does not belong to the registering decode: it was created by pid {pid}, "
            f"the endpoint's owner is pid {owner_pid}"
        )
    if len(nonce) != LEGACY_NONCE_HEX and not owner_alive(path):
        raise InvalidEndpoint(f"shm segment {path} does not belong to the registering decode: no live process owns it")
    return f"{pid}-{nonce}"


def check_file_ranges(ranges: Iterable[tuple[str, str, int, int]], peer_id: str) -> None:
    """``(region name, path, file_offset, nbytes)``: offsets non-negative, no two ranges of one file
    overlapping (two regions aliasing one byte)."""
    by_path: dict[str, list[tuple[int, int, str]]] = {}
    for name, path, off, n in ranges:
        if off < 0:
            raise InvalidEndpoint(f"shm endpoint of {peer_id}: region {name!r} file_offset {off} is negative")
        by_path.setdefault(path, []).append((off, n, name))
    for path, items in by_path.items():
        items.sort()
        for (o0, n0, a), (o1, _, b) in zip(items, items[1:]):
            if o0 + n0 > o1:
                raise InvalidEndpoint(
                    f"shm endpoint of {peer_id}: regions {a!r} and {b!r} overlap in {path} at file offset {o1}"
                )


class SegmentClaims:
    """Segment owners (``<pid>-<nonce>``) and the one connected peer each belongs to."""

    def __init__(self) -> None:
        self._owner_of: dict[str, str] = {}

    def check(self, peer_id: str, owners: Iterable[str], paths: dict[str, str]) -> None:
        for key in owners:
            other = self._owner_of.get(key)
            if other is not None and other != peer_id:
                raise InvalidEndpoint(
                    f"shm segment {paths[key]} does not belong to the registering decode: "
                    f"it is mapped for another live decode ({other})"
                )

    def claim(self, peer_id: str, owners: Iterable[str]) -> None:
        for key in owners:
            self._owner_of[key] = peer_id

    def release(self, peer_id: str) -> None:
        for key in [k for k, p in self._owner_of.items() if p == peer_id]:
            del self._owner_of[key]
