"""In-process engine for tests: both sides live in one process, copies are ``ctypes.memmove``.

A started decode-side engine is listed in a module-level table under its ``engine_id``; the
endpoint carries that id and a prefill engine in the same process finds the decode engine there.
Closing the decode engine removes it, so later submits to it fail like a vanished peer.

Scriptable behaviour, so tests of the agent and the workers need no real engine:

* ``delay_s``: a submitted plan lands only ``delay_s`` after ``submit`` (the copy happens at the
  first ``poll``/``wait`` after that), so ``poll`` returns False meanwhile and a short ``wait``
  times out.
* ``script_failure(nth_submit, after_bytes, message, on_submit)``: the ``nth_submit``-th
  ``submit`` of a non-empty plan (1-based, counted over this engine's life) copies the plan's
  first ``after_bytes`` bytes (descriptor order, possibly splitting one) and then fails with
  ``EngineError(message)``: raised by ``submit`` itself if ``on_submit``, else by ``poll`` and
  ``wait``. ``LoopbackEngine(failures=[ScriptedFailure(...)])`` scripts them up front.
* ``LoopbackEngine(delays=[ScriptedDelay(nth_submit, delay_s)])``: the ``nth_submit``-th submit
  of a non-empty plan lands ``delay_s`` after it (instead of ``delay_s`` of the engine): one
  slow copy among prompt ones.

Notifications (``submit(..., notify=msg)``) are delivered to the decode engine's
``notifications()`` as ``("loopback:<sender engine_id>", msg)`` once the plan has landed.

Endpoint: ``{"engine": "loopback", "engine_id": str, "regions": [...]}``.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pdstate.errors import EngineError
from pdstate.transfer.engines.base import Peer, TransferEngine, TransferHandle
from pdstate.transfer.plan import TransferPlan

_LIVE: dict[str, LoopbackEngine] = {}


@dataclass(frozen=True)
class ScriptedFailure:
    nth_submit: int
    after_bytes: int = 0
    message: str = "scripted loopback failure"
    on_submit: bool = False


@dataclass(frozen=True)
class ScriptedDelay:
    nth_submit: int
    delay_s: float


@dataclass
class _Pending:
    target_id: str  # the decode engine's engine_id, the key in _LIVE
    plan: TransferPlan
    due: float  # monotonic time at which the plan lands
    failure: ScriptedFailure | None
    notify: bytes


class LoopbackEngine(TransferEngine):
    """``LoopbackEngine(delay_s=0.0, failures=(), delays=())``; see the module docstring."""

    name = "loopback"
    supports_notify = True

    def __init__(
        self, delay_s: float = 0.0, failures: Sequence[ScriptedFailure] = (), delays: Sequence[ScriptedDelay] = ()
    ) -> None:
        super().__init__()
        self.delay_s = float(delay_s)
        self._failures = list(failures)
        self._delays = {d.nth_submit: float(d.delay_s) for d in delays}
        self._num_submits = 0
        self._inbox: list[tuple[str, bytes]] = []

    def script_failure(
        self,
        nth_submit: int,
        after_bytes: int = 0,
        message: str = "scripted loopback failure",
        on_submit: bool = False,
    ) -> None:
        """Make the ``nth_submit``-th submit (1-based, over the engine's life) fail."""
        self._failures.append(ScriptedFailure(nth_submit, after_bytes, message, on_submit))

    @property
    def num_submits(self) -> int:
        return self._num_submits

    def _start(self) -> None:
        _LIVE[self._engine_id] = self

    def _close(self) -> None:
        _LIVE.pop(self._engine_id, None)
        super()._close()

    def _connect(self, peer: Peer) -> None:
        if peer.endpoint["engine_id"] not in _LIVE:
            raise EngineError(f"loopback connect: peer {peer.peer_id} is not live in this process")

    def _submit(self, peer: Peer, plan: TransferPlan, handle: TransferHandle, notify: bytes) -> None:
        self._num_submits += 1
        failure = next((f for f in self._failures if f.nth_submit == self._num_submits), None)
        target_id = peer.endpoint["engine_id"]
        if failure is not None and failure.on_submit:
            self._land(target_id, plan, failure)  # raises
        delay_s = self._delays.get(self._num_submits, self.delay_s)
        handle.native = _Pending(target_id, plan, time.monotonic() + delay_s, failure, notify)
        if delay_s <= 0:
            self._poll(handle)

    def _notify(self, peer: Peer, message: bytes) -> None:
        self._deliver(peer.endpoint["engine_id"], message)

    def _deliver(self, target_id: str, message: bytes) -> None:
        target = _LIVE.get(target_id)
        if target is None:
            raise EngineError(f"loopback notify to loopback:{target_id} failed: the peer engine was closed")
        target._inbox.append((f"{self.name}:{self._engine_id}", message))

    def _notifications(self) -> list[tuple[str, bytes]]:
        out, self._inbox = self._inbox, []
        return out

    def _poll(self, handle: TransferHandle) -> None:
        pending: _Pending = handle.native
        if time.monotonic() < pending.due:
            return
        try:
            self._land(pending.target_id, pending.plan, pending.failure)
            if pending.notify:
                self._deliver(pending.target_id, pending.notify)
        except EngineError as exc:
            handle.fail(exc)
        else:
            handle.finish()

    def _wait(self, handle: TransferHandle, deadline: float) -> None:
        pending: _Pending = handle.native
        pause_s = min(pending.due, deadline) - time.monotonic()
        if pause_s > 0:
            time.sleep(pause_s)  # a simulated transfer: nothing to observe before it is due
        with self._lock:
            self._require_started("wait")
            self._poll(handle)

    def _land(self, target_id: str, plan: TransferPlan, failure: ScriptedFailure | None) -> None:
        """Copy the plan (or its first ``failure.after_bytes`` bytes, then raise)."""
        if target_id not in _LIVE:
            raise EngineError(f"loopback transfer to loopback:{target_id} failed: the peer engine was closed")
        budget = failure.after_bytes if failure is not None else plan.total_bytes
        memmove = ctypes.memmove
        for d, s, n in zip(plan.dst.tolist(), plan.src.tolist(), plan.length.tolist()):
            if budget <= 0:
                break
            memmove(d, s, min(n, budget))
            budget -= n
        if failure is not None:
            raise EngineError(failure.message)
