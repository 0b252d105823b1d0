"""``PdStateKVSender``: one request on a prefill rank, over the rank's ``PrefillAgent``.

SGLang's order: the sender is made when the request reaches the prefill (``Bootstrapping``); it
is ``WaitingForInput`` once the decode said where the request lands (the agent holds that request
until the sender exists: ``PrefillAgent.requested``); then ``init(num_pages, aux_index)`` makes
the agent's sender, ``send(pages, state_indices | None)`` goes once per chunk (state with the last
only), and ``poll()`` follows the agent's sender to ``Success`` (every chunk landed and the
decode's digest of the landed bytes matched) or ``Failed``.

A decode that refused this prefill's layout gives the room up: ``poll()`` is ``Failed`` at once,
``failure_exception()`` raises the refusal (upstream's class and text), and nothing was written.
The constructor is the running SGLang's: 0.5.19's prefill passes ``dest_tp_ranks`` and
``pp_rank`` positionally; 0.5.23's calls with keywords only (``mgr``, ``bootstrap_addr``,
``bootstrap_room``, ``req_has_disagg_prefill_dp_rank``). Whichever its ``CommonKVSender`` takes is
the one this class defines.

A decode that holds the request's prefix already (SGLang 0.5.23's decode radix cache:
``decode_prefix_len``) names only the pages past it, and its SWA window from there: the prefill's
scheduler still sends every page from the first (this backend's ``pop_decode_prefix_len`` is 0),
and the sender moves only what the decode named, the leading pages and SWA window pages dropped
(positionally the same as SGLang's own prefix-aware send); rings, request state and request rows
go whole. The digest covers what moved.

A prefill rank the decode does not take from (``is_dummy`` on the decode side: a wider prefill
attention TP) gets a request naming no pages; it moves nothing and completes with the others.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time

import numpy as np

from pdstate.errors import PdStateError, TransferFailed
from pdstate.integrations.sglang.states import conclude, conclude_failed, concluded, failure_exception, kv_poll

log = logging.getLogger("pdstate.integrations.sglang")

__all__ = ["build_sender"]

ABORT_FENCE_S = 5.0


def _state_lists(state_indices, n: int):
    if state_indices is None:
        return None
    if len(state_indices) != n:
        raise ValueError(f"state_indices: {len(state_indices)} lists for {n} state components")
    return [
        np.empty(0, dtype=np.int64) if s is None else np.asarray(s, dtype=np.int64).reshape(-1) for s in state_indices
    ]


def _past_prefix(states: list, wanted: list[int], state_types) -> list:
    """A request's state lists as a decode holding its prefix takes them: the SWA window's pages
    past the prefix (the decode's window starts there: the last ``wanted`` of the prefill's window,
    positionally), every other component whole (rings, request state, request rows)."""
    out = []
    for lst, n, st in zip(states, wanted, state_types):
        if str(getattr(st, "value", st)) == "swa" and 0 <= n < lst.size:
            lst = lst[lst.size - n :]
        out.append(lst)
    return out


@functools.cache
def build_sender() -> type:
    """``PdStateKVSender`` (SGLang imported here, on first install)."""
    from sglang.srt.disaggregation.base.conn import KVPoll, KVTransferMetric
    from sglang.srt.disaggregation.common.conn import CommonKVSender

    # The running SGLang's own constructor decides which contract the prefill calls.
    TAKES_DEST_RANKS = "dest_tp_ranks" in inspect.signature(CommonKVSender.__init__).parameters

    class PdStateKVSender(CommonKVSender):
        def _pdstate_init(self, base_args: tuple, base_kwargs: dict) -> None:
            self._agent_send = None
            self._inited = False
            self._queued: list = []  # chunks sent before the decode's request arrived
            self._dummy = False
            self._dummy_done = False
            self._skip_pages = 0  # the decode holds this request's first pages (its prefix): not sent
            self._state_lens: list[int] | None = None  # what the decode names per state component
            self.pdstate_error: BaseException | None = None
            CommonKVSender.__init__(self, *base_args, **base_kwargs)
            self.init_time = time.time()

        if TAKES_DEST_RANKS:  # SGLang 0.5.19: the prefill passes dest_tp_ranks and pp_rank

            def __init__(
                self, mgr, bootstrap_addr, bootstrap_room, dest_tp_ranks, pp_rank, req_has_disagg_prefill_dp_rank=False
            ):
                args = (mgr, bootstrap_addr, bootstrap_room, dest_tp_ranks, pp_rank, req_has_disagg_prefill_dp_rank)
                self._pdstate_init(args, {})

        else:  # SGLang 0.5.23: keywords only, no dest_tp_ranks / pp_rank

            def __init__(self, mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank=False):
                kwargs = dict(
                    mgr=mgr,
                    bootstrap_addr=bootstrap_addr,
                    bootstrap_room=bootstrap_room,
                    req_has_disagg_prefill_dp_rank=req_has_disagg_prefill_dp_rank,
                )
                self._pdstate_init((), kwargs)

        @property
        def agent(self):
            return self.kv_mgr.agent

        def pdstate_fail(self, error: BaseException, reason: str | None = None) -> int:
            if self.pdstate_error is None:
                self.pdstate_error = error
            return conclude_failed(self, reason or f"{type(error).__name__}: {error}")

        def init(self, num_kv_indices: int, aux_index=None):
            super().init(num_kv_indices, aux_index)
            self._inited = True
            if self.conclude_state is None:
                self._make_agent_sender()

        def _make_agent_sender(self) -> None:
            """Made once the decode's request is here (SGLang calls ``init`` after that; a caller
            that calls it before gets its sender then), so a dummy rank is known: the decode named
            no pages for a request that has some."""
            room = self.bootstrap_room
            pages = self.agent.pending_pages(room)
            if pages is None:
                return
            try:
                if self.num_kv_indices > 0 and pages == 0:
                    self._dummy = True  # the decode takes this room from another prefill rank
                    self._agent_send = self.agent.sender(room, 0, None)
                else:
                    if 0 < pages < self.num_kv_indices:  # a prefix hit on the decode (decode_prefix_len)
                        self._skip_pages = self.num_kv_indices - pages
                        self._state_lens = self.agent.pending_state_lengths(room)
                    self._agent_send = self.agent.sender(room, self.num_kv_indices - self._skip_pages, self.aux_index)
                for chunk in self._queued:
                    self._send_chunk(*chunk)
            except (PdStateError, ValueError) as exc:
                self.pdstate_fail(exc)
            self._queued.clear()

        def send(self, kv_indices, state_indices=None, num_kv_tokens=None):
            pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
            self.curr_idx += pages.size
            last = self.curr_idx >= self.num_kv_indices
            self._record_transfer_indices(pages, state_indices if last else None)
            if self.conclude_state is not None:
                return
            if self._agent_send is None:
                self._queued.append((pages, state_indices, last))
                return
            try:
                self._send_chunk(pages, state_indices, last)
            except (PdStateError, ValueError) as exc:
                self.pdstate_fail(exc)

        def _send_chunk(self, pages, state_indices, last: bool) -> None:
            if self._dummy:
                if last and not self._dummy_done:
                    self._dummy_done = True
                    self._agent_send.send([], None)
                return
            state_types = self.kv_mgr.kv_args.state_types
            states = _state_lists(state_indices, len(state_types)) if last else None
            if self._skip_pages:
                skip = min(self._skip_pages, pages.size)
                pages, self._skip_pages = pages[skip:], self._skip_pages - skip
            if states is not None and self._state_lens is not None:
                states = _past_prefix(states, self._state_lens, state_types)
            self._agent_send.send(pages, states)

        def poll(self) -> int:
            over = concluded(self)
            if over is not None:
                return over
            status = self.kv_mgr.request_status.get(self.bootstrap_room)
            if status == KVPoll.Failed:  # SGLang's own checks (DP routing conflict, ...)
                self.conclude_state = KVPoll.Failed
                return KVPoll.Failed
            if self._agent_send is None:
                refusal = self.agent.refusal(self.bootstrap_room)
                if refusal is not None:
                    return self.pdstate_fail(refusal)
                if self.agent.requested(self.bootstrap_room):
                    if not self._inited:
                        return KVPoll.WaitingForInput
                    self._make_agent_sender()
                    if self.conclude_state is not None:
                        return self.conclude_state
                else:
                    timed_out = self._check_bootstrap_timeout()
                    if timed_out is not None:
                        self.conclude_state = timed_out
                        return timed_out
                    return KVPoll.Bootstrapping
            poll = kv_poll(self._agent_send.poll())
            if poll == KVPoll.Failed:
                err = self._agent_send.failure_exception() or TransferFailed("the pdstate sender failed")
                return self.pdstate_fail(err)
            return conclude(self, poll)

        def failure_exception(self):
            failure_exception(self)

        def get_transfer_metric(self) -> KVTransferMetric:
            metric = super().get_transfer_metric()
            if self._agent_send is not None:
                m = self._agent_send.metrics
                metric.transfer_latency_s = m.get("transfer_s")
                if "bytes" in m:
                    metric.transfer_total_bytes = int(m["bytes"])
            return metric

        def abort(self):
            """Fail the request; returns once nothing of it can land any more (the agent's fence)."""
            if self._agent_send is not None and not self._agent_send.poll().terminal:
                try:
                    self._agent_send.abort("Aborted by AbortReq.", timeout_s=ABORT_FENCE_S)
                except Exception as exc:  # the fence could not be confirmed: say so, still fail the request
                    log.error("pdstate: room %s: abort not fenced: %s", self.bootstrap_room, exc)
            super().abort()

    PdStateKVSender.__qualname__ = "PdStateKVSender"
    return PdStateKVSender
