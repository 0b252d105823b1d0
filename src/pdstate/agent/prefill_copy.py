"""The prefill's copy pipeline (``CopyPipeline``, owned by ``agent.prefill_core.PrefillCore``): a
sender's chunks queued, planned and submitted to the engine once the decode's request is known,
the ``TransferDone`` once every chunk landed, a failure handed to its fence (``agent.fence``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from pdstate.agent.digest import submit_digested
from pdstate.agent.fence import Fences
from pdstate.agent.sender import DecodePeer, Sending, with_aux
from pdstate.agent.verify import wire_form
from pdstate.errors import (
    EngineError,
    IndexCountMismatch,
    ItemLengthMismatch,
    PdStateError,
    PeerGone,
    ProtocolError,
)
from pdstate.protocol import wire
from pdstate.protocol.lifecycle import RequestState

__all__ = ["CopyPipeline"]


def _moves_nothing(decode: DecodePeer, pages: np.ndarray, state, req: wire.AgentRequest, aux: bool) -> bool:
    """Whether a chunk has nothing to move and nothing the planner would refuse: no pages, no aux,
    no state on either side (a last chunk), and a pair whose channels plan without error."""
    if pages.size or aux or decode.planner.channel_error is not None:
        return False
    if state is not None:  # loops, not ``any`` over generators: this runs for every empty request
        for s in state:
            if s.size:
                return False
        for d in req.dst_state_indices:
            if d.data:
                return False
    return True


class CopyPipeline:
    """The copy pipeline of one prefill core, over what the core hands it: the caller's
    ``kv_args``, the engine port (``submit``, ``poll``), its decodes (``identity -> DecodePeer``),
    its ``Fences``, ``reply(identity, msg)``, ``watch(send) -> bool`` and ``again(key, send)``
    (see ``Fences``), ``clock()`` (the time of the input being handled, for deadlines) and
    ``stopwatch()`` (the time now, for the copy's own duration in the metrics). Run on the
    agent's I/O thread."""

    def __init__(
        self,
        kv_args: Any,
        engine: Any,
        decodes: Mapping[bytes, DecodePeer],
        fences: Fences,
        reply: Callable[[bytes, wire.Message], None],
        watch: Callable[[Sending], bool],
        again: Callable[[object, Sending], None],
        clock: Callable[[], float],
        stopwatch: Callable[[], float],
        landed_piece_bytes: int = 0,
    ) -> None:
        self.kv_args, self.engine, self.decodes, self.fences = kv_args, engine, decodes, fences
        self.reply, self.watch, self.again, self.clock, self.stopwatch = reply, watch, again, clock, stopwatch
        self.landed_piece_bytes = landed_piece_bytes

    def queue_chunk(self, send: Sending, pages: np.ndarray, state: list[np.ndarray] | None) -> None:
        if send.fence is not None:  # failing, its fence pending
            raise send.fence.error
        if send.record.state.terminal:
            raise send.record.error or ProtocolError(f"room {send.record.room} is finished")
        queued = sum(p.size for p, _ in send.queued)
        total = send.pages_sent + queued + pages.size
        if total > send.num_pages:
            raise ValueError(
                f"room {send.record.room}: chunk of {pages.size} pages brings the request to {total} "
                f"pages, more than the {send.num_pages} declared"
            )
        last = total == send.num_pages
        if state is not None and not last:
            raise ValueError(f"room {send.record.room}: state indices go with the last chunk only")
        if last and state is None:
            state = [np.empty(0, dtype=np.int64) for _ in self.kv_args.state_types]
        send.queued.append((pages, state))  # the shell pumps it after send() returned: no wait for the copy

    def pump(self, send: Sending) -> None:
        """Submit queued chunks once the decode's request is known; finish when all landed."""
        if send.request is None or send.record.state.terminal or send.fence is not None:
            return
        decode = self.decodes.get(send.identity)
        if decode is None:
            self.fences.fail(send, PeerGone("decode is no longer registered"), tell_decode=False)
            return
        while send.queued:
            pages, state = send.queued.pop(0)
            if send.record.state is RequestState.WAITING_FOR_INPUT:
                send.record.move(RequestState.TRANSFERRING)
                send.started = self.stopwatch()
            try:
                self._submit_chunk(send, decode, pages, state)
            except (PdStateError, ValueError) as exc:
                self.fences.fail(send, exc if isinstance(exc, PdStateError) else ItemLengthMismatch(str(exc)), True)
                return
        if send.pages_sent == send.num_pages and send.all_submitted and not send.done_sent:
            self.finish_if_landed(send)
        elif send.marks:  # a digest request's chunk still copying: tell the decode once it landed
            self.watch(send)

    def _submit_chunk(self, send: Sending, decode: DecodePeer, pages: np.ndarray, state) -> None:
        req = send.request
        n_comp = len(self.kv_args.state_types)
        if state is not None and (len(state) != n_comp or len(req.dst_state_indices) != n_comp):
            raise IndexCountMismatch(
                f"state index lists: prefill sent {len(state)}, decode sent "
                f"{len(req.dst_state_indices)}, layout has {n_comp} components"
            )
        last = state is not None
        aux = last and req.dst_aux is not None
        if send.digest is None and _moves_nothing(decode, pages, state, req, aux):
            # no plan to make, no engine call, no index list to unpack (an empty request's whole cost)
            send.chunks += 1
            send.all_submitted = send.all_submitted or last
            return
        dst_pages = req.dst_kv_pages.unpack()[send.pages_sent : send.pages_sent + pages.size]
        none = [np.empty(0, dtype=np.int64)] * n_comp
        pieces = self._pieces(send, pages.size, state if last else None)
        dst_state = [p.unpack() for p in req.dst_state_indices] if last and pieces else none
        state_sent = False  # state goes with the last chunk only, in its first piece
        for k, (lo, hi, with_state) in enumerate(pieces):
            state_sent = state_sent or with_state
            src_lists = [pages[lo:hi], *(state if with_state else none)]
            dst_lists = [dst_pages[lo:hi], *(dst_state if with_state else none)]
            plan = decode.planner.plan(src_lists, dst_lists)
            if with_state and aux:
                plan = with_aux(plan, self.kv_args, req.dst_aux, send.aux_index)
            updates = [
                *enumerate(src_lists),
                *([(len(src_lists), np.array([send.aux_index]))] if with_state and aux else []),
            ]
            handle = None  # an empty plan moves nothing: no engine call
            if len(plan):
                handle = submit_digested(self.engine, decode.peer_id, plan, send.digest, updates)
                send.handles.append(handle)
            send.bytes += plan.total_bytes
            send.descriptors += len(plan)
            if send.digest is not None:
                send.marks.append((handle, send.pages_sent + hi, state_sent))
                if not (last and k == len(pieces) - 1) and (handle is None or self.engine.poll(handle)):
                    self._tell_landed(send)  # landed already (shm copies on submit): say so now
        send.pages_sent += pages.size
        send.chunks += 1
        if last:
            send.all_submitted = True

    def _pieces(self, send: Sending, n_pages: int, state) -> list[tuple[int, int, bool]]:
        """How one chunk is submitted: ``(first page, end page, with state and aux)`` per piece.
        One piece without a digest. With one, a last chunk's state and aux go first, in a piece
        of their own told to the decode once landed (``wire.Landed``: it hashes them while the
        main KV copies); with ``landed_piece_bytes`` set, a chunk over twice that goes in pieces
        of about that size, state and aux first, each told once landed."""
        whole = [(0, n_pages, state is not None)]
        piece = self.landed_piece_bytes
        if send.digest is None:
            return whole
        if piece <= 0:  # state first, told at once: the decode hashes it while the main KV copies
            if not send.digest.split_state:  # a sample small enough to hash at the end
                return whole
            return [(0, 0, True), (0, n_pages, False)] if n_pages and state is not None else whole
        page_bytes = sum(self.kv_args.kv_item_lens)
        if page_bytes == 0:
            return whole
        state_bytes = 0
        if state is not None:
            state_bytes = sum(len(s) * sum(i) for s, i in zip(state, self.kv_args.state_item_lens))
        if n_pages * page_bytes + state_bytes < 2 * piece:
            return whole
        k = max(1, round(n_pages * page_bytes / piece))
        cuts = [n_pages * j // k for j in range(k + 1)]
        main = [(lo, hi, False) for lo, hi in zip(cuts, cuts[1:]) if hi > lo]
        return ([(0, 0, True)] if state is not None else []) + main

    def _tell_landed(self, send: Sending) -> None:
        """Tell the decode how much of the request has landed (``wire.Landed``), if more than it
        was told and not all of it (``TransferDone`` says that)."""
        told = send.told
        try:
            while send.marks and (send.marks[0][0] is None or self.engine.poll(send.marks[0][0])):
                _, pages, state = send.marks.pop(0)
                told = (pages, state)
        except EngineError:
            return  # the request fails on its way to TransferDone
        if told == send.told or (send.all_submitted and not send.marks):
            send.told = told
            return
        send.told = told
        self.reply(send.identity, wire.Landed(room=send.record.room, pages=told[0], state_landed=told[1]))

    def finish_if_landed(self, send: Sending) -> None:
        if send.fence is not None:  # failing: what landed ends its fence instead
            self.fences.check(send)
            return
        if send.done_sent or send.record.state.terminal:
            return
        if send.marks:
            self._tell_landed(send)
        if not send.all_submitted:
            return
        try:
            if send.handles and not all(self.engine.poll(h) for h in send.handles):  # landing off this thread
                if not self.watch(send):
                    self.again(send, send)  # no wake-up: look again soon
                return
        except EngineError as exc:
            self.fences.fail(send, exc, tell_decode=True)
            return
        send.done_sent, send.done_at = True, self.clock()
        m = send.record.metrics
        m.update(bytes=send.bytes, descriptors=send.descriptors, chunks=send.chunks)
        if send.digest is not None:
            m["digest_wait_s"] = round(send.digest.wait(), 6)  # what the copy did not hide
            m["digest_s"], m["digest_fused"] = round(send.digest.seconds, 6), send.digest.fused  # fused: in the copy
            m["digest_form"] = getattr(send.digest, "form", "host")
        m["transfer_s"] = round(self.stopwatch() - send.started, 6)
        self.reply(
            send.identity,
            wire.transfer_done(
                send.record.room,
                "success",
                send.bytes,
                send.descriptors,
                send.digest.digest() if send.digest is not None else None,
                m["transfer_s"],
                wire_form(send.digest),
            ),
        )
