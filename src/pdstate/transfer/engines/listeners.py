"""Where an engine's native side really listens, and the transport it really uses.

``tcp_listeners()``: the TCP sockets in LISTEN state this process holds, read from
``/proc/net/tcp`` and ``/proc/net/tcp6`` by the socket inodes of ``/proc/self/fd`` (empty where
there is no ``/proc``). ``TransferEngine.start`` takes it before and after the native start: the
difference is what the engine opened, whatever its configuration asked for (Mooncake 0.3.13
binds ``0.0.0.0`` and ``[::]`` whatever its ``host``; UCX one socket per network device).
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's ``st`` column


def _socket_inodes(pid: str) -> set[str]:
    out = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            out.add(link[len("socket:[") : -1])
    return out


def _address(hex_ip: str) -> str:
    raw = bytes.fromhex(hex_ip)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word host order
    ip = ipaddress.ip_address(words)
    return str(ip) if ip.version == 4 else f"[{ip}]"


def tcp_listeners(pid: str = "self") -> set[str]:
    """``tcp://host:port`` of each listening TCP socket process ``pid`` holds."""
    inodes = _socket_inodes(pid)
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == LISTEN and cols[9] in inodes:
                hex_ip, hex_port = cols[1].split(":")
                found.add(f"tcp://{_address(hex_ip)}:{int(hex_port, 16)}")
    return found


def beyond_loopback(address: str) -> bool:
    """Whether a ``tcp://host:port`` listener accepts connections from other hosts."""
    host = address.partition("://")[2].rpartition(":")[0].strip("[]")
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True


@dataclass(frozen=True)
class Transport:
    """An engine's transport as configured and as in use; ``problem``: why they differ (a
    silent fallback the worker must not be ready with), else None."""

    engine: str
    configured: str
    in_use: str
    listening: tuple[str, ...] = ()
    problem: str | None = None

    def as_dict(self) -> dict:
        return {
            "engine": self.engine,
            "configured": self.configured,
            "in_use": self.in_use,
            "listening": list(self.listening),
            "open": any(beyond_loopback(a) for a in self.listening),
            "problem": self.problem,
        }
