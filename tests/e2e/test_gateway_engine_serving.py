"""Serving cases S1–S5, K1, A3 and A4 of serving-cases.md through the gateway (client → gateway → a real
engine subprocess, SmolLM2 on CPU), checked on both sides: the client's bytes, the gateway's log line and
metrics, and the engine's log line and metrics for the same ``x-request-id``.

Scaled for 2 shared CPU cores: S1 streams 32 tokens (not 200; ~10 tokens/s on a 2-vCPU EPYC); the context is
1024 tokens, so K1's prompt has 1124 tokens and its short request asks for 1021. S4's wait is a ~900-token
prefill (seconds on such a CPU) against a gateway keep-alive interval of 0.5 s. Time bounds come from what the
test measured (the engine's decode time and TTFT), not from this CPU's speed. After every test a plain chat
request must answer 200.
"""

from __future__ import annotations

import pytest

from tests.e2e.gateway_engine_support import (
    GATEWAY_KEEPALIVE_S,
    MODEL,
    M,
    engine_generation_requests,
    plain_chat,
    start_stack,
    token_times,
    total,
    wait_for,
)
from tests.engine.server.e2e_support import CHAT, COMPLETIONS, chat, completion, delta, stream

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    running = start_stack(
        tmp_path_factory.mktemp("gw-serving"),
        "--kv-cache-memory",
        "64M",
        "--max-num-seqs",
        "2",
        "--enable-fault-injection",
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(stack):
    with stack.client() as http:
        yield http


@pytest.fixture(autouse=True)
def engine_stays_alive(client):
    yield
    response = plain_chat(client)
    assert response.status_code == 200, response.text


def test_s1_stream_is_not_buffered_and_ttft_agrees(stack, client):
    before = stack.gateway_metrics()
    body = chat("Count from 1 to 100 separated by spaces.", max_tokens=32, temperature=0, ignore_eos=True)
    result = stream(client, CHAT, body, {"x-request-id": "gw-s1"})
    assert result.status == 200
    assert result.headers["content-type"].startswith("text/event-stream")
    assert (result.headers["cache-control"], result.headers["x-accel-buffering"]) == ("no-cache", "no")
    assert "content-length" not in result.headers and "content-encoding" not in result.headers
    tokens = token_times(result)
    line = stack.gateway_line("gw-s1")
    engine = line["kvscope"]["engine"]
    assert line["gen_ai"]["usage"]["output_tokens"] == 32 and len(tokens) >= 28  # a few tokens carry no text
    # tokens reach the client spread over the decode as the engine measured it (first to last token), most
    # of them a good part of a decode step apart: a buffering gateway would deliver them in a burst
    step_s = engine["decode_s"] / 31
    spread = tokens[-1] - tokens[0]
    assert spread > 0.8 * engine["decode_s"] > 0, "tokens must reach the client as the engine makes them"
    gaps = [b - a for a, b in zip(tokens, tokens[1:], strict=False)]
    assert sum(g > step_s / 10 for g in gaps) > len(gaps) // 2, (step_s, gaps)
    ttft = line["kvscope"]["ttft_s"]  # stamped before the gateway forwards the next token
    assert engine["ttft_s"] <= ttft < tokens[1]
    after = stack.gateway_metrics()
    assert delta(before, after, "kvscope_gateway_time_to_first_token_seconds_count", **M) == 1
    assert delta(before, after, "kvscope_gateway_time_to_first_token_seconds_sum", **M) == pytest.approx(
        ttft, abs=1e-9
    )


@pytest.mark.parametrize(("path", "body"), [
    (CHAT, chat("Write a long story about a dragon.", max_tokens=16, temperature=0)),
    (COMPLETIONS, completion("Once upon a time", max_tokens=16, temperature=0)),
])  # fmt: skip
def test_s2_exactly_one_terminal_chunk(stack, client, path, body):
    rid = f"gw-s2-{'chat' if path == CHAT else 'text'}"
    result = stream(client, path, body, {"x-request-id": rid})
    parsed = result.parsed
    assert result.events[-1][1] == "data: [DONE]" and result.text.endswith("\n\ndata: [DONE]\n\n")
    assert parsed.data.count("[DONE]") == 1 and parsed.other == []
    assert all(c["choices"] for c in parsed.chunks), "no usage chunk without stream_options"
    reasons = [c["choices"][0]["finish_reason"] for c in parsed.chunks]
    assert reasons[-1] == "length" and reasons[:-1] == [None] * (len(reasons) - 1)
    line = stack.gateway_line(rid)
    assert line["gen_ai"]["response"]["finish_reasons"] == ["length"]
    assert line["gen_ai"]["usage"]["output_tokens"] == 16
    assert (line["http"]["response"]["status_code"], line["event"]["outcome"], line["log"]["level"]) == (
        200,
        "success",
        "info",
    )
    assert (line["kvscope"]["stream_error"], line["error"]["type"]) == (None, None)


def test_s3_engine_fault_mid_stream_is_not_success(stack, client):
    before_gw, before = stack.gateway_metrics(), stack.engine_metrics()
    body = chat("Tell me about the sea.", max_tokens=64, ignore_eos=True)
    parsed = stream(client, CHAT, body, {"x-request-id": "gw-s3", "x-kvscope-fault": "after_tokens=4"}).parsed
    assert "[DONE]" not in parsed.data
    error = parsed.data[-1]["error"]
    assert list(parsed.data[-1]) == ["error"] and "injected fault" in error["message"]
    assert {c["choices"][0]["finish_reason"] for c in parsed.chunks[:-1]} == {None}
    line = stack.gateway_line("gw-s3")
    assert (line["http"]["response"]["status_code"], line["event"]["outcome"], line["log"]["level"]) == (
        200,
        "failure",
        "error",
    )
    assert line["kvscope"]["stream_error"] == "upstream_error"
    assert line["error"]["message"] == error["message"] and line["error"]["type"] == error["code"]
    assert line["gen_ai"]["response"]["finish_reasons"] is None
    assert stack.engine_line("gw-s3")["kvscope"]["outcome"] == "error"
    after_gw = stack.gateway_metrics()
    assert (
        delta(before_gw, after_gw, "kvscope_gateway_stream_errors_total", reason="upstream_error", **M) == 1
    )
    assert delta(before_gw, after_gw, "kvscope_gateway_requests_total", route=CHAT, status="200", **M) == 1
    used = ("kvscope_engine_kv_cache_blocks", (("model", MODEL), ("state", "used")))
    after = wait_for(lambda: (m := stack.engine_metrics()) and m[used] == before[used] and m)
    assert delta(before, after, "kvscope_engine_request_success_total", finish_reason="error", **M) == 1


def test_s4_keepalive_comments_while_prefilling(stack, client):
    prompt = "The history of the ocean. " * 150  # ~900 tokens: seconds of prefill on a 2-vCPU EPYC
    result = stream(
        client,
        COMPLETIONS,
        completion(prompt, max_tokens=2, temperature=0),  # greedy: text, not
        {"x-request-id": "gw-s4"},
    )  # two sampled byte pieces without text (then no TTFT at all)
    head = result.text.split("data: ")[0]
    assert "event:" not in result.text
    assert set(result.parsed.comments) <= {": keep-alive"} and result.parsed.other == []
    # the k-th comment leaves ≥ k intervals after the gateway got the request (after the client sent it);
    # load only delays them (1 ms: timer rounding)
    comment_times = [t for t, event in result.events if event == ": keep-alive"]
    assert all(t >= GATEWAY_KEEPALIVE_S * k - 1e-3 for k, t in enumerate(comment_times, start=1)), (
        comment_times
    )
    line = stack.gateway_line("gw-s4")
    ttft, before_token = line["kvscope"]["ttft_s"], head.count(": keep-alive\n\n")
    # TTFT is the first token, not a comment: after every comment sent before it, and stamped before the
    # gateway forwards [DONE]
    assert GATEWAY_KEEPALIVE_S * before_token - 1e-3 <= ttft < result.data_times()[-1]
    assert line["kvscope"]["engine"]["ttft_s"] <= ttft
    # as many comments as the measured wait allows: at least one once the wait spans three intervals (load
    # may delay a timer, not skip a whole wait); the times above bound them from above
    assert before_token >= (1 if ttft >= 3 * GATEWAY_KEEPALIVE_S else 0), (before_token, ttft)


def test_s5_usage_chunk_equals_non_streaming_usage(stack, client):
    body = chat("Name a colour.", max_tokens=6, n=2, ignore_eos=True, temperature=0)
    client.post(CHAT, json=body)  # warm the prefix cache so cached_tokens match below
    plain = client.post(CHAT, json=body).json()
    assert (
        plain["usage"]["completion_tokens"] == 12
        and plain["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    )
    before_gw, before = stack.gateway_metrics(), stack.engine_metrics()
    result = stream(
        client, CHAT, {**body, "stream_options": {"include_usage": True}}, {"x-request-id": "gw-s5"}
    )
    parsed = result.parsed
    usage_chunks = [c for c in parsed.chunks if c.get("usage")]
    assert usage_chunks == [parsed.chunks[-1]] and parsed.data[-1] == "[DONE]"
    assert parsed.chunks[-1]["choices"] == [] and parsed.chunks[-1]["usage"] == plain["usage"]
    assert sorted(
        c["choices"][0]["index"] for c in parsed.chunks[:-1] if c["choices"][0]["finish_reason"]
    ) == [0, 1]
    line = stack.gateway_line("gw-s5")  # written after the metrics are updated
    after_gw, after = stack.gateway_metrics(), stack.engine_metrics()
    usage = plain["usage"]
    assert (
        line["gen_ai"]["usage"]["input_tokens"],
        line["gen_ai"]["usage"]["output_tokens"],
        line["gen_ai"]["usage"]["cache_read"]["input_tokens"],
    ) == (usage["prompt_tokens"], 12, usage["prompt_tokens_details"]["cached_tokens"])
    assert line["gen_ai"]["response"]["finish_reasons"] == ["length", "length"]
    for kind, value in (("input", usage["prompt_tokens"]), ("output", 12)):
        assert delta(before_gw, after_gw, "kvscope_gateway_tokens_total", type=kind, **M) == value
    cached = usage["prompt_tokens_details"]["cached_tokens"]  # a subset of input: its own counter
    assert delta(before_gw, after_gw, "kvscope_gateway_cached_tokens_total", **M) == cached
    assert delta(before, after, "kvscope_engine_generation_tokens_total", **M) == 12
    no_usage = stream(client, CHAT, body, {"x-request-id": "gw-s5-plain"}).parsed
    # the upstream was asked for usage: its "usage": null is removed from every chunk, the usage chunk dropped
    assert all(c["choices"] and "usage" not in c for c in no_usage.chunks) and no_usage.data[-1] == "[DONE]"
    assert stack.gateway_line("gw-s5-plain")["gen_ai"]["usage"]["output_tokens"] == 12  # usage still logged


def test_k1_over_long_input_is_refused_at_the_gateway(stack, client):
    limit = client.get("/v1/models").json()["data"][0]["max_model_len"]
    assert limit == 1024
    long_prompt = " ".join(["hello"] * (limit + 100))
    assert (
        client.post(stack.engine.url + "/tokenize", json={"prompt": long_prompt}).json()["count"]
        == limit + 100
    )
    short = chat("hi", max_tokens=limit - 3)
    prompt_len = client.post(stack.engine.url + "/tokenize", json={"messages": short["messages"]}).json()[
        "count"
    ]
    before_gw, before = stack.gateway_metrics(), stack.engine_metrics()
    engine_lines = len(stack.engine.log_records())
    cases = [
        (COMPLETIONS, completion(long_prompt), (limit, limit + 100, 16), "prompt"),
        (CHAT, short, (limit, prompt_len, limit - 3), "messages"),
        (COMPLETIONS, completion(long_prompt, stream=True), (limit, limit + 100, 16), "prompt"),
    ]
    for i, (path, body, numbers, param) in enumerate(cases):
        response = client.post(path, json=body, headers={"x-request-id": f"gw-k1-{i}"})
        assert response.status_code == 400 and response.headers["content-type"] == "application/json"
        error = response.json()["error"]
        assert (error["type"], error["code"], error["param"]) == (
            "invalid_request_error",
            "context_length_exceeded",
            param,
        )
        requested = numbers[1] + numbers[2]
        assert (
            f"maximum context length is {limit} tokens" in error["message"]
            and f"you requested {requested} tokens ({numbers[1]} in the {param}, {numbers[2]} in the "
            "completion)"
            in error["message"]
        ), error["message"]
        line = stack.gateway_line(f"gw-k1-{i}")
        assert (line["error"]["type"], line["kvscope"]["prompt_tokens_counted"]) == (
            "context_length_exceeded",
            numbers[1],
        )
        assert line["server"]["address"] is None and line["kvscope"]["attempts"] == 0
    after_gw, after = stack.gateway_metrics(), stack.engine_metrics()
    assert engine_generation_requests(after) == engine_generation_requests(before), "the engine saw nothing"
    assert len(stack.engine.log_records()) == engine_lines
    assert (
        delta(before_gw, after_gw, "kvscope_gateway_requests_total", route=COMPLETIONS, status="400", **M)
        == 2
    )
    assert delta(before_gw, after_gw, "kvscope_gateway_requests_total", route=CHAT, status="400", **M) == 1


def test_a3_malformed_bodies(stack, client):
    before_gw, before = stack.gateway_metrics(), stack.engine_metrics()
    cases = [
        (b'{"model": "smollm2-135m", "messages": [', None),
        (b'{"model": "smollm2-135m", "messages": "hi SECRET-MARKER"}', "messages"),
        (
            b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "SECRET-MARKER"}], '
            b'"max_tokens": "many"}',
            "max_tokens",
        ),
    ]
    for i, (body, param) in enumerate(cases):
        response = client.post(
            CHAT, content=body, headers={"content-type": "application/json", "x-request-id": f"gw-a3-{i}"}
        )
        assert response.status_code == 400 and response.headers["content-type"] == "application/json"
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["param"]) == ("invalid_request_error", param)
        line = stack.gateway_line(f"gw-a3-{i}")
        assert (line["http"]["response"]["status_code"], line["error"]["type"]) == (
            400,
            error["code"] or "invalid_request_error",
        )
        assert line["http"]["request"]["body"]["bytes"] == len(body)
    assert "SECRET-MARKER" not in stack.log.read_text()
    after_gw, after = stack.gateway_metrics(), stack.engine_metrics()
    assert (
        total(after_gw, "kvscope_gateway_requests_total", route=CHAT, status="400")
        - total(before_gw, "kvscope_gateway_requests_total", route=CHAT, status="400")
        == 3
    )
    assert engine_generation_requests(after) == engine_generation_requests(before)


def test_a4_unknown_models_are_bounded(stack, client):
    client.post(CHAT, json={**chat("hi"), "model": "warm-up-the-404-series"})
    before_gw, before = stack.gateway_metrics(), stack.engine_metrics()
    for i in range(1000):
        response = client.post(CHAT, json={**chat("hi"), "model": f"unknown-{i}-{i * 7919 % 10007}"})
        assert response.status_code == 404
        error = response.json()["error"]
        assert (error["type"], error["code"], error["param"]) == (
            "invalid_request_error",
            "model_not_found",
            "model",
        )
    counted = {"model": "unknown", "route": CHAT, "status": "404"}
    after_gw = wait_for(
        lambda: (
            (m := stack.gateway_metrics())
            and delta(before_gw, m, "kvscope_gateway_requests_total", **counted) == 1000
            and m
        )
    )
    after = stack.engine_metrics()
    assert len(after_gw) == len(before_gw), "unknown model names must not add series"
    assert engine_generation_requests(after) == engine_generation_requests(before)
    assert delta(before, after, "kvscope_engine_generation_tokens_total", **M) == 0


def test_openai_sdk_through_the_gateway(stack):
    import openai

    sdk = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "Name three fruits."}]
    plain = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    chunks = list(
        sdk.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == plain.choices[0].message.content
    )
    assert (chunks[-1].usage.completion_tokens, plain.usage.completion_tokens) == (6, 6)
    with pytest.raises(openai.NotFoundError) as not_found:
        sdk.chat.completions.create(model="gpt-nothing", messages=messages)
    assert (not_found.value.code, not_found.value.param) == ("model_not_found", "model")
