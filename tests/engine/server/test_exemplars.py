"""Exemplars on the engine's latency histograms (issue 39): an OpenMetrics scrape carries the trace id of a
sampled request on its TTFT, e2e, queue, prefill, decode, TPOT and inference-time buckets; an unsampled
request (traceparent flags 00) leaves none, since its trace is not in the backend."""

from __future__ import annotations

from litestar.testing import TestClient
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from kvscope.engine.server.app import create_app
from kvscope.engine.server.settings import ServerSettings
from kvscope.engine.server.tracing import Tracing
from tests.engine.server.conftest import chat_body
from tests.engine.server.fakes import FakeEngine

OPENMETRICS = {"accept": "application/openmetrics-text; version=1.0.0"}
LATENCY = (
    "time_to_first_token_seconds",
    "e2e_request_latency_seconds",
    "queue_time_seconds",
    "prefill_time_seconds",
    "decode_time_seconds",
    "time_per_output_token_seconds",
    "request_inference_time_seconds",
)
UNSAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"


def exemplar_trace_ids(text: str) -> dict[str, set[str]]:
    """Latency family (without prefix) → the trace ids its buckets' exemplars name."""
    out: dict[str, set[str]] = {name: set() for name in LATENCY}
    for family in text_string_to_metric_families(text):
        name = family.name.removeprefix("kvscope_engine_")
        if name in out:
            out[name] |= {s.exemplar.labels["trace_id"] for s in family.samples if s.exemplar is not None}
    return out


def test_latency_buckets_carry_the_trace_id_of_a_sampled_request() -> None:
    exporter = InMemorySpanExporter()
    app = create_app(
        ServerSettings(warmup=False),
        engine=FakeEngine(),
        registry=CollectorRegistry(),
        tracing=Tracing("t", exporter, batch=False),
    )
    with TestClient(app) as client:
        body = chat_body(max_tokens=4)
        assert (
            client.post("/v1/chat/completions", json=body, headers={"traceparent": UNSAMPLED}).status_code
            == 200
        )
        unsampled = exemplar_trace_ids(client.get("/metrics", headers=OPENMETRICS).text)
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        sampled = exemplar_trace_ids(client.get("/metrics", headers=OPENMETRICS).text)
    (root,) = [s for s in exporter.get_finished_spans() if s.name == "llm_request"]  # the sampled one only
    assert unsampled == {name: set() for name in LATENCY}
    assert sampled == {name: {f"{root.context.trace_id:032x}"} for name in LATENCY}
