"""OTel GenAI server metrics of the engine over OTLP/HTTP, decoded from a local receiver (issue 15, Build)."""

from __future__ import annotations

from litestar.testing import TestClient
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from kvscope.common.otel_genai import (
    OPERATION_DURATION_BUCKETS,
    TIME_PER_OUTPUT_TOKEN_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
)
from kvscope.common.version import kvscope_version
from kvscope.engine.server.app import create_app
from kvscope.engine.server.settings import ServerSettings
from kvscope.engine.server.tracing import Tracing
from tests.engine.server.conftest import chat_body
from tests.engine.server.fakes import FakeEngine
from tests.otlp_receiver import OtlpReceiver


def test_gen_ai_server_metrics_reach_an_otlp_receiver() -> None:
    with OtlpReceiver() as rx:
        settings = ServerSettings(otlp_endpoint=rx.url + "/v1/traces", service_name="kvscope-engine")
        app = create_app(
            settings,
            engine=FakeEngine(),
            tracing=Tracing("t", InMemorySpanExporter(), batch=False),
            registry=CollectorRegistry(),
        )
        with TestClient(app) as client:
            for _ in range(2):
                assert client.post("/v1/chat/completions", json=chat_body(max_tokens=4)).status_code == 200
            assert (
                client.post(
                    "/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 3}
                ).status_code
                == 200
            )
        points = rx.metric_points()  # the app's shutdown pushed the final export
        resources = rx.resources()
    names = {
        "gen_ai.server.request.duration",
        "gen_ai.server.time_to_first_token",
        "gen_ai.server.time_per_output_token",
    }
    assert names <= set(points)
    base = {
        "gen_ai.provider.name": "kvscope",
        "gen_ai.request.model": "fake-model",
        "gen_ai.response.model": "fake-model",
    }
    by_op = {a["gen_ai.operation.name"]: p for a, p in points["gen_ai.server.request.duration"]}
    assert all(
        a == {**base, "gen_ai.operation.name": a["gen_ai.operation.name"]}
        for a, _ in points["gen_ai.server.request.duration"]
    )
    assert (by_op["chat"].count, by_op["text_completion"].count) == (2, 1)
    assert list(by_op["chat"].explicit_bounds) == list(OPERATION_DURATION_BUCKETS)
    ttft = {a["gen_ai.operation.name"]: p for a, p in points["gen_ai.server.time_to_first_token"]}
    assert ttft["chat"].count == 2 and list(ttft["chat"].explicit_bounds) == list(TIME_TO_FIRST_TOKEN_BUCKETS)
    tpot = {a["gen_ai.operation.name"]: p for a, p in points["gen_ai.server.time_per_output_token"]}
    assert tpot["chat"].count == 2 and list(tpot["chat"].explicit_bounds) == list(
        TIME_PER_OUTPUT_TOKEN_BUCKETS
    )
    assert (
        resources[-1]["service.name"] == "kvscope-engine"
        and resources[-1]["service.version"] == kvscope_version()
    )


def test_engine_metrics_are_openmetrics_when_asked() -> None:
    app = create_app(ServerSettings(), engine=FakeEngine(), registry=CollectorRegistry())
    with TestClient(app) as client:
        om = client.get("/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
        text = client.get("/metrics")
    assert om.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert om.text.endswith("# EOF\n")
    assert text.headers["content-type"].startswith("text/plain; version=0.0.4") and "# EOF" not in text.text
