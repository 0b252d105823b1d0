"""``WorkerOptions``: what a worker is configured with (``WorkerOptions.from_config`` over a
``settings.config.WorkerConfig``, or built by a test),
and ``WorkerHooks``, the test seams (fault injection) a prefill takes beside them.

Production settings only in ``WorkerOptions``; production never passes hooks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdstate.pools.presets import PoolSettings

if TYPE_CHECKING:
    from pdstate.settings.config import WorkerConfig


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
    key_dir: str | None = None  # without a token: where this uid's control key is (``agent.curve``)
    heartbeat_interval_s: float = 1.0
    peer_timeout_s: float = 5.0
    request_deadline_s: float = 30.0
    max_inflight: int = 64
    local_checks: bool = True
    # decode: how the bytes that landed are checked against the room's synthetic content:
    # "full" reads every byte (one pass over the request), "sample" the first word of every item
    # and the last of every run of items (O(items)); see ``worker.synth``
    verify: str = "full"
    # the agent's verification level (``transfer.verify``): what the digests cover; the decode's
    # requests ask it, the prefill takes no less
    transfer_verify: str = "sampled"
    # accepted for configuration compatibility (``control.inline_max_bytes``); the agent's prefill
    # decides itself when a small request skips its thread hand-offs
    inline_max_bytes: int = 32 << 20
    # prefill: on stop (SIGTERM), how long to let the requests in flight finish before the goodbye
    # (new requests are refused meanwhile); 0: end them at once with "prefill shutting down"
    drain_s: float = 0.0
    # prefill: how long a request's verdict is awaited (``pdstate.agent.fairness``), and the most of
    # the pools one decode may hold while another decode is registered (1.0: no bound)
    verdict_timeout_s: float = 5.0
    decode_share: float = 0.5
    # decode: a dead prefill's quarantined pages come back this long after its session closed
    dead_prefill_release_s: float = 300.0
    advertise: tuple[str, ...] = ()  # prefill: other addresses decodes dial it at
    prefills: tuple[str, ...] = ()  # decode: the prefills a transfer may name (empty: peer and loopback)
    # decode: the migration listener's bind address, and the address targets dial ("": the bound one)
    migration_bind: str = "tcp://127.0.0.1:0"
    migration_advertise: str = ""

    @classmethod
    def from_config(cls, cfg: WorkerConfig) -> WorkerOptions:
        """The options of a worker configured by ``cfg`` (``ConfigError`` from an unreadable token file)."""
        return cls(
            role=cfg.role,
            pool=cfg.pool_settings(),
            engine=cfg.transfer.engine,
            engine_options=cfg.transfer.engine_options(),
            bind=cfg.control.bind,
            peer=cfg.control.peer,
            worker_id=cfg.worker_id,
            token=cfg.auth.secret(),
            key_dir=cfg.auth.key_dir or None,
            heartbeat_interval_s=cfg.control.heartbeat_interval_s,
            peer_timeout_s=cfg.control.peer_timeout_s,
            request_deadline_s=cfg.control.request_deadline_s,
            max_inflight=cfg.control.max_inflight,
            inline_max_bytes=cfg.control.inline_max_bytes,
            drain_s=cfg.control.drain_s,
            verdict_timeout_s=cfg.control.verdict_timeout_s,
            decode_share=cfg.control.decode_share,
            dead_prefill_release_s=cfg.control.dead_prefill_release_s,
            advertise=tuple(cfg.control.advertise),
            prefills=tuple(cfg.control.prefills),
            migration_bind=cfg.migration.bind,
            migration_advertise=cfg.migration.advertise,
            local_checks=cfg.checks.local,
            verify=cfg.checks.verify,
            transfer_verify=cfg.transfer.verify,
        )


@dataclass(frozen=True)
class WorkerHooks:
    """Fault-injection seams of a prefill worker, for tests; the defaults do nothing.

    ``delay_before_copy_s``: a request waits this long (a timer on the prefill's request loop)
    after its content was computed and before its pages go to the agent's sender, so a test can
    kill or freeze a process while requests are ``TRANSFERRING``. The wait ends early when the
    decode gives the request up or the worker stops.
    """

    delay_before_copy_s: float = 0.0


NO_HOOKS = WorkerHooks()
