"""One benchmark run: warm-up, paced arrivals, an optional concurrency cap, a progress bar, the metrics.

As ``vllm bench serve``: every request is launched at its arrival time (Poisson/gamma gaps, or all at once at
rate inf) and, with ``max_concurrency``, then waits for one of C slots before it is sent; duration runs from
the first arrival to the last completion.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

import httpx

from kvscope.bench.arrival import arrival_offsets, inter_arrival_times, paced
from kvscope.bench.client import EndpointConfig, RequestOutput, send_request
from kvscope.bench.dataset import SampleRequest
from kvscope.bench.metrics import BenchmarkMetrics, calculate_metrics

WARMUP_MAX_TOKENS = 16
# not a dataset prompt, so warming up does not put any benchmark prompt into a prefix cache
WARMUP_PROMPT = (
    "This is a warm-up request of the kvscope serving benchmark. Please reply with a short greeting."
)


class BenchmarkError(RuntimeError):
    """The benchmark cannot run (e.g. the warm-up request failed: wrong URL, model or arguments)."""


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """How requests are offered: ``request_rate`` in requests/s (inf = all at once), gamma ``burstiness``
    (1 = Poisson), at most ``max_concurrency`` in flight (None = unlimited)."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    num_warmups: int = 1
    request_timeout_s: float = 600.0
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)


@dataclass(frozen=True, slots=True)
class RunResult:
    """Everything one run measured; ``outputs[i]`` belongs to ``samples[i]``."""

    endpoint: EndpointConfig
    load: LoadConfig
    samples: list[SampleRequest]
    outputs: list[RequestOutput]
    metrics: BenchmarkMetrics
    started_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))


def make_client(load: LoadConfig) -> httpx.AsyncClient:
    """An HTTP client without a connection cap (httpx's default of 100 would silently cap concurrency) and
    without proxies from the environment (the benchmark measures the server, not a proxy)."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(load.request_timeout_s, connect=10.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        trust_env=False,
    )


async def run_benchmark(
    endpoint: EndpointConfig,
    samples: Sequence[SampleRequest],
    load: LoadConfig,
    *,
    client: httpx.AsyncClient | None = None,
    clock: Callable[[], float] = time.perf_counter,
    progress: bool = True,
    label: str = "",
) -> RunResult:
    """Run ``samples`` against ``endpoint`` under ``load``; returns per-request outputs and the metrics.

    Raises BenchmarkError if a warm-up request fails, ValueError on an empty ``samples``.
    """
    if not samples:
        raise ValueError("no samples to send")
    owned = client is None
    client = client or make_client(load)
    try:
        await _warm_up(client, endpoint, samples, load.num_warmups, clock)
        started_at = datetime.now(UTC).isoformat(timespec="seconds")
        outputs, duration = await _timed_run(client, endpoint, samples, load, clock, progress, label)
    finally:
        if owned:
            await client.aclose()
    metrics = calculate_metrics(outputs, duration, load.percentiles)
    return RunResult(endpoint, load, list(samples), outputs, metrics, started_at)


async def _warm_up(
    client: httpx.AsyncClient,
    endpoint: EndpointConfig,
    samples: Sequence[SampleRequest],
    num: int,
    clock: Callable[[], float],
) -> None:
    max_tokens = min(WARMUP_MAX_TOKENS, min(s.expected_output_len for s in samples))
    for i in range(num):
        sample = SampleRequest(f"{WARMUP_PROMPT} ({i})", 0, max_tokens)
        out = await send_request(client, endpoint, sample, clock)
        if not out.success:
            raise BenchmarkError(f"warm-up request to {endpoint.url} failed ({out.error_type}): {out.error}")


async def _timed_run(
    client: httpx.AsyncClient,
    endpoint: EndpointConfig,
    samples: Sequence[SampleRequest],
    load: LoadConfig,
    clock: Callable[[], float],
    progress: bool,
    label: str,
) -> tuple[list[RequestOutput], float]:
    from tqdm import tqdm

    gaps = inter_arrival_times(len(samples), load.request_rate, load.burstiness, load.seed)
    slots = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    bar = tqdm(
        total=len(samples), disable=not progress, file=sys.stderr, desc=label or None, unit="req", leave=False
    )

    async def one(sample: SampleRequest) -> RequestOutput:
        if slots is None:
            out = await send_request(client, endpoint, sample, clock)
        else:
            async with slots:
                out = await send_request(client, endpoint, sample, clock)
        bar.update(1)
        return out

    start = clock()
    tasks = [asyncio.create_task(one(s)) async for s in paced(samples, arrival_offsets(gaps), clock)]
    outputs = list(await asyncio.gather(*tasks))
    duration = clock() - start
    bar.close()
    return outputs, duration
