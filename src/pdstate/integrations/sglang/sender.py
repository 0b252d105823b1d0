"""``PdStateKVSender``: one request on a prefill rank, over the rank's ``PrefillAgent``.

SGLang's order: the sender is made when the request reaches the prefill (``Bootstrapping``); it
is ``WaitingForInput`` once the decode said where the request lands (the agent holds that request
until the sender exists: ``PrefillAgent.requested``); then ``init(num_pages, aux_index)`` makes
the agent's sender, ``send(pages, state_indices | None)`` goes once per chunk (state with the last
only), and ``poll()`` follows the agent's sender to ``Success`` (every chunk landed and the
decode's digest of the landed bytes matched) or ``Failed``.

``init`` and ``send`` post (as SGLang's own Mooncake sender does): ``init`` hands the making of
the agent sender to the agent's thread (``PrefillAgent.post``; it makes it there with
``PrefillAgent.sender(..., posted=True)``), and each chunk follows it there (``KVSender.post``),
without waiting for it, in the order of the calls; a chunk sent before the thread made the agent
sender reads ``Transferring`` all the same. What that thread refuses
(a chunk past the pages declared, a room with a live sender) fails the request at the next
``poll()``, ``failure_exception()`` raising that error (``states.posted_failure``); until the
thread took the sender, ``poll()`` says ``WaitingForInput``. ``abort()`` waits for the agent's
fence, which comes after every chunk posted before it.

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

A decode attention TP ``N`` times the prefill's: the ``N`` decode ranks SGLang maps to this rank
each ask under a room of their own (``replicas``); the sender waits for all of them, then sends
every chunk to each, and succeeds once every one of them verified its copy.

A prefill rank the decode does not take from (``is_dummy`` on the decode side: a wider prefill
attention TP) gets a request naming no pages; it moves nothing and completes with the others.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time

import numpy as np

from pdstate.errors import AgentClosed, PdStateError, TransferFailed
from pdstate.integrations.sglang import states as lifecycle
from pdstate.integrations.sglang.posted_step import PostedStep
from pdstate.integrations.sglang.replicas import MAX_REPLICAS, asked_rooms, refused_room, replica_room
from pdstate.integrations.sglang.states import AGENT_CHECK_POLLS
from pdstate.protocol.lifecycle import RequestState

log = logging.getLogger("pdstate.integrations.sglang")

__all__ = ["build_sender"]

ABORT_FENCE_S = 5.0
_TRANSFERRING, _WAITING = RequestState.TRANSFERRING, RequestState.WAITING_FOR_INPUT
_BOOTSTRAPPING, _SUCCESS = RequestState.BOOTSTRAPPING, RequestState.SUCCESS
# what turns SGLang's room into the first replica's room of each count (``replicas``): the rooms a
# decode rank may ask for SGLang's room under, looked for in one pass (``_agent_rooms``)
# (and 0: SGLang's room itself)
_AGENT_MASKS = (0, *(replica_room(0, 0, count) for count in range(2, MAX_REPLICAS + 1)))


def _past_prefix(states: list, wanted: list[int], state_types) -> list:
    """A request's state lists as a decode holding its prefix takes them: the SWA window's pages
    past the prefix (the decode's window starts there: the last ``wanted`` of the prefill's window,
    positionally), every other component whole (rings, request state, request rows)."""
    out = []
    for lst, n, st in zip(states, wanted, state_types):
        if lifecycle.is_swa(st) and 0 <= n < lst.size:
            lst = lst[lst.size - n :]
        out.append(lst)
    return out


class _Out:
    """One decode rank's copy of a request: the agent's sender under that rank's room, the leading
    pages its decode holds already (its prefix), and whether it is a dummy (named no pages)."""

    def __init__(self, send, dummy: bool = False, skip_pages: int = 0, state_lens: list[int] | None = None):
        self.send, self.dummy, self.dummy_done = send, dummy, False
        self.skip_pages, self.state_lens = skip_pages, state_lens

    @classmethod
    def made(cls, agent, room: int, num_pages: int, aux_index) -> _Out:
        pages = agent.pending_pages(room)
        pages = num_pages if pages is None else pages
        if num_pages > 0 and pages == 0:  # the decode takes this room from another prefill rank
            return cls(agent.sender(room, 0, None, posted=True), dummy=True)
        skip, lens = 0, None
        if 0 < pages < num_pages:  # a prefix hit on the decode (decode_prefix_len)
            skip, lens = num_pages - pages, agent.pending_state_lengths(room)
        return cls(agent.sender(room, num_pages - skip, aux_index, posted=True), skip_pages=skip, state_lens=lens)

    def send_chunk(self, pages: np.ndarray, states, last: bool, state_types) -> None:
        if self.dummy:
            if last and not self.dummy_done:
                self.dummy_done = True
                self.send.post([], None)
            return
        if self.skip_pages:
            skip = min(self.skip_pages, pages.size)
            pages, self.skip_pages = pages[skip:], self.skip_pages - skip
        if states is not None and self.state_lens is not None:
            states = _past_prefix(states, self.state_lens, state_types)
        self.send.post(pages, states)


@functools.cache
def build_sender() -> type:
    """``PdStateKVSender`` (SGLang imported here, on first install)."""
    from sglang.srt.disaggregation.base.conn import KVPoll, KVTransferMetric
    from sglang.srt.disaggregation.common.conn import CommonKVSender

    FAILED, WAITING, TRANSFERRING = KVPoll.Failed, KVPoll.WaitingForInput, KVPoll.Transferring
    # The running SGLang's own constructor decides which contract the prefill calls.
    TAKES_DEST_RANKS = "dest_tp_ranks" in inspect.signature(CommonKVSender.__init__).parameters

    class PdStateKVSender(CommonKVSender):
        def _pdstate_init(self, base_args: tuple, base_kwargs: dict) -> None:
            self._outs: list[_Out] = []  # one per decode rank fed (several: a wider decode attention TP)
            self._inited = False
            self._queued: list = []  # chunks sent before the decode's request arrived
            self.pdstate_error: BaseException | None = None
            # the poll's status words: the agent's ``arrivals`` at the last look for this room's
            # requests and refusals, and what it found; one decode rank's agent sender (its poll)
            self._arrivals_seen: int | None = None
            self._asked: list[int] | None = None
            self._word = None
            self._one = None  # that agent sender (its ``posted_error``)
            self._polls = 0
            self._rooms: frozenset[int] | None = None  # ``_agent_rooms``
            # ``init`` once the decode's request is here: the agent senders are made on the agent's
            # I/O thread (``_step``: ``_made``), not on SGLang's scheduler thread. While that is
            # under way (``_step.running``) the chunks sent go there after it, in order; the step
            # writes ``_outs``, ``_one`` and ``_word``; ``abort`` waits for it
            self._step = PostedStep()
            # a chunk sent while they were made (Transferring to SGLang from then on; the later
            # chunks go through the agent's thread too: ``send``)
            self._sent = False
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
                if not self._outs:  # no agent request to count it when it ends (``rank_status``)
                    self.kv_mgr.counters.failed(error)
            return lifecycle.conclude_failed(self, reason or f"{type(error).__name__}: {error}")

        def init(self, num_kv_indices: int, aux_index=None):
            super().init(num_kv_indices, aux_index)
            self._inited = True
            if self.conclude_state is not None:
                return
            if self._asked is None:  # before the decode's request: made by the poll that finds it
                self._make_agent_sender()
                return
            # SGLang's order (``init`` once the poll said WaitingForInput): the agent senders are
            # made on the agent's thread; this thread only hands the step over
            try:
                self._step.post(self.agent, self._made)
            except AgentClosed as exc:
                self.pdstate_fail(exc)

        def _made(self) -> BaseException | None:
            """The step on the agent's I/O thread (``_step``): ``_make_outs``."""
            error = self._make_outs()
            if error is not None:
                self._word = None  # the next poll looks further, and fails the request
            return error

        def _make_agent_sender(self) -> None:
            """On SGLang's scheduler thread: ``_make_outs`` (a caller that calls ``init`` before the
            decode's request arrived gets its senders so, from the poll that finds it)."""
            error = self._make_outs()
            if error is not None:
                self.pdstate_fail(error)

        def _make_outs(self) -> BaseException | None:
            """The agent senders, made once every decode rank's request is here (so a dummy rank
            is known: the decode named no pages for a request that has some), and the chunks
            sent before fed to them; none when no request waits (any more). Returns what refused
            them (the request fails with it), else ``None``."""
            rooms = asked_rooms(self.agent, self.bootstrap_room)
            if rooms is None:
                return None
            error = None
            try:
                for room in rooms:
                    out = _Out.made(self.agent, room, self.num_kv_indices, self.aux_index)
                    self._outs.append(out)
                    if not out.dummy:
                        self.kv_mgr.counters.watch(out.send, f"decode of room {room}")
                if len(self._outs) == 1 and not self._outs[0].dummy:
                    self._one = self._outs[0].send
                    self._word = self._one.record
                for chunk in self._queued:
                    self._send_chunk(*chunk)
            except (PdStateError, ValueError) as exc:
                error = exc
            self._queued.clear()
            return error

        def send(self, kv_indices, state_indices=None, num_kv_tokens=None):
            pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
            self.curr_idx += pages.size
            last = self.curr_idx >= self.num_kv_indices
            self._record_transfer_indices(pages, state_indices if last else None)
            if self.conclude_state is not None:
                return
            # the agent's thread makes the agent senders: the chunk goes there after; and once a
            # chunk went that way (``_sent``), every later one follows it there, in order (sent from
            # here it could reach the agent sender before the one the agent's thread still holds)
            if self._step.running or self._sent:
                try:  # the state lists checked here (a malformed one concludes the request at once)
                    states = self._states(state_indices, last)
                    self.agent.post(lambda: self._posted_chunk(pages, states, last))
                    self._sent = True
                except (AgentClosed, ValueError) as exc:
                    self.pdstate_fail(exc)
                return
            if not self._outs:
                self._queued.append((pages, state_indices, last))
                return
            try:
                self._send_chunk(pages, state_indices, last)
            except (PdStateError, ValueError) as exc:
                self.pdstate_fail(exc)

        def _posted_chunk(self, pages, states, last: bool) -> None:
            """On the agent's I/O thread, after ``_made``: a chunk ``send`` handed over (its state
            lists checked: ``_states``)."""
            step = self._step
            if step.error is not None:
                return
            if not self._outs:  # no request waits any more: kept for the senders made later
                self._queued.append((pages, states, last))
                return
            try:
                self._feed(pages, states, last)
            except (PdStateError, ValueError) as exc:
                step.error = exc
                self._word = None  # the next poll looks further, and fails the request

        def _states(self, state_indices, last: bool):
            """The last chunk's state lists (``states.state_lists``: raises ``ValueError`` on a
            malformed one), else ``None``."""
            if not last or state_indices is None:
                return None
            return lifecycle.state_lists(state_indices, self.kv_mgr.kv_args.state_types)

        def _send_chunk(self, pages, state_indices, last: bool) -> None:
            self._feed(pages, self._states(state_indices, last), last)

        def _feed(self, pages, states, last: bool) -> None:
            state_types = self.kv_mgr.kv_args.state_types
            for out in self._outs:
                out.send_chunk(pages, states, last, state_types)

        def poll(self) -> int:
            """SGLang's scheduler calls this for every request in flight on every iteration: the
            common answers (still transferring, still awaited, and the Success that ends it) read
            one status word; SGLang's own
            verdict on the room comes first, and the agent is asked whether it lives every
            ``AGENT_CHECK_POLLS``-th poll (then, dead, ``_poll`` fails the request)."""
            over = self.conclude_state
            if over is not None:
                return over
            self._polls += 1
            if not self._polls % AGENT_CHECK_POLLS and self.kv_mgr.agent_failure() is not None:
                return self._poll()
            if self.kv_mgr.request_status.get(self.bootstrap_room) != FAILED:
                word = self._word  # one decode rank fed: its agent sender's state, moved by the agent's thread
                if word is not None and self._one.posted_error is None:
                    state = word.state  # the agent's own state: Transferring and Success read as they are
                    if state is _TRANSFERRING:
                        return TRANSFERRING
                    if state is _SUCCESS:  # the agent's verdict: concluded here, nothing else to look at
                        return lifecycle.succeed(self)
                    state = self._one.poll()  # as the posted chunks show it
                    if state is _TRANSFERRING:
                        return TRANSFERRING
                    if state is _WAITING or state is _BOOTSTRAPPING:  # bootstrapping: its posted add is on its way
                        # (a posted chunk reads Transferring: ``KVSender.post``; one sent while the
                        # agent sender was made, before its thread hands it on: ``_sent``)
                        return TRANSFERRING if self._sent else WAITING
                    if state is _SUCCESS:  # the agent's verdict: concluded here, nothing else to look at
                        return lifecycle.succeed(self)
                elif word is None:
                    steady = self._awaited()
                    if steady is not None:
                        return steady
            return self._poll()

        def _awaited(self) -> int | None:
            """The answer of a poll with no agent sender yet (or one being made: ``_step.running``)
            that finds nothing new (nothing arrived at the agent since the last look:
            ``arrivals``), else ``None`` (``_poll`` looks further)."""
            if self._step.running:  # the agent's thread makes its senders; every so often ``_poll`` looks
                if not self._polls % AGENT_CHECK_POLLS:
                    return None
                return KVPoll.Transferring if self._sent else KVPoll.WaitingForInput
            if self._outs or self.agent.arrivals != self._arrivals_seen:
                return None
            if self._asked is not None:
                return None if self._inited else KVPoll.WaitingForInput
            timed_out = self._check_bootstrap_timeout()  # SGLang's check and text
            if timed_out is not None:
                self.conclude_state = timed_out
                return timed_out
            return KVPoll.Bootstrapping

        def _while_building(self) -> int:
            """WaitingForInput while the agent's thread makes the agent senders (Transferring once a
            chunk was sent); Failed (``AgentClosed``) when the agent closed before it ran that step
            (it never will)."""
            if not self.agent.closed:
                return KVPoll.Transferring if self._sent else KVPoll.WaitingForInput
            if not self._step.give_up():  # it ran meanwhile
                return self._poll()
            return self.pdstate_fail(
                AgentClosed(f"room {self.bootstrap_room}: the agent closed before it made this request's sender")
            )

        def _agent_rooms(self) -> frozenset[int]:
            """The agents' rooms a decode rank may ask for this request under: SGLang's room, and
            each count's first replica (``asked_rooms`` and ``refused_room`` look further)."""
            rooms = self._rooms
            if rooms is None:  # built in C: once per request, on SGLang's scheduler thread
                rooms = self._rooms = frozenset(map(self.bootstrap_room.__xor__, _AGENT_MASKS))
            return rooms

        def _refusal(self, agent):
            """The refusal a decode gave this request's room up with (``refused_room``), else
            ``None``; nothing given up on the agent (its usual state): one look, no room set built."""
            if not agent.refusals_held or not agent.refused_any(self._agent_rooms()):
                return None
            return refused_room(agent, self.bootstrap_room)

        def _asked_rooms(self, agent) -> list[int] | None:
            """``asked_rooms``: SGLang's room asked for itself (one decode rank: the usual case) is
            one dictionary look; only a request not there yet looks for the replicas' rooms."""
            room = self.bootstrap_room
            if agent.requested(room):
                return [room]
            if not agent.waiting:  # no request waits at all: no replica's either (no room set built)
                return None
            return asked_rooms(agent, room) if agent.requested_any(self._agent_rooms()) else None

        def _poll(self) -> int:
            over = lifecycle.concluded(self)
            if over is not None:
                return over
            status = self.kv_mgr.request_status.get(self.bootstrap_room)
            if status == KVPoll.Failed:  # SGLang's own checks (DP routing conflict, ...)
                self.conclude_state = KVPoll.Failed
                return KVPoll.Failed
            step = self._step
            if step.running:
                return self._while_building()
            if step.error is not None:  # what refused the agent senders on the agent's thread
                return self.pdstate_fail(step.error)
            if not self._outs:
                agent = self.agent
                arrivals = agent.arrivals  # read first: what arrives during the look is looked at next time
                if arrivals != self._arrivals_seen:
                    refusal = self._refusal(agent)
                    if refusal is not None:
                        return self.pdstate_fail(refusal)
                    self._asked = self._asked_rooms(agent)
                    self._arrivals_seen = arrivals
                if self._asked is not None:
                    if not self._inited:
                        return KVPoll.WaitingForInput
                    self._make_agent_sender()
                    if self.conclude_state is not None:
                        return self.conclude_state
                    if not self._outs:  # its request went away meanwhile (its decode gone): awaited again
                        self._asked = self._arrivals_seen = None
                        return KVPoll.Bootstrapping
                else:
                    timed_out = self._check_bootstrap_timeout()
                    if timed_out is not None:
                        self.conclude_state = timed_out
                        return timed_out
                    return KVPoll.Bootstrapping
            posted = lifecycle.posted_failure(out.send for out in self._outs)
            if posted is not None:  # what a posted init or send raised on the agent's thread
                return self.pdstate_fail(posted)
            # made once its decode's request was here: an agent sender still bootstrapping is one the
            # agent's thread has not added yet (``init`` posted it), WaitingForInput to SGLang (one
            # with a chunk posted reads Transferring already: ``KVSender.post``)
            early = _TRANSFERRING if self._sent else _WAITING  # (``_sent``: a chunk on its way to them)
            states = [
                early if s is _BOOTSTRAPPING or s is _WAITING else s for s in (out.send.poll() for out in self._outs)
            ]
            poll = lifecycle.combine(states)
            if poll == KVPoll.Failed:
                failed = next(out for out, s in zip(self._outs, states) if lifecycle.kv_poll(s) == KVPoll.Failed)
                err = failed.send.failure_exception() or TransferFailed("the pdstate sender failed")
                return self.pdstate_fail(err)
            return lifecycle.conclude(self, poll)

        def failure_exception(self):
            lifecycle.failure_exception(self)

        def pdstate_metrics(self) -> list[dict]:
            """The agent senders' metrics (stage times: ``trace``), one per decode rank fed."""
            return [out.send.metrics for out in self._outs if not out.dummy]

        def get_transfer_metric(self) -> KVTransferMetric:
            metric = super().get_transfer_metric()
            metrics = [out.send.metrics for out in self._outs]
            if metrics:
                latencies = [m["transfer_s"] for m in metrics if m.get("transfer_s") is not None]
                metric.transfer_latency_s = max(latencies) if latencies else None
                if all("bytes" in m for m in metrics):
                    metric.transfer_total_bytes = sum(int(m["bytes"]) for m in metrics)
            return metric

        def abort(self):
            """Fail the request; returns once nothing of it can land any more (the agent's fence).
            Agent senders still being made on the agent's thread are waited for first."""
            if not self._step.wait(ABORT_FENCE_S):  # not run yet (the agent's thread stuck or gone): never made now
                log.error("pdstate: room %s: abort: the agent did not make its sender in time", self.bootstrap_room)
            for out in list(self._outs):
                if out.send.poll().terminal:
                    continue
                try:
                    out.send.abort("Aborted by AbortReq.", timeout_s=ABORT_FENCE_S)
                except Exception as exc:  # the fence could not be confirmed: say so, still fail the request
                    log.error("pdstate: room %s: abort not fenced: %s", self.bootstrap_room, exc)
            super().abort()

    PdStateKVSender.__qualname__ = "PdStateKVSender"
    return PdStateKVSender
