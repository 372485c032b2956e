"""Spans of a request (case M3) with the in-memory exporter, and the engine timeline → span events: an HTTP
SERVER span (HTTP semconv) around the INTERNAL ``llm_request``, a span for a refused request, a disconnect
that is no error (issue 39)."""

from __future__ import annotations

import importlib.metadata
import json
import logging

import httpx
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from kvscope.engine.core.request import Request
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.server.access_log import ACCESS_LOGGER
from kvscope.engine.server.tracing import RequestSpans, RequestTimeline, Tracing, observe_step
from kvscope.testing.wait import wait_until
from tests.engine.server.conftest import chat_body
from tests.engine.server.helpers import serve_in_thread

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _by_name(exporter: InMemorySpanExporter) -> dict:
    return {span.name: span for span in exporter.get_finished_spans()}


def test_traceparent_is_continued_with_phase_children(client, spans, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    spans.clear()  # drop nothing-related spans (warm-up makes none, but be explicit)
    body = client.post(
        "/v1/chat/completions", json=chat_body(max_tokens=4), headers={"traceparent": TRACEPARENT}
    ).json()
    named = _by_name(spans)
    assert sorted(named) == ["POST /v1/chat/completions", "decode", "llm_request", "prefill", "queue"]
    server, root = named["POST /v1/chat/completions"], named["llm_request"]
    assert {f"{s.context.trace_id:032x}" for s in named.values()} == {"4bf92f3577b34da6a3ce929d0e0e4736"}
    assert f"{server.parent.span_id:016x}" == "00f067aa0ba902b7" and server.parent.is_remote
    assert (server.kind, root.kind, root.parent.span_id) == (
        SpanKind.SERVER,
        SpanKind.INTERNAL,
        server.context.span_id,
    )
    assert {k: v for k, v in server.attributes.items() if k != "client.address"} == {
        "http.request.method": "POST",
        "url.path": "/v1/chat/completions",
        "url.scheme": "http",
        "network.protocol.version": "1.1",
        "user_agent.original": "testclient",
        "http.route": "/v1/chat/completions",
        "http.response.status_code": 200,
    }
    assert server.status.status_code == StatusCode.UNSET
    assert server.start_time <= root.start_time and root.end_time <= server.end_time
    for child in ("queue", "prefill", "decode"):
        assert named[child].parent.span_id == root.context.span_id
    assert named["queue"].end_time <= named["prefill"].start_time + 1
    assert named["prefill"].end_time <= named["decode"].start_time + 1
    assert root.start_time <= named["queue"].start_time and named["decode"].end_time <= root.end_time
    attrs = root.attributes
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == attrs["gen_ai.response.model"] == "fake-model"
    assert (attrs["gen_ai.usage.input_tokens"], attrs["gen_ai.usage.output_tokens"]) == (20, 4)
    assert tuple(attrs["gen_ai.response.finish_reasons"]) == ("length",)
    assert attrs["gen_ai.request.max_tokens"] == 4 and attrs["gen_ai.response.id"] == body["id"]
    chunks = [e for e in named["prefill"].events if e.name == "prefill_chunk"]
    assert [(e.attributes["kvscope.chunk.start"], e.attributes["kvscope.chunk.end"]) for e in chunks] == [
        (0, 20)
    ]
    line = next(json.loads(r.getMessage()) for r in caplog.records if r.name == ACCESS_LOGGER)
    assert line["trace"]["id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert line["span"]["id"] == f"{root.context.span_id:016x}"


def test_without_traceparent_the_server_span_is_a_root(client, spans):
    spans.clear()
    client.post("/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 2})
    client.get("/health")
    client.get("/metrics")
    named = _by_name(spans)
    assert named["POST /v1/completions"].parent is None  # probes and scrapes make no span
    assert named["llm_request"].parent.span_id == named["POST /v1/completions"].context.span_id
    assert len({s.context.trace_id for s in named.values()}) == 1


def test_a_refused_request_has_a_server_span(client, spans):
    spans.clear()
    response = client.post(
        "/v1/chat/completions", json=chat_body(max_tokens=-1), headers={"traceparent": TRACEPARENT}
    )
    assert response.status_code == 400
    (server,) = spans.get_finished_spans()  # refused before admission: no llm_request
    assert (server.name, server.kind, f"{server.parent.span_id:016x}") == (
        "POST /v1/chat/completions",
        SpanKind.SERVER,
        "00f067aa0ba902b7",
    )
    assert server.attributes["http.response.status_code"] == 400
    assert server.status.status_code == StatusCode.UNSET and "error.type" not in server.attributes


def test_failed_request_span_has_error_status(client, spans):
    spans.clear()
    client.post(
        "/v1/chat/completions", json=chat_body(max_tokens=20), headers={"x-kvscope-fault": "after_tokens=2"}
    )
    named = _by_name(spans)
    root, server = named["llm_request"], named["POST /v1/chat/completions"]
    assert root.status.status_code == StatusCode.ERROR
    assert "injected fault" in root.status.description
    assert (
        server.status.status_code == StatusCode.ERROR
        and server.attributes["http.response.status_code"] == 500
    )
    assert server.attributes["error.type"]


def _request(prompt_len: int) -> Request:
    return Request("r1", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=8), 0, arrival_time=100.0)


def test_timeline_records_chunks_and_preemption_with_exact_times():
    timeline = RequestTimeline()
    request = _request(40)
    request.trace_context = timeline
    for computed, now in ((16, 101.0), (32, 102.0), (40, 103.0)):  # three prefill chunks
        request.num_computed_tokens = computed
        observe_step([request], now)
    request.append_output_token_ids([7])
    request.num_computed_tokens = 41  # one decode step: not a chunk
    observe_step([request], 104.0)
    request.stats.num_preemptions, request.num_computed_tokens = 1, 0
    observe_step([request], 105.0)
    request.num_computed_tokens = 41  # recompute prompt + output after the preemption
    observe_step([request], 106.0)
    names = [(e.name, e.time, e.initial_prefill) for e in timeline.events]
    assert names == [
        ("prefill_chunk", 101.0, True),
        ("prefill_chunk", 102.0, True),
        ("prefill_chunk", 103.0, True),
        ("preemption", 105.0, False),
        ("prefill_chunk", 106.0, False),
    ]
    assert timeline.events[-1].attributes["kvscope.chunk.num_tokens"] == 41

    exporter = InMemorySpanExporter()
    tracing = Tracing("t", exporter, batch=False)
    tracing.record(
        RequestSpans(
            timeline=timeline,
            arrival=100.0,
            arrival_wall_ns=1_000_000_000_000,
            end=107.0,
            first_scheduled=100.5,
            first_token=103.0,
            last_token=107.0,
            attributes={"gen_ai.operation.name": "chat"},
        )
    )
    named = _by_name(exporter)
    ns = 1_000_000_000
    assert (named["queue"].start_time, named["queue"].end_time) == (1000 * ns, 1000 * ns + ns // 2)
    assert (named["prefill"].start_time, named["prefill"].end_time) == (1000 * ns + ns // 2, 1003 * ns)
    assert (named["decode"].start_time, named["decode"].end_time) == (1003 * ns, 1007 * ns)
    assert [e.timestamp for e in named["prefill"].events] == [1001 * ns, 1002 * ns, 1003 * ns]
    assert [(e.name, e.timestamp) for e in named["decode"].events] == [
        ("preemption", 1005 * ns),
        ("prefill_chunk", 1006 * ns),
    ]


def test_final_chunk_added_when_request_finished_in_its_prefill_step():
    timeline = RequestTimeline()
    request = _request(20)
    request.num_computed_tokens = 16
    timeline.observe(request, 1.0)
    timeline.finish_prefill("r1", 20, first_token_time=2.0)
    assert [
        (e.attributes["kvscope.chunk.start"], e.attributes["kvscope.chunk.end"], e.time)
        for e in timeline.events
    ] == [(0, 16, 1.0), (16, 20, 2.0)]


def test_tracer_resource_names_service_version():
    exporter = InMemorySpanExporter()
    Tracing("kvscope-engine", exporter, batch=False, service_version="9.8.7").tracer.start_span("x").end()
    (span,) = exporter.get_finished_spans()
    assert span.resource.attributes["service.name"] == "kvscope-engine"
    assert span.resource.attributes["service.version"] == "9.8.7"
    default = Tracing("kvscope-engine").provider.resource.attributes["service.version"]
    assert default == importlib.metadata.version("kvscope")


def test_a_client_disconnect_is_not_a_server_error(app, fake_engine, spans):
    fake_engine.token_s = 1.0  # the answer would take seconds: the client leaves after its first event
    spans.clear()
    with serve_in_thread(app) as url:
        with httpx.stream(
            "POST", url + "/v1/chat/completions", json=chat_body(max_tokens=50, stream=True), timeout=30
        ) as response:
            next(response.iter_lines())
        # 30 s bounds a broken run only
        wait_until(lambda: "llm_request" in _by_name(spans), 30, "the llm_request span after the disconnect")
        wait_until(lambda: "POST /v1/chat/completions" in _by_name(spans), 30, "the server span after it")
    named = _by_name(spans)
    root, server = named["llm_request"], named["POST /v1/chat/completions"]
    assert (root.status.status_code, root.attributes["kvscope.outcome"]) == (
        StatusCode.UNSET,
        "client_disconnected",
    )
    assert server.status.status_code == StatusCode.UNSET  # the 200 was sent; no server error either
