"""Engine internals: where a request's time goes (queue → prefill → decode), what each step does, and how
the KV cache is used. The overview links here when an engine panel looks wrong."""

from __future__ import annotations

from kvscope.dashboards.alert_thresholds import alert_threshold
from kvscope.dashboards.grafana import Json, Target, dashboard, dashboard_link, row, timeseries
from kvscope.dashboards.overview import EN, GENERATION_ROUTES, latency_targets
from kvscope.dashboards.promql import PromQL

UID = "kvscope-engine"


def _phases(q: PromQL) -> list[Json]:
    return [
        row("Request phases"),
        timeseries(
            "Prefill time",
            "First scheduled to first token (includes chunked-prefill steps shared with other requests).",
            latency_targets(q, f"{EN}prefill_time_seconds"),
            "s",
            w=8,
        ),
        timeseries(
            "Decode time",
            "First token to last token.",
            latency_targets(q, f"{EN}decode_time_seconds"),
            "s",
            w=8,
        ),
        timeseries(
            "Inter-token latency",
            "Time between two consecutive output tokens (one observation per "
            "token, so long answers weigh more than in TPOT).",
            latency_targets(q, f"{EN}inter_token_latency_seconds"),
            "s",
            w=8,
        ),
        timeseries(
            "Finished requests / s",
            "Requests finished per second by finish reason (stop = EOS or "
            "stop string, length = max_tokens, abort = client gone, error).",
            [Target(q.sum_rate(f"{EN}request_success_total", by=("finish_reason",)), "{{finish_reason}}")],
            "reqps",
            stack=True,
        ),
        timeseries(
            "Mean request length",
            "Mean prompt and output length of finished requests (tokens).",
            [
                Target(q.mean(f"{EN}request_prompt_tokens"), "prompt"),
                Target(q.mean(f"{EN}request_generation_tokens"), "output"),
            ],
            "short",
        ),
        timeseries(
            "Inference time",
            "First scheduled to last token (prefill + decode) per request: the "
            "engine's working time, queueing excluded.",
            latency_targets(q, f"{EN}request_inference_time_seconds"),
            "s",
            w=8,
        ),
        timeseries(
            "Mean request parameters",
            "Mean max_tokens (of requests that set one) and n (choices per prompt) of finished requests.",
            [
                Target(q.mean(f"{EN}request_params_max_tokens"), "max_tokens"),
                Target(q.mean(f"{EN}request_params_n"), "n"),
            ],
            "short",
            w=8,
        ),
        timeseries(
            "Engine HTTP 5xx ratio",
            "Share of the engine server's generation requests answered with a "
            "5xx (the gateway retries those on another replica, so the gateway's own ratio can stay low) and "
            "of its streams broken after their 200 (an in-band error event); its /metrics and /health "
            "answers are not counted. KvscopeEngineHighErrorRate alerts on the two together.",
            [
                Target(
                    q.ratio(
                        q.sum_rate(f"{EN}http_requests_total", GENERATION_ROUTES, 'status=~"5.."'),
                        q.sum_rate(f"{EN}http_requests_total", GENERATION_ROUTES),
                    ),
                    "5xx",
                ),
                Target(
                    q.ratio(
                        q.sum_rate(f"{EN}stream_errors_total"),
                        q.sum_rate(f"{EN}http_requests_total", GENERATION_ROUTES),
                    ),
                    "broken streams",
                ),
            ],
            "percentunit",
            w=8,
            threshold=alert_threshold("KvscopeEngineHighErrorRate", long_window="1h"),
        ),
        timeseries(
            "Engine HTTP requests / s",
            "Requests answered by the engine server, by status and route.",
            [Target(q.sum_rate(f"{EN}http_requests_total", by=("status", "route")), "{{status}} {{route}}")],
            "reqps",
            stack=True,
        ),
    ]


def _steps(q: PromQL) -> list[Json]:
    return [
        row("Engine steps"),
        timeseries(
            "Tokens / s (engine)",
            "Prompt tokens prefilled and output tokens generated per second.",
            [
                Target(q.sum_rate(f"{EN}prompt_tokens_total"), "prompt"),
                Target(q.sum_rate(f"{EN}generation_tokens_total"), "generation"),
            ],
            "short",
            w=8,
        ),
        timeseries(
            "Tokens per step",
            "Tokens scheduled in one step (prefill chunks + one per decode); "
            "capped by max_num_batched_tokens.",
            latency_targets(q, f"{EN}step_tokens"),
            "short",
            w=8,
        ),
        timeseries(
            "Steps / s",
            "Engine steps per second (batch-size observations).",
            [Target(q.sum_rate(f"{EN}batch_size_count", by=("instance",)), "{{instance}}")],
            "short",
            w=8,
        ),
    ]


def _kv_cache(q: PromQL) -> list[Json]:
    hits, queries = f"{EN}prefix_cache_hits_total", f"{EN}prefix_cache_queries_total"
    return [
        row("KV cache"),
        timeseries(
            "KV blocks by state",
            "used = held by requests, cached = free but holding a reusable "
            "prefix (evicted LRU), free = empty.",
            [Target(q.gauge(f"{EN}kv_cache_blocks", by=("state",)), "{{state}}")],
            "short",
            stack=True,
            w=8,
        ),
        timeseries(
            "Prefix-cache tokens / s",
            "Prompt tokens looked up in the prefix cache and found there.",
            [Target(q.sum_rate(queries), "queried"), Target(q.sum_rate(hits), "hit")],
            "short",
            w=8,
        ),
        timeseries(
            "Preemptions per finished request",
            "Preemptions / finished requests: above ~0.1 the KV cache is too small for the load.",
            [
                Target(
                    q.ratio(q.sum_rate(f"{EN}preemptions_total"), q.sum_rate(f"{EN}request_success_total")),
                    "ratio",
                )
            ],
            "short",
            w=8,
        ),
    ]


def _structured(q: PromQL) -> list[Json]:
    return [
        row("Structured output"),
        timeseries(
            "Constrained requests / s",
            "Requests decoded under a grammar (response_format, "
            "structured_outputs/guided_*, tool_choice required or named), by constraint kind.",
            [Target(q.sum_rate(f"{EN}structured_output_requests_total", by=("kind",)), "{{kind}}")],
            "reqps",
            stack=True,
            w=8,
        ),
        timeseries(
            "Grammar compile time",
            "llguidance compile time of a constraint not yet in the cache.",
            latency_targets(q, f"{EN}structured_output_compile_seconds"),
            "s",
            w=8,
        ),
        timeseries(
            "Mask time per step",
            "Time a step spent filling the token bitmasks of its constrained requests.",
            latency_targets(q, f"{EN}structured_output_mask_seconds"),
            "s",
            w=8,
        ),
    ]


def _admission(q: PromQL) -> list[Json]:
    """Issue 42: what admission refused and how good the prediction it decides on is."""
    return [
        row("Admission"),
        timeseries(
            "Shed requests / s",
            "Requests refused at admission (ttft_slo: predicted TTFT over the tier's objective, a 503 with "
            "Retry-After) or dropped from the queue before their prefill (deadline), by tier and reason.",
            [Target(q.sum_rate(f"{EN}requests_shed_total", by=("tier", "reason")), "{{tier}} {{reason}}")],
            "reqps",
            stack=True,
            w=12,
        ),
        timeseries(
            "TTFT p99 by tier",
            "Arrival to first token in the engine, 99th percentile per service tier (priority, default, "
            "flex): what each tier's --ttft-slo objective is held against. Better tiers go first, so flex "
            "rises first under load.",
            [Target(q.quantile(0.99, f"{EN}tier_time_to_first_token_seconds", by=("tier",)), "{{tier}}")],
            "s",
            w=12,
        ),
        timeseries(
            "Queue time by tier",
            "Arrival to first scheduled, p50 and p99 per service tier: how long each tier waits behind the "
            "others (and behind admission's refusals, which keep it bounded).",
            [
                Target(q.quantile(0.5, f"{EN}tier_queue_time_seconds", by=("tier",)), "{{tier}} p50"),
                Target(q.quantile(0.99, f"{EN}tier_queue_time_seconds", by=("tier",)), "{{tier}} p99"),
            ],
            "s",
            w=12,
        ),
        timeseries(
            "TTFT prediction error",
            "|predicted - actual| / actual time to first token of the requests admitted (the prediction "
            "made when each was queued). Issue 42's bound: a median at or under 0.25.",
            [
                Target(q.quantile(0.5, f"{EN}ttft_prediction_error_ratio"), "p50"),
                Target(q.quantile(0.9, f"{EN}ttft_prediction_error_ratio"), "p90"),
            ],
            "percentunit",
            w=12,
        ),
    ]


def _spec_decode(q: PromQL) -> list[Json]:
    sd = f"{EN}spec_decode_"
    drafts, proposed, accepted = (
        q.sum_rate(f"{sd}{n}_total") for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    )
    per_position = q.sum_rate(f"{sd}num_accepted_tokens_per_pos_total", by=("position",))
    return [
        row("Speculative decoding"),
        timeseries(
            "Draft acceptance rate",
            "Accepted / proposed draft tokens (n-gram speculation, "
            "--speculative ngram); no point while nothing is proposed. Per position: share of drafts "
            "whose token at that position was accepted (falls with the position).",
            [
                Target(q.ratio(accepted, proposed), "all positions"),
                Target(f"{per_position} / on() group_left() ({drafts} > 0)", "position {{position}}"),
            ],
            "percentunit",
            w=8,
            max_value=1,
        ),
        timeseries(
            "Mean acceptance length",
            "Tokens emitted per verification of a draft (1 + accepted draft "
            "tokens; vLLM's mean acceptance length): 1 = nothing accepted, k+1 = whole drafts accepted. "
            "Decode tokens per forward pass for the requests that speculated.",
            [
                Target(q.mean(f"{sd}acceptance_length"), "mean"),
                Target(q.quantile(0.5, f"{sd}acceptance_length"), "p50"),
            ],
            "short",
            w=8,
        ),
        timeseries(
            "Draft tokens / s",
            "Drafts verified, tokens proposed and tokens accepted per second.",
            [Target(drafts, "drafts"), Target(proposed, "proposed"), Target(accepted, "accepted")],
            "short",
            w=8,
        ),
    ]


GPU_PANELS = (
    "GPU memory",
    "GPU utilisation",
    "GPU temperature",
    "GPU power",
    "GPU throttle reasons",
    "Allocator OOMs and retries",
)
"""Panels of NVML/torch.cuda series, which exist only while the engine runs on a CUDA device (empty on
CPU)."""


def _gpu(q: PromQL) -> list[Json]:
    by = ("instance", "device")
    return [
        row("GPU (CUDA only: no series on CPU)"),
        timeseries(
            "GPU memory",
            "Memory used on the device (NVML) against the engine's budget "
            "(gpu_memory_utilization x total, reserved on purpose at start-up) and the total; torch's "
            "caching allocator: reserved and in live tensors. Alert KvscopeGPUMemoryOverBudget fires 5 % "
            "of the device above the budget.",
            [
                Target(
                    q.gauge(f"{EN}device_memory_used_bytes", 'device=~"cuda.*"', by=by),
                    "used {{instance}} {{device}}",
                ),
                Target(q.gauge(f"{EN}gpu_memory_budget_bytes", by=by), "budget {{instance}} {{device}}"),
                Target(
                    q.gauge(f"{EN}device_memory_total_bytes", 'device=~"cuda.*"', by=by),
                    "total {{instance}} {{device}}",
                ),
                Target(
                    q.gauge(f"{EN}torch_memory_reserved_bytes", by=by),
                    "torch reserved {{instance}} {{device}}",
                ),
                Target(
                    q.gauge(f"{EN}torch_memory_allocated_bytes", by=by),
                    "torch allocated {{instance}} {{device}}",
                ),
            ],
            "bytes",
            w=8,
        ),
        timeseries(
            "GPU utilisation",
            "Share of NVML's last sample period in which a kernel ran.",
            [Target(q.gauge(f"{EN}gpu_utilization_ratio", by=by), "{{instance}} {{device}}")],
            "percentunit",
            w=8,
            max_value=1,
        ),
        timeseries(
            "GPU temperature",
            "Core temperature (NVML).",
            [Target(q.gauge(f"{EN}gpu_temperature_celsius", by=by, agg="max"), "{{instance}} {{device}}")],
            "celsius",
            w=8,
        ),
        timeseries(
            "GPU power",
            "Power draw and the enforced power limit (NVML).",
            [
                Target(q.gauge(f"{EN}gpu_power_watts", by=by), "draw {{instance}} {{device}}"),
                Target(q.gauge(f"{EN}gpu_power_limit_watts", by=by), "limit {{instance}} {{device}}"),
            ],
            "watt",
            w=8,
        ),
        timeseries(
            "GPU throttle reasons",
            "NVML clocks event reasons in force (1 = active). sw_power_cap is a "
            "busy GPU at its power limit; thermal, hw_slowdown and power-brake reasons fire "
            "KvscopeGPUThrottled.",
            [
                Target(
                    q.gauge(f"{EN}gpu_throttled", 'reason!="gpu_idle"', by=(*by, "reason"), agg="max"),
                    "{{reason}} {{instance}} {{device}}",
                )
            ],
            "short",
            w=8,
            max_value=1,
        ),
        timeseries(
            "Allocator OOMs and retries",
            "torch's caching allocator: out-of-memory errors and "
            "allocations retried after freeing its cache, per interval (KvscopeGPUAllocatorFailures).",
            [
                Target(q.sum_increase(f"{EN}torch_ooms_total", by=by), "OOMs {{instance}} {{device}}"),
                Target(
                    q.sum_increase(f"{EN}torch_alloc_retries_total", by=by), "retries {{instance}} {{device}}"
                ),
            ],
            "short",
            w=8,
        ),
    ]


def panels(q: PromQL) -> list[Json]:
    """The rows and panels of the engine-internals dashboard (also the body of its vLLM and SGLang variants,
    engine_variants.py); raises KeyError/ValueError on a metric the catalog lacks."""
    return [
        *_phases(q),
        *_steps(q),
        *_kv_cache(q),
        *_admission(q),
        *_gpu(q),
        *_structured(q),
        *_spec_decode(q),
    ]


def build(q: PromQL) -> Json:
    """The engine-internals dashboard; raises KeyError/ValueError on a metric the catalog lacks."""
    links = [dashboard_link("Overview", "kvscope-overview")]
    return dashboard(
        UID,
        "kvscope / Engine internals",
        "Request phases, engine steps, KV cache, admission, GPU, structured output and speculative decoding.",
        panels(q),
        links,
    )
