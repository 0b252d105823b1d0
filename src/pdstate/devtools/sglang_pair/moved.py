"""Bytes and descriptors a child hands to Mooncake, counted at the engine call.

Both backends the bench compares move their bytes through ``mooncake.engine.TransferEngine``
(SGLang's Mooncake backend through its ``MooncakeTransferEngine``, backend pdstate through its
Mooncake engine). ``install`` wraps the transfer methods of that class, once per process, so that
every call, from any thread and any owner of an engine object, adds its lengths (the sum) and its
entries (the count) to one counter; ``reset`` and ``read`` bracket a request. Counted, not
estimated: what was asked of the engine, whether or not it later failed.

Imports Mooncake only when ``install`` runs (the children do; the parent never).
"""

from __future__ import annotations

import functools
import threading

# Every transfer call of the Python binding: a batch (``lengths``, a list) or one (``length``).
# In each, the lengths are the fourth argument after ``self`` (target, buffers, peer addresses, lengths).
BATCH = (
    "batch_transfer_sync_write",
    "batch_transfer_async_write",
    "batch_transfer_sync_read",
    "batch_transfer_async_read",
    "batch_transfer_sync",
    "batch_transfer_async",
)
SINGLE = ("transfer_sync_write", "transfer_sync_read", "transfer_sync", "transfer_submit_write")
LENGTH_AT = 3

_lock = threading.Lock()
_count = {"bytes": 0, "descriptors": 0, "calls": 0}
_installed: list[str] = []


def add(lengths: list[int]) -> None:
    """Count one engine call that moves ``lengths``."""
    with _lock:
        _count["bytes"] += sum(int(n) for n in lengths)
        _count["descriptors"] += len(lengths)
        _count["calls"] += 1


def reset() -> None:
    with _lock:
        for k in _count:
            _count[k] = 0


def read() -> dict[str, int]:
    """What was counted since the last ``reset``: ``bytes``, ``descriptors`` and engine ``calls``."""
    with _lock:
        return dict(_count)


def _wrap(cls: type, name: str, batch: bool) -> None:
    native = getattr(cls, name)
    key = "lengths" if batch else "length"

    @functools.wraps(native)
    def counted(self, *args, **kwargs):
        value = args[LENGTH_AT] if len(args) > LENGTH_AT else kwargs[key]
        add(list(value) if batch else [value])
        return native(self, *args, **kwargs)

    setattr(cls, name, counted)


def wrap_class(cls: type) -> list[str]:
    """Wrap ``cls``'s transfer methods (those it has) to count; the names wrapped."""
    names = []
    for names_of, batch in ((BATCH, True), (SINGLE, False)):
        for name in names_of:
            if hasattr(cls, name):
                _wrap(cls, name, batch)
                names.append(name)
    return names


def install() -> list[str]:
    """Count every transfer of ``mooncake.engine.TransferEngine`` in this process (once)."""
    if not _installed:
        from mooncake.engine import TransferEngine

        _installed.extend(wrap_class(TransferEngine))
    return list(_installed)
