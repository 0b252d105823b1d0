"""The decode's ``Landed`` and ``TransferDone`` frames against the bytes that landed: what landed
is hashed early, in the background, while the rest copies; at ``TransferDone`` the rest is
hashed and the digest compared with the prefill's before the verdict.

``LandedDigests`` keeps, per request, only how far its hashing got (``Receiving.digest`` and
``Receiving.hashed``); the hashing itself (threads reading the caller's memory) lies behind the
engine port ``DecodePort``, which the decode's shell implements and core tests fake.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from pdstate.agent.receiver import Receiving
from pdstate.agent.verify import level_of
from pdstate.errors import DigestMismatch, PdStateError
from pdstate.protocol import wire

__all__ = ["DecodePort", "Digest", "LandedDigests"]

Updates = list[tuple[int, np.ndarray]]  # (channel, destination indices): main KV 0, state 1.., aux last


class Digest(Protocol):
    """One request's digest under way (``agent.digest.RequestDigest``)."""

    seconds: float  # all its hashing so far

    def update_async(self, updates: Updates) -> None: ...

    def cancel(self) -> None: ...


class DecodePort(Protocol):
    """The few engine and memory calls the decode's core makes."""

    def prove(self, nonce: bytes, audience: str) -> dict:
        """The endpoint fields proving this decode's memory is its own (a prefill's challenge)."""
        ...

    def on_device(self) -> bool:
        """Whether this decode's memory lies on a device (its digests are then in device form)."""
        ...

    def open_digest(self, request: wire.AgentRequest, level: str, form: str | None) -> Digest:
        """A new digest of ``request``'s destination at ``level``, in ``form`` (None: the default)."""
        ...

    def settle(self, digest: Digest, updates: Updates) -> tuple[bytes, float]:
        """Hash ``updates`` here, after the background work; the digest, and the seconds it took."""
        ...


class LandedDigests:
    """The decode's hashing of landed bytes, per request; off when ``enabled`` is False."""

    def __init__(self, port: DecodePort, enabled: bool) -> None:
        self.port, self.enabled = port, enabled

    def landed(self, recv: Receiving, msg: wire.Landed) -> None:
        """Hash what the prefill says has landed of a live request, in the background."""
        if not self.enabled or recv.request is None:
            return
        recv.record.metrics["landed"] = recv.record.metrics.get("landed", 0) + 1
        updates = self._updates(recv, msg.pages, msg.state_landed, None)
        if updates:
            recv.digest.update_async(updates)

    def wants_sample(self, recv: Receiving) -> bool:
        """Whether a request just sent has a sample to pick (``sampled``, its digest not open)."""
        req = recv.request
        return (
            self.enabled and req is not None and recv.digest is None and level_of(req.digest, req.verify) == "sampled"
        )

    def prepare(self, recv: Receiving) -> None:
        """A request just sent: its digest opened and, where it can (``sampled``), the sample of
        its whole destination picked here (the I/O thread, once the request's frame went out: tens of
        µs, no thread hop) while the prefill copies."""
        req = recv.request
        if not self.wants_sample(recv):
            return
        recv.digest = self.port.open_digest(req, "sampled", None)
        if hasattr(recv.digest, "prepare"):  # where the sample lies, not its bytes
            recv.digest.prepare(self._remaining(recv, len(req.dst_kv_pages), True))

    def restart(self, recv: Receiving) -> None:
        """The request went out (again): everything lands again."""
        recv.digest, recv.hashed = None, (0, False)

    def drop(self, recv: Receiving) -> None:
        """Stop hashing an ended request's pages: the work not started is dropped and the running
        part waited for, so nothing reads pages the caller may free."""
        if recv.digest is not None:
            recv.digest.cancel()
            recv.digest = None

    def verdict(self, recv: Receiving, msg: wire.TransferDone) -> PdStateError | None:
        """Why a transfer the prefill reports done failed here (its digest differs, or it sent
        none), or None; the request's metrics get the level and the hashing time."""
        rec, req = recv.record, recv.request
        rec.metrics["verify"] = level_of(req.digest, req.verify)
        if not self.enabled:
            return None
        form = msg.digest_form or "host"  # the prefill's; hashed again in it if the early hashing was not
        if recv.digest is not None and getattr(recv.digest, "form", "host") != form:
            self.drop(recv)
            recv.hashed = (0, False)
        updates = self._updates(recv, len(req.dst_kv_pages), True, form)
        mine, seconds = self.port.settle(recv.digest, updates)
        rec.metrics["digest_s"] = round(seconds, 6)  # after TransferDone: the part not hidden
        rec.metrics["digest_hashing_s"] = round(recv.digest.seconds, 6)  # all of it, early parts included
        if msg.digest is None:
            return DigestMismatch(f"room {msg.room}: the prefill sent no digest")
        if msg.digest != mine:
            return DigestMismatch(
                f"room {msg.room}: digest of the {msg.bytes} bytes that landed ({mine.hex()}) differs "
                f"from the prefill's digest of the bytes it sent ({msg.digest.hex()})"
            )
        return None

    def _updates(self, recv: Receiving, pages: int, state: bool, form: str | None) -> Updates:
        """The destination beyond what is hashed already, up to ``pages`` main-KV pages (and,
        with ``state``, its state and aux), marked hashed; the request's digest opened first."""
        req = recv.request
        if recv.digest is None:
            recv.digest = self.port.open_digest(req, level_of(req.digest, req.verify), form)
        updates = self._remaining(recv, pages, state)
        recv.hashed = (max(min(pages, len(req.dst_kv_pages)), recv.hashed[0]), state or recv.hashed[1])
        return updates

    def _remaining(self, recv: Receiving, pages: int, state: bool) -> Updates:
        """The destination beyond what is hashed already, up to ``pages`` main-KV pages (and,
        with ``state``, its state and aux)."""
        req = recv.request
        n = 1 + len(req.dst_state_indices)
        done_pages, done_state = recv.hashed
        pages = min(pages, len(req.dst_kv_pages))
        updates: Updates = []
        if pages > done_pages:
            updates.append((0, req.dst_kv_pages.unpack()[done_pages:pages]))
        if state and not done_state:
            updates += [(c, lst.unpack()) for c, lst in enumerate(req.dst_state_indices, start=1)]
            if req.dst_aux is not None:
                updates.append((n, np.array([req.dst_aux.index])))
        return updates
