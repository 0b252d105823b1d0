"""What both workers share: options, pool/report/engine construction, stats, the loop clock."""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from pdstate import wire
from pdstate.errors import DraftMappingMissing
from pdstate.handshake import LocalSide
from pdstate.layout import ErrorInfo, LayoutReport, build_report
from pdstate.pools.memory import PrivateMemory, SharedMemory, sweep_stale_segments
from pdstate.presets import PoolSettings, WorkerPools, build_worker_pools

log = logging.getLogger("pdstate")


@dataclass(frozen=True)
class WorkerOptions:
    role: str  # "prefill" | "decode"
    pool: PoolSettings
    engine: str = "shm"
    engine_options: dict[str, Any] = field(default_factory=dict)
    bind: str = "tcp://127.0.0.1:0"  # prefill
    peer: str = ""  # decode
    worker_id: str = ""
    token: bytes | None = None
    heartbeat_interval_s: float = 1.0
    peer_timeout_s: float = 5.0
    request_deadline_s: float = 30.0
    max_inflight: int = 64
    local_checks: bool = True


class LocalCheckFailed(RuntimeError):
    """Raised at start when the worker's own target/draft pair fails ``setup_state_kv_args``."""


@dataclass
class Stats:
    handshakes: dict[str, int] = field(default_factory=lambda: {"accepted": 0, "rejected": 0})
    transfers: dict[str, int] = field(default_factory=lambda: {"success": 0, "failed": 0, "busy": 0})
    bytes: int = 0
    engine_errors: int = 0
    protocol_errors: int = 0
    latencies_s: list[float] = field(default_factory=list)
    failure_reasons: dict[str, int] = field(default_factory=dict)

    def fail(self, reason: str) -> None:
        self.transfers["failed"] += 1
        key = reason.split(":")[0][:80]
        self.failure_reasons[key] = self.failure_reasons.get(key, 0) + 1


def new_incarnation() -> str:
    return secrets.token_hex(8)


def build_side(opts: WorkerOptions):
    """Pools (in shared memory for a decode on the shm engine), report, KVArgs and local check.

    Returns ``(pools, report, kv_args, local_error)``. ``local_error`` is the upstream refusal of
    this side's own pair, or ``None``.
    """
    if opts.role == "decode" and opts.engine == "shm":
        sweep_stale_segments()
        memory = SharedMemory()
    else:
        memory = PrivateMemory()
    pools = build_worker_pools(opts.pool, memory)
    report, kv_args = build_report(pools.target, pools.draft)
    err = None
    if not report.local_check.ok:
        from pdstate.errors import error_from_wire

        err = error_from_wire(report.local_check.error.type, report.local_check.error.message)
        if isinstance(err, DraftMappingMissing):
            err = DraftMappingMissing(report.local_check.error.message)
    if kv_args is None and not opts.local_checks:
        # A side that does not verify its own pair still registers its buffers (as upstream
        # would have, had it not checked): describe them without the checks.
        from pdstate.kvargs import KVArgs, append_state_component, state_components

        kv_args = KVArgs()
        kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = pools.target.get_contiguous_buf_infos()
        kv_args.page_size = pools.target.page_size
        for st, infos in state_components(pools.target, pools.draft, check=False):
            append_state_component(kv_args, st, *infos)
    return pools, report, kv_args, err


def local_side(opts: WorkerOptions, worker_id: str, incarnation: str, report: LayoutReport, kv_args, endpoint: dict) -> LocalSide:
    return LocalSide(
        worker_id=worker_id,
        incarnation=incarnation,
        report=report,
        kv=None if kv_args is None else wire.KVDesc.of(kv_args),
        engine=wire.EngineDesc(name=opts.engine, endpoint=endpoint),
        heartbeat_interval_s=opts.heartbeat_interval_s,
        peer_timeout_s=opts.peer_timeout_s,
    )


def error_info(exc: BaseException) -> ErrorInfo:
    return ErrorInfo.of(exc)


now = time.monotonic
