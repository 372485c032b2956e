"""Gateway metrics that add up and do not saturate (issue 15, points 4 and 5)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from kvscope.gateway.metrics import GatewayMetrics
from kvscope.gateway.settings import MetricsConfig, load_settings
from kvscope.testing.harness import metric_samples, sample
from tests.gateway.conftest import Stack

UPSTREAM = {"upstreams": [{"url": "http://127.0.0.1:9"}]}


def test_a_request_above_600s_lands_in_a_finite_bucket() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    metrics.request_duration.labels("m", "/v1/chat/completions").observe(1500.0)
    metrics.ttft.labels("m").observe(700.0)
    value = registry.get_sample_value
    labels = {"model": "m", "route": "/v1/chat/completions"}
    assert value("kvscope_gateway_request_duration_seconds_bucket", {**labels, "le": "600.0"}) == 0.0
    assert value("kvscope_gateway_request_duration_seconds_bucket", {**labels, "le": "1800.0"}) == 1.0
    assert value("kvscope_gateway_time_to_first_token_seconds_bucket", {"model": "m", "le": "640.0"}) == 0.0
    assert value("kvscope_gateway_time_to_first_token_seconds_bucket", {"model": "m", "le": "1200.0"}) == 1.0


def test_default_buckets_reach_the_total_timeout() -> None:
    settings = load_settings(None, UPSTREAM, env={})
    assert settings.timeouts.total_s == 1800.0
    assert settings.metrics.duration_buckets[-1] >= 1800.0 and settings.metrics.ttft_buckets[-1] >= 1800.0


def test_buckets_ending_below_the_total_timeout_are_refused() -> None:
    with pytest.raises(ValueError, match=r"metrics.duration_buckets must reach timeouts.total_s \(1800 s\)"):
        load_settings(None, {**UPSTREAM, "metrics": {"duration_buckets": [1.0, 600.0]}}, env={})
    ok = load_settings(
        None,
        {
            **UPSTREAM,
            "metrics": {"duration_buckets": [1.0, 600.0], "ttft_buckets": [1.0, 60.0]},
            "timeouts": {"total_s": 60.0},
        },
        env={},
    )
    assert ok.metrics == MetricsConfig(duration_buckets=(1.0, 600.0), ttft_buckets=(1.0, 60.0))


def test_token_types_add_up_and_cached_tokens_have_their_own_counter(stack: Stack) -> None:
    """sum by (type) of kvscope_gateway_tokens_total == input + output: cached prompt tokens are a subset
    of input and are counted in kvscope_gateway_cached_tokens_total, never as a type."""
    before = metric_samples(stack.metrics())
    body = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "hello world hi"}],
        "max_tokens": 5,
        "fake": {"cached_tokens": 2},
    }
    with stack.client() as c:
        assert c.post("/v1/chat/completions", json=body).status_code == 200
    after = metric_samples(stack.metrics())

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    tokens = {
        labels: v - before.get((name, labels), 0.0)
        for (name, labels), v in after.items()
        if name == "kvscope_gateway_tokens_total" and dict(labels)["model"] == "fake-model"
    }
    by_type = {dict(labels)["type"]: v for labels, v in tokens.items()}
    assert by_type == {"input": 3.0, "output": 5.0}
    assert sum(by_type.values()) == 3.0 + 5.0
    assert delta("kvscope_gateway_cached_tokens_total", model="fake-model") == 2.0


def test_known_label_sets_export_zero_before_the_first_event(stack: Stack) -> None:
    samples = metric_samples(stack.metrics())
    for reason in ("requests", "tokens", "concurrency"):
        assert ("kvscope_gateway_rate_limited_total", (("reason", reason),)) in samples
    for model in ("fake-model", "tok-model", "broken-model"):
        assert sample(samples, "kvscope_gateway_stream_errors_total", model=model, reason="timeout") == 0.0
        assert ("kvscope_gateway_cached_tokens_total", (("model", model),)) in samples
    assert ("kvscope_gateway_tokens_total", (("model", "broken-model"), ("type", "output"))) in samples
    upstream = stack.fakes["tok"].url.removeprefix("http://")
    key = (("kind", "kvscope"), ("reason", "connect"), ("upstream", upstream))  # the fake says kvscope
    assert samples[("kvscope_gateway_upstream_errors_total", key)] == 0.0
    assert sample(samples, "kvscope_gateway_log_records_total", outcome="dropped", sink="file") == 0.0
    assert sample(samples, "kvscope_gateway_log_records_spooled_total", sink="file") == 0.0
    assert not [
        k
        for k in samples
        if k[0] == "kvscope_gateway_log_records_total"
        and dict(k[1])["outcome"] not in ("shipped", "failed", "dropped")
    ]
