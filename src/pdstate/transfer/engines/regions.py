"""Registered regions as sorted numpy columns, and the plan checks every engine runs.

``RegionTable.locate`` maps each descriptor's ``[addr, addr + length)`` to the region holding it
with one ``searchsorted``; no per-descriptor Python. ``check_plan`` runs it for both sides of a
plan before any byte moves, so a bad descriptor is refused with its index and address.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdstate.errors import DescriptorMismatch, DescriptorOutOfRange, EngineError, InvalidEndpoint
from pdstate.pools.memory import Region
from pdstate.transfer.plan import TransferPlan

_U64 = np.uint64


@dataclass(frozen=True)
class RegionTable:
    """Registered regions sorted by base address, for vectorised address -> region lookup."""

    names: tuple[str, ...] = ()
    base: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=_U64))
    nbytes: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=_U64))

    @classmethod
    def build(cls, regions: Iterable[Region]) -> RegionTable:
        """Sort and check: every region non-empty, no two overlapping (else ``EngineError``)."""
        regs = sorted(regions, key=lambda r: int(r.base_ptr))
        for r in regs:
            if int(r.nbytes) <= 0 or int(r.base_ptr) <= 0:
                raise EngineError(f"region {r.name!r} at 0x{int(r.base_ptr):x} has no bytes to register")
        for a, b in zip(regs, regs[1:]):
            if int(a.base_ptr) + int(a.nbytes) > int(b.base_ptr):
                raise EngineError(f"regions {a.name!r} and {b.name!r} overlap at 0x{int(b.base_ptr):x}")
        return cls(
            tuple(r.name for r in regs),
            np.array([int(r.base_ptr) for r in regs], dtype=_U64),
            np.array([int(r.nbytes) for r in regs], dtype=_U64),
        )

    def __post_init__(self) -> None:
        # each region's end, after a 0 for "below every region" (``locate``'s one lookup)
        top = (1 << 64) - 1  # a region reaching the top of the address space ends there
        ends = [0] + [min(int(b) + int(n), top) for b, n in zip(self.base.tolist(), self.nbytes.tolist())]
        object.__setattr__(self, "_ends", np.array(ends, dtype=_U64))

    @property
    def regions(self) -> list[Region]:
        return [Region(n, int(b), int(s)) for n, b, s in zip(self.names, self.base, self.nbytes)]

    def __len__(self) -> int:
        return len(self.names)

    def locate(self, addrs: np.ndarray, lengths: np.ndarray, what: str) -> np.ndarray:
        """Index of the region holding each ``[addr, addr + length)``.

        Raises ``DescriptorOutOfRange`` naming the first descriptor that fits in no region.
        """
        n = addrs.shape[0]
        if n == 0:
            return np.empty(0, dtype=np.intp)
        if len(self) == 0:
            ok = np.zeros(n, dtype=bool)
            idx = np.zeros(n, dtype=np.intp)
        else:
            # above: the region whose base is the last at or below each address (0: below every
            # region); base[above - 1] <= addr holds by the search, so the descriptor fits when
            # it starts at or before that region's end and its length fits in what is left
            above = np.searchsorted(self.base, addrs, side="right")
            end = self._ends[above]
            # unsigned arithmetic: the subtraction wraps only where the comparison before it failed
            ok = (above > 0) & (addrs <= end) & (lengths <= end - addrs)
            idx = above - 1
        if not ok.all():
            i = int(np.argmin(ok))
            addr, length = int(addrs[i]), int(lengths[i])
            raise DescriptorOutOfRange(
                f"descriptor {i}: {what} address 0x{addr:x} (+{length} bytes) is outside every "
                f"registered {what} region; nothing was transferred",
                index=i,
                address=addr,
            )
        return idx

    def check_inside(self, ranges: Iterable[tuple[str, int, int]], whose: str) -> None:
        """Each ``(label, ptr, nbytes)`` lies inside one region (``DescriptorMismatch`` if not):
        a peer's registered buffers must be memory it published to its engine."""
        items = list(ranges)
        if not items:
            return
        addrs = np.array([p for _, p, _ in items], dtype=_U64)
        lengths = np.array([n for _, _, n in items], dtype=_U64)
        try:
            self.locate(addrs, lengths, "registered")
        except DescriptorOutOfRange as exc:
            label, ptr, n = items[exc.index]
            raise DescriptorMismatch(
                f"{label}: [{ptr:#x}, +{n}) is outside every region {whose} published to its transfer engine"
            ) from None

    def to_wire(self) -> list[dict]:
        return [{"name": r.name, "base_ptr": r.base_ptr, "nbytes": r.nbytes} for r in self.regions]

    @classmethod
    def from_wire(cls, items: Any) -> RegionTable:
        try:
            return cls.build(Region(str(d["name"]), int(d["base_ptr"]), int(d["nbytes"])) for d in items)
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidEndpoint(f"endpoint regions are malformed: {exc!r}") from exc


def check_plan(plan: TransferPlan, local: RegionTable, remote: RegionTable) -> tuple[np.ndarray, np.ndarray]:
    """Validate every descriptor; returns the (src, dst) region index of each."""
    src, dst, length = plan.src, plan.dst, plan.length
    if not (src.shape == dst.shape == length.shape) or src.ndim != 1:
        raise EngineError(f"plan arrays must be 1-D and equal length: {src.shape} {dst.shape} {length.shape}")
    if not (src.dtype == dst.dtype == length.dtype == _U64):
        raise EngineError("plan arrays must be uint64 (build plans with TransferPlan.from_arrays)")
    return local.locate(src, length, "src"), remote.locate(dst, length, "dst")


def drop_empty(plan: TransferPlan) -> TransferPlan:
    """The plan without its zero-length descriptors (native engines reject or mishandle them)."""
    keep = plan.length != 0
    if keep.all():
        return plan
    return TransferPlan(plan.src[keep], plan.dst[keep], plan.length[keep], plan.total_bytes)
