"""The ``PrefillAgent``'s ROUTER socket, and which registrations it takes further: one live decode
per ``worker_id``, and the decode's memory proven to be its own before anything is checked,
mapped or recorded.

The socket binds a ZeroMQ identity to its first connection (no ``ROUTER_HANDOVER``): a second
connection copying a decode's identity is refused by ZeroMQ and cannot take over its pipe.
``ROUTER_MANDATORY`` makes a send to an identity with no connection fail (the liveness probe).

Run on the prefill agent's I/O thread:

* a register whose ``worker_id`` an accepted decode on another connection still holds (heard
  from within the peer timeout, its connection open: a probe heartbeat can be queued to it) is
  refused with ``WorkerIdInUse`` and that decode is left as it was; a killed decode's connection
  closes at once, so its restart is accepted without waiting for the timeout;
* with an engine that proves ownership (shm), a compatible register whose endpoint does not
  answer a challenge yet gets a ``Challenge``; the engine's ``connect`` checks the answer.
"""

from __future__ import annotations

import time
from typing import Any

import zmq

from pdstate.errors import WorkerIdInUse
from pdstate.protocol import wire
from pdstate.protocol.report import ErrorInfo


def bind_router(loop: Any, bind: str) -> tuple[zmq.Socket, str]:
    """The prefill agent's ROUTER, bound to ``bind`` (``tcp://host:0``: a free port); returns it
    and its address."""
    sock = loop.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if bind.startswith("tcp://") and bind.endswith(":0"):
        port = sock.bind_to_random_port(bind[: -len(":0")])
        return sock, f"{bind[: -len(':0')]}:{port}"
    sock.bind(bind)
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


def live_holder(agent: Any, identity: bytes, worker_id: str):
    """The accepted decode (``DecodePeer``) holding ``worker_id`` on another live connection."""
    now = time.monotonic()
    for key, d in agent._decodes.items():
        if d.worker_id != worker_id or key == identity or now - d.last_seen > agent.peer_timeout_s:
            continue
        probe = wire.Heartbeat(worker_id=agent.worker_id, incarnation=agent.incarnation, seq=int(now * 1000))
        try:
            agent._sock.send_multipart([key, wire.encode(probe, agent.token)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # no connection with that identity any more (ROUTER_MANDATORY), or full
            continue
        return d
    return None


def gatekeep(agent: Any, identity: bytes, msg: wire.Register) -> bool:
    """Answer ``msg`` here if it ends here (a ``Reject`` or a ``Challenge``; True), else False: go
    on to the handshake's checks and the engine's ``connect``."""
    answer = _early_answer(agent, identity, msg)
    if answer is not None:
        agent._reply(identity, answer)
    return answer is not None


def _early_answer(agent: Any, identity: bytes, msg: wire.Register) -> wire.Message | None:
    holder = live_holder(agent, identity, msg.worker_id)
    if holder is not None:
        err = WorkerIdInUse(
            f"worker_id {msg.worker_id!r} is held by a live decode (incarnation {holder.incarnation}); "
            "a new incarnation is accepted once that one is gone"
        )
        return wire.Reject(worker_id=agent.worker_id, error=ErrorInfo.of(err))
    engine = agent._engine
    if (
        engine.proves_ownership
        and msg.engine.name == engine.name
        and "challenge" not in msg.engine.endpoint
        and isinstance(agent._handshake.receive(msg), wire.Accept)  # (an incompatible one: refused as ever)
    ):
        nonce = engine.challenge(f"{msg.worker_id}/{msg.incarnation}")
        return wire.Challenge(worker_id=agent.worker_id, incarnation=agent.incarnation, nonce=nonce)
    return None
