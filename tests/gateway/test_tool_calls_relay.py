"""Issue 14 point 4: a tool-calling answer passes through the gateway unchanged, and its log line and gen_ai
span record ``gen_ai.response.finish_reasons`` = ["tool_calls"] (streamed and not)."""

from __future__ import annotations

import json

import pytest

from kvscope.testing.harness import records_by_id, sse_events
from tests.gateway.conftest import Stack
from tests.gateway.test_semconv_spans import HI, client_span, server_span


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_finish_reason_is_logged_and_traced(stack: Stack, stream: bool) -> None:
    rid = f"tools-{stream}"
    body = {
        "model": "fake-model",
        "messages": HI,
        "max_tokens": 2,
        "stream": stream,
        "fake": {"finish_reason": "tool_calls"},
    }
    with stack.client() as c:
        response = c.post("/v1/chat/completions", json=body, headers={"x-request-id": rid})
    assert response.status_code == 200
    if stream:
        events = sse_events(response.content)
        reasons = [ch["finish_reason"] for e in events[:-1] for ch in json.loads(e)["choices"]]
        assert (events[-1], reasons[-1]) == ("[DONE]", "tool_calls")
    else:
        assert response.json()["choices"][0]["finish_reason"] == "tool_calls"
    record = records_by_id(stack.log, [rid])[rid][0]
    assert record["gen_ai"]["response"]["finish_reasons"] == ["tool_calls"]
    assert record["event"]["outcome"] == "success"
    span = client_span(stack, server_span(stack, rid))
    assert span.attributes["gen_ai.response.finish_reasons"] == ("tool_calls",)
