"""Benchmark statistics with the names and definitions of ``vllm bench serve`` (vllm/benchmarks/serve.py
``calculate_metrics``), so the numbers are comparable.

- completed / failed: requests that did / did not finish a stream with at least one token.
- request_throughput = completed / duration; input_throughput = Σ prompt_len / duration;
  output_throughput = Σ output tokens / duration; total_token_throughput = (Σ in + Σ out) / duration
  (completed requests only; duration = first arrival → last completion, seconds).
- TTFT, e2e latency (E2EL): one value per completed request. TPOT = (e2e − TTFT) / (output tokens − 1), for
  completed requests with ≥ 2 output tokens. ITL: every gap between consecutive token chunks of every
  completed request, pooled.
- Each latency: mean, median, std (population, as ``np.std``) and percentiles by linear interpolation
  between closest ranks (``np.percentile``'s default), reported in milliseconds.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvscope.bench.client import RequestOutput

LATENCIES = ("ttft", "tpot", "itl", "e2el")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0–100) of ``values`` by linear interpolation (numpy's default ``linear``
    method): rank h = (n−1)·q/100, result x[⌊h⌋] + (h−⌊h⌋)·(x[⌊h⌋+1] − x[⌊h⌋]). 0.0 for no values.
    Raises ValueError if q ∉ [0, 100]."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (rank - low) * (ordered[high] - ordered[low])


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """Summary of one latency, in milliseconds. ``percentiles`` maps q (e.g. 99.0) to the value."""

    mean: float
    median: float
    std: float
    percentiles: dict[float, float]
    count: int

    @classmethod
    def of(cls, seconds: Sequence[float], qs: Sequence[float]) -> LatencyStats:
        """Stats of ``seconds`` (converted to ms); all zero for an empty sequence (as vLLM's ``or 0``)."""
        ms = [s * 1000.0 for s in seconds]
        if not ms:
            return cls(0.0, 0.0, 0.0, {float(q): 0.0 for q in qs}, 0)
        mean = sum(ms) / len(ms)
        std = math.sqrt(sum((x - mean) ** 2 for x in ms) / len(ms))
        return cls(mean, percentile(ms, 50), std, {float(q): percentile(ms, q) for q in qs}, len(ms))


@dataclass(frozen=True, slots=True)
class BenchmarkMetrics:
    """Aggregate figures of one run (vLLM names). Latency stats in ms, throughputs per second."""

    duration: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_token_throughput: float
    latencies: dict[str, LatencyStats]
    error_counts: dict[str, int] = field(default_factory=dict)
    output_len_mismatches: int = 0  # completed requests whose output tokens ≠ the expected length
    stream_usage_mismatches: int = 0  # completed requests whose stream count ≠ usage.completion_tokens
    missing_usage: int = 0  # completed requests without usage.completion_tokens
    server_input_tokens: int = 0  # Σ usage.prompt_tokens (chat template / BOS included)
    cached_tokens: int = 0  # Σ usage.prompt_tokens_details.cached_tokens (prefix-cache hits)

    def as_dict(self) -> dict[str, float | int | dict[str, int]]:
        """Flat vLLM-style keys: ``mean_ttft_ms``, ``median_tpot_ms``, ``std_itl_ms``, ``p99_e2el_ms`` …"""
        flat: dict[str, float | int | dict[str, int]] = {
            name: getattr(self, name)
            for name in (
                "duration",
                "completed",
                "failed",
                "total_input_tokens",
                "total_output_tokens",
                "request_throughput",
                "input_throughput",
                "output_throughput",
                "total_token_throughput",
                "output_len_mismatches",
                "stream_usage_mismatches",
                "missing_usage",
                "server_input_tokens",
                "cached_tokens",
            )
        }
        flat["error_counts"] = dict(self.error_counts)
        for name, stats in self.latencies.items():
            flat[f"mean_{name}_ms"] = stats.mean
            flat[f"median_{name}_ms"] = stats.median
            flat[f"std_{name}_ms"] = stats.std
            for q, value in stats.percentiles.items():
                flat[f"p{q_label(q)}_{name}_ms"] = value
        return flat


def calculate_metrics(
    outputs: Sequence[RequestOutput], duration: float, percentiles: Sequence[float] = (50, 90, 99)
) -> BenchmarkMetrics:
    """Aggregate ``outputs`` of a run that took ``duration`` seconds. Raises ValueError if duration ≤ 0."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0, got {duration}")
    done = [o for o in outputs if o.success]
    total_in = sum(o.input_tokens for o in done)
    total_out = sum(o.output_tokens for o in done)
    samples = {
        "ttft": [o.ttft for o in done],
        "tpot": [t for o in done if (t := o.tpot) is not None],
        "itl": [gap for o in done for gap in o.itl],
        "e2el": [o.latency for o in done],
    }
    return BenchmarkMetrics(
        duration=duration,
        completed=len(done),
        failed=len(outputs) - len(done),
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(done) / duration,
        input_throughput=total_in / duration,
        output_throughput=total_out / duration,
        total_token_throughput=(total_in + total_out) / duration,
        latencies={name: LatencyStats.of(samples[name], percentiles) for name in LATENCIES},
        error_counts=dict(Counter(o.error_type for o in outputs if not o.success)),
        output_len_mismatches=sum(o.output_tokens != o.expected_output_len for o in done),
        stream_usage_mismatches=sum(o.usage_output_tokens not in (None, o.stream_tokens) for o in done),
        missing_usage=sum(o.usage_output_tokens is None for o in done),
        server_input_tokens=sum(o.usage_prompt_tokens or 0 for o in done),
        cached_tokens=sum(o.cached_tokens or 0 for o in done),
    )


def q_label(q: float) -> str:
    """99.0 → "99", 99.9 → "99.9" (vLLM's key format)."""
    return str(int(q)) if float(q).is_integer() else str(q)
