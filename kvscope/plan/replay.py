"""Replay the gateway's request log (docs/logs.md) against a capacity: concurrency and KV over time.

Each record is one request in flight over ``[event.start, event.end)`` (half-open: a request that ends when
another starts is not concurrent with it). While in flight it is charged the KV blocks of its whole
sequence, ``ceil((gen_ai.usage.input_tokens + output_tokens) / block_size)`` (its size at the last token:
an upper bound of what it held; no prefix sharing). A sweep over start/end events gives the exact peak
concurrency and KV, the peak of every wall-clock minute (the "p99 minute" is the 99th percentile of those
peaks), and for a device capacity (KV blocks, max_num_seqs) the arrivals that would have had to wait.
The replay does not re-time requests: a queued arrival is counted, the later timeline is the observed one.
Only generations count: a record without ``gen_ai.usage.input_tokens`` (a 4xx refused at the edge, a
``/v1/models`` call, an upstream that never answered) held no KV and is left out, counted as
``not_generations``.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass

from kvscope.plan.formulas import blocks_for

MINUTE_S = 60.0
ZERO_DURATION_S = 1e-6
"""A request logged with end == start is in flight for this long (so it counts once)."""


@dataclass(frozen=True, slots=True)
class Span:
    """One logged request: in flight over [start_s, end_s) (epoch seconds), with its token counts."""

    start_s: float
    end_s: float
    input_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None


@dataclass(frozen=True, slots=True)
class Capacity:
    num_blocks: int
    max_num_seqs: int
    block_size: int


def quantile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0–1) by linear interpolation between ranks (Hyndman-Fan type 7, numpy's default,
    as ``kvscope logs report``); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _events(spans: list[Span], block_size: int) -> list[tuple[float, int, int, int]]:
    """(time, order, ±blocks, span index) sorted: ends (order 0) before starts (order 1) at a tie."""
    events = []
    for i, span in enumerate(spans):
        end = max(span.end_s, span.start_s + ZERO_DURATION_S)
        blocks = blocks_for(span.input_tokens + span.output_tokens, block_size)
        events.append((span.start_s, 1, blocks, i))
        events.append((end, 0, -blocks, i))
    return sorted(events)


@dataclass(frozen=True, slots=True)
class Timeline:
    """The sweep's results."""

    peak_concurrency: int
    peak_concurrency_at_s: float
    peak_blocks: int
    minute_peak_concurrency: dict[int, int]
    """epoch minute → most requests in flight during it."""
    minute_peak_blocks: dict[int, int]
    concurrency_at_arrival: tuple[int, ...]
    """Per span (input order): requests in flight just after it arrived, itself included."""
    queued_arrivals: int = 0
    seconds_over_capacity: float = 0.0


def sweep(spans: list[Span], block_size: int, capacity: Capacity | None = None) -> Timeline:
    """Sweep the start/end events of ``spans`` (see module doc). ``capacity`` counts the arrivals that find
    the device full (in flight > max_num_seqs or KV blocks > num_blocks, the arrival included).
    Every minute from the first arrival to the last end has a peak (0 when idle)."""
    count = blocks = peak = peak_blocks = queued = 0
    peak_at, prev_t, over_s = 0.0, None, 0.0
    minute_count: dict[int, int] = defaultdict(int)
    minute_blocks: dict[int, int] = defaultdict(int)
    at_arrival = [0] * len(spans)
    for t, order, delta_blocks, index in _events(spans, block_size):
        if prev_t is not None and t > prev_t and count:
            if capacity is not None and _over(count, blocks, capacity):
                over_s += t - prev_t
            for minute in range(int(prev_t // MINUTE_S), math.ceil(t / MINUTE_S)):
                minute_count[minute] = max(minute_count[minute], count)
                minute_blocks[minute] = max(minute_blocks[minute], blocks)
        prev_t = t
        count += 1 if order else -1
        blocks += delta_blocks
        if order:
            at_arrival[index] = count
            queued += capacity is not None and _over(count, blocks, capacity)
            if count > peak:
                peak, peak_at = count, t
            peak_blocks = max(peak_blocks, blocks)
    if spans and prev_t is not None:
        for minute in range(int(spans_first(spans) // MINUTE_S), math.ceil(prev_t / MINUTE_S)):
            minute_count.setdefault(minute, 0)
            minute_blocks.setdefault(minute, 0)
    return Timeline(
        peak,
        peak_at,
        peak_blocks,
        dict(sorted(minute_count.items())),
        dict(sorted(minute_blocks.items())),
        tuple(at_arrival),
        int(queued),
        over_s,
    )


def spans_first(spans: list[Span]) -> float:
    return min(s.start_s for s in spans)


def _over(count: int, blocks: int, capacity: Capacity) -> bool:
    return count > capacity.max_num_seqs or blocks > capacity.num_blocks


def ttft_p99_by_concurrency(spans: list[Span], timeline: Timeline) -> dict[int, float]:
    """Observed p99 TTFT (s) of the requests grouped by the concurrency they arrived into."""
    groups: dict[int, list[float]] = defaultdict(list)
    for span, concurrency in zip(spans, timeline.concurrency_at_arrival, strict=True):
        if span.ttft_s is not None:
            groups[concurrency].append(span.ttft_s)
    return {c: p99 for c, v in sorted(groups.items()) if (p99 := quantile(v, 0.99)) is not None}


def length_stats(values: list[int]) -> dict[str, float | None]:
    """p50/p90/p99/max/mean of a token-length list (None when empty)."""
    floats = [float(v) for v in values]
    return {
        "p50": quantile(floats, 0.5),
        "p90": quantile(floats, 0.9),
        "p99": quantile(floats, 0.99),
        "max": max(floats) if floats else None,
        "mean": statistics.fmean(floats) if floats else None,
    }
