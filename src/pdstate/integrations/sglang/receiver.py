"""``PdStateKVReceiver``: one request on a decode rank, over the rank's ``DecodeAgent``.

SGLang's order: made when the request reaches the decode (``Bootstrapping``); ``init(prefill_dp_rank)``
resolves the prefill ranks of that DP group through SGLang's bootstrap server (SGLang's own code:
``rank_ip`` / ``rank_port`` per rank, the real one and, for a wider prefill attention TP, dummies)
and opens one agent receiver per rank (a decode attention TP wider than the prefill's: under a
room of this decode rank's own, ``replicas``; a PP prefill: each stage's through the agent of
that stage's slice of this rank's memory, ``stages``), whose first use connects and shakes hands: ``poll()`` is
``WaitingForInput`` once every one was accepted. ``send_metadata(pages, aux_index, state_indices,
decode_prefix_len)`` tells the real rank where everything lands (the dummies: nothing), and
``poll()`` follows the agent receivers to ``Success`` (digests equal) or ``Failed``. ``init`` and
``send_metadata`` post their agent work (``DecodeAgent.receiver(..., posted=True)``,
``KVReceiver.post_init``; from a prefill of one stage ``init`` hands even the making of the agent
receiver to the agent's thread, ``DecodeAgent.post``, and ``send_metadata`` follows it there) and
return; what the agent's thread refuses there fails the request at
the next ``poll()`` with that error (``states.posted_failure``). A receiver whose one prefill rank
had accepted this rank's agent by ``init`` (``DecodeAgent.accepted``) answers WaitingForInput from
then on, as its agent receiver will read once made: SGLang names its destination in the same
scheduler iteration, not the next.

The contract is the running SGLang's (0.5.19 or 0.5.23): ``init`` runs SGLang's own rank
mapping and ``/route`` lookups, but never its ZMQ registration (``_register_kv_args``, which
0.5.23's ``init`` calls): the agents shake hands instead. 0.5.23's ``send_metadata`` names a
destination; only device memory is taken.

A refused handshake (a layout factor differs) fails the request at once with the prefill's error
(upstream's class and text) before any byte moves; the agent tells that prefill, whose sender of
the room fails with the same error.

SGLang's request lifecycle, as its own receivers do it: its waiting timeout
(``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``, from ``send_metadata`` on) fails the request with its
text; an abort ("Aborted by AbortReq."), the timeout and 0.5.23's notification after any failure all
go through ``_send_abort_notification``, where the agent's abort fences the writes and, for 0.5.23's
deferred decode KV release, every prefill rank's acknowledgement is recorded the moment the fence
holds (the pages go back at the queue's next poll). ``failure_exception`` clears the room's status
and failure record as SGLang's does, so the room can be sent again (a retracted request's
rebootstrap). With ``decode_prefix_len`` (0.5.23's decode radix cache) SGLang names only the pages
past the prefix; the prefill's sender moves just those.
"""

from __future__ import annotations

import functools
import logging
import time

import numpy as np

from pdstate.errors import AgentClosed, PdStateError, TransferFailed
from pdstate.integrations.sglang import trace
from pdstate.integrations.sglang.posted_step import PostedStep
from pdstate.integrations.sglang.replicas import replica_index, replica_room
from pdstate.integrations.sglang.states import (
    AGENT_CHECK_POLLS,
    combine,
    conclude,
    conclude_failed,
    concluded,
    failure_exception,
    kv_poll,
    posted_failure,
    state_lists,
    succeed,
)
from pdstate.protocol.lifecycle import RequestState

log = logging.getLogger("pdstate.integrations.sglang")

__all__ = ["build_receiver"]

ABORT_FENCE_S = 5.0
# SGLang 0.5.19 (no deferred decode KV release) frees a request's pages at Failed: a request that
# failed while its prefill may still write them (the prefill gone silent) reports Failed only once
# that prefill confirmed, or after this long (logged: the pages are SGLang's again unfenced)
UNFENCED_FAILED_WAIT_S = 30.0
_BOOTSTRAPPING, _WAITING, _TRANSFERRING, _SUCCESS = (
    RequestState.BOOTSTRAPPING,
    RequestState.WAITING_FOR_INPUT,
    RequestState.TRANSFERRING,
    RequestState.SUCCESS,
)


@functools.cache
def build_receiver() -> type:
    """``PdStateKVReceiver`` (SGLang imported here, on first install)."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    SUCCESS, TRANSFERRING = KVPoll.Success, KVPoll.Transferring
    WAITING, BOOTSTRAPPING = KVPoll.WaitingForInput, KVPoll.Bootstrapping

    class PdStateKVReceiver(CommonKVReceiver):
        def __init__(self, mgr, bootstrap_addr, bootstrap_room=None):
            self._recvs: list[tuple[bool, object]] = []  # (is_dummy, agent receiver)
            self.pdstate_error: BaseException | None = None
            self._unfenced_since: float | None = None  # failed, a prefill may still write (0.5.19)
            self._unfenced_released = False  # held ``UNFENCED_FAILED_WAIT_S`` and given back unfenced
            self._aborted: set[int] = set()  # the agent receivers told to abort (``_fence``), by id
            self._word = None  # one agent receiver, not a dummy: its record (its state: the poll's status word)
            self._one = None  # that agent receiver (its ``posted_error``)
            self._polls = 0
            # ``init`` of a one-stage prefill: the agent receivers are made on the agent's I/O
            # thread (``_step``), not on SGLang's scheduler thread; while that is under way
            # (``_step.running``) ``send_metadata`` goes there after it. The step writes
            # ``_recvs``, ``_one`` and ``_word``; what reads ``_recvs`` off the poll waits for it
            # (``_built``)
            self._step = PostedStep()
            # the least the poll answers while the agent's side lags behind what it said: Bootstrapping;
            # WaitingForInput once ``init`` found its one prefill had accepted this rank's agent (its
            # agent receiver starts there: the poll answers so before the agent's thread made it, and
            # SGLang names the destination in the same iteration); Transferring once ``send_metadata``
            # posted the destination (on its way to the agent receiver)
            self._said = BOOTSTRAPPING
            # whether its trace is written when it succeeds (``trace.wanted``: read where its agent
            # receivers are made, off the scheduler thread for a one-stage prefill); True: asked then
            self._traced = True
            super().__init__(mgr, bootstrap_addr, bootstrap_room)

        def pdstate_fail(self, error: BaseException, reason: str | None = None) -> int:
            if self.pdstate_error is None:
                self.pdstate_error = error
                if not self._recvs:  # no agent request to count it when it ends (``rank_status``)
                    self.kv_mgr.counters.failed(error)
            return conclude_failed(self, reason or f"{type(error).__name__}: {error}")

        def init(self, prefill_dp_rank: int):
            reason = self.kv_mgr.topology_errors.get(self.bootstrap_addr)
            if reason is not None:
                self.pdstate_fail(TransferFailed(reason))
                return
            super().init(prefill_dp_rank)  # SGLang's rank mapping and /route lookups (not its registration)
            if self.conclude_state == KVPoll.Failed or not self.bootstrap_infos:
                return
            stages = int(getattr(getattr(self, "prefill_info", None), "pp_size", 1) or 1)  # a PP prefill: ``stages``
            if stages > 1:  # several stages' agents (threads): made here
                error = self._make_recvs(self._room(), stages)
                if error is not None:
                    self.pdstate_fail(error)
                return
            # one agent: its thread makes them (its room too); this thread only hands the step over
            agent = self.kv_mgr.agent
            try:
                self._step.post(agent, self._made)
            except AgentClosed as exc:
                self.pdstate_fail(exc)
                return
            one = self.kv_mgr.one_prefill(self.bootstrap_infos)  # one real prefill rank (the usual case)
            if one is not None and agent.accepted(one):
                self._said = WAITING

        def _room(self) -> int:
            """The room this rank's agent asks under: SGLang's, or, a decode attention TP wider
            than the prefill's, one of this rank's own (``replicas``)."""
            count = int(getattr(self, "required_dst_info_num", None) or 1)
            index = replica_index(self.kv_mgr.kv_args.engine_rank, self.kv_mgr.attn_tp_size, count)
            return replica_room(self.bootstrap_room, index, count)

        def _make_recvs(self, room: int, stages: int) -> BaseException | None:
            """An agent receiver per prefill rank resolved (its stage's agent), each counted;
            returns what refused one (the request fails with it), else ``None``."""
            try:
                for info in self.bootstrap_infos:
                    address = self.kv_mgr.agent_address(info)
                    agent = self.kv_mgr.agent_for(int(info.get("pp_rank", 0)), stages)
                    recv = agent.receiver(address, room, posted=True)
                    self._recvs.append((bool(info.get("is_dummy")), recv))
                    if not info.get("is_dummy"):
                        self.kv_mgr.counters.watch(recv, address)
            except (PdStateError, ValueError) as exc:
                return exc
            if len(self._recvs) == 1 and not self._recvs[0][0]:
                self._one = self._recvs[0][1]
                self._word = self._one.record
            return None

        def _made(self) -> BaseException | None:
            """The step on the agent's I/O thread (``_step``): its room and ``_make_recvs``, and
            whether the request is traced (``trace.wanted``, read here rather than at its Success)."""
            self._traced = trace.wanted(self)
            try:
                room = self._room()
            except ValueError as exc:
                return exc
            error = self._make_recvs(room, 1)
            if error is not None:
                self._word = None  # the next poll looks further, and fails the request
            return error

        def _built(self) -> None:
            """Wait for agent receivers being made on the agent's thread (an abort, a view of them):
            at most ``ABORT_FENCE_S``, then never made."""
            if not self._step.wait(ABORT_FENCE_S):  # not run yet (the agent's thread stuck or gone): never made now
                log.error("pdstate: room %s: the agent did not make its receiver in time", self.bootstrap_room)

        def _while_building(self) -> int:
            """What the poll answers while the agent's thread makes the agent receivers (as they
            would read: ``_said``); Failed
            (``AgentClosed``) when the agent closed before it ran that step (it never will)."""
            if not self.kv_mgr.agent.closed:
                return self._said
            if not self._step.give_up():  # it ran meanwhile
                return self._poll()
            return self.pdstate_fail(
                AgentClosed(f"room {self.bootstrap_room}: the agent closed before it made this request's receiver")
            )

        @property
        def agent_rooms(self) -> list[int]:
            """The rooms this rank's agent asks its prefill ranks under (SGLang's own, or, fed with
            other decode ranks by one prefill rank, this rank's own: ``replicas``)."""
            self._built()
            return [recv.room for _, recv in self._recvs]

        def _register_kv_args(self) -> bool:
            """No registration through SGLang's ZMQ socket (0.5.23's ``init`` sends one to each
            prefill rank it resolved): this rank's agent shakes hands with the prefill's itself."""
            return True

        def _fence(self, reason: str) -> bool:
            """Abort every agent receiver still live; returns once none of their writes can land
            (the agents' fence), False when a prefill did not confirm within ``ABORT_FENCE_S`` or
            a receiver ended unconfirmed (its prefill gone silent: it confirms later)."""
            self._built()
            fenced = True
            for _, recv in self._recvs:
                if not recv.poll().terminal:
                    self._aborted.add(id(recv))
                    try:
                        recv.abort(reason, timeout_s=ABORT_FENCE_S)
                    except Exception as exc:  # not fenced in time: say so, the request fails all the same
                        log.error("pdstate: room %s: abort not fenced: %s", self.bootstrap_room, exc)
                        fenced = False
                elif not recv.fenced:
                    fenced = False
            return fenced

        def _ack_when_fenced(self, generation) -> None:
            """0.5.23's deferred release: every prefill rank's acknowledgement, recorded once
            every agent receiver is fenced (now, or from the agent's thread when its prefill
            confirms)."""
            mgr, room = self.kv_mgr, self.bootstrap_room
            ranks = range(len(self.bootstrap_infos or ()))
            left = [recv for _, recv in self._recvs if not recv.fenced]
            if not left:
                for rank in ranks:
                    mgr.note_abort_ack(room, rank, generation)
                return
            waiting = {id(r) for r in left}

            def one(recv) -> None:
                waiting.discard(id(recv))
                if not waiting:
                    log.info("pdstate: room %s: its prefill confirmed; SGLang may free its pages", room)
                    for rank in ranks:
                        mgr.note_abort_ack(room, rank, generation)

            for recv in left:
                recv.add_fence_callback(one)

        def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
            """SGLang 0.5.23's: tell the prefill ranks once (and arm the deferred-release
            acknowledgement); the same on 0.5.19, whose scheduler never calls it."""
            if not self.abort_notified and getattr(self, "bootstrap_infos", None) is not None:
                self._send_abort_notification(force_arm=force_arm)
                self.abort_notified = True

        def _send_abort_notification(self, *args, force_arm: bool = False, **kwargs) -> None:
            """Where SGLang's own receivers send a ZMQ abort notification to each prefill rank
            (its ``abort``, its waiting timeout, 0.5.23's ``ensure_abort_notified`` after a failure):
            the agent tells the prefill and fences the writes, and the prefill ranks'
            acknowledgements SGLang 0.5.23's deferred KV release waits for are recorded the moment
            the fence holds, so the decode's pages are released at once, not after its timeout."""
            fenced = self._fence(self.kv_mgr.failure_records.get(self.bootstrap_room) or "Aborted by AbortReq.")
            mgr = self.kv_mgr
            if not getattr(mgr, "enable_deferred_decode_kv_release", False):
                return
            if not (force_arm or self.init_time is not None):
                return  # as SGLang's: a receiver that named no destination is released without waiting
            generation = mgr.register_deferred_abort_room(self.bootstrap_room)
            self._abort_generation = generation
            if fenced:
                for rank in range(len(self.bootstrap_infos or ())):
                    mgr.note_abort_ack(self.bootstrap_room, rank, generation)
            else:  # acknowledged once the prefill confirms (or SGLang's deferred-release deadline)
                self._ack_when_fenced(generation)

        def send_metadata(
            self, kv_indices, aux_index=None, state_indices=None, decode_prefix_len=None, destination=None
        ):
            if self.conclude_state is not None:
                return
            if destination is not None and getattr(destination, "value", destination) != "device":
                self.pdstate_fail(
                    TransferFailed(
                        f"destination={getattr(destination, 'value', destination)}: pdstate's SGLang backend "
                        "receives into device memory only"
                    )
                )
                return
            # decode_prefix_len (0.5.23's decode radix cache): SGLang named only the pages past the
            # prefix and the SWA window from there; the prefill's sender moves just those
            self.decode_prefix_len = int(decode_prefix_len or 0)
            state_types = self.kv_mgr.kv_args.state_types
            n = len(state_types)
            try:
                lists = state_lists(list(state_indices) if state_indices is not None else [None] * n, state_types)
            except ValueError as exc:
                self.pdstate_fail(exc)
                return
            if self._step.running:  # the agent's thread makes the agent receivers: named there after
                try:
                    self.kv_mgr.agent.post(lambda: self._posted_name(kv_indices, lists, aux_index, n))
                except AgentClosed as exc:
                    self.pdstate_fail(exc)
                    return
                self._said = TRANSFERRING
            else:
                error = self._name(kv_indices, lists, aux_index, n)
                if error is not None:
                    self.pdstate_fail(error)
                    return
            self.init_time = time.time()  # SGLang's waiting-timeout clock starts once the destination is named

        def _name(self, kv_indices, lists, aux_index, n: int) -> BaseException | None:
            """Each agent receiver told where the request lands (a dummy: nowhere); returns what
            refused it, else ``None``."""
            empty = [np.empty(0, dtype=np.int64)] * n
            try:
                for dummy, recv in self._recvs:
                    if dummy:
                        recv.post_init([], empty, None)
                    else:
                        recv.post_init(kv_indices, lists, aux_index)
            except (PdStateError, ValueError) as exc:
                return exc
            return None

        def _posted_name(self, kv_indices, lists, aux_index, n: int) -> None:
            """On the agent's I/O thread, after ``_made``: ``send_metadata`` handed over."""
            step = self._step
            if step.error is None:
                error = step.error = self._name(kv_indices, lists, aux_index, n)
                if error is not None:
                    self._word = None  # the next poll looks further, and fails the request

        def poll(self) -> int:
            """SGLang's scheduler calls this for every request in flight on every iteration: the
            common answers (awaiting its prefill or transferring, and the Success that ends it) read
            one status word."""
            over = self.conclude_state
            if over is not None:
                return over if over == SUCCESS else self._poll()  # Failed: held while unfenced
            self._polls += 1
            check = not self._polls % AGENT_CHECK_POLLS  # the agent, and SGLang's waiting timeout, looked at
            if check and self.kv_mgr.agent_failure() is not None:
                return self._poll()
            word = self._word
            if word is not None and self._one.posted_error is None:
                state = word.state  # the agent's own state: Transferring and Success read as they are
                if state is _TRANSFERRING:
                    steady = TRANSFERRING
                elif state is _SUCCESS:  # the agent's verdict: concluded here, nothing else to look at
                    return succeed(self, self._traced)
                elif (state := self._one.poll()) is _TRANSFERRING:  # as the posted calls show it
                    steady = TRANSFERRING
                elif state is _WAITING:  # (Transferring when its destination is on its way: ``_said``)
                    steady = TRANSFERRING if self._said == TRANSFERRING else WAITING
                elif state is _BOOTSTRAPPING:
                    steady = self._said
                else:
                    return self._poll()
                # SGLang's waiting timeout (seconds): its own check (``_poll``) once due, looked at
                # on the polls that look at the agent
                init = self.init_time
                if not check or init is None or time.time() - init < self.kv_mgr.waiting_timeout:
                    return steady
            elif self._step.running and self._polls % AGENT_CHECK_POLLS:  # its agent receivers are being made
                return self._said  # (``_poll`` looks every so often)
            return self._poll()

        def _poll(self) -> int:
            step = self._step
            if step.running and self.conclude_state is None and self.kv_mgr.agent_failure() is None:
                return self._while_building()
            if self.conclude_state is None and step.error is not None:
                self.pdstate_fail(step.error)  # what refused them on the agent's thread
            if self.conclude_state is None:
                posted = posted_failure(recv for _, recv in self._recvs)
                if posted is not None:  # what a posted init or send_metadata raised on the agent's thread
                    self.pdstate_fail(posted)
            over = concluded(self)
            if over is not None:  # Failed (aborted, timed out) while a prefill may still write: held
                return KVPoll.Transferring if over == KVPoll.Failed and self._hold_unfenced() else over
            if not self._recvs:
                status = self.kv_mgr.request_status.get(self.bootstrap_room, KVPoll.Bootstrapping)
                if status == KVPoll.Failed:
                    self.conclude_state = KVPoll.Failed
                return status
            states = [recv.poll() for _, recv in self._recvs]
            if self._said != BOOTSTRAPPING:  # not less than said already (``_said``)
                floor = _TRANSFERRING if self._said == TRANSFERRING else _WAITING
                states = [
                    floor if s is _BOOTSTRAPPING or s is _WAITING and floor is _TRANSFERRING else s for s in states
                ]
            poll = combine(states)
            if poll == KVPoll.Failed:
                if self._hold_unfenced():
                    return KVPoll.Transferring
                for (_, recv), state in zip(self._recvs, states):
                    if kv_poll(state) == KVPoll.Failed:
                        return self.pdstate_fail(
                            recv.failure_exception() or TransferFailed("the pdstate receiver failed")
                        )
            if poll != KVPoll.Success and self.init_time is not None:
                # SGLang's waiting timeout (SGLANG_DISAGGREGATION_WAITING_TIMEOUT), its own check and
                # text ("Request N timed out after 3.0s in KVPoll.WaitingForInput"); the prefill is
                # told, and the writes fenced, through ``_send_abort_notification``
                timed_out = self._check_waiting_timeout()
                if timed_out is not None:
                    self.conclude_state = KVPoll.Failed
                    return KVPoll.Transferring if self._hold_unfenced() else timed_out
            return conclude(self, poll)

        def _hold_unfenced(self) -> bool:
            """Without deferred decode KV release (0.5.19), SGLang frees the pages at Failed: a
            request whose prefill may still write them stays Transferring until it confirms, at
            most ``UNFENCED_FAILED_WAIT_S`` (then Failed, logged as unfenced). A prefill may still
            write through an agent receiver that ended unconfirmed (its prefill went silent) or
            that was told to abort and has not been confirmed (SGLang's abort or waiting timeout,
            whose fence gave up after ``ABORT_FENCE_S``)."""
            if self._unfenced_released or getattr(self.kv_mgr, "enable_deferred_decode_kv_release", False):
                return False  # SGLang holds the pages until the acknowledgements (``_ack_when_fenced``)
            if all(recv.fenced for _, recv in self._recvs if id(recv) in self._aborted or recv.poll().terminal):
                return False
            now = time.monotonic()
            if self._unfenced_since is None:
                self._unfenced_since = now
            if now - self._unfenced_since < UNFENCED_FAILED_WAIT_S:
                return True
            self._unfenced_released = True
            log.error(
                "pdstate: room %s: failed, and its prefill did not confirm within %g s that nothing more of it "
                "lands; SGLang frees its pages now",
                self.bootstrap_room,
                UNFENCED_FAILED_WAIT_S,
            )
            return False

        def failure_exception(self):
            failure_exception(self)

        def pdstate_metrics(self) -> list[dict]:
            """The agent receivers' metrics (stage times: ``trace``), one per prefill rank read."""
            self._built()
            return [recv.metrics for dummy, recv in self._recvs if not dummy]

        def abort(self):
            """Fail the request (SGLang's own ``abort``: "Aborted by AbortReq."); returns once no
            write of it can land any more (the agent's fence, through ``_send_abort_notification``)."""
            super().abort()

    PdStateKVReceiver.__qualname__ = "PdStateKVReceiver"
    return PdStateKVReceiver
