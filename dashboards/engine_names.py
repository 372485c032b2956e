"""Our engine's metrics and what vLLM and SGLang export for the same thing: one table, read by
docs/metrics.md (its "vLLM equivalent" and "SGLang equivalent" columns, metrics_doc.py) and by the engine
dashboard's vLLM and SGLang variants (engine_variants.py), so the page and the dashboards cannot disagree.

Sources: vLLM V1's ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``: every series labelled
``model_name`` and ``engine``; ``vllm:request_success_total`` also ``finished_reason``) and
``vllm/v1/spec_decode/metrics.py``; SGLang's ``python/sglang/srt/metrics/collector.py``
(``SchedulerMetricsCollector``: gauges and ``sglang:queue_time_seconds`` labelled ``model_name``,
``engine_type``, ``tp_rank``, ``pp_rank``, ``moe_ep_rank``; ``TokenizerMetricsCollector``: counters and
latency histograms labelled ``model_name``). The rows of the state the gateway samples (requests running
and waiting, KV-cache usage) are read from ``kvscope.common.upstream_metrics`` (the gateway scraper's table),
not repeated. Kinds are the values of the gateway's ``UpstreamKind`` (gateway/engines/kinds.py), spelled out
here because the dashboards package imports nothing of the gateway (import-linter: dashboards and gateway
are independent layers); tests/test_engine_variants.py checks they match.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvscope.common.upstream_metrics import METRIC_PREFIXES, UPSTREAM_METRIC_NAMES


@dataclass(frozen=True, slots=True)
class Equivalent:
    """What another engine exports for one of our metric families."""

    series: str | None = None
    """The series name as that engine exposes it, of the same type as ours: a counter with its ``_total``,
    a histogram's family name (``_bucket``/``_sum``/``_count`` follow), a gauge as is. None: no
    equivalent."""
    note: str = ""
    """Prose for docs/metrics.md: older names, a different definition, the closest thing when there is
    none."""

    def cell(self) -> str:
        """The docs/metrics.md cell: ``name (note)``, ``— (note)`` or ``—``."""
        head = f"`{self.series}`" if self.series else "—"
        return f"{head} ({self.note})" if self.note else head


VARIANT_KINDS = ("vllm", "sglang")
"""Upstream kinds (``UpstreamKind`` values) whose metric names get an engine dashboard variant."""
KIND_TITLES = {"vllm": "vLLM", "sglang": "SGLang"}
LABEL_NAMES: dict[str, dict[str, str | None]] = {
    "vllm": {"model": "model_name", "finish_reason": "finished_reason"},
    "sglang": {"model": "model_name", "finish_reason": None, "kind": None},
}
"""kind → our label → its label of the same meaning, None where the kind has no such label (SGLang's finished
requests have no finish reason, its structured-output counter no constraint kind: a ``by`` drops it, a legend
says "all"). A label not listed keeps its name."""


def variant_uid(kind: str) -> str:
    """The Grafana uid of the engine dashboard's variant for ``kind`` (``kvscope-engine-vllm``)."""
    return f"kvscope-engine-{kind}"


METRIC_PREFIX = {kind: METRIC_PREFIXES[kind] for kind in VARIANT_KINDS}
"""The prefix every series of the kind starts with (the dashboard variables' ``__name__`` regex;
``kvscope.common.upstream_metrics``, the table the gateway detects kinds with)."""

_NO_SPEC_COUNTERS = (
    "SGLang exports gauges of the last batch only: `sglang:spec_accept_rate`, `sglang:spec_accept_length`"
)
_DCGM_FB_USED = "DCGM exporter: `DCGM_FI_DEV_FB_USED`, MiB"


def _sampled(names: tuple[str, ...], note: str = "") -> Equivalent:
    """An equivalent read from the gateway scraper's table (``kvscope.common.upstream_metrics``, the same
    names the request log's sampled state comes from): its first name, older releases' names in the note."""
    first, *rest = names
    older = "older releases: " + ", ".join(f"`{n}`" for n in rest) if rest else ""
    return Equivalent(first, "; ".join(part for part in (older, note) if part))


ENGINE_EQUIVALENTS: dict[str, dict[str, Equivalent]] = {
    "kvscope_engine_requests_running": {
        kind: _sampled(UPSTREAM_METRIC_NAMES[kind].requests_running) for kind in VARIANT_KINDS
    },
    "kvscope_engine_requests_waiting": {
        kind: _sampled(UPSTREAM_METRIC_NAMES[kind].requests_waiting) for kind in VARIANT_KINDS
    },
    "kvscope_engine_kv_cache_usage_ratio": {
        "vllm": _sampled(UPSTREAM_METRIC_NAMES["vllm"].kv_cache_usage, "0–1"),
        "sglang": _sampled(
            UPSTREAM_METRIC_NAMES["sglang"].kv_cache_usage,
            f"KV tokens used / `{UPSTREAM_METRIC_NAMES['sglang'].kv_capacity_tokens[0]}`, 0–1",
        ),
    },
    "kvscope_engine_kv_cache_blocks": {
        "vllm": Equivalent(note="vLLM: `num_gpu_blocks` label of `vllm:cache_config_info`"),
        "sglang": Equivalent(note="in tokens: `sglang:num_used_tokens` of `sglang:max_total_num_tokens`"),
    },
    "kvscope_engine_prompt_tokens": {
        "vllm": Equivalent("vllm:prompt_tokens_total"),
        "sglang": Equivalent("sglang:prompt_tokens_total", "counted when the request finishes"),
    },
    "kvscope_engine_generation_tokens": {
        "vllm": Equivalent("vllm:generation_tokens_total"),
        "sglang": Equivalent("sglang:generation_tokens_total", "counted when the request finishes"),
    },
    "kvscope_engine_request_success": {
        "vllm": Equivalent("vllm:request_success_total", "label `finished_reason`"),
        "sglang": Equivalent(
            "sglang:num_requests_total",
            "no finish reason; aborts also in `sglang:num_aborted_requests_total`",
        ),
    },
    "kvscope_engine_preemptions": {
        "vllm": Equivalent("vllm:num_preemptions_total"),
        "sglang": Equivalent(
            "sglang:num_retracted_requests_total",
            "retractions, SGLang's preemptions; older releases: the gauge `sglang:num_retracted_reqs`",
        ),
    },
    "kvscope_engine_prefix_cache_queries": {
        "vllm": Equivalent(
            "vllm:prefix_cache_queries_total", "older V1 releases: `vllm:gpu_prefix_cache_queries_total`"
        ),
        "sglang": Equivalent(
            "sglang:prompt_tokens_total", "every prompt token is looked up in the radix cache"
        ),
    },
    "kvscope_engine_prefix_cache_hits": {
        "vllm": Equivalent(
            "vllm:prefix_cache_hits_total", "older V1 releases: `vllm:gpu_prefix_cache_hits_total`"
        ),
        "sglang": Equivalent("sglang:cached_tokens_total"),
    },
    "kvscope_engine_time_to_first_token_seconds": {
        "vllm": Equivalent("vllm:time_to_first_token_seconds"),
        "sglang": Equivalent("sglang:time_to_first_token_seconds"),
    },
    "kvscope_engine_inter_token_latency_seconds": {
        "vllm": Equivalent(
            "vllm:inter_token_latency_seconds", "older V1 releases: `vllm:time_per_output_token_seconds`"
        ),
        "sglang": Equivalent(
            "sglang:inter_token_latency_seconds", "older releases: `sglang:time_per_output_token_seconds`"
        ),
    },
    "kvscope_engine_time_per_output_token_seconds": {
        "vllm": Equivalent("vllm:request_time_per_output_token_seconds"),
    },
    "kvscope_engine_e2e_request_latency_seconds": {
        "vllm": Equivalent("vllm:e2e_request_latency_seconds"),
        "sglang": Equivalent("sglang:e2e_request_latency_seconds"),
    },
    "kvscope_engine_queue_time_seconds": {
        "vllm": Equivalent("vllm:request_queue_time_seconds"),
        "sglang": Equivalent("sglang:queue_time_seconds"),
    },
    "kvscope_engine_prefill_time_seconds": {
        "vllm": Equivalent("vllm:request_prefill_time_seconds"),
        "sglang": Equivalent(note="closest: `sglang:per_stage_req_latency_seconds` by `stage`"),
    },
    "kvscope_engine_decode_time_seconds": {
        "vllm": Equivalent("vllm:request_decode_time_seconds"),
    },
    "kvscope_engine_request_inference_time_seconds": {
        "vllm": Equivalent("vllm:request_inference_time_seconds"),
    },
    "kvscope_engine_request_params_n": {"vllm": Equivalent("vllm:request_params_n")},
    "kvscope_engine_request_params_max_tokens": {"vllm": Equivalent("vllm:request_params_max_tokens")},
    "kvscope_engine_http_requests": {
        "vllm": Equivalent(
            note="vLLM's API server: `http_requests_total` of prometheus-fastapi-instrumentator, "
            "labels `handler`, `status` as `2xx`"
        ),
    },
    "kvscope_engine_structured_output_requests": {
        "vllm": Equivalent(note="vLLM has no structured-output counter"),
        "sglang": Equivalent("sglang:num_so_requests_total", "no constraint kind"),
    },
    "kvscope_engine_structured_output_compile_seconds": {
        "sglang": Equivalent("sglang:grammar_compilation_time_seconds"),
    },
    "kvscope_engine_batch_size": {
        "vllm": Equivalent(note="closest: `vllm:num_requests_running` sampled per step"),
        "sglang": Equivalent(note="closest: `sglang:num_running_reqs` sampled per step"),
    },
    "kvscope_engine_step_tokens": {
        "vllm": Equivalent("vllm:iteration_tokens_total", "a histogram despite the name"),
    },
    "kvscope_engine_request_prompt_tokens": {
        "vllm": Equivalent("vllm:request_prompt_tokens"),
        "sglang": Equivalent("sglang:prompt_tokens_histogram", "with `--collect-tokens-histogram`"),
    },
    "kvscope_engine_request_generation_tokens": {
        "vllm": Equivalent("vllm:request_generation_tokens"),
        "sglang": Equivalent("sglang:generation_tokens_histogram", "with `--collect-tokens-histogram`"),
    },
    "kvscope_engine_device_memory_used_bytes": {"vllm": Equivalent(note=_DCGM_FB_USED)},
    "kvscope_engine_device_memory_total_bytes": {
        "vllm": Equivalent(note="DCGM exporter: `DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE`"),
    },
    "kvscope_engine_latency_cause_seconds": {"vllm": Equivalent(note="vLLM has no per-request attribution")},
    "kvscope_engine_requests_shed": {
        "vllm": Equivalent(note="vLLM queues every request (no admission by predicted TTFT)"),
    },
    "kvscope_engine_ttft_prediction_error_ratio": {"vllm": Equivalent(note="vLLM predicts no TTFT")},
    "kvscope_engine_tier_queue_time_seconds": {
        "vllm": Equivalent(note="closest: `vllm:request_queue_time_seconds`, not by priority"),
    },
    "kvscope_engine_tier_time_to_first_token_seconds": {
        "vllm": Equivalent(note="closest: `vllm:time_to_first_token_seconds`, not by priority"),
    },
    "kvscope_engine_gpu_memory_budget_bytes": {
        "vllm": Equivalent(note="vLLM: `gpu_memory_utilization` label of `vllm:cache_config_info`"),
    },
    "kvscope_engine_gpu_utilization_ratio": {
        "vllm": Equivalent(note="DCGM exporter: `DCGM_FI_DEV_GPU_UTIL`, %")
    },
    "kvscope_engine_gpu_temperature_celsius": {
        "vllm": Equivalent(note="DCGM exporter: `DCGM_FI_DEV_GPU_TEMP`")
    },
    "kvscope_engine_gpu_power_watts": {"vllm": Equivalent(note="DCGM exporter: `DCGM_FI_DEV_POWER_USAGE`")},
    "kvscope_engine_gpu_power_limit_watts": {
        "vllm": Equivalent(note="DCGM exporter: `DCGM_FI_DEV_POWER_MGMT_LIMIT`"),
    },
    "kvscope_engine_gpu_throttled": {
        "vllm": Equivalent(note="DCGM exporter: `DCGM_FI_DEV_CLOCK_THROTTLE_REASONS`, one bitmask"),
    },
    "kvscope_engine_torch_memory_reserved_bytes": {"vllm": Equivalent(note="`torch.cuda.memory_reserved`")},
    "kvscope_engine_torch_memory_allocated_bytes": {"vllm": Equivalent(note="`torch.cuda.memory_allocated`")},
    "kvscope_engine_torch_alloc_retries": {
        "vllm": Equivalent(note='`torch.cuda.memory_stats()["num_alloc_retries"]`'),
    },
    "kvscope_engine_torch_ooms": {"vllm": Equivalent(note='`torch.cuda.memory_stats()["num_ooms"]`')},
    "kvscope_engine_spec_decode_num_drafts": {
        "vllm": Equivalent("vllm:spec_decode_num_drafts_total"),
        "sglang": Equivalent(note=_NO_SPEC_COUNTERS),
    },
    "kvscope_engine_spec_decode_num_draft_tokens": {
        "vllm": Equivalent("vllm:spec_decode_num_draft_tokens_total")
    },
    "kvscope_engine_spec_decode_num_accepted_tokens": {
        "vllm": Equivalent("vllm:spec_decode_num_accepted_tokens_total"),
    },
    "kvscope_engine_spec_decode_num_accepted_tokens_per_pos": {
        "vllm": Equivalent("vllm:spec_decode_num_accepted_tokens_per_pos_total", "same `position` label"),
    },
    "kvscope_engine_spec_decode_acceptance_length": {
        "vllm": Equivalent(
            note="vLLM logs the mean acceptance length, 1 + accepted / drafts, from the counters"
        ),
        "sglang": Equivalent(note="the gauge `sglang:spec_accept_length`, mean of the last batch"),
    },
    "kvscope_gateway_requests": {
        "vllm": Equivalent(
            note="vLLM's API server: `http_requests_total` of prometheus-fastapi-instrumentator"
        ),
    },
    "kvscope_gateway_request_duration_seconds": {
        "vllm": Equivalent(note="vLLM's API server: `http_request_duration_seconds`"),
    },
}
"""Our metric family (prometheus_client's family name: a counter without ``_total``) → kind → what that
kind exports for it. A family or kind not listed has no equivalent and no note."""


def equivalent(family: str, kind: str) -> Equivalent:
    """What ``kind`` exports for our ``family`` (``Equivalent()`` when nothing)."""
    return ENGINE_EQUIVALENTS.get(family, {}).get(kind, Equivalent())
