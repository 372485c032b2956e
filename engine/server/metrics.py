"""Prometheus collectors of the engine: every ``kvscope_engine_*`` metric of docs/metrics.md.

This module only *defines* the metrics. The server creates one :class:`EngineMetrics` on its own
``CollectorRegistry`` and calls ``.labels(...).observe/inc/set`` on the attributes; nothing here is global.

Naming follows the Prometheus conventions (app prefix, base units: seconds, bytes, ratios 0–1, ``_total``
counters). Labels are bounded: ``model`` (served model name), ``finish_reason``
(``stop``/``length``/``abort``/ ``error``), ``state`` (``used``/``cached``/``free``), ``device`` (``cpu``,
``cuda:0`` …), ``reason`` (NVML throttle reasons, :data:`GPU_THROTTLE_REASONS`; of ``stream_errors``:
:data:`STREAM_ERROR_REASONS`). The mapping to vLLM's ``vllm:*`` names is in docs/metrics.md. The GPU series
(``gpu_*``, ``torch_*``) are only created while a CUDA device is in use (absent on CPU).

Default buckets follow vLLM's ``vllm/v1/metrics/loggers.py`` with finer low ends (a 135M model on a GPU emits
a token in a few milliseconds) and durations that reach 3600 s (TTFT 1800 s). They must keep the SLO
thresholds the alert rules and dashboards use as exact bucket bounds: TTFT 1.0 s, TPOT 0.1 s (tests check
this).
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import Annotated

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvscope.common.settings_cli import Flag
from kvscope.common.version import kvscope_version
from kvscope.engine.core.admission import SHED_REASONS, TIERS
from kvscope.engine.core.attribution import LATENCY_CAUSES
from kvscope.engine.structured.params import KINDS as STRUCTURED_KINDS

FINISH_REASONS = ("stop", "length", "abort", "error")
"""Values of the ``finish_reason`` label (kvscope.engine.core.request.RequestStatus.finish_reason)."""
STREAM_ERROR_REASONS = (
    "engine_shutdown",
    "engine_unavailable",
    "request_failed",
    "injected_fault",
    "internal_error",
)
"""Values of the ``reason`` label of ``stream_errors``: why a stream ended with an in-band error after its
200 — the engine stopping (``engine_shutdown``) or dead (``engine_unavailable``), the engine failing the
request (``request_failed``: a failed step, an engine abort), ``--enable-fault-injection``'s
``x-kvscope-fault`` (``injected_fault``), anything else (``internal_error``). Client disconnects and the
client's own errors (4xx, ``invalid_request_error``) are never counted."""
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions")
"""``route`` values of ``http_requests`` created at zero by :meth:`EngineMetrics.initialize`."""
REQUEST_N_BUCKETS = (1, 2, 5, 10, 20)
"""Buckets of ``request_params_n``, as vLLM's ``vllm:request_params_n``."""
KV_BLOCK_STATES = ("used", "cached", "free")
"""Values of the ``state`` label: held by a request, free but holding a reusable prefix, free and empty."""
GPU_THROTTLE_REASONS = (
    "gpu_idle",
    "applications_clocks_setting",
    "sw_power_cap",
    "hw_slowdown",
    "sync_boost",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
    "display_clock_setting",
)
"""Values of the ``reason`` label of ``gpu_throttled``: NVML's clocks event (throttle) reasons, in bit
order."""


TTFT_PREDICTION_ERROR_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)
"""Bounds of ``ttft_prediction_error_ratio`` (|predicted - actual| / actual); 0.25 is issue 42's bound on
the median."""
STRUCTURED_COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
STRUCTURED_MASK_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)


def _check_buckets(name: str, bounds: tuple[float, ...]) -> None:
    if not bounds:
        raise ValueError(f"{name} needs at least one bucket bound")
    if any(b <= 0 for b in bounds):
        raise ValueError(f"{name} bucket bounds must be positive, got {bounds}")
    if any(b >= c for b, c in zip(bounds, bounds[1:], strict=False)):
        raise ValueError(f"{name} bucket bounds must be strictly increasing, got {bounds}")


def parse_buckets(text: str) -> tuple[float, ...]:
    """Bucket bounds from ``"0.01,0.1,1"`` (seconds or counts). Validation happens in MetricBuckets."""
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise ValueError(f"bucket bounds must be comma-separated numbers, got {text!r}") from exc


@dataclass(frozen=True, slots=True)
class MetricBuckets:
    """Histogram bucket upper bounds (``+Inf`` is added by prometheus_client). Raises ValueError when a tuple
    is empty, not positive or not strictly increasing."""

    ttft_s: Annotated[tuple[float, ...], Flag("comma-separated TTFT histogram bounds (s)",
                                              name="--ttft-buckets", parse=parse_buckets)] = (
        0.001, 0.0025, 0.005, 0.0075, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
        2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 600.0, 1200.0, 1800.0,
    )  # fmt: skip
    """Time to first token (seconds)."""
    token_latency_s: Annotated[tuple[float, ...], Flag("TPOT / inter-token latency bounds (s)",
                                                       name="--tpot-buckets", parse=parse_buckets)] = (
        0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
        0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
    )  # fmt: skip
    """Time per output token and inter-token latency (seconds)."""
    duration_s: Annotated[tuple[float, ...], Flag("e2e/queue/prefill/decode bounds (s)",
                                                  name="--duration-buckets", parse=parse_buckets)] = (
        0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0,
        120.0, 240.0, 480.0, 600.0, 900.0, 1200.0, 1800.0, 3600.0,
    )  # fmt: skip
    """End-to-end, queue, prefill and decode time (seconds); up to an hour, past the gateway's default total
    timeout (1800 s), so a long request is counted in a finite bucket instead of only in ``+Inf``."""
    batch_size: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    """Running requests per engine step."""
    step_tokens: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
    """Tokens scheduled per engine step (prefill chunks + decodes)."""
    request_tokens: tuple[float, ...] = (
        1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000,
    )  # fmt: skip
    """Prompt and generation length per request (tokens), 1-2-5 series as vLLM's build_1_2_5_buckets."""

    def __post_init__(self) -> None:
        for name in self.__slots__:
            _check_buckets(name, getattr(self, name))


class EngineMetrics:
    """All engine collectors, registered on ``registry``.

    Attributes are prometheus_client metric objects named after the metric without prefix and suffix,
    e.g. ``metrics.time_to_first_token.labels(model="smollm2-135m").observe(0.042)``.
    Raises ValueError (from prometheus_client) if ``registry`` already holds one of these names.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        buckets: MetricBuckets | None = None,
        num_speculative_tokens: int = 0,
    ) -> None:
        """``num_speculative_tokens`` (k, 0 = speculation off) sets the ``position`` values of the
        per-position acceptance counter (0 … k-1) and the acceptance-length buckets (1 … k+1)."""
        b = buckets if buckets is not None else MetricBuckets()
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        self.num_speculative_tokens = num_speculative_tokens
        self._init_scheduler_state(registry)
        self._init_token_counters(registry)
        self._init_latency_histograms(registry, b)
        self._init_size_histograms(registry, b)
        self._init_device_memory(registry)
        self._init_gpu(registry)
        self._init_structured(registry)
        self._init_spec_decode(registry, num_speculative_tokens)

    def _init_scheduler_state(self, r: CollectorRegistry) -> None:
        self.requests_running = Gauge(
            "kvscope_engine_requests_running",
            "Requests in the running batch (scheduled in the engine step).",
            ["model"],
            registry=r,
        )
        self.requests_waiting = Gauge(
            "kvscope_engine_requests_waiting",
            "Requests waiting to be scheduled (queued or preempted).",
            ["model"],
            registry=r,
        )
        self.kv_cache_usage_ratio = Gauge(
            "kvscope_engine_kv_cache_usage_ratio",
            "Fraction of KV-cache blocks held by requests (0-1).",
            ["model"],
            registry=r,
        )
        self.kv_cache_blocks = Gauge(
            "kvscope_engine_kv_cache_blocks",
            "KV-cache blocks by state: used (held by requests), cached (free, reusable prefix), free "
            "(empty).",
            ["model", "state"],
            registry=r,
        )
        self.preemptions = Counter(
            "kvscope_engine_preemptions",
            "Requests preempted (by recompute) because KV blocks ran out.",
            ["model"],
            registry=r,
        )
        self.request_success = Counter(
            "kvscope_engine_request_success",
            "Requests finished, by finish reason.",
            ["model", "finish_reason"],
            registry=r,
        )

    def _init_token_counters(self, r: CollectorRegistry) -> None:
        self.prompt_tokens = Counter(
            "kvscope_engine_prompt_tokens",
            "Prompt tokens processed (prefill, prefix-cache hits included).",
            ["model"],
            registry=r,
        )
        self.generation_tokens = Counter(
            "kvscope_engine_generation_tokens", "Output tokens generated.", ["model"], registry=r
        )
        self.prefix_cache_queries = Counter(
            "kvscope_engine_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            ["model"],
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "kvscope_engine_prefix_cache_hits",
            "Prompt tokens found in the prefix cache (not recomputed).",
            ["model"],
            registry=r,
        )

    def _init_latency_histograms(self, r: CollectorRegistry, b: MetricBuckets) -> None:
        def hist(name: str, doc: str, bounds: tuple[float, ...]) -> Histogram:
            return Histogram(f"kvscope_engine_{name}_seconds", doc, ["model"], buckets=bounds, registry=r)

        self.time_to_first_token = hist(
            "time_to_first_token", "Arrival to first token sampled, in the engine.", b.ttft_s
        )
        self.inter_token_latency = hist(
            "inter_token_latency",
            "Time between two consecutive output tokens of a request.",
            b.token_latency_s,
        )
        self.time_per_output_token = hist(
            "time_per_output_token", "Decode time / (output tokens - 1), per request.", b.token_latency_s
        )
        self.e2e_request_latency = hist(
            "e2e_request_latency", "Arrival to finish of a request, in the engine.", b.duration_s
        )
        self.queue_time = hist("queue_time", "Arrival to first scheduled (time spent waiting).", b.duration_s)
        self.prefill_time = hist("prefill_time", "First scheduled to first token (prefill).", b.duration_s)
        self.decode_time = hist("decode_time", "First token to last token (decode).", b.duration_s)
        self.latency_cause = Counter(
            "kvscope_engine_latency_cause_seconds",
            "Seconds of finished requests' TTFT (queue + prefill) and decode by cause, from the "
            'scheduler\'s step records (docs/logs.md, "Why was this request slow?").',
            ["model", "phase", "cause"],
            registry=r,
        )
        self.ttft_prediction_error = Histogram(
            "kvscope_engine_ttft_prediction_error_ratio",
            "|predicted - actual| / actual time to first token of requests that got a first token and a "
            "prediction when queued (engine/core/ttft.py): the accuracy of what admission decides on.",
            ["model"],
            buckets=TTFT_PREDICTION_ERROR_BUCKETS,
            registry=r,
        )
        self.tier_queue_time = Histogram(
            "kvscope_engine_tier_queue_time_seconds",
            "Arrival to first scheduled by service tier (priority, default, flex): the wait that tiers "
            "order and admission's TTFT objectives bound.",
            ["model", "tier"],
            buckets=b.duration_s,
            registry=r,
        )
        self.tier_time_to_first_token = Histogram(
            "kvscope_engine_tier_time_to_first_token_seconds",
            "Arrival to first token sampled, in the engine, by service tier: what each tier's TTFT objective "
            "(--ttft-slo) is held against.",
            ["model", "tier"],
            buckets=b.ttft_s,
            registry=r,
        )
        self.requests_shed = Counter(
            "kvscope_engine_requests_shed",
            "Requests refused at admission (reason ttft_slo: predicted TTFT over the tier's objective, a "
            "503) or dropped from the queue before their prefill (reason ttft_slo_queued: their first token "
            "could no longer come within that objective, a 503; reason deadline: x-kvscope-timeout "
            "passed), by service tier.",
            ["model", "tier", "reason"],
            registry=r,
        )
        self.request_inference_time = hist(
            "request_inference_time",
            "First scheduled to last token (prefill + decode), per request.",
            b.duration_s,
        )

    def _init_size_histograms(self, r: CollectorRegistry, b: MetricBuckets) -> None:
        self.batch_size = Histogram(
            "kvscope_engine_batch_size",
            "Requests in one engine step.",
            ["model"],
            buckets=b.batch_size,
            registry=r,
        )
        self.step_tokens = Histogram(
            "kvscope_engine_step_tokens",
            "Tokens scheduled in one engine step (prefill chunks + decodes).",
            ["model"],
            buckets=b.step_tokens,
            registry=r,
        )
        self.request_prompt_tokens = Histogram(
            "kvscope_engine_request_prompt_tokens",
            "Prompt length of finished requests (tokens).",
            ["model"],
            buckets=b.request_tokens,
            registry=r,
        )
        self.request_generation_tokens = Histogram(
            "kvscope_engine_request_generation_tokens",
            "Output length of finished requests (tokens).",
            ["model"],
            buckets=b.request_tokens,
            registry=r,
        )
        self.request_params_n = Histogram(
            "kvscope_engine_request_params_n",
            "The n (choices per prompt) of finished requests.",
            ["model"],
            buckets=REQUEST_N_BUCKETS,
            registry=r,
        )
        self.request_params_max_tokens = Histogram(
            "kvscope_engine_request_params_max_tokens",
            "The max_tokens of finished requests that set one.",
            ["model"],
            buckets=b.request_tokens,
            registry=r,
        )
        self.http_requests = Counter(
            "kvscope_engine_http_requests",
            "HTTP requests answered by the engine server, by route and status.",
            ["route", "status"],
            registry=r,
        )
        self.stream_errors = Counter(
            "kvscope_engine_stream_errors",
            "Streams that failed after their 200 (an in-band error event, no [DONE]; the status stays 200), "
            "by reason (STREAM_ERROR_REASONS). Client disconnects and client errors are not counted.",
            ["model", "reason"],
            registry=r,
        )

    def _init_device_memory(self, r: CollectorRegistry) -> None:
        self.device_memory_used = Gauge(
            "kvscope_engine_device_memory_used_bytes",
            "Device memory in use: VRAM on CUDA (NVML/torch.cuda); KV cache + weights on CPU.",
            ["device"],
            registry=r,
        )
        self.device_memory_total = Gauge(
            "kvscope_engine_device_memory_total_bytes",
            "Device memory capacity: VRAM on CUDA; the host's physical memory on CPU.",
            ["device"],
            registry=r,
        )
        self.build_info = Gauge(
            "kvscope_engine_build_info",
            "Always 1, labelled with the kvscope version and the Python version the engine runs (the "
            "Prometheus build_info convention: join on it, count versions during a rollout).",
            ["version", "python"],
            registry=r,
        )
        self.weights_bytes = Gauge(
            "kvscope_engine_weights_bytes",
            "Bytes of model weights held (compact int4/int8 and dense packed copies), labelled with the "
            "weight format served: dtype and quantization (--quantization auto resolved).",
            ["model", "dtype", "quantization"],
            registry=r,
        )
        self.weights_kernel_info = Gauge(
            "kvscope_engine_weights_kernel_info",
            "Always 1 per kernel serving the weights on CPU and its row counts (requests in a decode step): "
            "first_row to last_row (+Inf: and above). Kernels: gemv, "
            "tiles_float32/tiles_bfloat16/tiles_int16 (the small-batch matmul), amx, dense_<dtype> (the "
            "start-up probe's crossovers; dense weights: "
            "dense_<dtype> from row 1). Absent off CPU and for torch's own int4/int8 kernels.",
            ["model", "kernel", "first_row", "last_row"],
            registry=r,
        )

    def _init_gpu(self, r: CollectorRegistry) -> None:
        # Sampled by kvscope.engine.server.gpu_telemetry while a CUDA device is in use; never created on CPU
        # (absent, not zero), so `initialize` leaves them alone.
        self.gpu_memory_budget = Gauge(
            "kvscope_engine_gpu_memory_budget_bytes",
            "Device memory the engine may use by design: "
            "gpu_memory_utilization x total (weights, activations and the KV cache it sized at start-up).",
            ["device"],
            registry=r,
        )
        self.gpu_utilization = Gauge(
            "kvscope_engine_gpu_utilization_ratio",
            "Fraction of the last NVML sample period in which a kernel ran on the GPU (0-1).",
            ["device"],
            registry=r,
        )
        self.gpu_temperature = Gauge(
            "kvscope_engine_gpu_temperature_celsius",
            "GPU core temperature (degrees Celsius, NVML).",
            ["device"],
            registry=r,
        )
        self.gpu_power = Gauge(
            "kvscope_engine_gpu_power_watts", "GPU power draw (watts, NVML).", ["device"], registry=r
        )
        self.gpu_power_limit = Gauge(
            "kvscope_engine_gpu_power_limit_watts",
            "GPU power limit the driver enforces (watts, NVML).",
            ["device"],
            registry=r,
        )
        self.gpu_throttled = Gauge(
            "kvscope_engine_gpu_throttled",
            "1 while NVML reports this clocks event (throttle) reason, else 0.",
            ["device", "reason"],
            registry=r,
        )
        self.torch_memory_reserved = Gauge(
            "kvscope_engine_torch_memory_reserved_bytes",
            "Device memory held by torch's caching allocator.",
            ["device"],
            registry=r,
        )
        self.torch_memory_allocated = Gauge(
            "kvscope_engine_torch_memory_allocated_bytes",
            "Device memory in live tensors (torch allocator).",
            ["device"],
            registry=r,
        )
        self.torch_alloc_retries = Counter(
            "kvscope_engine_torch_alloc_retries",
            "Allocations torch retried after freeing its cache "
            "(torch.cuda.memory_stats num_alloc_retries): the allocator is short of memory.",
            ["device"],
            registry=r,
        )
        self.torch_ooms = Counter(
            "kvscope_engine_torch_ooms",
            "Out-of-memory errors raised by torch's allocator (torch.cuda.memory_stats num_ooms).",
            ["device"],
            registry=r,
        )

    def _init_structured(self, r: CollectorRegistry) -> None:
        self.structured_output_requests = Counter(
            "kvscope_engine_structured_output_requests",
            "Requests decoded under a grammar constraint, by kind "
            "(json, json_object, regex, choice, grammar; tool_choice required/named count as json).",
            ["model", "kind"],
            registry=r,
        )
        self.structured_output_compile_time = Histogram(
            "kvscope_engine_structured_output_compile_seconds",
            "Grammar compile time of a constraint not in the cache (llguidance).",
            ["model"],
            buckets=STRUCTURED_COMPILE_BUCKETS,
            registry=r,
        )
        self.structured_output_mask_time = Histogram(
            "kvscope_engine_structured_output_mask_seconds",
            "Time one engine step spent computing the token bitmasks of its constrained requests.",
            ["model"],
            buckets=STRUCTURED_MASK_BUCKETS,
            registry=r,
        )

    def _init_spec_decode(self, r: CollectorRegistry, k: int) -> None:
        # vLLM v1's family (vllm/v1/spec_decode/metrics.py SpecDecodingProm) under our prefix
        self.spec_decode_num_drafts = Counter(
            "kvscope_engine_spec_decode_num_drafts",
            "Speculative drafts verified (one per request and step that proposed at least one token).",
            ["model"],
            registry=r,
        )
        self.spec_decode_num_draft_tokens = Counter(
            "kvscope_engine_spec_decode_num_draft_tokens",
            "Draft tokens proposed (n-gram lookup) and verified.",
            ["model"],
            registry=r,
        )
        self.spec_decode_num_accepted_tokens = Counter(
            "kvscope_engine_spec_decode_num_accepted_tokens",
            "Draft tokens accepted by the verification.",
            ["model"],
            registry=r,
        )
        self.spec_decode_num_accepted_tokens_per_pos = Counter(
            "kvscope_engine_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each position of the draft (0 = the first proposed token).",
            ["model", "position"],
            registry=r,
        )
        self.spec_decode_acceptance_length = Histogram(
            "kvscope_engine_spec_decode_acceptance_length",
            "Tokens emitted per verification of a draft: 1 + "
            "accepted draft tokens (the bonus or correction token included).",
            ["model"],
            buckets=acceptance_length_buckets(k),
            registry=r,
        )

    def initialize(self, model: str, device: str) -> None:
        """Create every labelled series at zero for ``model`` and ``device`` so that rates, ratios and
        dashboards see a series from the first scrape (Prometheus best practice: avoid missing metrics)."""
        per_model = (
            self.requests_running, self.requests_waiting, self.kv_cache_usage_ratio, self.preemptions,
            self.prompt_tokens, self.generation_tokens, self.prefix_cache_queries, self.prefix_cache_hits,
            self.time_to_first_token, self.inter_token_latency, self.time_per_output_token,
            self.e2e_request_latency, self.queue_time, self.prefill_time, self.decode_time, self.batch_size,
            self.step_tokens, self.request_prompt_tokens, self.request_generation_tokens,
            self.request_inference_time, self.request_params_n, self.request_params_max_tokens,
        )  # fmt: skip
        for metric in per_model:
            metric.labels(model=model)
        for state in KV_BLOCK_STATES:
            self.kv_cache_blocks.labels(model=model, state=state)
        for reason in FINISH_REASONS:
            self.request_success.labels(model=model, finish_reason=reason)
        for reason in STREAM_ERROR_REASONS:
            self.stream_errors.labels(model=model, reason=reason)
        for tier in TIERS:
            for reason in SHED_REASONS:
                self.requests_shed.labels(model=model, tier=tier, reason=reason)
            self.tier_queue_time.labels(model=model, tier=tier)
            self.tier_time_to_first_token.labels(model=model, tier=tier)
        self.ttft_prediction_error.labels(model=model)
        for phase, causes in LATENCY_CAUSES.items():
            for cause in causes:
                self.latency_cause.labels(model=model, phase=phase, cause=cause)
        self.build_info.labels(version=kvscope_version(), python=platform.python_version()).set(1)
        for route in GENERATION_ROUTES:  # the success and the 5xx series the dashboards divide
            for status in ("200", "500"):
                self.http_requests.labels(route=route, status=status)
        self.device_memory_used.labels(device=device)
        self.device_memory_total.labels(device=device)
        for kind in STRUCTURED_KINDS:
            self.structured_output_requests.labels(model=model, kind=kind)
        self.structured_output_compile_time.labels(model=model)
        self.structured_output_mask_time.labels(model=model)
        for metric in (
            self.spec_decode_num_drafts,
            self.spec_decode_num_draft_tokens,
            self.spec_decode_num_accepted_tokens,
            self.spec_decode_acceptance_length,
        ):
            metric.labels(model=model)  # at zero with speculation off too, as every other counter
        for position in range(self.num_speculative_tokens):
            self.spec_decode_num_accepted_tokens_per_pos.labels(model=model, position=str(position))


def acceptance_length_buckets(num_speculative_tokens: int) -> tuple[float, ...]:
    """Bounds 1, 2, …, k+1 of the acceptance-length histogram (a verification emits 1 to k+1 tokens); (1,)
    with speculation off (k = 0)."""
    return tuple(float(n) for n in range(1, num_speculative_tokens + 2))
