"""The ``--from-log`` section of a plan: the observed traffic replayed against the planned device."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from kvscope.plan.planner import Plan, PlanRequest, slo_break_concurrency
from kvscope.plan.replay import Capacity, Span, length_stats, quantile, sweep, ttft_p99_by_concurrency
from kvscope.plan.shape import ModelShape


def _iso(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _dist(values: list[float]) -> dict[str, float | None]:
    return {
        "p50": quantile(values, 0.5),
        "p99": quantile(values, 0.99),
        "max": max(values) if values else None,
    }


def with_log(
    result: Plan,
    req: PlanRequest,
    shape: ModelShape,
    spans: list[Span],
    source: str,
    meta: dict[str, Any],
    device: Any,
) -> Plan:
    """``result`` with its ``log`` section: lengths, peak concurrency and KV, the per-minute distribution,
    whether the planned capacity would have queued, and where the TTFT SLO breaks (observed and bound)."""
    capacity = Capacity(result.memory["num_blocks"], result.flags["engine"]["--max-num-seqs"], req.block_size)
    timeline = sweep(spans, req.block_size, capacity)
    block_bytes = result.kv_cache["bytes_per_block"]
    minute_kv = [float(b * block_bytes) for b in timeline.minute_peak_blocks.values()]
    prompts = [s.input_tokens for s in spans]
    observed = ttft_p99_by_concurrency(spans, timeline)
    prompt_p99 = int(quantile([float(p) for p in prompts], 0.99) or req.prompt_len)
    speed = result.speed
    bound_at = slo_break_concurrency(
        req,
        shape,
        device,
        speed["peak_flops"],
        speed["streamed_weight_bytes"],
        speed["decode_context_tokens"],
        max(capacity.max_num_seqs, 1),
        max(prompt_p99, 1),
    )
    section = {
        "source": source,
        "requests": len(spans),
        **meta,
        "start": _iso(min(s.start_s for s in spans)) if spans else None,
        "end": _iso(max(s.end_s for s in spans)) if spans else None,
        "prompt_tokens": length_stats(prompts),
        "output_tokens": length_stats([s.output_tokens for s in spans]),
        "peak_concurrency": timeline.peak_concurrency,
        "peak_concurrency_at": _iso(timeline.peak_concurrency_at_s) if spans else None,
        "peak_kv_blocks": timeline.peak_blocks,
        "peak_kv_bytes": timeline.peak_blocks * block_bytes,
        "minutes": len(minute_kv),
        "minute_kv_bytes": _dist(minute_kv),
        "minute_concurrency": _dist([float(c) for c in timeline.minute_peak_concurrency.values()]),
        "capacity": {"num_blocks": capacity.num_blocks, "max_num_seqs": capacity.max_num_seqs},
        "would_queue": timeline.queued_arrivals > 0,
        "queued_arrivals": timeline.queued_arrivals,
        "seconds_over_capacity": timeline.seconds_over_capacity,
        "ttft_slo": {
            "ttft_slo_s": req.ttft_slo_s,
            "observed_p99_by_concurrency": observed,
            "observed_breaks_at_concurrency": next(
                (c for c, v in observed.items() if v > req.ttft_slo_s), None
            ),
            "bound_prompt_tokens": prompt_p99,
            "bound_breaks_at_concurrency": bound_at,
        },
        "kv_formula": (
            f"ceil((input_tokens + output_tokens) / {req.block_size}) blocks × {block_bytes} B per request "
            "in flight"
        ),
    }
    return replace(result, log=section)
