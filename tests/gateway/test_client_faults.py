"""What the client does is not counted against the server (issue 15, point 8): a client that leaves during
the body upload is 499, not 500; 5xx the client asked for (fault injection) never eject a replica; chunks
carry no ``"usage": null`` when the client did not ask for usage."""

from __future__ import annotations

import json
import socket
import time

from kvscope.testing.harness import metric_samples, records_by_id, sample, sse_events
from tests.gateway.conftest import KEYS, Stack

HI = [{"role": "user", "content": "hi"}]


def test_client_leaving_during_the_body_upload_is_499(stack: Stack) -> None:
    before = metric_samples(stack.metrics())
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS['alice']}\r\n"
        "Content-Type: application/json\r\nContent-Length: 5000\r\nx-request-id: left-mid-body\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", stack.gateway.port)) as sock:
        sock.sendall(head.encode() + b'{"model": "fake-model", "messages": [')
        time.sleep(0.2)  # the gateway is reading the body
    record = records_by_id(stack.log, ["left-mid-body"])["left-mid-body"][0]
    assert record["http"]["response"]["status_code"] == 499
    assert record["kvscope"]["client_disconnected"] is True
    assert record["kvscope"]["disconnect_phase"] == "request_body"
    assert record["event"]["outcome"] == "unknown" and record["log"]["level"] == "warning"
    assert record["error"]["type"] == "client_disconnected"
    after = metric_samples(stack.metrics())
    labels = {"model": "unknown", "route": "/v1/chat/completions"}
    assert (
        sample(after, "kvscope_gateway_requests_total", **labels, status="499")
        == sample(before, "kvscope_gateway_requests_total", **labels, status="499") + 1
    )
    assert sample(after, "kvscope_gateway_requests_total", **labels, status="500") == sample(
        before, "kvscope_gateway_requests_total", **labels, status="500"
    )


def test_no_usage_null_in_chunks_when_the_client_did_not_ask(stack: Stack) -> None:
    body = {"model": "fake-model", "messages": HI, "stream": True, "max_tokens": 3}
    with stack.client() as c:
        plain = c.post("/v1/chat/completions", json=body).content
        asked = c.post(
            "/v1/chat/completions", json={**body, "stream_options": {"include_usage": True}}
        ).content
    chunks = [json.loads(e) for e in sse_events(plain) if e != "[DONE]"]
    assert len(chunks) == 5 and all("usage" not in chunk for chunk in chunks)
    with_usage = [json.loads(e) for e in sse_events(asked) if e != "[DONE]"]
    assert [c["usage"] is None for c in with_usage] == [True] * 5 + [False]  # asked: as the upstream sent it


def up(stack: Stack, name: str) -> float:
    label = stack.fakes[name].url.removeprefix("http://")
    key = ("kvscope_gateway_upstream_up", (("kind", "kvscope"), ("upstream", label)))  # the fake: kvscope
    return metric_samples(stack.metrics())[key]


def test_5xx_the_client_asked_for_do_not_eject_the_replica(own_stack: Stack) -> None:
    body = {"model": "fake-model", "messages": HI, "fake": {"status": 500}}
    with own_stack.client() as c:
        for _ in range(5):  # past failure_threshold (3)
            resp = c.post("/v1/chat/completions", json=body, headers={"x-kvscope-fault": "status=500"})
            assert resp.status_code == 500
        assert up(own_stack, "main") == 1.0
        assert c.post("/v1/chat/completions", json={"model": "fake-model", "messages": HI}).status_code == 200
        for _ in range(3):  # the same 5xx without the client asking for it: the replica is ejected
            assert c.post("/v1/chat/completions", json=body).status_code == 500
        assert up(own_stack, "main") == 0.0
        errors = sample(
            metric_samples(own_stack.metrics()),
            "kvscope_gateway_upstream_errors_total",
            upstream=own_stack.fakes["main"].url.removeprefix("http://"),
            kind="kvscope",
            reason="status_5xx",
        )
        assert errors == 8.0  # every 5xx is still counted
