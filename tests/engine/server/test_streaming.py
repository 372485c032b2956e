"""SSE framing, terminal events, usage chunks, keep-alive, UTF-8 safety and in-band errors (S1–S5, T1, A2)
against the scripted FakeEngine (reply "Hello world" + EOS unless the test sets another)."""

from __future__ import annotations

from collections import Counter

from tests.engine.server.conftest import chat_body
from tests.engine.server.helpers import metric_samples, parse_sse, sample


def _stream(client, path: str, body: dict, **headers: str):
    response = client.post(path, json={**body, "stream": True}, headers=headers)
    assert response.status_code == 200, response.text
    return response, parse_sse(response.text)


def test_sse_headers_and_framing(client):
    response, stream = _stream(client, "/v1/chat/completions", chat_body(max_tokens=4))
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-accel-buffering"] == "no"
    assert "content-length" not in response.headers
    assert response.text.endswith("data: [DONE]\n\n")
    assert stream.other == [] and stream.data[-1] == "[DONE]"
    deltas = [c["choices"][0]["delta"] for c in stream.chunks]
    assert deltas == [
        {"role": "assistant", "content": ""},
        {"content": "H"},
        {"content": "e"},
        {"content": "l"},
        {"content": "l"},
    ]
    assert [c["choices"][0]["finish_reason"] for c in stream.chunks] == [None, None, None, None, "length"]
    assert all("usage" not in c for c in stream.chunks)


def test_natural_end_is_stop_and_completions_terminal_chunk(client):
    _, stream = _stream(
        client, "/v1/completions", {"model": "fake-model", "prompt": "Once upon a time", "max_tokens": 50}
    )
    texts = [c["choices"][0]["text"] for c in stream.chunks]
    reasons = [c["choices"][0]["finish_reason"] for c in stream.chunks]
    assert "".join(texts) == "Hello world"
    assert reasons == [None] * 11 + ["stop"]
    assert {c["object"] for c in stream.chunks} == {"text_completion"}


def test_usage_chunk_equals_non_streaming_usage_with_n2(client):
    body = chat_body(max_tokens=4, n=2)
    plain = client.post("/v1/chat/completions", json=body).json()
    _, stream = _stream(client, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert stream.data[-1] == "[DONE]"
    usage_chunks = [c for c in stream.chunks if c.get("usage")]
    assert usage_chunks == [stream.chunks[-1]]
    assert stream.chunks[-1]["choices"] == []
    assert (
        stream.chunks[-1]["usage"]
        == plain["usage"]
        == {
            "prompt_tokens": 20,
            "completion_tokens": 8,
            "total_tokens": 28,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
    )
    assert (
        set(stream.chunks[-1]["kvscope"])
        == set(plain["kvscope"])
        == {
            "queue_s",
            "ttft_s",
            "predicted_ttft_s",
            "service_tier",
            "prefill_s",
            "decode_s",
            "tpot_s",
            "batch_size_mean",
            "batch_size_max",
            "kv_blocks",
            "kv_cache_usage",
            "num_preemptions",
            "prompt_tokens",
            "cached_tokens",
            "queue_ahead",
            "running_on_arrival",
            "queue_limit",
            "queue_blocked_steps",
            "attributed_queue_s",
            "recomputed_tokens",
            "structured_mask_s",
            "structured_wait_s",
            "structured_compile_s",
            "spec_drafts",
            "spec_draft_tokens",
            "spec_accepted_tokens",
            "spec_mean_accepted_length",
            *(
                f"{phase}_{name}"
                for phase in ("prefill", "decode")
                for name in (
                    "steps",
                    "tokens",
                    "other_prefill_tokens",
                    "other_decode_tokens",
                    "other_requests_max",
                    "step_s_mean",
                    "step_s_max",
                    "own_s",
                    "interference_s",
                    "interference_prefill_s",
                    "preempted_s",
                    "other_s",
                )
            ),
        }
    )
    assert all(c["usage"] is None for c in stream.chunks[:-1])
    for index in (0, 1):
        reasons = [
            c["choices"][0]["finish_reason"]
            for c in stream.chunks
            if c["choices"] and c["choices"][0]["index"] == index
        ]
        assert reasons == [None] * 4 + ["length"]


def test_keepalive_comments_while_waiting_for_first_token(client, fake_engine):
    fake_engine.prefill_s = 0.32  # keep-alive interval 0.05 s in the fixture settings
    response, stream = _stream(client, "/v1/chat/completions", chat_body(max_tokens=2))
    head = response.text.split("data: ")[0]
    assert set(stream.comments) == {": keep-alive"}
    assert 2 <= head.count(": keep-alive\n\n") <= 7  # ~0.32 s / 0.05 s, fewer when the loop is slowed
    assert "event:" not in response.text
    assert response.text.count(": keep-alive") == head.count(": keep-alive")


def test_no_broken_characters_and_stream_equals_json(client, fake_engine):
    fake_engine.reply = "你好，世界！🌶️🎉 ďábelské".encode()
    body = chat_body(max_tokens=60, logprobs=True, temperature=0)
    plain = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    _, stream = _stream(client, "/v1/chat/completions", body)
    deltas = [c["choices"][0]["delta"].get("content", "") for c in stream.chunks]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == plain["message"]["content"] == "你好，世界！🌶️🎉 ďábelské"
    raw = b"".join(bytes(e["bytes"]) for e in plain["logprobs"]["content"])
    assert raw.decode("utf-8") == plain["message"]["content"]
    assert len(plain["logprobs"]["content"]) == len("你好，世界！🌶️🎉 ďábelské".encode())  # EOS has no entry
    for chunk in stream.chunks:  # each chunk's logprobs cover exactly that chunk's token
        logprobs = chunk["choices"][0]["logprobs"]
        assert logprobs is None or len(logprobs["content"]) == 1


def test_top_logprobs_count_and_order(client):
    choice = client.post(
        "/v1/chat/completions", json=chat_body(max_tokens=3, logprobs=True, top_logprobs=3)
    ).json()["choices"][0]
    entries = choice["logprobs"]["content"]
    assert [e["token"] for e in entries] == ["H", "e", "l"]
    for entry in entries:
        tops = [t["logprob"] for t in entry["top_logprobs"]]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and entry["logprob"] == tops[0] <= 0
    plain = client.post("/v1/chat/completions", json=chat_body(max_tokens=1, logprobs=True)).json()
    assert plain["choices"][0]["logprobs"]["content"] == [
        {"token": "H", "logprob": -0.5, "bytes": [72], "top_logprobs": []}
    ]


def test_completions_prompt_list_and_legacy_logprobs(client):
    body = {
        "model": "fake-model",
        "prompt": ["ab", "c"],
        "max_tokens": 2,
        "n": 2,
        "logprobs": 1,
        "echo": True,
    }
    result = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in result["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in result["choices"]] == ["abHe", "abHe", "cHe", "cHe"]
    assert result["usage"]["prompt_tokens"] == 3 and result["usage"]["completion_tokens"] == 8
    lp = result["choices"][2]["logprobs"]
    assert lp == {
        "tokens": ["c", "H", "e"],
        "token_logprobs": [None, -0.5, -0.5],
        "top_logprobs": [None, {"H": -0.5}, {"e": -0.5}],
        "text_offset": [0, 1, 2],
    }


def test_injected_fault_mid_stream_is_in_band_error(client, fake_engine):
    fake_engine.token_s = 0.01
    before = metric_samples(client.get("/metrics").text)
    response, stream = _stream(
        client, "/v1/chat/completions", chat_body(max_tokens=50), **{"x-kvscope-fault": "after_tokens=3"}
    )
    assert "[DONE]" not in stream.data
    assert list(stream.data[-1]) == ["error"]
    assert stream.data[-1]["error"]["type"] == "server_error"
    assert "injected fault" in stream.data[-1]["error"]["message"]
    assert all(c["choices"][0]["finish_reason"] is None for c in stream.chunks if "choices" in c)
    request_id = stream.chunks[0]["id"]
    assert (request_id, "injected fault") in fake_engine.aborted
    after = metric_samples(client.get("/metrics").text)
    name = "kvscope_engine_request_success_total"
    assert (
        sample(after, name, model="fake-model", finish_reason="error")
        - sample(before, name, model="fake-model", finish_reason="error")
        == 1
    )
    # the availability SLO sees the broken stream although its status stays 200 (alerts/kvscope.rules.yaml)
    assert _stream_errors(after) - _stream_errors(before) == {"injected_fault": 1}


def _stream_errors(samples: dict) -> Counter:
    return Counter(
        {
            labels[1][1]: value
            for (name, labels), value in samples.items()
            if name == "kvscope_engine_stream_errors_total" and labels[0] == ("model", "fake-model")
        }
    )


def test_stream_error_reasons_are_bounded_and_skip_client_errors():
    from kvscope.engine.async_engine import RequestFailedError
    from kvscope.engine.server.errors import OpenAIError
    from kvscope.engine.server.serving import failure_error, stream_error_reason

    shutdown = RequestFailedError("r", "engine shutting down")
    assert stream_error_reason(shutdown, failure_error(shutdown)) == "engine_shutdown"
    failed = RequestFailedError("r", "engine step failed: RuntimeError: boom")
    assert stream_error_reason(failed, failure_error(failed)) == "request_failed"
    crash = KeyError("x")
    assert stream_error_reason(crash, failure_error(crash)) == "internal_error"
    odd = OpenAIError(502, "upstream", code="something_else")
    assert stream_error_reason(odd, odd) == "internal_error"
    grammar = OpenAIError(400, "the grammar exceeds a limit", param="response_format")
    assert grammar.type == "invalid_request_error" and stream_error_reason(grammar, grammar) is None


def test_injected_fault_non_streaming_is_500_json(client):
    response = client.post(
        "/v1/chat/completions", json=chat_body(max_tokens=50), headers={"x-kvscope-fault": "after_tokens=0"}
    )
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "request_failed"
    assert client.post("/v1/chat/completions", json=chat_body(max_tokens=4)).status_code == 200


def test_created_is_the_request_time_not_the_server_start(client, monkeypatch):
    import kvscope.engine.server.serving_chat as serving_chat

    monkeypatch.setattr(serving_chat.time, "time", lambda: 2_000_000_000.5)
    body = client.post("/v1/chat/completions", json=chat_body(max_tokens=2)).json()
    assert body["created"] == 2_000_000_000
