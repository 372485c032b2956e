"""Gateway spans as OTel semantic conventions 1.41 define them (issue 15, points 2 and 3), read from the
in-memory span exporter of the in-process gateway.

HTTP server span (semconv "HTTP spans", Status): 4xx leaves the status UNSET, 5xx is ERROR with
``error.type`` = the status code; ``url.scheme`` is set; the client's request id is ``kvscope.request.id``
(there is no ``http.request.id`` attribute in OTel)."""

from __future__ import annotations

import time

from opentelemetry.trace import SpanKind, StatusCode

from tests.gateway.conftest import Stack

HI = [{"role": "user", "content": "hi"}]


def server_span(stack: Stack, request_id: str, timeout_s: float = 5.0):
    """The finished SERVER span of the request sent with ``x-request-id: request_id``."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = [s for s in stack.exporter.get_finished_spans()
                 if s.kind is SpanKind.SERVER and s.attributes.get("kvscope.request.id") == request_id]
        if found or time.monotonic() > deadline:
            assert len(found) == 1, f"{len(found)} server spans for {request_id}"
            return found[0]
        time.sleep(0.02)


def test_server_span_status_follows_http_semconv(stack: Stack) -> None:
    with stack.client() as c, stack.client("limited") as limited:
        ok = c.post("/v1/chat/completions", json={"model": "fake-model", "messages": HI, "max_tokens": 2},
                    headers={"x-request-id": "span-200"})
        bad = c.post("/v1/chat/completions", json={"model": "fake-model", "messages": "nope"},
                     headers={"x-request-id": "span-400"})
        unauth = c.post("/v1/chat/completions", json={"model": "fake-model", "messages": HI},
                        headers={"x-request-id": "span-401", "authorization": "Bearer wrong"})
        denied = limited.post("/v1/chat/completions", json={"model": "fake-model", "messages": HI,
                                                            "max_tokens": 100}, headers={"x-request-id": "span-4xx"})
        broken = c.post("/v1/chat/completions", json={"model": "broken-model", "messages": HI},
                        headers={"x-request-id": "span-500"})
    assert (ok.status_code, bad.status_code, unauth.status_code, broken.status_code) == (200, 400, 401, 500)
    assert 400 <= denied.status_code < 500
    for rid, status in (("span-200", 200), ("span-400", 400), ("span-401", 401),
                        ("span-4xx", denied.status_code)):
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
        c.post("/v1/chat/completions", json={"model": "fake-model", "messages": HI, "max_tokens": 1},
               headers={"x-request-id": "span-attrs", "user-agent": "kvscope-test/1"})
    span = server_span(stack, "span-attrs")
    assert span.name == "POST /v1/chat/completions"
    assert {k: span.attributes[k] for k in ("http.request.method", "url.path", "url.scheme", "http.route",
                                            "network.protocol.version", "client.address",
                                            "user_agent.original", "kvscope.request.id")} == {
        "http.request.method": "POST", "url.path": "/v1/chat/completions", "url.scheme": "http",
        "http.route": "/v1/chat/completions", "network.protocol.version": "1.1", "client.address": "127.0.0.1",
        "user_agent.original": "kvscope-test/1", "kvscope.request.id": "span-attrs"}
    assert "http.request.id" not in span.attributes
