"""Gateway spans as OTel semantic conventions 1.41 define them (issue 15, points 2 and 3), read from the
in-memory span exporter of the in-process gateway.

HTTP server span (semconv "HTTP spans", Status): 4xx leaves the status UNSET, 5xx is ERROR with
``error.type`` = the status code; ``url.scheme`` is set; the client's request id is ``kvscope.request.id``
(there is no ``http.request.id`` attribute in OTel)."""

from __future__ import annotations

import json

from opentelemetry.trace import SpanKind, StatusCode

from kvscope.testing.harness import sse_events
from kvscope.testing.wait import wait_until
from tests.gateway.conftest import Stack

HI = [{"role": "user", "content": "hi"}]


def server_span(stack: Stack, request_id: str, timeout_s: float = 5.0):
    """The finished SERVER span of the request sent with ``x-request-id: request_id``."""
    found = wait_until(
        lambda: [
            s
            for s in stack.exporter.get_finished_spans()
            if s.kind is SpanKind.SERVER and s.attributes.get("kvscope.request.id") == request_id
        ],
        timeout_s,
        f"the server span of {request_id}",
    )
    assert len(found) == 1, f"{len(found)} server spans for {request_id}"
    return found[0]


def test_server_span_status_follows_http_semconv(stack: Stack) -> None:
    with stack.client() as c, stack.client("limited") as limited:
        ok = c.post(
            "/v1/chat/completions",
            json={"model": "fake-model", "messages": HI, "max_tokens": 2},
            headers={"x-request-id": "span-200"},
        )
        bad = c.post(
            "/v1/chat/completions",
            json={"model": "fake-model", "messages": "nope"},
            headers={"x-request-id": "span-400"},
        )
        unauth = c.post(
            "/v1/chat/completions",
            json={"model": "fake-model", "messages": HI},
            headers={"x-request-id": "span-401", "authorization": "Bearer wrong"},
        )
        denied = limited.post(
            "/v1/chat/completions",
            json={"model": "fake-model", "messages": HI, "max_tokens": 100},
            headers={"x-request-id": "span-4xx"},
        )
        broken = c.post(
            "/v1/chat/completions",
            json={"model": "broken-model", "messages": HI},
            headers={"x-request-id": "span-500"},
        )
    assert (ok.status_code, bad.status_code, unauth.status_code, broken.status_code) == (200, 400, 401, 500)
    assert 400 <= denied.status_code < 500
    for rid, status in (
        ("span-200", 200),
        ("span-400", 400),
        ("span-401", 401),
        ("span-4xx", denied.status_code),
    ):
        span = server_span(stack, rid)
        assert span.status.status_code is StatusCode.UNSET, rid
        assert span.attributes["http.response.status_code"] == status
        assert "error.type" not in span.attributes
    failed = server_span(stack, "span-500")
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.attributes["error.type"] == "500"
    assert failed.attributes["http.response.status_code"] == 500


def test_server_span_required_attributes(stack: Stack) -> None:
    with stack.client() as c:
        c.post(
            "/v1/chat/completions",
            json={"model": "fake-model", "messages": HI, "max_tokens": 1},
            headers={"x-request-id": "span-attrs", "user-agent": "kvscope-test/1"},
        )
    span = server_span(stack, "span-attrs")
    assert span.name == "POST /v1/chat/completions"
    assert {
        k: span.attributes[k]
        for k in (
            "http.request.method",
            "url.path",
            "url.scheme",
            "http.route",
            "network.protocol.version",
            "client.address",
            "user_agent.original",
            "kvscope.request.id",
        )
    } == {
        "http.request.method": "POST",
        "url.path": "/v1/chat/completions",
        "url.scheme": "http",
        "http.route": "/v1/chat/completions",
        "network.protocol.version": "1.1",
        "client.address": "127.0.0.1",
        "user_agent.original": "kvscope-test/1",
        "kvscope.request.id": "span-attrs",
    }
    assert "http.request.id" not in span.attributes


def client_span(stack: Stack, server):
    found = wait_until(
        lambda: [
            s
            for s in stack.exporter.get_finished_spans()
            if s.kind is SpanKind.CLIENT and s.parent and s.parent.span_id == server.context.span_id
        ],
        5,
        "the client span under the server span",
    )
    assert len(found) == 1
    return found[0]


def test_gen_ai_client_span_has_every_semconv_attribute(stack: Stack) -> None:
    """Point 3: provider, server host + port (not a URL), response id, request parameters, cache reads,
    time to first chunk."""
    body = {
        "model": "fake-model",
        "messages": HI,
        "stream": True,
        "max_tokens": 3,
        "temperature": 0.5,
        "top_p": 0.9,
        "stream_options": {"include_usage": True},
        "fake": {"cached_tokens": 2},
    }
    with stack.client() as c:
        c.post("/v1/chat/completions", json=body, headers={"x-request-id": "genai-attrs"})
    fake = stack.fakes["main"]
    response_id = json.loads(sse_events(fake.records[-1].sse.encode("latin-1"))[0])["id"]
    assert response_id.startswith("chatcmpl-")
    span = client_span(stack, server_span(stack, "genai-attrs"))
    attrs = dict(span.attributes)
    ttfc = attrs.pop("gen_ai.response.time_to_first_chunk")
    assert 0 < ttfc < (span.end_time - span.start_time) / 1e9
    assert attrs == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "kvscope",
        "gen_ai.request.model": "fake-model",
        "gen_ai.request.stream": True,
        "gen_ai.request.max_tokens": 3,
        "gen_ai.request.temperature": 0.5,
        "gen_ai.request.top_p": 0.9,
        "server.address": "127.0.0.1",
        "server.port": fake.port,
        "gen_ai.response.id": response_id,
        "gen_ai.response.model": "fake-model",
        "gen_ai.response.finish_reasons": ("length",),
        "gen_ai.usage.input_tokens": 1,
        "gen_ai.usage.output_tokens": 3,
        "gen_ai.usage.cache_read.input_tokens": 2,
        "kvscope.attempts": 1,
    }
    assert span.name == "chat fake-model" and span.status.status_code is StatusCode.UNSET


def test_gen_ai_client_span_error_type(stack: Stack) -> None:
    with stack.client() as c:
        c.post(
            "/v1/chat/completions",
            json={"model": "broken-model", "messages": HI},
            headers={"x-request-id": "genai-error"},
        )
    span = client_span(stack, server_span(stack, "genai-error"))
    assert span.status.status_code is StatusCode.ERROR
    # GenAI semconv: error.type SHOULD be the provider's error code (the fake answers type server_error)
    assert span.attributes["error.type"] == "server_error"
    assert span.attributes["gen_ai.provider.name"] == "kvscope"
