"""Loopback addresses: what the servers (dashboard, HTTP API) bind by default
and answer to there, so a web page can't reach them by DNS rebinding."""

from __future__ import annotations

import ipaddress
from typing import Final

#: The Host names a server bound to a loopback address answers to.
LOOPBACK_NAMES: Final = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and any loopback IP (``[::1]`` with brackets too)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
