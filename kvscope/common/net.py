"""Address helpers shared by the engine and gateway servers (a leaf: imports neither)."""

from __future__ import annotations

import ipaddress

SERVE_PORT = 4000
"""The port of the gateway ``kvscope serve`` (and ``make run``) starts, and so the default of every client
command (``kvscope bench``); LiteLLM's default. The engine alone listens on 8000."""


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
