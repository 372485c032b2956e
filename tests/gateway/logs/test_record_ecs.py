"""The request log record against ECS 9.x and the OTel GenAI message schema (issue 15, point 6)."""

from __future__ import annotations

import json
import time

from kvscope.engine.server.access_log import AccessRecord
from kvscope.gateway.context import RequestContext
from kvscope.gateway.logs.genai_messages import input_messages, output_messages
from kvscope.gateway.logs.record import ECS_VERSION, LOG_LEVELS, RecordBuilder, ServiceInfo


def ctx(status: int, input_content: object = None, output_content: list[str] | None = None) -> RequestContext:
    now = time.perf_counter()
    c = RequestContext(
        request_id="r",
        method="POST",
        path="/v1/chat/completions",
        route="/v1/chat/completions",
        start=now,
        start_wall=time.time(),
    )
    c.request.input_content, c.answer.output_content = input_content, output_content
    c.outcome.status, c.outcome.end_at = status, now + 0.01
    return c


def build(c: RequestContext, log_content: bool = False) -> dict:
    return RecordBuilder(ServiceInfo("kvscope-gateway", "0.1.0", "gw"), log_content).build(c)


def engine_level(status: int) -> str:
    record = AccessRecord("POST", "/v1/chat/completions", "r")
    record.status = status
    return json.loads(record.to_json("kvscope-engine"))["log"]["level"]


def test_ecs_version_is_the_first_with_gen_ai_fields_in_both_services() -> None:
    assert ECS_VERSION == "9.1.0"
    assert build(ctx(200))["ecs"] == {"version": "9.1.0"}
    record = AccessRecord("POST", "/v1/completions", "r")
    record.status = 200
    assert json.loads(record.to_json("kvscope-engine"))["ecs"] == {"version": "9.1.0"}


def test_one_log_level_vocabulary_for_gateway_and_engine() -> None:
    gateway = {status: build(ctx(status))["log"]["level"] for status in (200, 400, 429, 500, 503)}
    engine = {status: engine_level(status) for status in (200, 400, 429, 500, 503)}
    assert gateway == engine == {200: "info", 400: "warning", 429: "warning", 500: "error", 503: "error"}
    assert set(gateway.values()) == set(LOG_LEVELS)
    left = ctx(499)
    left.outcome.mark_disconnected("first_token")
    assert build(left)["log"]["level"] == "warning"


def test_log_content_follows_the_otel_genai_message_schema() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": "https://x/cat.png"}},
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "look", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "a cat"},
    ]
    c = ctx(200, input_content=messages, output_content=["A cat.", "Cat"])
    c.answer.finish_reasons = ["stop", "length"]
    gen_ai = build(c, log_content=True)["gen_ai"]
    assert gen_ai["input"]["messages"] == [
        {"role": "system", "parts": [{"type": "text", "content": "be brief"}]},
        {
            "role": "user",
            "parts": [
                {"type": "text", "content": "what is this?"},
                {"type": "uri", "modality": "image", "uri": "https://x/cat.png"},
            ],
        },
        {
            "role": "assistant",
            "parts": [{"type": "tool_call", "id": "call_1", "name": "look", "arguments": "{}"}],
        },
        {"role": "tool", "parts": [{"type": "tool_call_response", "id": "call_1", "response": "a cat"}]},
    ]
    assert gen_ai["output"]["messages"] == [
        {"role": "assistant", "parts": [{"type": "text", "content": "A cat."}], "finish_reason": "stop"},
        {"role": "assistant", "parts": [{"type": "text", "content": "Cat"}], "finish_reason": "length"},
    ]


def test_completion_prompts_become_user_messages() -> None:
    assert input_messages("hello") == [{"role": "user", "parts": [{"type": "text", "content": "hello"}]}]
    assert input_messages(["a", "b"]) == [
        {"role": "user", "parts": [{"type": "text", "content": "a"}]},
        {"role": "user", "parts": [{"type": "text", "content": "b"}]},
    ]
    assert input_messages([1, 2, 3]) == [
        {"role": "user", "parts": [{"type": "text", "content": "[1, 2, 3]"}]}
    ]
    assert output_messages(["x"], []) == [
        {"role": "assistant", "parts": [{"type": "text", "content": "x"}], "finish_reason": None}
    ]
    assert input_messages(None) is None and output_messages(None, []) is None
