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
* the registrant proves it can read every segment it names: each segment's header holds a
  random secret (``pools.memory``), and the endpoint carries, per segment, HMAC-SHA256 under that
  secret of a nonce this prefill issued to that registrant (``Challenges``: single use, expiring),
  the registrant's ``worker_id/incarnation`` and the segment's name. Checked before any segment
  is mapped, so a peer without read access to the file (another uid, another container, the
  network) cannot claim it, even before its owner registers, and a captured register cannot be
  replayed (to a restarted prefill, or to this one again);
* every region's file range is non-negative, lies inside the file, starts after the segment's
  header and overlaps no other region's range of the same file.

The trust boundary is the uid (plus the control channel's auth token): a process of the same uid
can read another decode's ``0600`` segment files, hence prove them, and could write them directly
anyway; what this rules out is the prefill writing for anyone else (a confused deputy), and a
forged offset sending its writes outside the mapping (memory corruption or SIGSEGV in the prefill).
"""

from __future__ import annotations

import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Iterable

from pdstate.errors import EngineError, InvalidEndpoint, PrefillBusy
from pdstate.pools.memory import LEGACY_NONCE_HEX, SEGMENT_HEADER_BYTES, SEGMENT_NAME_RE, SEGMENT_PREFIX, owner_alive

CHALLENGE_BYTES = 16
CHALLENGE_TTL_S = 10.0  # a decode answers in a round trip; a flood's nonces go soon
MAX_CHALLENGES = 4096  # outstanding, all registrants together (more are refused, none evicted)
MAX_CHALLENGES_PER_CLAIMANT = 8  # per connection (holder): its oldest go first


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
        if off < SEGMENT_HEADER_BYTES:
            raise InvalidEndpoint(
                f"shm endpoint of {peer_id}: region {name!r} file_offset {off} is inside the segment's "
                f"{SEGMENT_HEADER_BYTES}-byte header"
            )
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
                    "it is mapped for another live decode"  # which one is not the registrant's to learn
                )

    def claim(self, peer_id: str, owners: Iterable[str]) -> None:
        for key in owners:
            self._owner_of[key] = peer_id

    def release(self, peer_id: str) -> None:
        for key in [k for k, p in self._owner_of.items() if p == peer_id]:
            del self._owner_of[key]


class Challenges:
    """Nonces this prefill issued, each to one claimant (``worker_id/incarnation``) on one
    connection (its holder); each can be redeemed once, by that claimant, within
    ``CHALLENGE_TTL_S``. A new engine (a restarted prefill) knows none of an earlier one's.

    Registers from other connections never evict a holder's nonces (the claimant's name is no
    secret: a flood naming it used to lock its decode out): each holder keeps its newest
    ``MAX_CHALLENGES_PER_CLAIMANT``, and past ``MAX_CHALLENGES`` in all a new one is refused
    (``PrefillBusy``; the decode registers again) rather than an old one forgotten."""

    def __init__(self) -> None:
        # oldest first: every nonce lives CHALLENGE_TTL_S, so the expired ones are at the front
        self._issued: OrderedDict[bytes, tuple[str, float, str]] = OrderedDict()
        self._by_claimant: dict[str, OrderedDict[bytes, None]] = {}  # each holder's, oldest first

    def __len__(self) -> int:
        return len(self._issued)

    def _drop(self, nonce: bytes) -> tuple[str, float, str] | None:
        issued = self._issued.pop(nonce, None)
        if issued is not None:
            mine = self._by_claimant[issued[2]]
            del mine[nonce]
            if not mine:
                del self._by_claimant[issued[2]]
        return issued

    def issue(self, claimant: str, holder: str = "") -> bytes:
        """A fresh nonce for ``claimant`` on connection ``holder`` (default: the claimant); the
        expired ones and that holder's oldest beyond ``MAX_CHALLENGES_PER_CLAIMANT`` are forgotten
        first. Constant time per call (a flood of registers costs no scan)."""
        now, holder = time.monotonic(), holder or claimant
        while self._issued:
            oldest = next(iter(self._issued))
            if self._issued[oldest][1] >= now:
                break
            self._drop(oldest)
        mine = self._by_claimant.get(holder)
        if mine is not None and len(mine) >= MAX_CHALLENGES_PER_CLAIMANT:  # it holds at most the cap
            self._drop(next(iter(mine)))
        if len(self._issued) >= MAX_CHALLENGES:
            raise PrefillBusy(
                f"this prefill has {len(self._issued)} ownership challenges outstanding (the most it keeps); "
                "register again shortly"
            )
        nonce = secrets.token_bytes(CHALLENGE_BYTES)
        self._issued[nonce] = (claimant, now + CHALLENGE_TTL_S, holder)
        self._by_claimant.setdefault(holder, OrderedDict())[nonce] = None
        return nonce

    def redeem(self, nonce: bytes, claimant: str) -> None:
        """Consume ``nonce`` for ``claimant``; ``InvalidEndpoint`` if this prefill did not issue it
        to that claimant, or it was used or expired."""
        issued = self._drop(nonce)
        if issued is None or issued[0] != claimant or issued[1] < time.monotonic():
            raise InvalidEndpoint(
                f"shm proof of ownership from {claimant or 'the decode'} answers a challenge this prefill "
                "did not issue to it (an earlier prefill's, or one already answered or expired); "
                "register again for a fresh challenge"
            )


def challenge_unknown(error_message: str) -> bool:
    """Whether a decode's ``error`` says it does not know the ``challenge`` message (an older one)."""
    return error_message.startswith("unknown message kind 'challenge'")


def challenge_unknown_error() -> EngineError:
    """What a prefill answers (with ``reject``) a decode that does not know ``challenge``."""
    return EngineError(
        "this prefill needs the decode to prove it owns its shm segments (protocol message 'challenge'), "
        "which this decode does not know: run the same pdstate version on both sides"
    )
