"""Request arrival times: a Poisson process (burstiness 1) or a gamma renewal process, as ``vllm bench
serve``.

Inter-arrival gaps are i.i.d. Gamma(shape=b, scale=1/(R·b)) seconds (vllm/benchmarks/serve.py
``get_request``): mean 1/R for every burstiness b, coefficient of variation 1/√b; b = 1 is the exponential
distribution, i.e. Poisson arrivals at rate R. R = inf sends every request at time 0.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")


def inter_arrival_times(num: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """``num`` gaps in seconds between consecutive requests (the first is the gap before request 0).

    Raises ValueError if ``request_rate`` ≤ 0 or ``burstiness`` ≤ 0. All gaps are 0.0 when the rate is inf.
    """
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num
    rng = random.Random(seed)
    scale = 1.0 / (request_rate * burstiness)
    return [rng.gammavariate(burstiness, scale) for _ in range(num)]


def arrival_offsets(gaps: Iterable[float]) -> list[float]:
    """Cumulative arrival times (seconds after the start) of the gaps from ``inter_arrival_times``."""
    offsets, total = [], 0.0
    for gap in gaps:
        total += gap
        offsets.append(total)
    return offsets


async def paced(
    items: Sequence[T],
    offsets: Sequence[float],
    clock: Callable[[], float],
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
) -> AsyncIterator[T]:
    """Yield ``items[i]`` once ``offsets[i]`` seconds have passed on ``clock`` since the first call.

    Sleeps to absolute deadlines, so lateness of one request does not shift the later ones.
    """
    start = clock()
    for item, offset in zip(items, offsets, strict=True):
        delay = start + offset - clock()
        if delay > 0:
            await sleep(delay)
        yield item
