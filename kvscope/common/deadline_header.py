"""``x-kvscope-timeout``: a request's deadline in seconds from its arrival, read by the engine (which drops a
request still queued when it passes, before its prefill) and by the gateway (a client's own, shorter than its
total timeout, becomes the request's deadline; every upstream attempt carries what is left of it). One parse,
so both answer a bad value alike."""

from __future__ import annotations

import math

TIMEOUT_HEADER = "x-kvscope-timeout"
"""Seconds from the request's arrival until its deadline (docs/engine-server.md, "Deadlines")."""


def parse_timeout(value: str | None) -> float | None:
    """The header's seconds; None without one. Raises ValueError, its message naming the header, for anything
    but a positive finite number (each side answers it with its own 400, ``param`` the header)."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not seconds > 0 or math.isinf(seconds):
        raise ValueError(f"{TIMEOUT_HEADER} must be a positive number of seconds.")
    return seconds
