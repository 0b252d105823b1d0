"""Host names in endpoints and bind addresses: what counts as this machine's loopback.

Imported by the auth rules when configuration loads (before any worker starts), so it needs
nothing heavier than the standard library."""

from __future__ import annotations

import ipaddress


def is_loopback_host(host: str) -> bool:
    """``host`` (an IP literal, ``[v6]`` or ``localhost``) names only this machine's loopback.

    Anything else, including ``""``, ``*``, interface names and host names (no DNS lookup at load
    time), counts as reachable from outside: the checks built on this fail closed."""
    h = host.strip()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    if h.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False
