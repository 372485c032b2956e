"""Every rejection is OpenAI error JSON with the right status, type, param and code (cases A1, A3, A4, K1)."""

from __future__ import annotations

import pytest

from tests.engine.server.conftest import chat_body
from tests.engine.server.helpers import metric_samples, sample


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize(("body", "param", "fragment"), [
    ({"model": "fake-model", "messages": "hi"}, "messages", "Expected `array`, got `str`"),
    ({"model": "fake-model"}, "messages", "missing required field `messages`"),
    ({"model": "fake-model", "messages": []}, "messages", "length >= 1"),
    (chat_body(max_tokens="16"), "max_tokens", "got `str`"),
    (chat_body(max_tokens=0), "max_tokens", ">= 1"),
    (chat_body(temperature=2.5), "temperature", "<= 2.0"),
    (chat_body(top_p=0), "top_p", "> 0.0"),
    (chat_body(n=0), "n", ">= 1"),
    (chat_body(stream="yes"), "stream", "got `str`"),
    (chat_body(stop=[1]), "stop[0]", "Expected `str`"),
    (chat_body(logit_bias={"12": 101}), "logit_bias", "<= 100.0"),
    (chat_body(logit_bias={"x": 1}), "logit_bias", "token ids"),
    (chat_body(logprobs=True, top_logprobs=21), "top_logprobs", "<= 20"),
    (chat_body(top_logprobs=2), "top_logprobs", "requires logprobs"),
    (chat_body(logprobs=False, top_logprobs=2), "top_logprobs", "requires logprobs"),
    ({"model": "fake-model", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].type", "Invalid value 'image_url'"),
    ({"model": "fake-model", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "Invalid"),
])  # fmt: skip
def test_chat_bad_fields_name_param(client, body, param, fragment):
    error = _error(client.post("/v1/chat/completions", json=body), 400)
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert fragment in error["message"]


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "fake-model", "prompt": ""}, "prompt"),
    ({"model": "fake-model", "prompt": [""]}, "prompt"),
    ({"model": "fake-model", "prompt": []}, "prompt"),
    ({"model": "fake-model", "prompt": ["a", 1]}, "prompt"),
    ({"model": "fake-model", "prompt": [1, 999]}, "prompt"),
    ({"model": "fake-model", "prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"model": "fake-model", "prompt": "hi", "stop_token_ids": [300]}, "stop_token_ids"),
    ({"model": "fake-model", "prompt": "hi", "min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    ({"model": "fake-model", "prompt": "hi", "best_of": 3}, "best_of"),
    ({"model": "fake-model", "prompt": "hi", "n": 2, "best_of": 3}, "best_of"),
    ({"model": "fake-model", "prompt": "hi", "suffix": " and so on."}, "suffix"),
])  # fmt: skip
def test_completions_bad_prompts_and_fields(client, fake_engine, body, param):
    error = _error(client.post("/v1/completions", json=body), 400)
    assert error["param"] == param
    assert fake_engine.started == ["warmup"], "nothing may reach the engine"


@pytest.mark.parametrize("extra", [{"best_of": 1}, {"n": 2, "best_of": 2}, {"suffix": ""}, {"suffix": None}])
def test_best_of_equal_to_n_and_an_empty_suffix_are_accepted(client, extra):
    response = client.post(
        "/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 2, **extra}
    )
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == extra.get("n", 1)


def test_invalid_json_is_400_json_and_counted(client):
    error = _error(client.post("/v1/chat/completions", content=b'{"model": "fake-model", "messages": ['), 400)
    assert (error["param"], error["code"]) == (None, "invalid_json")
    samples = metric_samples(client.get("/metrics").text)
    assert (
        sample(samples, "kvscope_engine_http_requests_total", route="/v1/chat/completions", status="400") == 1
    )


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "fake-model", "messages": [{"role": "user", "content": "a\xff\xfeb"}]}',
        b'{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "x": '
        + b"[" * 100_000
        + b"]" * 100_000
        + b"}",
    ],
)
def test_invalid_utf8_and_deep_nesting_are_400_invalid_json(client, body):
    error = _error(client.post("/v1/chat/completions", content=body), 400)
    assert (error["param"], error["code"]) == (None, "invalid_json")


def test_unknown_fields_are_ignored(client):
    response = client.post(
        "/v1/chat/completions",
        json=chat_body(max_tokens=3, frobnicate={"x": 1}, response_format={"type": "text"}),
    )
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "Hel"


def test_unknown_model_is_404_model_not_found_with_bounded_series(client, fake_engine):
    before = len(metric_samples(client.get("/metrics").text))
    for i in range(50):
        error = _error(client.post("/v1/chat/completions", json={**chat_body(), "model": f"nope-{i}"}), 404)
        assert (error["code"], error["param"], error["type"]) == (
            "model_not_found",
            "model",
            "invalid_request_error",
        )
    samples = metric_samples(client.get("/metrics").text)
    # one new series pair (total + created) for {route, status=404}, plus /metrics' own 200
    assert len(samples) - before == 4
    assert (
        sample(samples, "kvscope_engine_http_requests_total", route="/v1/chat/completions", status="404")
        == 50
    )
    assert fake_engine.started == ["warmup"]


def test_routing_errors_are_openai_json(client):
    assert _error(client.get("/v1/nothing"), 404)["code"] == "not_found"
    assert _error(client.get("/v1/chat/completions"), 405)["code"] == "method_not_allowed"
    assert (
        _error(client.post("/v1/completions", content=b"x" * (11 << 20)), 413)["code"] == "request_too_large"
    )


def test_over_long_prompt_is_400_with_real_numbers(client, fake_engine):
    # fake context length 128; the chat template adds 18 tokens around "hi"
    error = _error(client.post("/v1/completions", json={"model": "fake-model", "prompt": [65] * 228}), 400)
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    assert error["message"] == (
        "This model's maximum context length is 128 tokens. However, you requested 244 "
        "tokens (228 in the prompt, 16 in the completion). Please reduce the length of "
        "the prompt or completion."
    )
    error = _error(client.post("/v1/chat/completions", json=chat_body(max_completion_tokens=125)), 400)
    assert error["param"] == "messages"  # as OpenAI and the gateway name it (one vocabulary, issue 12)
    assert "maximum context length is 128 tokens" in error["message"]
    assert "you requested 145 tokens (20 in the messages, 125 in the completion)" in error["message"]
    streamed = client.post("/v1/chat/completions", json=chat_body(content="x" * 120, stream=True))
    assert _error(streamed, 400)["param"] == "messages"
    assert fake_engine.started == ["warmup"]


def test_engine_not_running_is_503(client, fake_engine):
    fake_engine.stop()
    error = _error(client.post("/v1/chat/completions", json=chat_body()), 503)
    assert error["type"] == "server_error"
    assert _error(client.get("/health"), 503)["code"] == "engine_unavailable"


def test_concurrency_limit_is_429(fake_engine, spans):
    from litestar.testing import TestClient
    from prometheus_client import CollectorRegistry

    from kvscope.engine.server.app import create_app
    from kvscope.engine.server.settings import ServerSettings
    from kvscope.engine.server.tracing import Tracing

    app = create_app(
        ServerSettings(max_concurrent_requests=1),
        engine=fake_engine,
        tracing=Tracing("t", spans, batch=False),
        registry=CollectorRegistry(),
    )
    with TestClient(app) as client:
        app.state.server.in_flight = 1
        error = _error(client.post("/v1/chat/completions", json=chat_body()), 429)
        assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")


@pytest.mark.parametrize(("body", "param"), [
    (chat_body(service_tier="g" * 100_000), "service_tier"),
    ({"model": "fake-model", "messages": [{"role": "r" * 100_000, "content": "x"}]}, "messages[0].role"),
])  # fmt: skip
def test_an_echoed_bad_value_is_clipped(client, body, param):
    """msgspec's message quotes the bad value whole ("Invalid enum value '<2 MB>'"): the 400's body and the
    engine's log line grew with it. The message keeps its first 256 characters and the field's path."""
    error = _error(client.post("/v1/chat/completions", json=body), 400)
    value = body.get("service_tier") or body["messages"][0]["role"]
    assert error["param"] == param
    whole = f"Invalid enum value '{value}'"  # 100,021 characters before the path
    assert error["message"] == f"{whole[:256]}…[+99765 chars] - at `$.{param}`"


def test_a_huge_unknown_model_name_is_clipped_in_the_404(client):
    error = _error(client.post("/v1/chat/completions", json={**chat_body(), "model": "m" * 100_000}), 404)
    assert error["message"] == f"The model `{'m' * 256}…[+99744 chars]` does not exist."
