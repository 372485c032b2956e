"""kvscope/common/otel_env.py: which OTLP exporters the OpenTelemetry environment and a flag/config
endpoint give (the process tests, tests/{engine/server,gateway}/test_otel_env.py, check what arrives)."""

from __future__ import annotations

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

from kvscope.common.otel_env import exports, metric_reader, protocol, signal_url, span_exporter

pytestmark = pytest.mark.usefixtures("no_otel_environment")  # tests/conftest.py


def test_a_signal_is_exported_when_its_url_or_the_base_is_set() -> None:
    assert [
        exports("traces", None, env)
        for env in (
            {},
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"},
            {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c/t"},
            {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://c/m"},
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c", "OTEL_SDK_DISABLED": "TRUE"},
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c", "OTEL_TRACES_EXPORTER": "none"},
        )
    ] == [False, True, True, False, False, False]
    assert exports("metrics", "http://flag", {}) and not exports(
        "metrics", "http://flag", {"OTEL_SDK_DISABLED": "true"}
    )


def test_protocol_per_signal_and_unsupported_values() -> None:
    assert protocol("traces", {}) == "http/protobuf"
    env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf"}
    assert (protocol("traces", env), protocol("metrics", env)) == ("grpc", "http/protobuf")
    with pytest.raises(ValueError, match="must be one of http/protobuf, grpc, got 'http/json'"):
        protocol("traces", {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def test_signal_urls_of_a_flag_endpoint() -> None:
    assert [
        signal_url(u, "metrics") for u in ("http://c:4318", "http://c:4318/", "http://c:4318/v1/traces")
    ] == ["http://c:4318/v1/metrics"] * 3


def test_the_sdk_reads_the_environment_and_a_flag_overrides_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://vendor/api/traces")
    exporter = span_exporter()
    assert isinstance(exporter, OTLPSpanExporter) and exporter._endpoint == "http://vendor/api/traces"
    assert span_exporter("http://flag:4318")._endpoint == "http://flag:4318/v1/traces"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    assert isinstance(span_exporter(), GrpcSpanExporter)


def test_the_export_interval_is_the_environments_unless_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "http://c/m")
    readers = [metric_reader()]
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "2000")
    readers += [metric_reader(), metric_reader(interval_s=3600)]
    try:
        assert [r._export_interval_millis for r in readers] == [15000.0, 2000.0, 3600000.0]
        assert (
            isinstance(readers[0]._exporter, OTLPMetricExporter)
            and readers[0]._exporter._endpoint == "http://c/m"
        )
    finally:
        for reader in readers:
            reader.shutdown()
