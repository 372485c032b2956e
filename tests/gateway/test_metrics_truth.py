"""Gateway metrics that add up and do not saturate (issue 15, points 4 and 5)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from gateway.metrics import GatewayMetrics
from gateway.settings import MetricsConfig, load_settings

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
    ok = load_settings(None, {**UPSTREAM, "metrics": {"duration_buckets": [1.0, 600.0], "ttft_buckets": [1.0, 60.0]},
                              "timeouts": {"total_s": 60.0}}, env={})
    assert ok.metrics == MetricsConfig(duration_buckets=(1.0, 600.0), ttft_buckets=(1.0, 60.0))
