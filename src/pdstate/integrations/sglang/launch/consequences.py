"""What SGLang 0.5.19's own transfer backend does at run time when a pair whose layouts differ is
launched anyway, one differing factor at a time (measured, ``shared/reference/sglang_cpu.md``): each
factor's ``effect`` in the registry of layout factors (``pdstate.protocol.factors``)."""

from __future__ import annotations

from typing import Any

from pdstate.protocol import factors

UNKNOWN_EFFECT = "the state layouts differ: wrong bytes"


def consequence(factor: str, p: Any, d: Any) -> str:
    """Run-time effect of one differing factor under SGLang's own transfer backend."""
    entry = factors.get(factor)
    if entry is None or entry.effect is None:
        return UNKNOWN_EFFECT
    return entry.effect(p, d)
