"""Where memory lives: host memory, or a CUDA device's (asked of the driver, never by reading it)."""

from __future__ import annotations

import ctypes

__all__ = ["memory_devices"]

_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
_CU_MEMORYTYPE_DEVICE = 2


def memory_devices(ptrs: list[int]) -> list[str | None]:
    """Where each address lives: ``None`` for host memory, ``"cuda:N"`` for device ``N``'s.

    Without CUDA (no torch CUDA build, no device, no driver) every address is host memory; with
    it, the driver says (``cuPointerGetAttribute``: an address it does not know is host memory)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return [None] * len(ptrs)
        lib = ctypes.CDLL("libcuda.so.1")
    except (ImportError, OSError):
        return [None] * len(ptrs)
    out: list[str | None] = []
    for p in ptrs:
        kind, ordinal = ctypes.c_uint(0), ctypes.c_int(0)
        rc = lib.cuPointerGetAttribute(ctypes.byref(kind), _CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ctypes.c_uint64(p))
        if rc == 0 and kind.value == _CU_MEMORYTYPE_DEVICE:
            lib.cuPointerGetAttribute(ctypes.byref(ordinal), _CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ctypes.c_uint64(p))
            out.append(f"cuda:{ordinal.value}")
        else:
            out.append(None)
    return out
