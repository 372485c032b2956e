"""The one polling helper of the test suite and the benchmarks: wait until a condition holds, or fail saying
what was awaited and what was last seen.

Use it for waiting on something that will happen (a log line written, a metric moved, a server up). A check
that something did NOT happen cannot be a wait: send a sentinel after the event under test and wait for the
sentinel instead (its arrival proves the earlier event was handled), as tests/e2e/gateway_engine_support.py
does for duplicate log lines.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T | None],
    timeout_s: float,
    what: str,
    interval_s: float = 0.02,
    retry_on: tuple[type[BaseException], ...] = (),
) -> T:
    """Call ``predicate()`` every ``interval_s`` seconds until it returns a truthy value; return that value.

    ``retry_on``: exceptions that mean "not yet" (e.g. ``OSError`` while a server starts); any other
    propagates. Raises AssertionError naming ``what``, the timeout and the last value (or exception) seen when
    ``timeout_s`` seconds pass first; the predicate is called at least once, and once more at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        expired = time.monotonic() >= deadline
        try:
            value = predicate()
        except retry_on as exc:
            last: object = exc
        else:
            if value:
                return value
            last = value
        if expired:
            shown = repr(last)
            shown = shown if len(shown) <= 500 else shown[:500] + "…"
            raise AssertionError(f"{what}: not within {timeout_s:g} s (last seen: {shown})")
        time.sleep(max(0.0, min(interval_s, deadline - time.monotonic())))


async def async_wait_until(
    predicate: Callable[[], T | None],
    timeout_s: float,
    what: str,
    interval_s: float = 0.005,
) -> T:
    """:func:`wait_until` for a test running on an event loop: sleeps with ``asyncio.sleep``, so the loop
    (a server, a connection under test) runs meanwhile. Same return value and AssertionError."""
    deadline = time.monotonic() + timeout_s
    while True:
        expired = time.monotonic() >= deadline
        value = predicate()
        if value:
            return value
        if expired:
            shown = repr(value)
            raise AssertionError(f"{what}: not within {timeout_s:g} s (last seen: {shown[:500]})")
        await asyncio.sleep(max(0.0, min(interval_s, deadline - time.monotonic())))
