"""``TransferPlan``: what a planner produces and an engine consumes (columnar descriptors)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TransferPlan:
    """RDMA-style descriptors: write ``length[i]`` bytes from local ``src[i]`` to remote ``dst[i]``.

    Three equal-length uint64 arrays plus the byte total. Built once per request; engines map it
    to their own API without branching on model or layout.
    """

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray
    total_bytes: int

    @classmethod
    def from_arrays(cls, src, dst, length) -> TransferPlan:
        s = np.ascontiguousarray(src, dtype=np.uint64)
        d = np.ascontiguousarray(dst, dtype=np.uint64)
        n = np.ascontiguousarray(length, dtype=np.uint64)
        if not (s.shape == d.shape == n.shape) or s.ndim != 1:
            raise ValueError(f"plan arrays must be 1-D and equal length: {s.shape} {d.shape} {n.shape}")
        return cls(s, d, n, int(n.sum()))

    @classmethod
    def empty(cls) -> TransferPlan:
        z = np.empty(0, dtype=np.uint64)
        return cls(z, z, z, 0)

    def __len__(self) -> int:
        return int(self.src.shape[0])

    @property
    def num_descriptors(self) -> int:
        return len(self)

    def chunks(self, max_descriptors: int):
        """Yield sub-plans of at most ``max_descriptors`` descriptors (engine batch limits)."""
        for i in range(0, len(self), max_descriptors):
            sl = slice(i, i + max_descriptors)
            yield TransferPlan(self.src[sl], self.dst[sl], self.length[sl], int(self.length[sl].sum()))
