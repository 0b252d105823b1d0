"""What a worker's HTTP listener holds before any request is read, bounded.

Every connection costs a descriptor before authentication can run. Three bounds keep a worker
serviceable when many are opened and never finish a request (slow headers, idle sockets):

- ``raise_open_files_limit``: the process's descriptor soft limit is raised to its hard limit at
  start (a container's or a unit's soft default is often 1,024 while the hard one is far higher);
- a request's head and body must arrive within ``REQUEST_TIMEOUT_S`` of the connection's start or
  of the previous response, else the connection is closed (uvicorn has no such timeout: its own
  keep-alive timeout only starts once a response was sent);
- at most ``http_connection_cap`` connections are held at once: one beyond it is closed as it is
  accepted, and a request met at the cap is answered 503 (uvicorn's ``limit_concurrency``).

The prefill's control socket has its own bound (``pdstate.agent.admission.HANDSHAKE_IVL_MS``).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("pdstate.status.connections")

REQUEST_TIMEOUT_S = 10.0  # a request line, its headers and its body (64 KiB at most) arrive within this
MAX_HTTP_CONNECTIONS = 8192  # HTTP connections held at once, at most
NOFILE_FALLBACK = 1 << 20  # the soft limit asked for where the hard one is unlimited


def raise_open_files_limit() -> int:
    """Raise ``RLIMIT_NOFILE``'s soft limit to its hard limit; returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = NOFILE_FALLBACK if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:  # a hard limit above the kernel's nr_open
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, target, exc)
    return soft


def http_connection_cap(nofile: int) -> int:
    """HTTP connections held at once: ``MAX_HTTP_CONNECTIONS``, or half the descriptors where the
    limit is lower (the other half stays for the worker: its control socket, peers, segments)."""
    if nofile == resource.RLIM_INFINITY:
        return MAX_HTTP_CONNECTIONS
    return max(64, min(MAX_HTTP_CONNECTIONS, nofile // 2))


def bounded_h11(max_connections: int, request_timeout_s: float = REQUEST_TIMEOUT_S) -> type[H11Protocol]:
    """uvicorn's h11 protocol (``uvicorn.Config(http=...)``) with the two bounds above."""

    class BoundedH11Protocol(H11Protocol):
        _request_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.abort()  # connection_lost follows: the descriptor is released now
                return
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._request_timer = self.loop.call_later(request_timeout_s, self._request_timed_out)

        def _disarm(self) -> None:
            if self._request_timer is not None:
                self._request_timer.cancel()
                self._request_timer = None

        def _request_timed_out(self) -> None:
            self._request_timer = None
            # IDLE: the request's head is not in yet; SEND_BODY: its body is not
            if not self.transport.is_closing() and self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
                self.transport.abort()

    return BoundedH11Protocol


def listen_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def http_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
