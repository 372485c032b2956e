"""One streamed request against a scripted SSE stream with known event times: TTFT, ITL, e2e, TPOT, token
counts, usage and every error type."""

from __future__ import annotations

import httpx
import pytest

from kvscope.bench.client import EndpointConfig, build_body, send_request
from kvscope.bench.dataset import SampleRequest
from tests.bench.fakes import (
    FakeClock,
    ScriptedServer,
    chat_chunk,
    completion_chunk,
    token_stream,
    usage_chunk,
)

SAMPLE = SampleRequest("hello world", 2, 3)
COMPLETIONS = EndpointConfig("http://server:8000/", "m")


async def run_one(script, cfg: EndpointConfig = COMPLETIONS, start: float = 10.0):
    clock = FakeClock(start)
    server = ScriptedServer(clock, lambda body: script)
    async with server.client() as client:
        out = await send_request(client, cfg, SAMPLE, clock)
    return out, server


async def test_completion_stream_timings_are_the_event_times():
    events = [(0.0, ": keep-alive"), *token_stream([0.5, 0.125, 0.25], done_after=0.125)]
    events[-2] = (0.0, usage_chunk(3, prompt=7, cached=4))
    out, server = await run_one(events)
    assert out.success and out.error_type == ""
    assert out.start_time == 10.0
    assert out.ttft == pytest.approx(0.5, abs=1e-12)
    assert out.itl == pytest.approx([0.125, 0.25], abs=1e-12)
    assert out.latency == pytest.approx(1.0, abs=1e-12)
    assert out.stream_tokens == 3 and out.usage_output_tokens == 3 and out.output_tokens == 3
    assert out.tpot == pytest.approx((1.0 - 0.5) / 2, abs=1e-12)
    assert (out.usage_prompt_tokens, out.cached_tokens) == (7, 4)
    assert out.generated_text == "t0t1t2" and out.finish_reason == "length"
    assert server.urls == ["http://server:8000/v1/completions"]


async def test_chat_role_chunk_before_prefill_does_not_count_as_first_token():
    chat = EndpointConfig("http://server:8000", "m", endpoint="chat")
    events = [
        (0.25, chat_chunk({"role": "assistant", "content": ""})),
        (0.5, chat_chunk({"content": "Hi"})),
        (0.125, chat_chunk({"content": " there"})),
        (0.0, chat_chunk({}, "stop")),
        (0.125, "data: [DONE]"),
    ]
    out, server = await run_one(events, chat)
    assert out.success
    assert out.ttft == pytest.approx(0.75, abs=1e-12)
    assert out.itl == pytest.approx([0.125], abs=1e-12)
    assert out.latency == pytest.approx(1.0, abs=1e-12)
    assert out.usage_output_tokens is None and out.output_tokens == 2
    assert out.tpot == pytest.approx(0.25, abs=1e-12)
    assert server.bodies[0]["messages"] == [{"role": "user", "content": "hello world"}]
    assert server.urls == ["http://server:8000/v1/chat/completions"]


async def test_usage_wins_over_the_stream_count():
    out, _ = await run_one(token_stream([0.5, 0.25], done_after=0.25, usage_tokens=3))
    assert (out.stream_tokens, out.usage_output_tokens, out.output_tokens) == (2, 3, 3)
    assert out.tpot == pytest.approx((1.0 - 0.5) / 2, abs=1e-12)


async def test_single_token_has_no_tpot():
    out, _ = await run_one(token_stream([0.5], done_after=0.0))
    assert out.success and out.output_tokens == 1 and out.tpot is None and out.itl == []


async def test_tokens_without_text_complete_with_their_output_at_the_end():
    """A stream whose 128 tokens are all byte tokens that never form a character (SmolLM2 does this for
    some random prompts with ignore_eos): usage says 128, no chunk carries text. Completed, as in vLLM's
    client; the output reached the client only with the end, so TTFT is the e2e latency; no TPOT, no ITL."""
    events = [(0.5, completion_chunk("", "length")), (0.0, usage_chunk(128)), (0.25, "data: [DONE]")]
    out, _ = await run_one(events)
    assert out.success and out.error_type == ""
    assert (out.stream_tokens, out.output_tokens) == (0, 128)
    assert out.ttft == out.latency == pytest.approx(0.75, abs=1e-12)
    assert out.tpot is None and out.itl == []


@pytest.mark.parametrize(
    ("script", "error_type", "message"),
    [
        ((429, {"error": {"message": "slow down", "type": "rate_limit_error"}}), "http_429", "slow down"),
        (
            [(0.5, completion_chunk("a")), (0.1, {"error": {"message": "boom", "type": "server_error"}})],
            "stream_error:server_error",
            "boom",
        ),
        (
            [(0.5, completion_chunk("a"))],
            "incomplete_stream",
            "stream ended without [DONE] after 1 token chunks",
        ),
        ([(0.5, completion_chunk("")), (0.1, "data: [DONE]")], "no_output", "the stream carried no text"),
        ([(0.5, "data: {not json")], "invalid_json", "{not json"),
    ],
)
async def test_failures_are_typed(script, error_type, message):
    out, _ = await run_one(script)
    assert not out.success
    assert (out.error_type, out.error) == (error_type, message)
    assert out.tpot is None


@pytest.mark.parametrize(
    ("exc", "error_type"),
    [
        (httpx.ConnectError("refused"), "connect_error"),
        (httpx.ReadTimeout("slow"), "timeout"),
        (httpx.RemoteProtocolError("bad"), "protocol_error"),
        (httpx.ReadError("reset"), "http_error:ReadError"),
    ],
)
async def test_transport_errors_are_typed(exc, error_type):
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        out = await send_request(client, COMPLETIONS, SAMPLE, FakeClock())
    assert not out.success and out.error_type == error_type


def test_body_is_greedy_streamed_with_usage_and_equal_lengths():
    cfg = EndpointConfig(
        "http://x", "m", ignore_eos=True, extra_body={"cache_prompt": False, "temperature": 0.5}
    )
    assert build_body(cfg, SAMPLE) == {
        "model": "m",
        "prompt": "hello world",
        "max_tokens": 3,
        "temperature": 0.5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "min_tokens": 3,
        "cache_prompt": False,
    }
    plain = build_body(EndpointConfig("http://x", "m"), SAMPLE, max_tokens=16)
    assert "ignore_eos" not in plain and "min_tokens" not in plain
    assert (plain["max_tokens"], plain["temperature"]) == (16, 0.0)
