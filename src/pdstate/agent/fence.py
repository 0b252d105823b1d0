"""The prefill's fences (``Fences``, owned by ``agent.prefill_core.PrefillCore``), which never wait.

A request that fails (an abort from either side, an engine error, a decode gone or refused, a
missed verdict) may still have engine copies in flight. It ends only once none is: its fence
holds. Until then it is pending work (``Sending.fence``), looked at again when its copies land
(a ``Watch`` of its handles where the engine says when one finishes, else an ``Again``: the
shell calls the core back) and at each tick, while the I/O thread goes on answering heartbeats
and serving other requests. What depends on the fence waits for it:

* the request moves to FAILED (the caller frees its source pages once it is terminal);
* the decode's failed ``TransferDone`` (an abort's acknowledgement: nothing more of the room
  lands; SGLang's deferred release relies on that) goes out;
* a gone decode's mapping (``release``) is disconnected only once no fence into it is pending.

A failed request is fenced only when proven: every handle of it polled finished (or failed). A
dropped decode's request (silent past the timeout, or registered again on another connection)
is confirmed on the connection it came on once its fence holds (a frozen decode reads it when it
wakes). A decode that registered again on a new connection asks again for each request it has
no confirmation of (an ``Abort`` of the room, after its Accept): the core moves such a request,
still failing, to the new connection, whose answer then waits for the fence, and answers at
once for a room that ended or is unknown (nothing of it can land).

A fence whose copies are still in flight after ``FENCE_TIMEOUT_S`` (a wedged native engine) ends
the request without telling the decode, which then never reports it fenced. At ``close`` the
shell waits for the pending fences' handles (the engine closes next), then ``settle_all`` ends them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pdstate.agent.sender import Fence, Sending
from pdstate.errors import EngineError, PdStateError, TransferAborted
from pdstate.protocol import wire
from pdstate.protocol.report import ErrorInfo

__all__ = ["FENCE_TIMEOUT_S", "Fences", "done_failed"]

FENCE_TIMEOUT_S = 60.0


def done_failed(room: int, error: BaseException | None, landed: int = 0) -> wire.TransferDone:
    """A failed ``TransferDone``; ``landed``: the bytes of the room that landed before its fence
    held (both sides' records then say the same)."""
    info = ErrorInfo.of(error) if error is not None else ErrorInfo(type="TransferFailed", message="failed")
    return wire.TransferDone(room=room, status="failed", error=info, bytes=landed)


class Fences:
    """The pending fences of one prefill core, over what the core hands them: the engine port
    (``poll``), its decodes (``identity -> DecodePeer``), ``reply(identity, msg)``,
    ``watch(send) -> bool`` (a wake-up asked for the request's new handles; False: the engine
    cannot say), ``again(key, send)`` (look again in a moment), ``disconnect(peer_id)`` and
    ``clock()`` (the time of the input being handled)."""

    def __init__(
        self,
        engine: Any,
        decodes: Mapping[bytes, Any],
        reply: Callable[[bytes, wire.Message], None],
        watch: Callable[[Sending], bool],
        again: Callable[[object, Sending], None],
        disconnect: Callable[[str], None],
        clock: Callable[[], float],
    ) -> None:
        self.engine, self.decodes, self.reply = engine, decodes, reply
        self.watch, self.again, self.disconnect, self.clock = watch, again, disconnect, clock
        self.fencing: dict[int, Sending] = {}  # room -> a failing request whose fence is pending
        self.unreleased: set[str] = set()  # peer ids of gone decodes whose release waits for a fence

    def fail(self, send: Sending, error: PdStateError, tell_decode: bool) -> None:
        """Fail ``send`` with ``error`` once its fence holds (at once when nothing is in flight),
        then tell its decode if ``tell_decode``. A request already failing keeps its first error;
        a later ``tell_decode`` (the decode's abort) is kept."""
        if send.fence is not None:
            send.fence.tell = send.fence.tell or tell_decode
            return
        send.queued.clear()
        if send.digest is not None:
            send.digest.cancel()  # no thread reads the request's pages after the fence
        send.fence = Fence(error, tell_decode, self.clock() + FENCE_TIMEOUT_S)
        self.fencing[send.record.room] = send
        self.check(send)

    def abort(self, send: Sending, reason: str) -> None:
        if not send.record.state.terminal:
            self.fail(send, TransferAborted(reason), tell_decode=True)

    def in_flight(self, send: Sending) -> bool:
        """Whether a handle of ``send`` is still copying (one that failed is finished)."""
        busy = False
        for h in send.handles:
            try:
                busy = not self.engine.poll(h) or busy
            except EngineError:
                pass  # failed: finished, nothing more of it lands
        return busy

    def check(self, send: Sending) -> None:
        """End ``send``'s failure if its fence holds (no handle in flight) or its deadline passed;
        else look again when a handle lands (or in a moment, or at the next tick)."""
        fence = send.fence
        if fence is None:
            return
        if not self.in_flight(send):
            self._end(send, fence, held=True)
        elif self.clock() >= fence.deadline:
            self._end(send, fence, held=False)  # a wedged engine: never confirmed
        elif not self.watch(send):
            self.again(fence, send)

    def settle_all(self) -> None:
        """At close, once the shell waited for their handles: end every pending fence, held or not."""
        for send in list(self.fencing.values()):
            fence = send.fence
            if fence is not None:
                self._end(send, fence, held=not self.in_flight(send))

    def _end(self, send: Sending, fence: Fence, held: bool) -> None:
        send.fence = None
        del self.fencing[send.record.room]
        if held:
            send.record.metrics["bytes"] = send.bytes  # what landed before the fence held
        send.record.fail(fence.error)
        if held and send.identity is not None and (fence.tell or send.request is not None):
            # the decode frees the pages on it (or reads it when it wakes, if it was dropped)
            self.reply(send.identity, done_failed(send.record.room, fence.error, send.bytes))
        for peer_id in [p for p in self.unreleased if not self.fenced_into(p)]:
            self.unreleased.discard(peer_id)
            self.release(peer_id)

    def fenced_into(self, peer_id: str) -> bool:
        """Whether a pending fence has a copy into ``peer_id``."""
        return any(h.peer_id == peer_id for s in self.fencing.values() for h in s.handles)

    def release(self, peer_id: str) -> None:
        """Disconnect ``peer_id`` (its mappings and claims) unless an accepted decode still uses it;
        only once no pending fence has a copy into it (its requests were failed first)."""
        if any(d.peer_id == peer_id for d in self.decodes.values()):
            return
        if self.fenced_into(peer_id):
            self.unreleased.add(peer_id)  # released when the last such fence ends
            return
        self.disconnect(peer_id)
