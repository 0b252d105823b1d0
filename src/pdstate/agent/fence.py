"""The prefill agent's fences, on its I/O thread, which never waits for one.

A request that fails (an abort from either side, an engine error, a decode gone or refused, a
missed verdict) may still have engine copies in flight. It ends only once none is: its fence
holds. Until then it is pending work (``Sending.fence``), looked at again when its copies land
(the engine's wake-up, ``sender.wake_when_landed``, else ``AgentLoop.again``) and at each tick,
while the I/O thread goes on answering heartbeats and serving other requests. What depends on
the fence waits for it:

* the request moves to FAILED (the caller frees its source pages once it is terminal);
* the decode's failed ``TransferDone`` (an abort's acknowledgement: nothing more of the room
  lands; SGLang's deferred release relies on that) goes out;
* a gone decode's mapping (``_release``) is disconnected only once no fence into it is pending.

A dropped decode's request (silent past the timeout, or registered again on another connection)
is confirmed on the connection it came on once its fence holds (a frozen decode reads it when it
wakes). A decode that registered again on a new connection asks again for each request it has
no confirmation of (an ``Abort`` of the room, after its Accept): ``PrefillAgent`` moves such a
request, still failing, to the new connection, whose answer then waits for the fence, and
answers at once for a room that ended or is unknown (nothing of it can land).

A fence whose copies are still in flight after ``FENCE_TIMEOUT_S`` (a wedged native engine) ends
the request without telling the decode, which then never reports it fenced. At ``close`` the
pending fences are waited for on the I/O thread (the engine closes next).
"""

from __future__ import annotations

import time

from pdstate.agent.sender import Fence, Sending, wake_when_landed
from pdstate.errors import EngineError, PdStateError, TransferAborted
from pdstate.protocol import wire
from pdstate.protocol.report import ErrorInfo

__all__ = ["FENCE_TIMEOUT_S", "Fences"]

FENCE_TIMEOUT_S = 60.0


class Fences:
    """Mixed into ``PrefillAgent`` (which has ``_engine``, ``_loop``, ``_decodes`` and ``_reply``);
    every method runs on its I/O thread."""

    def _init_fences(self) -> None:
        self._fencing: dict[int, Sending] = {}  # room -> a failing request whose fence is pending
        self._unreleased: set[str] = set()  # peer ids of gone decodes whose release waits for a fence

    def _done_failed(self, room: int, error: BaseException | None, landed: int = 0) -> wire.TransferDone:
        """A failed ``TransferDone``; ``landed``: the bytes of the room that landed before its fence
        held (both sides' records then say the same)."""
        info = ErrorInfo.of(error) if error is not None else ErrorInfo(type="TransferFailed", message="failed")
        return wire.TransferDone(room=room, status="failed", error=info, bytes=landed)

    def _fail(self, send: Sending, error: PdStateError, tell_decode: bool) -> None:
        """Fail ``send`` with ``error`` once its fence holds (at once when nothing is in flight),
        then tell its decode if ``tell_decode``. A request already failing keeps its first error;
        a later ``tell_decode`` (the decode's abort) is kept."""
        if send.fence is not None:
            send.fence.tell = send.fence.tell or tell_decode
            return
        send.queued.clear()
        if send.digest is not None:
            send.digest.cancel()  # no thread reads the request's pages after the fence
        send.fence = Fence(error, tell_decode, time.monotonic() + FENCE_TIMEOUT_S)
        self._fencing[send.record.room] = send
        self._fence_check(send)

    def _abort(self, send: Sending, reason: str) -> None:
        if send.record.state.terminal:
            return
        self._fail(send, TransferAborted(reason), tell_decode=True)

    def _fence_check(self, send: Sending) -> None:
        """End ``send``'s failure if its fence holds (no handle in flight) or its deadline passed;
        else look again when a handle lands (or in a moment, or at the next tick)."""
        fence = send.fence
        if fence is None:
            return
        in_flight = False
        for h in send.handles:
            try:
                in_flight = not self._engine.poll(h) or in_flight
            except EngineError:
                pass  # failed: finished, nothing more of it lands
        if not in_flight:
            self._fence_end(send, fence, held=True)
        elif time.monotonic() >= fence.deadline:
            self._fence_end(send, fence, held=False)  # a wedged engine: never confirmed
        elif not wake_when_landed(self._engine, self._loop, send, self._fence_check):
            self._loop.again(fence, lambda: self._fence_check(send))

    def _fence_end(self, send: Sending, fence: Fence, held: bool) -> None:
        send.fence = None
        del self._fencing[send.record.room]
        if held:
            send.record.metrics["bytes"] = send.bytes  # what landed before the fence held
        send.record.fail(fence.error)
        if held and send.identity is not None and (fence.tell or send.request is not None):
            # the decode frees the pages on it (or reads it when it wakes, if it was dropped)
            self._reply(send.identity, self._done_failed(send.record.room, fence.error, send.bytes))
        for peer_id in [p for p in self._unreleased if not self._fenced_into(p)]:
            self._unreleased.discard(peer_id)
            self._release(peer_id)

    def _fenced_into(self, peer_id: str) -> bool:
        """Whether a pending fence has a copy into ``peer_id``."""
        return any(h.peer_id == peer_id for s in self._fencing.values() for h in s.handles)

    def _release(self, peer_id: str) -> None:
        """Disconnect ``peer_id`` (its mappings and claims) unless an accepted decode still uses it;
        only once no pending fence has a copy into it (its requests were failed first)."""
        if any(d.peer_id == peer_id for d in self._decodes.values()):
            return
        if self._fenced_into(peer_id):
            self._unreleased.add(peer_id)  # released when the last such fence ends
            return
        self._engine.disconnect(peer_id)

    def _hold_fences(self) -> None:
        """At close: wait here for every pending fence (up to its deadline), then end it."""
        for send in list(self._fencing.values()):
            fence = send.fence
            for h in send.handles:
                try:
                    self._engine.wait(h, max(0.0, fence.deadline - time.monotonic()))
                except EngineError:
                    pass  # failed or still in flight: ``_fence_check`` tells which
            if send.fence is fence:
                self._fence_check(send)
            if send.fence is fence:  # still in flight at its deadline
                self._fence_end(send, fence, held=False)
