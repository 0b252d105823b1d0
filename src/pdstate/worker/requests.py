"""Per-request allocation on one side of ``pdstate serve``, and the index lists it yields for
every channel (the rules are ``pools.indices``'s, by the pools' release).

Both sides allocate the request's full pages and only the SWA tail (the window's pages) — the
prefill keeps no SWA state beyond the window either — plus a request slot that addresses the
unified ring rows and the C128 state slot.

The SWA component is addressed by the window's SWA pages (``indices.swa_page_indices``) in every
release and mode, the same rule on both sides of a serve pair. Unified SGLang 0.5.23 pools address
their C4 states by request slot (``indices.swa_component_indices``), but request slot 0 is then
index 0, which the planner refuses as the reserved padding page (``PaddingPageIndex``); until the
planner tells a slot from a page there, serve's workers keep the page rule.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pdstate.errors import AllocationError
from pdstate.pools import indices
from pdstate.pools.presets import WorkerPools
from pdstate.worker.status import RequestStatus, TransferResult

BUSY_BACKOFF_S = (0.002, 0.1)  # first and longest wait before a decode asks a busy prefill again


@dataclass
class Allocation:
    req_slot: int
    locs: torch.Tensor
    lists: list[np.ndarray]
    freed: bool = False
    usage: dict[str, int] = field(default_factory=dict)  # what it took of each ``free_counts`` resource


@dataclass(eq=False)
class Pending:
    """One request of a decode on its request loop (touched only there, after ``submit``)."""

    status: RequestStatus
    fut: Future
    verify: str
    deadline_s: float
    res: TransferResult
    t0: float = 0.0
    end: float = 0.0
    alloc: Allocation | None = None
    recv: Any = None  # its latest KVReceiver
    backoff: float = BUSY_BACKOFF_S[0]
    why: str | None = None  # set when its deadline passed and its abort went out
    done: bool = False
    timers: list[asyncio.TimerHandle] = field(default_factory=list)  # deadline, backoff, fence
    hold: bool = False  # kept running once landed (``Running``), not freed
    steps: int = 0  # synthetic decode steps to run once it landed (with ``hold``)
    step: int = 0  # the decode step its content is at when it lands (a migrated request's)


@dataclass(eq=False)
class Running:
    """A request kept on a decode after it landed (``hold``), advanced by synthetic decode steps
    (``synth.advance``); touched on the decode's request loop only. ``migrating``: paused while
    its state moves to another decode (no step writes it, nothing frees it)."""

    room: int
    seq_len: int
    alloc: Allocation
    step: int
    since: float
    source: str = ""  # where it came from: the prefill's control address, or the migrating decode's
    migrating: bool = False

    def as_dict(self, now: float) -> dict:
        return {
            "room": self.room,
            "seq_len": self.seq_len,
            "step": self.step,
            "migrating": self.migrating,
            "source": self.source,
            "running_s": now - self.since,
        }


_NO_LOCS = torch.empty(0, dtype=torch.int64)
_NO_INDICES = np.empty(0, dtype=np.int64)
_NO_INDICES.flags.writeable = False  # shared by every empty transfer's lists


def check_submit(seq_len: int, verify: str | None, prefill: str | None) -> None:
    """A decode's ``submit`` arguments, checked the same on every decode (``ValueError``)."""
    if verify not in (None, "full", "sample"):
        raise ValueError(f"verify must be 'full' or 'sample', not {verify!r}")
    if seq_len < 0:
        raise ValueError(f"seq_len must not be negative, got {seq_len} (0: an empty transfer)")
    if prefill is not None and (not isinstance(prefill, str) or not prefill.startswith("tcp://")):
        raise ValueError(f"prefill must be a tcp://host:port control address, not {prefill!r}")


def channel_names(desc) -> list[str]:
    return ["main_kv"] + [getattr(t, "value", t) for t in desc.state_types]


def capacity_tokens(pools: WorkerPools) -> int:
    return pools.allocator.size_full


def allocate(pools: WorkerPools, names: list[str], seq_len: int) -> Allocation:
    """Allocate a request of ``seq_len`` prompt tokens (0: an empty transfer, a request slot alone);
    raises ``AllocationError`` when full."""
    target, alloc = pools.target, pools.allocator
    if seq_len < 0:
        raise AllocationError(f"seq_len must not be negative, got {seq_len}")
    slot = pools.req_to_token.alloc()
    if not seq_len:  # an empty transfer: a request slot and no pages (every index list is empty)
        pools.req_to_token.write(slot, _NO_INDICES)  # (so that freeing the slot clears nothing)
        return Allocation(slot, _NO_LOCS, [_NO_INDICES] * len(names))
    try:
        locs = alloc.alloc_swa_tail(seq_len, target.sliding_window)
    except AllocationError:
        pools.req_to_token.free(slot)
        raise
    locs_np = locs.numpy()  # one view for every list (a tensor's ``numpy()`` costs a few us each)
    pools.req_to_token.write(slot, locs_np)
    try:
        by_name: dict[str, np.ndarray] = {}  # the draft's SWA channel shares the target's list
        for name in names:
            if name not in by_name:
                by_name[name] = _list_for(name, pools, slot, locs_np, seq_len)
        lists = [by_name[name] for name in names]
    except Exception:
        alloc.free(locs)
        pools.req_to_token.free(slot)
        raise
    return Allocation(slot, locs, lists)


def _list_for(name: str, pools: WorkerPools, slot: int, locs: np.ndarray, seq_len: int) -> np.ndarray:
    t = pools.target
    if name == "main_kv":
        return indices.main_kv_page_indices(locs, seq_len, t.page_size)
    if name == "swa":  # by the window's SWA pages in every release and mode: see the module docstring
        mapping = pools.allocator.full_to_swa_index_mapping
        return indices.swa_page_indices(locs, seq_len, t.sliding_window, t.page_size, mapping)
    if name == "swa_ring":
        return indices.swa_ring_rows(slot, seq_len, t.unified_swa_window, t.unified_swa_ring_size)
    if name == "c128_state":
        return indices.request_state_indices(slot, seq_len, t.online_c128, t.c128_ring_size)
    raise ValueError(f"no index rule for state component {name!r}")


def free(pools: WorkerPools, a: Allocation) -> bool:
    """Free exactly once; returns False when it was already freed."""
    if a.freed:
        return False
    a.freed = True
    pools.allocator.free(a.locs)
    pools.req_to_token.free(a.req_slot)
    return True


def free_counts(pools: WorkerPools) -> dict[str, int]:
    return {
        "full_tokens": pools.allocator.full_available_size(),
        "swa_tokens": pools.allocator.swa_available_size(),
        "req_slots": pools.req_to_token.available_size(),
    }
