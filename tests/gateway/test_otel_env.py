"""The OpenTelemetry SDK environment, honoured by the gateway process (issue 39): OTEL_SERVICE_NAME,
OTEL_EXPORTER_OTLP_{TRACES_,METRICS_,}ENDPOINT, OTEL_EXPORTER_OTLP_PROTOCOL (http/protobuf and grpc),
OTEL_METRIC_EXPORT_INTERVAL and OTEL_SDK_DISABLED, each set on a real ``python -m kvscope.gateway`` in
front of a fake upstream."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvscope.testing.harness import Proc, spawn_fake, spawn_gateway, wait_http
from tests.otlp_receiver import GrpcOtlpReceiver, OtlpReceiver

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 3}
PUSH_WITHIN_S = 8.0
"""OTEL_METRIC_EXPORT_INTERVAL=2000 must bring the first gen_ai push within this (the default is 15 s)."""
GATEWAY_METRICS = {"gen_ai.client.operation.duration", "gen_ai.client.token.usage"}


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    fake = spawn_fake(tmp_path_factory.mktemp("upstream"), "fake")
    try:
        wait_http(fake.url + "/health", proc=fake.popen)
        yield fake
    finally:
        fake.stop()


def run_gateway(tmp: Path, upstream: Proc, env: dict[str, str], streams: bool = False) -> tuple[Proc, float]:
    """Start a gateway with ``env`` added, send one chat request; returns the gateway (running) and the
    monotonic time the request was sent."""
    gateway = spawn_gateway(tmp, "gateway", {"upstreams": [{"url": upstream.url}]}, env=env)
    wait_http(gateway.url + "/readyz", proc=gateway.popen)
    sent = time.monotonic()
    response = httpx.post(gateway.url + "/v1/chat/completions", json={**CHAT, "stream": streams}, timeout=30)
    assert response.status_code == 200
    return gateway, sent


def wait_for_metrics(rx: OtlpReceiver | GrpcOtlpReceiver, since: float) -> None:
    while time.monotonic() - since < PUSH_WITHIN_S:
        if GATEWAY_METRICS <= set(rx.metric_points()):
            return
        time.sleep(0.1)
    raise AssertionError(f"no gen_ai push within {PUSH_WITHIN_S} s: {sorted(rx.metric_points())}")


def test_gateway_exports_to_the_otel_environment_over_http(tmp_path: Path, upstream: Proc) -> None:
    with OtlpReceiver() as rx:
        env = {
            "OTEL_SERVICE_NAME": "gateway-from-env",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": rx.url + "/collector/traces",
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": rx.url + "/vendor/api/metrics",
            "OTEL_METRIC_EXPORT_INTERVAL": "2000",
        }
        gateway, sent = run_gateway(tmp_path, upstream, env)
        try:
            wait_for_metrics(rx, sent)
        finally:
            gateway.stop()  # flushes the spans
        # with only the signal URLs set, both are used as given (not derived from each other)
        assert set(rx.paths) == {"/collector/traces", "/vendor/api/metrics"}
        assert {r["service.name"] for r in rx.resources()} == {"gateway-from-env"}
        spans = rx.spans()
    assert {name for _, name in spans} >= {"POST /v1/chat/completions", "chat fake-model"}
    assert {r["service.name"] for r, _ in spans} == {"gateway-from-env"}


def test_gateway_exports_over_grpc_to_the_generic_endpoint(tmp_path: Path, upstream: Proc) -> None:
    with GrpcOtlpReceiver() as rx:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": rx.url,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_METRIC_EXPORT_INTERVAL": "2000",
        }
        gateway, sent = run_gateway(tmp_path, upstream, env, streams=True)
        try:
            wait_for_metrics(rx, sent)
        finally:
            gateway.stop()
        assert set(rx.paths) == {"grpc:traces", "grpc:metrics"}
        assert {r["service.name"] for r in rx.resources()} == {"kvscope-gateway"}
        assert "gen_ai.client.operation.time_to_first_chunk" in rx.metric_points()
        assert "chat fake-model" in {name for _, name in rx.spans()}


def test_sdk_disabled_exports_nothing(tmp_path: Path, upstream: Proc) -> None:
    with OtlpReceiver() as rx:
        env = {
            "OTEL_SDK_DISABLED": "true",
            "OTEL_EXPORTER_OTLP_ENDPOINT": rx.url,
            "OTEL_METRIC_EXPORT_INTERVAL": "200",
        }
        gateway, _ = run_gateway(tmp_path, upstream, env)
        gateway.stop()  # a shutdown would push the last metrics and flush the spans
        assert (rx.paths, rx.metrics, rx.traces) == ([], [], [])
