"""Moving a running request from one SGLang decode rank (the source) to another (the target).

What a deployment would call on each side, SGLang 0.5.23 and backend ``pdstate`` on both:

* source: ``source_agent(kv_manager)`` is a ``PrefillAgent`` over the source rank's own memory
  (the ``KVArgs`` its ``PdStateKVManager`` registered, its layout report), so the target is judged
  exactly as a prefill judges a decode; ``source_indices(...)`` names a running request's pages
  and state rows in the source's pools as SGLang's decode names them for a transfer (the same
  payloads, for a sequence of ``seq_len`` tokens: prompt and output so far, less the last token);
  ``boundary_aux(...)`` fills the request's aux row as a prefill does, its last output token as the
  handoff token;
* target: ``target_request(req)`` makes an arriving request's ``Req`` look like SGLang's own
  retracted one (``pd_rebootstrap_in_progress``: its sequence is prompt plus output, less the
  boundary token, which lands in the aux row), so that the target's own ``DecodePreallocQueue``
  sizes and allocates its rows; ``build_receiver()`` is the ``KVReceiver`` the target's queues
  poll, over the target rank's ``DecodeAgent`` (its manager's), aimed at the source's agent
  address instead of a prefill found through the bootstrap server.

The source releases the request's rows only after the target verified it (its receiver reached
Success); nothing here releases anything: the caller's scheduler does.
"""

from __future__ import annotations

import functools
import time

import numpy as np

from pdstate.agent import PrefillAgent
from pdstate.errors import ConfigError, TransferFailed
from pdstate.integrations.sglang.settings import load_settings
from pdstate.integrations.sglang.states import kv_poll, state_lists
from pdstate.protocol.lifecycle import RequestState

__all__ = [
    "boundary_aux",
    "build_receiver",
    "check_supported",
    "seq_len_of",
    "source_agent",
    "source_indices",
    "target_request",
]


def check_supported() -> None:
    """``ConfigError`` unless the running SGLang names a request's state rows as 0.5.23 does (its
    pool's ``request_state_transfer_indices``, ``StateType.DSV4_REQUEST_STATE``): 0.5.19 is not
    supported."""
    from sglang.srt.disaggregation.base.conn import StateType

    if not hasattr(StateType, "DSV4_REQUEST_STATE"):
        from pdstate.integrations.sglang import sglang_release

        raise ConfigError(
            f"moving a running request between decodes is not supported on SGLang {sglang_release() or '0.5.19'}: "
            "it needs SGLang 0.5.23 (its decode's request-state rows, DSV4_REQUEST_STATE)"
        )


def seq_len_of(req) -> int:
    """Tokens of a running request's KV: its prompt and its output but the last token (the next
    step's input, whose KV is not written yet)."""
    return len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0)


def source_agent(kv_manager, *, bind: str = "tcp://127.0.0.1:0", worker_id: str | None = None) -> PrefillAgent:
    """A ``PrefillAgent`` over a decode rank's registered memory (its manager's ``kv_args`` and
    ``layout_report``), with the rank's pdstate settings (engine, token, verification)."""
    check_supported()
    settings = load_settings("prefill")
    return PrefillAgent(
        kv_manager.kv_args,
        report=kv_manager.layout_report,
        bind=bind,
        worker_id=worker_id or f"sglang-migration-source-{time.monotonic_ns():x}",
        **settings.agent_options(),
    )


def source_indices(kv_args, pools, req_to_token, slot: int, seq_len: int) -> tuple[np.ndarray, list]:
    """``(page indices, state indices per kv_args.state_types)`` of a request of ``seq_len`` tokens
    in request slot ``slot``, as SGLang 0.5.23's decode names its own rows for a transfer
    (``DecodePreallocQueue.pop_preallocated``: main KV pages, the SWA window's pages translated to
    the SWA pool, the unified ring's rows, the request-state rows, the request row).
    ``pools``: ``(token_to_kv_pool, allocator, sliding window)``."""
    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.mem_cache.common import kv_to_page_indices

    check_supported()
    target, alloc, window = pools
    page = alloc.page_size
    row = req_to_token[slot, :seq_len]
    pages = np.asarray(kv_to_page_indices(row, page), dtype=np.int64)

    def swa():
        start = max(0, seq_len - window) // page * page
        return kv_to_page_indices(alloc.translate_swa_indices_for_transfer(req_to_token[slot, start:seq_len]), page)

    def ring():
        stride = target.unified_swa_ring_size
        positions = np.arange(max(0, seq_len - target.unified_swa_window), seq_len, dtype=np.int64)
        return (slot * stride + positions % stride).astype(np.int32)

    payloads = {
        StateType.SWA: swa,
        StateType.SWA_RING: ring,
        StateType.DSV4_REQUEST_STATE: lambda: target.request_state_transfer_indices(slot, seq_len),
        StateType.REQUEST_ROW: lambda: np.array([slot], dtype=np.int32),
    }
    missing = [str(st.value) for st in kv_args.state_types if st not in payloads]
    if missing:
        raise ValueError(f"a running request's state of type {', '.join(missing)} cannot be migrated")
    return pages, [np.asarray(payloads[st]()) for st in kv_args.state_types]


def boundary_aux(metadata_buffers, index_allocator, req) -> int:
    """The request's aux row on the source, as a prefill fills it (``MetadataBuffers.set_buf``), its
    last output token as the handoff token the target commits; returns the row's index (the
    caller frees it with ``index_allocator.free`` once the move ended)."""
    index = index_allocator.alloc()
    if index is None:
        raise TransferFailed("no free aux row on the source to move the request's metadata")
    req.metadata_buffer_index = index
    metadata_buffers.set_buf(req)
    metadata_buffers.output_ids[index][0] = req.output_ids[-1]
    return index


def target_request(req) -> None:
    """Make ``req`` (prompt and output so far, as on the source) enter the target's queues as SGLang
    re-admits a retracted request: its boundary token leaves ``output_ids`` (it comes back in the
    aux row, committed by the transfer queue), and ``pd_rebootstrap_in_progress`` sizes its rows
    to the whole sequence (``DecodePreallocQueue._pre_alloc_fill_len``). The caller clears the
    flag when the request enters the running batch (as ``process_prebuilt`` does)."""
    if not req.output_ids:
        raise ValueError(f"request {req.rid} has no output token: nothing runs yet, nothing to migrate")
    req.output_ids.pop()
    req.pd_rebootstrap_in_progress = True


@functools.cache
def build_receiver() -> type:
    """``MigrationReceiver``: SGLang's ``BaseKVReceiver`` of one request moving in from a source decode."""
    from sglang.srt.disaggregation.base.conn import BaseKVReceiver, KVPoll

    check_supported()

    class MigrationReceiver(BaseKVReceiver):
        """Polled by the target's own queues; ``source``: the source's agent address; ``seq_len``:
        the request's tokens. ``kv_mgr``: the target rank's ``PdStateKVManager`` (its agent)."""

        require_staging = False

        def __init__(self, mgr, source: str, room: int, seq_len: int | None = None):
            self.kv_mgr, self.bootstrap_addr, self.bootstrap_room, self.seq_len = mgr, source, room, seq_len
            self.bootstrap_infos = [{"source": source}]
            self.conclude_state = None
            self.init_time = None
            self.abort_notified = False
            self.failure: BaseException | None = None
            self.agent_receiver = mgr.agent.receiver(source, room)

        def init(self, prefill_dp_rank: int = 0) -> None:
            """Nothing to resolve: the source's address is known."""

        def send_metadata(
            self, kv_indices, aux_index=None, state_indices=None, decode_prefix_len=None, destination=None
        ):
            if decode_prefix_len:  # the target's radix cache matched a prefix: the source sends every row
                self.failure = TransferFailed(
                    f"migration of room {self.bootstrap_room}: the target named rows past a cached prefix of "
                    f"{decode_prefix_len} tokens; a migrated request takes every row (no decode radix cache)"
                )
                self.abort()
                return
            state_types = self.kv_mgr.kv_args.state_types
            lists = state_lists(list(state_indices), state_types)
            self.agent_receiver.init(kv_indices, lists, aux_index, seq_len=self.seq_len)
            self.init_time = time.time()

        def poll(self) -> int:
            if self.conclude_state is not None:
                return self.conclude_state
            state = self.agent_receiver.poll()
            if state in (RequestState.SUCCESS, RequestState.FAILED):
                self.conclude_state = kv_poll(state)
            return kv_poll(state)

        def failure_exception(self):
            error = self.failure or self.agent_receiver.failure_exception()
            raise error if error is not None else TransferFailed(f"migration of room {self.bootstrap_room} failed")

        def abort(self) -> None:
            if not self.agent_receiver.poll().terminal:
                self.agent_receiver.abort("migration aborted by the target")
            self.conclude_state = KVPoll.Failed

        def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
            if not self.abort_notified:
                self.abort()
                self.abort_notified = True

        def is_abort_release_safe(self) -> bool:
            return self.agent_receiver.fenced

        @property
        def metrics(self) -> dict:
            return self.agent_receiver.metrics

    return MigrationReceiver
