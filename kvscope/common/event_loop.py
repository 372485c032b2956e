"""Which asyncio event loop the engine's and the gateway's uvicorn servers run on (a leaf: imports neither).

``auto`` (the default) is uvloop (libuv's loop, written in Cython; installed with both the ``engine`` and the
``gateway`` extras, as with ``uvicorn[standard]``) wherever it imports, else asyncio's own loop; ``uvloop``
and ``asyncio`` force one. Why uvloop: on the 2-core machines kvscope serves from, the server's event-loop
thread shares the cores with the engine's two OpenMP threads, and every microsecond it spends per streamed
token is taken from a decode step; uvloop spends less of it per callback (the engine's throughput at 32
streams and the gateway's CPU per relayed token, asyncio against uvloop: docs/benchmarks.md "uvloop under the
engine's and the gateway's servers").
"""

from __future__ import annotations

import importlib.util
from typing import Literal

EventLoop = Literal["auto", "uvloop", "asyncio"]
EVENT_LOOPS: tuple[str, ...] = ("auto", "uvloop", "asyncio")


def uvloop_available() -> bool:
    """Whether ``uvloop`` can be imported here (it has no Windows build)."""
    return importlib.util.find_spec("uvloop") is not None


def resolve_event_loop(choice: str) -> Literal["uvloop", "asyncio"]:
    """The loop to run for ``choice`` (uvicorn's ``loop`` setting takes the result as is).

    Raises ValueError for a choice not in :data:`EVENT_LOOPS`, or for ``uvloop`` where it is not installed."""
    if choice not in EVENT_LOOPS:
        raise ValueError(f"event loop must be one of {', '.join(EVENT_LOOPS)}, got {choice!r}")
    if choice == "asyncio":
        return "asyncio"
    if uvloop_available():
        return "uvloop"
    if choice == "uvloop":
        raise ValueError("event loop 'uvloop' was asked for but uvloop is not installed (pip install uvloop)")
    return "asyncio"
