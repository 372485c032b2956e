"""Renders docs/metrics.md: the metric catalog, where each metric is shown or alerted on, and vLLM names."""

from __future__ import annotations

from collections.abc import Sequence

from kvscope.dashboards.catalog import Catalog, MetricInfo
from kvscope.dashboards.coverage import alerted_by, not_shown, shown_on
from kvscope.dashboards.grafana import Json

VLLM_NAMES = {
    "kvscope_engine_requests_running": "`vllm:num_requests_running`",
    "kvscope_engine_requests_waiting": "`vllm:num_requests_waiting`",
    "kvscope_engine_kv_cache_usage_ratio": "`vllm:kv_cache_usage_perc` (older V1 releases: "
    "`vllm:gpu_cache_usage_perc`), 0–1",
    "kvscope_engine_kv_cache_blocks": "— (vLLM: `num_gpu_blocks` label of `vllm:cache_config_info`)",
    "kvscope_engine_prompt_tokens": "`vllm:prompt_tokens_total`",
    "kvscope_engine_generation_tokens": "`vllm:generation_tokens_total`",
    "kvscope_engine_request_success": "`vllm:request_success_total` (label `finished_reason`)",
    "kvscope_engine_preemptions": "`vllm:num_preemptions_total`",
    "kvscope_engine_prefix_cache_queries": "`vllm:prefix_cache_queries_total` (older V1 releases: "
    "`vllm:gpu_prefix_cache_queries_total`)",
    "kvscope_engine_prefix_cache_hits": "`vllm:prefix_cache_hits_total` (older V1 releases: "
    "`vllm:gpu_prefix_cache_hits_total`)",
    "kvscope_engine_time_to_first_token_seconds": "`vllm:time_to_first_token_seconds`",
    "kvscope_engine_inter_token_latency_seconds": "`vllm:inter_token_latency_seconds` (older V1 releases: "
    "`vllm:time_per_output_token_seconds`)",
    "kvscope_engine_time_per_output_token_seconds": "`vllm:request_time_per_output_token_seconds`",
    "kvscope_engine_e2e_request_latency_seconds": "`vllm:e2e_request_latency_seconds`",
    "kvscope_engine_queue_time_seconds": "`vllm:request_queue_time_seconds`",
    "kvscope_engine_prefill_time_seconds": "`vllm:request_prefill_time_seconds`",
    "kvscope_engine_decode_time_seconds": "`vllm:request_decode_time_seconds`",
    "kvscope_engine_request_inference_time_seconds": "`vllm:request_inference_time_seconds`",
    "kvscope_engine_request_params_n": "`vllm:request_params_n`",
    "kvscope_engine_request_params_max_tokens": "`vllm:request_params_max_tokens`",
    "kvscope_engine_http_requests": "— (vLLM's API server: `http_requests_total` of "
    "prometheus-fastapi-instrumentator, labels `handler`, `status` as `2xx`)",
    "kvscope_engine_structured_output_requests": "— (vLLM has no structured-output counter)",
    "kvscope_engine_structured_output_compile_seconds": "—",
    "kvscope_engine_structured_output_mask_seconds": "—",
    "kvscope_engine_batch_size": "— (closest: `vllm:num_requests_running` sampled per step)",
    "kvscope_engine_step_tokens": "`vllm:iteration_tokens_total` (a histogram despite the name)",
    "kvscope_engine_request_prompt_tokens": "`vllm:request_prompt_tokens`",
    "kvscope_engine_request_generation_tokens": "`vllm:request_generation_tokens`",
    "kvscope_engine_device_memory_used_bytes": "— (DCGM exporter: `DCGM_FI_DEV_FB_USED`, MiB)",
    "kvscope_engine_device_memory_total_bytes": "— (DCGM exporter: "
    "`DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE`)",
    "kvscope_engine_latency_cause_seconds": "— (vLLM has no per-request attribution)",
    "kvscope_engine_gpu_memory_budget_bytes": "— (vLLM: `gpu_memory_utilization` label of "
    "`vllm:cache_config_info`)",
    "kvscope_engine_gpu_utilization_ratio": "— (DCGM exporter: `DCGM_FI_DEV_GPU_UTIL`, %)",
    "kvscope_engine_gpu_temperature_celsius": "— (DCGM exporter: `DCGM_FI_DEV_GPU_TEMP`)",
    "kvscope_engine_gpu_power_watts": "— (DCGM exporter: `DCGM_FI_DEV_POWER_USAGE`)",
    "kvscope_engine_gpu_power_limit_watts": "— (DCGM exporter: `DCGM_FI_DEV_POWER_MGMT_LIMIT`)",
    "kvscope_engine_gpu_throttled": "— (DCGM exporter: `DCGM_FI_DEV_CLOCK_THROTTLE_REASONS`, one bitmask)",
    "kvscope_engine_torch_memory_reserved_bytes": "— (`torch.cuda.memory_reserved`)",
    "kvscope_engine_torch_memory_allocated_bytes": "— (`torch.cuda.memory_allocated`)",
    "kvscope_engine_torch_alloc_retries": '— (`torch.cuda.memory_stats()["num_alloc_retries"]`)',
    "kvscope_engine_torch_ooms": '— (`torch.cuda.memory_stats()["num_ooms"]`)',
    "kvscope_engine_spec_decode_num_drafts": "`vllm:spec_decode_num_drafts_total`",
    "kvscope_engine_spec_decode_num_draft_tokens": "`vllm:spec_decode_num_draft_tokens_total`",
    "kvscope_engine_spec_decode_num_accepted_tokens": "`vllm:spec_decode_num_accepted_tokens_total`",
    "kvscope_engine_spec_decode_num_accepted_tokens_per_pos": (
        "`vllm:spec_decode_num_accepted_tokens_per_pos_total` (same `position` label)"
    ),
    "kvscope_engine_spec_decode_acceptance_length": "— (vLLM logs the mean acceptance length, 1 + accepted / "
    "drafts, from the counters)",
    "kvscope_gateway_requests": "— (vLLM's API server: `http_requests_total` of "
    "prometheus-fastapi-instrumentator)",
    "kvscope_gateway_request_duration_seconds": "— (vLLM's API server: `http_request_duration_seconds`)",
}
"""Family name → the vLLM metric that measures the same thing (vLLM labels every series ``model_name``)."""

BUCKET_NOTES = {
    "kvscope_engine_spec_decode_acceptance_length": "1, 2, …, k+1 with k the engine's num_speculative_tokens "
    "(`kvscope.engine.server.metrics.acceptance_length_buckets`; 1 with "
    "speculation off)",
}
"""Histograms whose bounds follow the engine's configuration rather than MetricBuckets."""

_INTRO = """\
# Metrics

Generated by `python -m kvscope.dashboards.generate` from the collector classes (`engine/server/metrics.py`,
`gateway/metrics.py`); `python -m kvscope.dashboards.generate --check` fails when this page or a dashboard is
stale.

Conventions (Prometheus naming): `kvscope_` prefix, then the component; base units (seconds, bytes, ratios
0–1); counters end in `_total`; histograms expose `_bucket`, `_sum`, `_count`. Labels are bounded: `model`
is a served model name (unknown names become `"unknown"`), `status` an HTTP code, `finish_reason` one of
`stop`/`length`/`abort`/`error`, `state` one of `used`/`cached`/`free`, `device` `cpu` or `cuda:N`.
Dashboards compute means as `sum(rate(x_sum)) / (sum(rate(x_count)) > 0)` and quantiles with
`histogram_quantile` over `sum by (le)`.

Labels add up: the values of one label are disjoint, so `sum by (label)` is the total. Hence cached prompt
tokens (a subset of `type="input"`) are `kvscope_gateway_cached_tokens_total`, not a third token type, and
spooled log records (a transit state) are `kvscope_gateway_log_records_spooled_total`, not an outcome.
Label sets known at start (rate-limit reasons, upstream error reasons, log sinks and outcomes, the served
models' token types and stream-error reasons) are exported at 0, so panels read 0 rather than "No data".
The speculative-decoding series (`kvscope_engine_spec_decode_*`, vLLM's `vllm:spec_decode_*` family) are
exported at 0 with speculation off too, like every other counter; `…_per_pos_total` has one `position` per
draft slot of the configured `num_speculative_tokens` k (`"0"` … `"k-1"`, none with speculation off), and a
draft with `a` accepted tokens counts once at positions 0 … a-1, so position i over `…_num_drafts_total` is
the acceptance rate of the i-th proposed token.
Latency histograms reach past the gateway's total timeout (1800 s): no request lands only in `+Inf`.
Both services also export prometheus_client's standard process metrics (`process_cpu_seconds_total`,
`process_resident_memory_bytes`, `process_open_fds`, … of the server process) and a `…_build_info` gauge,
always 1, labelled with the kvscope `version` and the `python` version (count it by `version` during a
rollout).

GPU series (`kvscope_engine_gpu_*`, `kvscope_engine_torch_*`) exist only while the engine runs on a CUDA
device: on CPU they are absent, not 0. The engine samples them every `--gpu-telemetry-interval` seconds (5 by
default; engine/server/gpu_telemetry.py) through NVML (the `nvidia-ml-py` bindings, `pynvml`) and
`torch.cuda.memory_stats`, together with `kvscope_engine_device_memory_used_bytes`/`…_total_bytes`, which on
CUDA are NVML's used/total (refreshed, not written once) and on CPU the KV cache + weights and the host's
memory. `kvscope_engine_gpu_throttled{reason}` is 1 while NVML reports that clocks event (throttle) reason:
`gpu_idle`, `applications_clocks_setting`, `sw_power_cap`, `hw_slowdown`, `sync_boost`, `sw_thermal_slowdown`,
`hw_thermal_slowdown`, `hw_power_brake_slowdown`, `display_clock_setting`. The engine reserves
`gpu_memory_utilization` of the device on purpose (`kvscope_engine_gpu_memory_budget_bytes`), so memory alerts
compare memory used with that budget, never with the total.

Exemplars: `/metrics` (gateway and engine) answers in OpenMetrics 1.0 when the scraper's `Accept` asks for
`application/openmetrics-text`, else in the Prometheus text format. The gateway's request-duration, TTFT
and TPOT histograms carry the `trace_id` of a sampled request as an exemplar (the same id as the request log's
`trace.id`), and so do the engine's latency histograms (TTFT, e2e, queue, prefill, decode, TPOT, inference
time: the trace id of the request's `llm_request` span); compose runs Prometheus with
`--enable-feature=exemplar-storage`, and the Grafana Prometheus datasource links `trace_id` to the Jaeger
datasource (`exemplarTraceIdDestinations`), so a p99 point opens the trace of a slow request.
"""

_OTEL = """\
## OpenTelemetry GenAI metrics (OTLP)

Beside the Prometheus series, the gateway and the engine push the OTel semantic-conventions 1.41 GenAI
metrics over OTLP (HTTP protobuf or gRPC) where the OpenTelemetry SDK environment points them
(`OTEL_EXPORTER_OTLP_METRICS_ENDPOINT` as is, else `OTEL_EXPORTER_OTLP_ENDPOINT` + `/v1/metrics`; gateway
`tracing.otlp_endpoint` and engine `--otlp-endpoint` override it; none with `OTEL_SDK_DISABLED=true`) every
`OTEL_METRIC_EXPORT_INTERVAL` ms (default 15 s; gateway `tracing.metrics_export_interval_s` overrides), with a
last push at shutdown (docs/engine-server.md, "Traces", lists every variable). Built in
`kvscope/common/otel_genai.py` with the semconv names, units and bucket boundaries:

| metric | unit | where | buckets |
|---|---|---|---|
| `gen_ai.client.operation.duration` | s | gateway, per upstream call | 0.01 … 81.92 (×2) |
| `gen_ai.client.token.usage` (`gen_ai.token.type` = input \\| output) | {token} | gateway | \
1 … 67108864 (×4) |
| `gen_ai.client.operation.time_to_first_chunk` | s | gateway, streams | 0.01 … 81.92 (×2) |
| `gen_ai.client.operation.time_per_output_chunk` | s | \
gateway, streams: each gap between chunks after the first (one per chunk) | 0.01 … 81.92 (×2) |
| `gen_ai.server.request.duration` | s | engine, per request | 0.01 … 81.92 (×2) |
| `gen_ai.server.time_to_first_token` | s | engine, successful requests | 0.001 … 10 |
| `gen_ai.server.time_per_output_token` | s | engine, successful requests | 0.01 … 2.5 |

Attributes: `gen_ai.operation.name`, `gen_ai.provider.name` (`kvscope`; gateway: `tracing.gen_ai_provider`),
`gen_ai.request.model`, `gen_ai.response.model`, `server.address` + `server.port` (gateway: the upstream) and
`error.type` when the call failed. The semconv buckets stop at 81.92 s; the Prometheus histograms above keep
their own bounds up to the total timeout.
"""

_PORTING = """\
## Porting a vLLM dashboard

Replace each `vllm:*` name by the kvscope name of the same row and the label `model_name` by `model`.
vLLM V1 also labels every engine series with `engine` (the engine-core index, `"0"` with one engine core per
server); kvscope runs one engine per process, so drop `engine` from `by (…)` clauses and selectors, or read
it as `instance`. The names are vLLM V1's (`vllm/v1/metrics/loggers.py`); vLLM V0 is gone. Older V1
releases used `vllm:gpu_cache_usage_perc`, `vllm:gpu_prefix_cache_*` and, for the inter-token gap,
`vllm:time_per_output_token_seconds`: that one observes every gap between two tokens, i.e. kvscope's
`kvscope_engine_inter_token_latency_seconds`, while kvscope's `time_per_output_token` is one observation per
request (decode time / (output tokens − 1)), like vLLM's `vllm:request_time_per_output_token_seconds`.
`vllm:request_inference_time_seconds` (first scheduled → last token) is
`kvscope_engine_request_inference_time_seconds`, with the same phase split into prefill and decode.
The gateway metrics have no vLLM equivalent: they are measured in front of the engine, so the gap between a
gateway and an engine histogram is the gateway plus the network.
"""


def _series(metric: MetricInfo) -> str:
    return "<br>".join(f"`{s}`" for s in metric.series)


def _row(metric: MetricInfo, panels: Sequence[str], alerts: Sequence[str]) -> str:
    labels = ", ".join(f"`{label}`" for label in metric.labels) or "—"
    cells = [
        _series(metric),
        metric.type,
        labels,
        metric.unit,
        metric.help,
        VLLM_NAMES.get(metric.name, "—"),
        "; ".join(panels) or "**none**",
        ", ".join(alerts) or "—",
    ]
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _table(
    catalog: Catalog, component: str, shown: dict[str, list[str]], alerted: dict[str, list[str]]
) -> str:
    head = (
        "| series | type | labels | unit | meaning | vLLM equivalent | dashboard panels | alerts |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    rows = [_row(m, shown[m.name], alerted[m.name]) for m in catalog.metrics if m.component == component]
    return "\n".join([head, *rows])


def _buckets(catalog: Catalog) -> str:
    lines = [
        "## Default histogram buckets",
        "",
        "Upper bounds (`+Inf` implied), configurable: engine `kvscope.engine.server.metrics.MetricBuckets`, "
        "gateway `kvscope.gateway.settings.MetricsConfig`.",
        "",
    ]
    for metric in catalog.metrics:
        if metric.type == "histogram":
            bounds = BUCKET_NOTES.get(metric.name) or ", ".join(f"{b:g}" for b in metric.buckets)
            lines.append(f"- `{metric.name}`: {bounds}")
    return "\n".join(lines)


def render(catalog: Catalog, dashboards: Sequence[Json]) -> str:
    """docs/metrics.md for ``catalog``, with the panels (of ``dashboards``) and alerts using each metric."""
    shown, alerted = shown_on(dashboards, catalog), alerted_by(catalog)
    unshown = not_shown(dashboards, catalog)
    report = ", ".join(f"`{n}`" for n in unshown) if unshown else "none — every defined metric is on a panel."
    parts = [
        _INTRO,
        "## Engine (`kvscope_engine_*`, scraped at `:8000/metrics`)",
        "",
        _table(catalog, "engine", shown, alerted),
        "",
        "## Gateway (`kvscope_gateway_*`, scraped at `:4000/metrics`)",
        "",
        _table(catalog, "gateway", shown, alerted),
        "",
        "## Defined but on no dashboard",
        "",
        report,
        "",
        _buckets(catalog),
        "",
        _OTEL,
        "",
        _PORTING,
    ]
    return "\n".join(parts)
