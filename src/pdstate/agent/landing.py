"""Which ended requests a prefill may still write (the decode's core, ``agent.decode_core``).

A request is *fenced* once nothing more of it can land in its destination (``Receiving.fenced``):
no prefill was told where to write, or the one told confirmed (its ``TransferDone``, sent once its
fence holds; its goodbye) or is proven gone (a new process holds its address; with a synchronous
engine, the control session it had completed closed). A request that ended otherwise (its prefill
gone silent: it, or this decode, frozen or slow) is held here, by (prefill address, room), until
one of those happens; the caller's fence callbacks are handed out then (``notify``: the core's
outbox, the shell runs them). Silence alone never releases one.

A prefill killed for good never confirms nor restarts. With an engine whose copies outlive the
writer's I/O thread (loopback, Mooncake, NIXL), the close of a control session it had completed
starts a horizon (``DecodeTimers.dead_prefill_release_s``): the kernel closed that socket because
the process exited (or it let its control socket go, which an agent does only once its fences
held); what its kernel may still deliver of the writes it had handed to the network (an orphaned
TCP socket's retransmissions, RDMA packets already on the wire) arrives within that horizon. No
session with that address completed since, its requests are fenced at the horizon's end. A frozen
or partitioned prefill keeps its session (its kernel answers): no horizon starts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pdstate.agent.receiver import Receiving

__all__ = ["Landing"]


class Landing:
    """The decode's ended, unfenced requests and their fence callbacks; a fence callback due is
    handed to ``notify(room, fn)`` (run later, by the shell, never inside the core)."""

    def __init__(self, notify: Callable[[int, Callable[[], None]], None]) -> None:
        self._held: dict[tuple[str, int], list[Receiving]] = {}
        self._notify = notify
        # prefill address -> (the incarnation whose completed session closed, when): the horizon
        self._closed: dict[str, tuple[str, float]] = {}

    def ended(self, recv: Receiving) -> None:
        """``recv`` turned terminal: fenced, its callbacks run; else it is held."""
        if recv.fenced:
            self._run(recv)
        else:
            self._held.setdefault((recv.prefill, recv.record.room), []).append(recv)

    def on_fence(self, recv: Receiving, fn: Callable[[], None]) -> None:
        """Hand ``fn`` out once ``recv`` is terminal and fenced (now, if it is)."""
        if recv.record.state.terminal and recv.fenced:
            self._notify(recv.record.room, fn)
        else:
            recv.fence_callbacks.append(fn)

    def acked(self, recv: Receiving) -> None:
        """Nothing more of ``recv`` lands: its prefill said so, or is proven gone."""
        if recv.acked:
            return
        recv.acked = True
        if not recv.record.state.terminal:
            return  # its end runs the callbacks
        key = (recv.prefill, recv.record.room)
        held = self._held.get(key)
        if held is not None and recv in held:
            held.remove(recv)
            if not held:
                del self._held[key]
        self._run(recv)

    def confirm(self, live: Iterable[Receiving], address: str, which, room: int | None = None) -> None:
        """Every request of ``address`` (of ``room`` only, if given) among ``live`` and the held
        ones for which ``which(recv)`` holds is fenced."""
        found = list(live)
        for (a, r), held in self._held.items():
            if a == address and (room is None or r == room):
                found += held
        for recv in found:
            if which(recv):
                self.acked(recv)

    def earlier(self, address: str, epoch: int) -> list[Receiving]:
        """The held requests sent to ``address`` under a registration before ``epoch`` (its
        process then, or one before it, which gave up that address): asked again after it."""
        return [
            recv
            for (a, _), held in self._held.items()
            if a == address
            for recv in held
            if recv.sent_to is not None and recv.sent_to[1] < epoch and not recv.acked
        ]

    def holds(self, address: str) -> bool:
        return any(a == address for a, _ in self._held)

    def count(self) -> int:
        return sum(len(v) for v in self._held.values())

    def _run(self, recv: Receiving) -> None:
        callbacks, recv.fence_callbacks = recv.fence_callbacks, []
        for fn in callbacks:
            self._notify(recv.record.room, fn)

    def pages(self) -> int:
        """The destination pages (main KV) of the held requests: quarantined until fenced."""
        return sum(len(r.request.dst_kv_pages) for held in self._held.values() for r in held if r.request is not None)

    # --- a prefill killed for good ------------------------------------------------------------

    def session_closed(self, address: str, incarnation: str, now: float) -> None:
        """A completed control session with ``incarnation`` at ``address`` closed at ``now``: its
        horizon starts (the first close counts; a later one does not push it back)."""
        if self._closed.get(address, ("", 0.0))[0] != incarnation:
            self._closed[address] = (incarnation, now)

    def session_up(self, address: str) -> None:
        """A session with ``address`` completed: whoever holds it is alive; no horizon runs."""
        self._closed.pop(address, None)

    def stalled(self, seconds: float) -> None:
        """This process did not run for ``seconds`` (frozen, swapped out): the horizons move by
        as much (bytes its own kernel buffered meanwhile are copied in once it runs again)."""
        self._closed = {a: (inc, at + seconds) for a, (inc, at) in self._closed.items()}

    def past_horizon(self, now: float, horizon_s: float) -> list[tuple[str, str]]:
        """``(address, incarnation)`` of each closed session older than ``horizon_s``, once: the
        requests sent to that incarnation are fenced (the caller confirms them)."""
        due = [(a, inc) for a, (inc, at) in self._closed.items() if now - at >= horizon_s]
        for a, _ in due:
            del self._closed[a]
        return due
