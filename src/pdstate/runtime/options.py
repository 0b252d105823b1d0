"""``WorkerOptions``: what a worker is configured with (built by ``service.config`` or a test).

Production settings only; the test seams (fault injection) are ``runtime.hooks.WorkerHooks``,
passed to a worker beside its options.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdstate.pools.presets import PoolSettings


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
    # decode: how the bytes that landed are checked against the room's synthetic content:
    # "full" reads every byte (one pass over the request), "sample" the first word of every item
    # and the last of every run of items (O(items)); see ``runtime.synth``
    verify: str = "full"
    # prefill: a request of at most this many bytes, on a synchronous engine (shm), is computed and
    # copied on the control thread when the transfer thread is idle and no other frame waits: two
    # thread wake-ups (0.15-0.3 ms on a small VM) saved per request, at most a few milliseconds of
    # the control loop (a 2k ``dsv4-flash`` request is 18 MB: compute and copy take ~3.5 ms); 0: never
    inline_max_bytes: int = 32 << 20
    # prefill: on stop (SIGTERM), how long to let the requests in flight finish before the goodbye
    # (new requests are refused meanwhile); 0: end them at once with "prefill shutting down"
    drain_s: float = 0.0
