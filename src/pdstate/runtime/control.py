"""The ZeroMQ control channel: a ROUTER on the prefill, one DEALER per decode incarnation.

These classes only move frames; decoding, validation and decisions live in ``pdstate.protocol.wire`` and
``pdstate.protocol.handshake``. Sockets are created in ``open()`` and must be used from one thread.
"""

from __future__ import annotations

import zmq

from pdstate.protocol import wire


class ControlServer:
    """ROUTER socket bound on the prefill; ``bind`` may use port 0 (see ``endpoint``)."""

    def __init__(self, ctx: zmq.Context, bind: str, token: bytes | None = None) -> None:
        self._ctx, self._bind, self.token = ctx, bind, token
        self.sock: zmq.Socket | None = None
        self.endpoint = ""

    def open(self) -> str:
        s = self._ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        # An identity is bound to its first connection: a second connection claiming an identity
        # in use is refused by ZeroMQ (no ROUTER_HANDOVER), so no one can take over a decode's pipe
        # by copying its ``worker_id/incarnation``. ROUTER_MANDATORY makes a send to an identity
        # with no connection fail, which is how ``send`` reports that a peer is unreachable.
        s.setsockopt(zmq.ROUTER_HANDOVER, 0)
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        s.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES + 1024)
        if self._bind.startswith("tcp://") and self._bind.endswith(":0"):
            port = s.bind_to_random_port(self._bind[: -len(":0")])
            self.endpoint = f"{self._bind[: -len(':0')]}:{port}"
        else:
            s.bind(self._bind)
            self.endpoint = s.getsockopt_string(zmq.LAST_ENDPOINT)
        self.sock = s
        return self.endpoint

    def recv(self) -> tuple[bytes, bytes] | None:
        """One ``(identity, frame)``; ``None`` for a malformed multipart message (dropped)."""
        parts = self.sock.recv_multipart(copy=True)
        if len(parts) != 2:
            return None
        return parts[0], parts[1]

    def send(self, identity: bytes, msg: wire.Message) -> bool:
        """Queue ``msg`` for ``identity``; False if no connection has that identity (gone) or its
        queue is full: heartbeats will notice either."""
        try:
            self.sock.send_multipart([identity, wire.encode(msg, self.token)], flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return False
            raise
        return True

    def close(self, linger_ms: int = 0) -> None:
        """Close; ``linger_ms`` > 0 keeps flushing what was queued (goodbyes) that long."""
        if self.sock is not None:
            self.sock.close(linger_ms)
            self.sock = None


class ControlClient:
    """DEALER socket of a decode worker; its identity is ``worker_id/incarnation``."""

    def __init__(self, ctx: zmq.Context, peer: str, identity: bytes, token: bytes | None = None) -> None:
        self._ctx, self._peer, self._identity, self.token = ctx, peer, identity, token
        self.sock: zmq.Socket | None = None

    def open(self) -> None:
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.IDENTITY, self._identity)
        s.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES + 1024)
        s.setsockopt(zmq.SNDHWM, 10000)
        s.connect(self._peer)
        self.sock = s

    def recv(self) -> bytes:
        return self.sock.recv(copy=True)

    def send(self, msg: wire.Message) -> None:
        try:
            self.sock.send(wire.encode(msg, self.token), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # not connected yet / peer gone: retried by the handshake and heartbeat timers

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None
