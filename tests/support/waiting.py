"""Waiting by polling with a deadline (nothing in the tests sleeps to synchronise)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_until(
    what: str,
    probe: Callable[[], Any],
    timeout_s: float = 10.0,
    pause_s: float = 0.02,
    ignore: tuple[type[BaseException], ...] = (),
) -> Any:
    """Poll ``probe`` until it returns something truthy; fail with ``what`` past the deadline.

    ``ignore``: exceptions a probe may raise while what it polls is not up yet (they count as a
    falsy answer, and the last one is named in the failure)."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except ignore as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(pause_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}; last probe: {last!r}")
