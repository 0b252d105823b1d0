"""Sans-IO handshake and request lifecycle: feed a message, get the answer back.

``PrefillHandshake(local).receive(register)`` returns ``Accept`` or ``Reject``, validating in the
protocol's order (engine name; the decode's own target/draft pair; page size and KV dtype; every
other layout factor; descriptor sanity). ``DecodeHandshake(local).receive(accept_or_reject)``
re-checks the prefill's report the same way and raises the very error the other side raised, so
both sides refuse with the same class and message.

The lifecycles (request and peer states) are tables in ``pdstate.protocol.lifecycle``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdstate.errors import DescriptorMismatch, EngineError, error_from_wire
from pdstate.protocol import compat
from pdstate.protocol.report import ErrorInfo, LayoutReport
from pdstate.protocol.wire import Accept, EngineDesc, KVDesc, Register, Reject


@dataclass(frozen=True)
class LocalSide:
    """What one worker brings to the handshake."""

    worker_id: str
    incarnation: str
    report: LayoutReport
    kv: KVDesc | None
    engine: EngineDesc
    heartbeat_interval_s: float = 1.0
    peer_timeout_s: float = 5.0


class PrefillHandshake:
    def __init__(self, local: LocalSide) -> None:
        self.local = local

    def receive(self, msg: Register) -> Accept | Reject:
        try:
            self.validate(msg)
        except (RuntimeError, ValueError, EngineError) as exc:  # EngineError is not a RuntimeError
            return Reject(worker_id=self.local.worker_id, error=ErrorInfo.of(exc))
        return Accept(
            worker_id=self.local.worker_id,
            incarnation=self.local.incarnation,
            report=self.local.report,
            heartbeat_interval_s=self.local.heartbeat_interval_s,
            peer_timeout_s=self.local.peer_timeout_s,
        )

    def validate(self, msg: Register) -> None:
        if msg.engine.name != self.local.engine.name:
            raise EngineError(
                f"transfer engine mismatch: prefill server uses {self.local.engine.name!r}, "
                f"but decode server uses {msg.engine.name!r}"
            )
        compat.check_peer(self.local.report, msg.report, "prefill")
        if msg.kv is None:
            raise DescriptorMismatch("decode registered no buffers (its local setup_state_kv_args failed)")
        if self.local.kv is not None:
            compat.check_descriptors(self.local.kv, msg.kv)


class DecodeHandshake:
    def __init__(self, local: LocalSide) -> None:
        self.local = local

    def register_message(self, proof: dict | None = None) -> Register:
        """The register; ``proof``: endpoint fields answering the prefill's ``Challenge``."""
        engine = self.local.engine
        if proof:
            engine = EngineDesc(name=engine.name, endpoint={**engine.endpoint, **proof})
        return Register(
            worker_id=self.local.worker_id,
            incarnation=self.local.incarnation,
            role="decode",
            report=self.local.report,
            kv=self.local.kv,
            engine=engine,
        )

    def receive(self, msg: Accept | Reject) -> Accept:
        """Returns the ``Accept`` when the pair is compatible; raises the refusal otherwise."""
        if isinstance(msg, Reject):
            raise error_from_wire(msg.error.type, msg.error.message)
        compat.check_peer(self.local.report, msg.report, "decode")
        return msg
