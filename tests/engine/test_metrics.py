"""kvscope.engine.server.metrics: the exact kvscope_engine_* names, types and labels of docs/metrics.md,
bucket defaults and validation, and exposition after initialize()."""

from __future__ import annotations

import platform

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvscope.engine.server.metrics import (
    FINISH_REASONS,
    KV_BLOCK_STATES,
    STREAM_ERROR_REASONS,
    EngineMetrics,
    MetricBuckets,
    kvscope_version,
)

EXPECTED = {
    "kvscope_engine_requests_running": ("gauge", ("model",)),
    "kvscope_engine_requests_waiting": ("gauge", ("model",)),
    "kvscope_engine_kv_cache_usage_ratio": ("gauge", ("model",)),
    "kvscope_engine_kv_cache_blocks": ("gauge", ("model", "state")),
    "kvscope_engine_prompt_tokens": ("counter", ("model",)),
    "kvscope_engine_generation_tokens": ("counter", ("model",)),
    "kvscope_engine_request_success": ("counter", ("finish_reason", "model")),
    "kvscope_engine_preemptions": ("counter", ("model",)),
    "kvscope_engine_prefix_cache_queries": ("counter", ("model",)),
    "kvscope_engine_prefix_cache_hits": ("counter", ("model",)),
    "kvscope_engine_time_to_first_token_seconds": ("histogram", ("model",)),
    "kvscope_engine_inter_token_latency_seconds": ("histogram", ("model",)),
    "kvscope_engine_time_per_output_token_seconds": ("histogram", ("model",)),
    "kvscope_engine_e2e_request_latency_seconds": ("histogram", ("model",)),
    "kvscope_engine_queue_time_seconds": ("histogram", ("model",)),
    "kvscope_engine_prefill_time_seconds": ("histogram", ("model",)),
    "kvscope_engine_decode_time_seconds": ("histogram", ("model",)),
    "kvscope_engine_batch_size": ("histogram", ("model",)),
    "kvscope_engine_step_tokens": ("histogram", ("model",)),
    "kvscope_engine_request_prompt_tokens": ("histogram", ("model",)),
    "kvscope_engine_request_generation_tokens": ("histogram", ("model",)),
    "kvscope_engine_request_inference_time_seconds": ("histogram", ("model",)),
    "kvscope_engine_request_params_n": ("histogram", ("model",)),
    "kvscope_engine_latency_cause_seconds": ("counter", ("cause", "model", "phase")),
    "kvscope_engine_request_params_max_tokens": ("histogram", ("model",)),
    "kvscope_engine_http_requests": ("counter", ("route", "status")),
    "kvscope_engine_stream_errors": ("counter", ("model", "reason")),
    "kvscope_engine_requests_shed": ("counter", ("model", "reason", "tier")),
    "kvscope_engine_ttft_prediction_error_ratio": ("histogram", ("model",)),
    "kvscope_engine_tier_queue_time_seconds": ("histogram", ("model", "tier")),
    "kvscope_engine_tier_time_to_first_token_seconds": ("histogram", ("model", "tier")),
    "kvscope_engine_structured_output_requests": ("counter", ("kind", "model")),
    "kvscope_engine_structured_output_compile_seconds": ("histogram", ("model",)),
    "kvscope_engine_structured_output_mask_seconds": ("histogram", ("model",)),
    "kvscope_engine_device_memory_used_bytes": ("gauge", ("device",)),
    "kvscope_engine_device_memory_total_bytes": ("gauge", ("device",)),
    "kvscope_engine_spec_decode_num_drafts": ("counter", ("model",)),
    "kvscope_engine_spec_decode_num_draft_tokens": ("counter", ("model",)),
    "kvscope_engine_spec_decode_num_accepted_tokens": ("counter", ("model",)),
    "kvscope_engine_spec_decode_num_accepted_tokens_per_pos": ("counter", ("model", "position")),
    "kvscope_engine_spec_decode_acceptance_length": ("histogram", ("model",)),
    "kvscope_engine_weights_bytes": (
        "gauge",
        (),
    ),  # labelled model/dtype/quantization, set by the server at start
    "kvscope_engine_weights_kernel_info": ("gauge", ()),  # one series per kernel's rows, set at start
    "kvscope_engine_build_info": ("gauge", ("python", "version")),
    # CUDA only, set by engine/server/gpu_telemetry.py: no series after initialize() (absent on CPU, not 0)
    **{
        f"kvscope_engine_{name}": ("gauge", ())
        for name in (
            "gpu_memory_budget_bytes",
            "gpu_utilization_ratio",
            "gpu_temperature_celsius",
            "gpu_power_watts",
            "gpu_power_limit_watts",
            "gpu_throttled",
            "torch_memory_reserved_bytes",
            "torch_memory_allocated_bytes",
        )
    },
    "kvscope_engine_torch_alloc_retries": ("counter", ()),
    "kvscope_engine_torch_ooms": ("counter", ()),
}


def families(registry: CollectorRegistry) -> dict[str, tuple[str, tuple[str, ...]]]:
    return {
        f.name: (f.type, tuple(sorted({k for s in f.samples for k in s.labels if k != "le"})))
        for f in registry.collect()
    }


def test_initialize_exposes_every_design_metric_with_its_labels() -> None:
    registry = CollectorRegistry()
    EngineMetrics(registry, num_speculative_tokens=3).initialize("smollm2-135m", "cpu")
    assert families(registry) == EXPECTED


def test_initialize_creates_each_label_value_at_zero() -> None:
    registry = CollectorRegistry()
    EngineMetrics(registry).initialize("m", "cuda:0")
    text = generate_latest(registry).decode()
    for reason in FINISH_REASONS:
        assert f'kvscope_engine_request_success_total{{finish_reason="{reason}",model="m"}} 0.0' in text
    for reason in STREAM_ERROR_REASONS:
        assert f'kvscope_engine_stream_errors_total{{model="m",reason="{reason}"}} 0.0' in text
    for state in KV_BLOCK_STATES:
        assert f'kvscope_engine_kv_cache_blocks{{model="m",state="{state}"}} 0.0' in text
    assert 'kvscope_engine_device_memory_total_bytes{device="cuda:0"} 0.0' in text
    assert 'kvscope_engine_time_to_first_token_seconds_bucket{le="0.001",model="m"} 0.0' in text


def test_build_info_is_one_with_the_versions() -> None:
    registry = CollectorRegistry()
    EngineMetrics(registry).initialize("m", "cpu")
    assert (
        registry.get_sample_value(
            "kvscope_engine_build_info", {"version": kvscope_version(), "python": platform.python_version()}
        )
        == 1.0
    )


def test_observations_land_in_the_right_buckets() -> None:
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry)
    for ttft in (0.004, 0.9, 1.0, 700.0, 5000.0):
        metrics.time_to_first_token.labels(model="m").observe(ttft)
    metrics.prompt_tokens.labels(model="m").inc(17)
    value = registry.get_sample_value
    bucket = "kvscope_engine_time_to_first_token_seconds_bucket"
    assert value(bucket, {"model": "m", "le": "0.005"}) == 1.0
    assert value(bucket, {"model": "m", "le": "1.0"}) == 3.0
    assert value(bucket, {"model": "m", "le": "600.0"}) == 3.0
    assert value(bucket, {"model": "m", "le": "1200.0"}) == 4.0  # above 600 s: a finite bucket
    assert value(bucket, {"model": "m", "le": "+Inf"}) == 5.0
    assert value("kvscope_engine_time_to_first_token_seconds_sum", {"model": "m"}) == pytest.approx(5701.904)
    assert value("kvscope_engine_prompt_tokens_total", {"model": "m"}) == 17.0


def test_default_buckets_meet_the_design() -> None:
    b = MetricBuckets()
    assert b.ttft_s[0] < 0.01 and b.token_latency_s[0] < 0.01
    assert b.ttft_s[-1] == 1800.0 and b.duration_s[-1] == 3600.0  # past the gateway's 1800 s total timeout
    assert 1.0 in b.ttft_s and 0.1 in b.token_latency_s  # SLO thresholds of alerts/ and dashboards/


def test_custom_buckets_are_used() -> None:
    registry = CollectorRegistry()
    EngineMetrics(registry, MetricBuckets(batch_size=(1, 3, 9))).batch_size.labels(model="m").observe(2)
    bounds = [
        s.labels["le"]
        for f in registry.collect()
        if f.name == "kvscope_engine_batch_size"
        for s in f.samples
        if s.name.endswith("_bucket")
    ]
    assert bounds == ["1.0", "3.0", "9.0", "+Inf"]


@pytest.mark.parametrize("bounds", [(), (0.0, 1.0), (0.5, 0.5), (2.0, 1.0)])
def test_invalid_buckets_raise(bounds: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="ttft_s"):
        MetricBuckets(ttft_s=bounds)


def test_instances_are_independent_per_registry() -> None:
    first, second = CollectorRegistry(), CollectorRegistry()
    EngineMetrics(first).preemptions.labels(model="m").inc()
    EngineMetrics(second)
    assert first.get_sample_value("kvscope_engine_preemptions_total", {"model": "m"}) == 1.0
    assert second.get_sample_value("kvscope_engine_preemptions_total", {"model": "m"}) is None
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        EngineMetrics(first)


def test_a_finished_sequence_adds_its_seconds_by_cause() -> None:
    from kvscope.engine.core.attribution import cause_seconds
    from kvscope.engine.core.stats import KvscopeStats
    from kvscope.engine.server.stat_logger import SequenceTimings, ServerMetrics

    stats = KvscopeStats(
        queue_s=2.0,
        prefill_steps=3,
        prefill_own_s=0.5,
        prefill_interference_s=1.25,
        prefill_interference_prefill_s=1.0,
        prefill_preempted_s=0.0,
        prefill_other_s=0.125,
        decode_steps=10,
        decode_own_s=0.25,
        decode_interference_s=0.75,
        decode_interference_prefill_s=0.5,
        decode_preempted_s=0.375,
        decode_other_s=0.0,
    )
    causes = cause_seconds(stats)
    assert causes == {
        ("ttft", "queue"): 2.0,
        ("ttft", "own"): 0.5,
        ("ttft", "other_prefills"): 1.0,
        ("ttft", "batched_decodes"): 0.25,
        ("ttft", "preemption"): 0.0,
        ("ttft", "host"): 0.125,
        ("decode", "own"): 0.25,
        ("decode", "other_prefills"): 0.5,
        ("decode", "batched_decodes"): 0.25,
        ("decode", "preemption"): 0.375,
        ("decode", "host"): 0.0,
    }
    registry = CollectorRegistry()
    metrics = ServerMetrics(registry, "m")
    for _ in range(2):
        metrics.on_sequence_finished(SequenceTimings("stop", 11, e2e_s=6.0, causes=causes))
    value = registry.get_sample_value
    assert (
        value("kvscope_engine_latency_cause_seconds_total", {"model": "m", "phase": "ttft", "cause": "queue"})
        == 4.0
    )
    assert (
        value(
            "kvscope_engine_latency_cause_seconds_total",
            {"model": "m", "phase": "decode", "cause": "preemption"},
        )
        == 0.75
    )
    assert (
        value(
            "kvscope_engine_latency_cause_seconds_total", {"model": "m", "phase": "decode", "cause": "host"}
        )
        == 0.0
    )
