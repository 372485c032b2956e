"""Console output (``vllm bench serve``'s layout) and the JSON result file of a run or a comparison."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

from kvscope.bench.metrics import BenchmarkMetrics, q_label
from kvscope.bench.runner import RunResult

TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


def summary_lines(metrics: BenchmarkMetrics, title: str = "Serving Benchmark Result") -> list[str]:
    """The run's figures as aligned text lines (vLLM's ``print`` block, plus input tok/s and errors)."""
    lines = [f"{' ' + title + ' ':=^50}"]

    def row(name: str, value: float | int, fmt: str = ".2f") -> None:
        lines.append(f"{name:<40} {value:<10{fmt if isinstance(value, float) else ''}}")

    row("Successful requests:", metrics.completed)
    row("Failed requests:", metrics.failed)
    row("Benchmark duration (s):", metrics.duration)
    row("Total input tokens:", metrics.total_input_tokens)
    row("Total generated tokens:", metrics.total_output_tokens)
    row("Request throughput (req/s):", metrics.request_throughput)
    row("Input token throughput (tok/s):", metrics.input_throughput)
    row("Output token throughput (tok/s):", metrics.output_throughput)
    row("Total token throughput (tok/s):", metrics.total_token_throughput)
    for name, stats in metrics.latencies.items():
        heading, short = TITLES[name]
        lines.append(f"{heading:-^50}")
        row(f"Mean {short} (ms):", stats.mean)
        row(f"Median {short} (ms):", stats.median)
        for q, value in stats.percentiles.items():
            if q != 50:
                row(f"P{q_label(q)} {short} (ms):", value)
    if metrics.error_counts:
        lines.append(f"{'Errors':-^50}")
        for error_type, count in sorted(metrics.error_counts.items()):
            row(f"{error_type}:", count)
    lines.append("=" * 50)
    return lines


def warning_lines(metrics: BenchmarkMetrics) -> list[str]:
    """Checks on the output lengths that make a comparison unfair when they fail."""
    warnings = []
    if metrics.output_len_mismatches:
        warnings.append(
            f"WARNING: {metrics.output_len_mismatches} requests produced a different number of output "
            "tokens than requested (server ignores ignore_eos/min_tokens?)"
        )
    if metrics.stream_usage_mismatches:
        warnings.append(
            f"NOTE: {metrics.stream_usage_mismatches} requests: token chunks in the stream ≠ "
            "usage.completion_tokens (a chunk carried several tokens, e.g. a multi-byte character; TPOT uses "
            "usage)"
        )
    if metrics.missing_usage:
        warnings.append(
            f"WARNING: {metrics.missing_usage} requests had no usage; tokens counted from the stream"
        )
    if metrics.cached_tokens:
        warnings.append(f"NOTE: {metrics.cached_tokens} prompt tokens were prefix-cache hits")
    return warnings


def print_summary(result: RunResult, out: TextIO) -> None:
    """Print the run's block and its warnings."""
    for line in summary_lines(result.metrics) + warning_lines(result.metrics):
        print(line, file=out)


def run_to_json(result: RunResult, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON result: configuration, flat vLLM-style metrics, vLLM's per-request lists (``input_lens``,
    ``output_lens``, ``ttfts``, ``itls``, ``errors``) and ``requests``: every request's timings (seconds)."""
    endpoint = asdict(result.endpoint) | {"api_key": None}
    load = asdict(result.load)
    load["request_rate"] = _json_float(load["request_rate"])
    outputs = result.outputs
    return {
        "date": result.started_at,
        "base_url": result.endpoint.base_url,
        "model": result.endpoint.model,
        "endpoint_type": result.endpoint.endpoint,
        "num_prompts": len(outputs),
        "endpoint": endpoint,
        "load": load,
        **(extra or {}),
        **result.metrics.as_dict(),
        "input_lens": [o.input_tokens for o in outputs],
        "output_lens": [o.output_tokens for o in outputs],
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "errors": [o.error for o in outputs],
        "requests": [_request_json(o) for o in outputs],
    }


def write_json(data: dict[str, Any], path: str | Path) -> None:
    """Write ``data`` to ``path`` (parents created), indented."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def comparison_lines(
    labels: Sequence[str], figures: dict[str, list[float]], ratios: dict[str, list[float]]
) -> list[str]:
    """A table: one row per figure, one column per endpoint (median over rounds) and one ratio column per
    endpoint after the first (median of the per-round ratios to the first endpoint)."""
    ratio_names = [f"{label}/{labels[0]}" for label in labels[1:]]
    width = max(14, *(len(label) + 2 for label in labels))
    ratio_width = max(16, *(len(name) + 2 for name in ratio_names))
    header = f"{'figure':<24}" + "".join(f"{label:>{width}}" for label in labels)
    header += "".join(f"{name:>{ratio_width}}" for name in ratio_names)
    lines = [header, "-" * len(header)]
    for name, values in figures.items():
        line = f"{name:<24}" + "".join(f"{v:>{width}.2f}" for v in values)
        line += "".join(f"{r:>{ratio_width}.3f}" for r in ratios[name])
        lines.append(line)
    return lines


def _request_json(o) -> dict[str, Any]:
    return {
        "success": o.success,
        "prompt_len": o.prompt_len,
        "expected_output_len": o.expected_output_len,
        "output_tokens": o.output_tokens,
        "stream_tokens": o.stream_tokens,
        "usage_output_tokens": o.usage_output_tokens,
        "usage_prompt_tokens": o.usage_prompt_tokens,
        "cached_tokens": o.cached_tokens,
        "start_time": o.start_time,
        "ttft": o.ttft,
        "tpot": o.tpot,
        "latency": o.latency,
        "itl": o.itl,
        "finish_reason": o.finish_reason,
        "error_type": o.error_type,
        "error": o.error,
    }


def _json_float(value: float) -> float | str:
    return "inf" if math.isinf(value) else value
