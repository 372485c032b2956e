"""Serving cases S1–S5, T1–T2, A1–A4, K1, N1 against a real engine server (SmolLM2 on CPU, a subprocess).

Token counts are scaled down from ../shared/cases/serving-cases.md to fit a 2-core CPU (S1: 48 tokens instead
of 200); the properties checked are the cases' own. After every test a plain chat request must answer 200.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.engine.server.e2e_support import (
    CHAT,
    COMPLETIONS,
    BackgroundStream,
    chat,
    completion,
    delta,
    log_line,
    stream,
    wait_for,
)
from tests.engine.server.helpers import start_engine

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]
KEEPALIVE_S = 0.25
"""The engine's ``--sse-keepalive-s``: a ``: keep-alive`` comment this often while no event is due."""


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    process = start_engine(
        tmp_path_factory.mktemp("engine"),
        "--max-model-len",
        "2048",
        "--kv-cache-memory",
        "160M",
        "--max-num-seqs",
        "4",
        "--sse-keepalive-s",
        str(KEEPALIVE_S),
        "--enable-fault-injection",
    )
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(engine):
    with httpx.Client(base_url=engine.url, timeout=120) as http:
        yield http


@pytest.fixture(autouse=True)
def engine_stays_alive(client):
    yield
    response = client.post(CHAT, json=chat("hi", max_tokens=4))
    assert response.status_code == 200, response.text


def test_the_start_up_log_says_each_fact_once(engine):
    """Issue 45: the weight format and why in one line (it was also in a ModelInfo repr and the serving
    line), an ``engine ready`` line that is not a repr, a serving line without the format again."""
    text = engine.err_path.read_text()
    start_up = text[: text.index("serving smollm2-135m")]
    assert start_up.count("--dtype float32 given") == 1
    assert [line for line in start_up.splitlines() if "dtype" in line or "quantization" in line] == [
        line for line in start_up.splitlines() if "weights format: dtype float32, quantization none (" in line
    ]
    assert "ModelInfo(" not in text and "'float32@1'" not in text
    assert text.count("engine ready: smollm2-135m (max_model_len 2048, 16-token KV blocks, built in ") == 1
    assert text.count("serving smollm2-135m (the OpenAI API under /v1, Prometheus metrics at /metrics)") == 1


def test_s1_stream_is_not_buffered_and_ttft_agrees(engine, client):
    before = engine.metrics()
    result = stream(
        client,
        CHAT,
        chat("Count from 1 to 100 separated by spaces.", max_tokens=48, temperature=0, ignore_eos=True),
    )
    assert result.headers["content-type"].startswith("text/event-stream")
    assert (result.headers["cache-control"], result.headers["x-accel-buffering"]) == ("no-cache", "no")
    assert "content-length" not in result.headers
    times = result.data_times()
    assert len(times) > 40  # role chunk, one chunk per token (48, a few may carry no text), [DONE]
    line = log_line(engine, result.parsed.chunks[0]["id"])
    assert line["gen_ai"]["usage"]["output_tokens"] == 48
    # events arrive spread over the decode as the engine measured it (first to last token), most of them a
    # good part of a decode step apart: a buffering server would deliver them in a burst at the end
    decode_s = line["kvscope"]["engine"]["decode_s"]
    step_s = decode_s / 47
    assert times[-1] - times[0] > 0.8 * decode_s > 0, "events must arrive spread over time"
    gaps = [b - a for a, b in zip(times[1:-1], times[2:-1], strict=False)]
    assert sum(g > step_s / 10 for g in gaps) > len(gaps) // 2, (step_s, gaps)
    after = engine.metrics()
    # the engine stamps the first token before the client can read the next token's event (load only widens
    # it)
    second_token = [
        t
        for t, data in zip(times, result.parsed.data, strict=True)
        if data != "[DONE]" and data["choices"] and data["choices"][0]["delta"].get("content")
    ][1]
    assert 0 < line["kvscope"]["ttft_s"] < second_token
    m = {"model": "smollm2-135m"}
    assert delta(before, after, "kvscope_engine_time_to_first_token_seconds_count", **m) == 1
    assert delta(before, after, "kvscope_engine_time_to_first_token_seconds_sum", **m) == pytest.approx(
        line["kvscope"]["ttft_s"], abs=1e-9
    )


@pytest.mark.parametrize(("path", "body"), [
    (CHAT, chat("Write a long story about a dragon.", max_tokens=16)),
    (COMPLETIONS, completion("Once upon a time", max_tokens=16)),
])  # fmt: skip
def test_s2_exactly_one_terminal_chunk(engine, client, path, body):
    result = stream(client, path, body).parsed
    assert result.data[-1] == "[DONE]" and result.other == []
    reasons = [c["choices"][0]["finish_reason"] for c in result.chunks]
    assert reasons[-1] == "length" and reasons[:-1] == [None] * (len(reasons) - 1)
    line = log_line(engine, result.chunks[0]["id"])
    assert line["gen_ai"]["response"]["finish_reasons"] == ["length"]
    assert line["gen_ai"]["usage"]["output_tokens"] == 16
    assert (line["http"]["response"]["status_code"], line["event"]["outcome"]) == (200, "success")


def test_s3_failure_mid_stream_is_not_success(engine, client):
    before = engine.metrics()
    result = stream(
        client,
        CHAT,
        chat("Tell me about the sea.", max_tokens=64, ignore_eos=True),
        headers={"x-kvscope-fault": "after_tokens=4"},
    ).parsed
    assert "[DONE]" not in result.data
    assert list(result.data[-1]) == ["error"] and "injected fault" in result.data[-1]["error"]["message"]
    assert {c["choices"][0]["finish_reason"] for c in result.chunks if "choices" in c} == {None}
    line = log_line(engine, result.chunks[0]["id"])
    assert (line["kvscope"]["outcome"], line["event"]["outcome"]) == ("error", "failure")
    assert "injected fault" in line["error"]["message"]
    after = wait_for(lambda: (m := engine.metrics()) and sample_used(m) == sample_used(before) and m)
    assert (
        delta(
            before, after, "kvscope_engine_request_success_total", model="smollm2-135m", finish_reason="error"
        )
        == 1
    )


def sample_used(samples: dict) -> float:
    return samples[("kvscope_engine_kv_cache_blocks", (("model", "smollm2-135m"), ("state", "used")))]


def test_s4_keepalive_comments_while_prefilling(engine, client):
    prompt = "The history of the ocean. " * 100  # ~600 tokens: seconds of prefill on a 2-vCPU EPYC
    result = stream(client, COMPLETIONS, completion(prompt, max_tokens=2))
    head = result.text.split("data: ")[0]
    assert "event:" not in result.text and set(result.parsed.comments) <= {": keep-alive"}
    line = log_line(engine, result.parsed.chunks[0]["id"])
    ttft = line["kvscope"]["ttft_s"]
    # TTFT is the first token: stamped before the engine emits the next event, which the client reads later
    assert 0 < ttft < result.data_times()[1]
    # a comment every KEEPALIVE_S while the first token is awaited, as many as the measured wait allows: at
    # least one once it spans three intervals (load may delay a timer, not skip a whole wait), never more
    # than the intervals that passed before the first data event (1 ms: timer rounding)
    comments = head.count(": keep-alive\n\n")
    most = (result.data_times()[0] + 1e-3) / KEEPALIVE_S
    assert (1 if ttft >= 3 * KEEPALIVE_S else 0) <= comments <= most, (comments, ttft, most)


def test_s5_usage_chunk_equals_non_streaming_usage(engine, client):
    body = chat("Name a colour.", max_tokens=6, n=2, ignore_eos=True)
    client.post(CHAT, json=body)  # warm the prefix cache so cached_tokens match below
    plain = client.post(CHAT, json=body).json()
    before = engine.metrics()
    result = stream(client, CHAT, {**body, "stream_options": {"include_usage": True}}).parsed
    after = engine.metrics()
    usage_chunks = [c for c in result.chunks if c.get("usage")]
    assert usage_chunks == [result.chunks[-1]] and result.data[-1] == "[DONE]"
    assert result.chunks[-1]["choices"] == []
    assert result.chunks[-1]["usage"] == plain["usage"]
    assert plain["usage"]["completion_tokens"] == 12
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    m = {"model": "smollm2-135m"}
    assert delta(before, after, "kvscope_engine_generation_tokens_total", **m) == 12
    assert delta(before, after, "kvscope_engine_prompt_tokens_total", **m) == plain["usage"]["prompt_tokens"]
    no_usage = stream(client, CHAT, body).parsed
    assert all("usage" not in c for c in no_usage.chunks) and no_usage.data[-1] == "[DONE]"


def test_t1_no_broken_characters(client):
    body = chat("Repeat exactly: 你好，世界！🌶️🎉 ďábelské", temperature=0, logprobs=True, max_tokens=40)
    plain = client.post(CHAT, json=body).json()["choices"][0]
    content = plain["message"]["content"]
    deltas = [
        c["choices"][0]["delta"].get("content", "")
        for c in stream(client, CHAT, body).parsed.chunks
        if c["choices"]
    ]
    assert "\ufffd" not in content and all("\ufffd" not in d for d in deltas)
    assert "".join(deltas).encode() == content.encode()
    assert any(len(ch.encode()) > 1 for ch in content), "the answer must exercise multi-byte characters"
    assert b"".join(bytes(e["bytes"]) for e in plain["logprobs"]["content"]).decode() == content


def test_t1_token_prompt_ending_mid_character(client):
    ids = client.post("/tokenize", json={"prompt": "Repeat exactly: 你好🌶️"}).json()["tokens"]
    cut = next(
        k
        for k in range(len(ids) - 1, 0, -1)
        if client.post("/detokenize", json={"tokens": ids[:k]}).json()["prompt"].endswith("\ufffd")
    )
    chunks = stream(client, COMPLETIONS, completion(ids[:cut], max_tokens=6, temperature=0)).parsed.chunks
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert "Repeat" not in text and "\ufffd" not in text


def _texts(client, body: dict) -> tuple[dict, str]:
    plain = client.post(COMPLETIONS, json=body).json()["choices"][0]
    chunks = stream(client, COMPLETIONS, body).parsed.chunks
    return plain, "".join(c["choices"][0]["text"] for c in chunks)


def test_t2_stop_strings(client):
    prompt = "The alphabet: A B C D E F G H I J K"  # SmolLM2-135M skips "M N O" after the bare letters
    reference = client.post(COMPLETIONS, json=completion(prompt, temperature=0, max_tokens=10)).json()
    ref_text = reference["choices"][0]["text"]
    assert "O P Q" in ref_text
    expected = ref_text[: ref_text.index("O P Q")]
    for stop in (["O P Q"], "O P Q"):
        plain, streamed = _texts(client, completion(prompt, temperature=0, max_tokens=10, stop=stop))
        assert (plain["finish_reason"], plain["stop_reason"]) == ("stop", "O P Q")
        assert plain["text"] == streamed == expected
    never = completion(prompt, temperature=0, max_tokens=10, stop=["U V W X Y Z!"])
    plain, streamed = _texts(client, never)
    assert ref_text.endswith("U")  # "U" could start the stop string: held back, then flushed at the end
    assert plain["finish_reason"] == "length" and plain["text"] == streamed == ref_text


def test_t2_stop_string_prefix_of_a_token(client):
    prompt = "The capital of France is"
    ref_text = client.post(COMPLETIONS, json=completion(prompt, temperature=0, max_tokens=6)).json()[
        "choices"
    ][0]["text"]
    assert "Paris" in ref_text
    plain, streamed = _texts(client, completion(prompt, temperature=0, max_tokens=6, stop="Pari"))
    assert plain["finish_reason"] == "stop"
    assert plain["text"] == streamed == ref_text[: ref_text.index("Pari")]


@pytest.mark.parametrize(("path", "body", "param"), [
    (COMPLETIONS, completion(""), "prompt"), (COMPLETIONS, completion([""]), "prompt"),
    (CHAT, {"model": "smollm2-135m", "messages": []}, "messages")])  # fmt: skip
def test_a1_empty_input_is_a_clear_400(client, path, body, param):
    response = client.post(path, json=body)
    assert response.status_code == 400 and response.headers["content-type"] == "application/json"
    assert (response.json()["error"]["type"], response.json()["error"]["param"]) == (
        "invalid_request_error",
        param,
    )


def test_a2_logprobs(client):
    body = chat("Say something.", temperature=0, max_tokens=5, ignore_eos=True, logprobs=True)
    entries = client.post(CHAT, json=body).json()["choices"][0]["logprobs"]["content"]
    assert len(entries) == 5
    assert all(e["logprob"] <= 0 and e["top_logprobs"] == [] and e["bytes"] and e["token"] for e in entries)
    top3 = client.post(CHAT, json={**body, "top_logprobs": 3}).json()["choices"][0]["logprobs"]["content"]
    for entry in top3:
        alts = [t["logprob"] for t in entry["top_logprobs"]]
        assert len(alts) == 3 and alts == sorted(alts, reverse=True)
        assert (entry["top_logprobs"][0]["token"], alts[0]) == (entry["token"], entry["logprob"])
    chunks = [c for c in stream(client, CHAT, body).parsed.chunks if c["choices"][0]["logprobs"]]
    assert [len(c["choices"][0]["logprobs"]["content"]) for c in chunks] == [1] * 5
    for bad in ({"logprobs": False, "top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}):
        error = client.post(CHAT, json={**body, **bad}).json()["error"]
        assert error["param"] == "top_logprobs"


def test_a3_malformed_bodies(engine, client):
    before = engine.metrics()
    cases = [
        b'{"model": "smollm2-135m", "messages": [',
        b'{"messages": "hi SECRET-MARKER"}',
        b'{"messages": [{"role": "user", "content": "SECRET-MARKER"}], "max_tokens": "many"}',
    ]
    for body in cases:
        response = client.post(CHAT, content=body, headers={"content-type": "application/json"})
        assert response.status_code == 400 and response.headers["content-type"] == "application/json"
        assert response.json()["error"]["type"] == "invalid_request_error"
    after = engine.metrics()
    assert delta(before, after, "kvscope_engine_http_requests_total", route=CHAT, status="400") == 3
    lines = wait_for(
        lambda: [
            r
            for r in engine.log_records()
            if r["http"]["response"]["status_code"] == 400 and r["url"]["path"] == CHAT
        ][-3:]
    )
    assert all(r["error"]["type"] == "invalid_request_error" for r in lines)
    assert "SECRET-MARKER" not in engine.log_path.read_text()


def test_a4_unknown_models_are_bounded(engine, client):
    generated = engine.metrics()
    client.post(CHAT, json={**chat("hi"), "model": "warm-up-the-404-series"})
    series_before = len(engine.metrics())
    for i in range(1000):
        error = client.post(CHAT, json={**chat("hi"), "model": f"unknown-{i}-{i * 7919 % 10007}"}).json()[
            "error"
        ]
        assert (error["code"], error["param"]) == ("model_not_found", "model")
    after = engine.metrics()
    assert len(after) == series_before
    assert delta(generated, after, "kvscope_engine_generation_tokens_total", model="smollm2-135m") == 0
    assert delta(generated, after, "kvscope_engine_http_requests_total", route=CHAT, status="404") == 1001


def test_k1_over_long_input(engine, client):
    limit = client.get("/v1/models").json()["data"][0]["max_model_len"]
    assert limit == 2048
    before = engine.metrics()
    long_prompt = completion([1000] * (limit + 100))
    short = chat("hi", max_tokens=limit - 3)
    prompt_len = client.post("/tokenize", json={"messages": short["messages"]}).json()["count"]
    for path, body, numbers in (
        (COMPLETIONS, long_prompt, (limit, limit + 100, 16)),
        (CHAT, short, (limit, prompt_len, limit - 3)),
        (COMPLETIONS, {**long_prompt, "stream": True}, (limit, limit + 100, 16)),
    ):
        response = client.post(path, json=body)
        assert response.status_code == 400 and response.headers["content-type"] == "application/json"
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "context_length_exceeded")
        for number in numbers:
            assert str(number) in error["message"]
    after = engine.metrics()
    for name in ("prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_count"):
        assert delta(before, after, f"kvscope_engine_{name}", model="smollm2-135m") == 0


def test_n1_huge_per_request_lists_are_refused(engine, client):
    """Serving case N1 (issue 35): a logit_bias naming every token of the vocabulary (0.5 each) with n 128
    and max_tokens 6, and stop_token_ids of 500,000 entries with n 16, are each a 400 naming the field
    (caps 300 and 1024, engine/sampling_params.py) before any engine work; a plain request right after is
    served."""
    vocab = 49152  # SmolLM2's
    before = engine.metrics()
    attacks = (
        (
            COMPLETIONS,
            completion("Hello", n=128, max_tokens=6, logit_bias={str(i): 0.5 for i in range(vocab)}),
            "logit_bias",
            f"logit_bias may hold at most 300 entries, got {vocab}.",
        ),
        (
            CHAT,
            chat("Hello", n=16, max_tokens=6, stop_token_ids=[5] * 500_000),
            "stop_token_ids",
            "stop_token_ids may hold at most 1024 token ids, got 500000.",
        ),
        (
            COMPLETIONS,
            completion("Hello", max_tokens=6, logit_bias={"1_0": 5}),
            "logit_bias",
            "logit_bias keys must be token ids written in decimal digits (like \"50256\"), got '1_0'.",
        ),
    )
    for path, body, param, message in attacks:
        response = client.post(path, json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"] == {
            "message": message,
            "type": "invalid_request_error",
            "param": param,
            "code": "invalid_value",
        }
    after = engine.metrics()
    for name in ("prompt_tokens_total", "generation_tokens_total"):
        assert delta(before, after, f"kvscope_engine_{name}", model="smollm2-135m") == 0
    plain = client.post(CHAT, json=chat("Say hi.", max_tokens=4, ignore_eos=True))
    assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 4


def test_n3_fan_out_is_capped_and_cannot_stall_a_plain_request(engine, client):
    """Serving case N3 (issue 35): /v1/completions with 400 prompts and n 64 (a 6 KB body, 25,600
    sequences) is a 400 naming the limit (--max-sequences-per-request, 256) before any engine work. A
    request at the limit (4 prompts x n 64, 64 times this engine's --max-num-seqs 4) streaming while a
    plain streamed request arrives does not hold it back (engine/core/fairness.py): the plain request is
    admitted in the first step after it arrives (its kvscope ``queue_blocked_steps`` is 0) and its first
    token comes before more than one batch (max_num_seqs) of the attacker's sequences has finished. Under
    FCFS it waited for 252 of them."""
    before = engine.metrics()
    body = completion(["Tell a joke."] * 400, n=64, max_tokens=16)
    response = client.post(COMPLETIONS, json=body)
    assert response.status_code == 400, response.text
    assert len(response.request.content) > 6000
    assert response.json()["error"] == {
        "message": (
            "This request asks for 25600 sequences (400 prompt(s) x n=64); the limit is 256 sequences per "
            "request (--max-sequences-per-request). Send fewer prompts or a smaller n, or split the request."
        ),
        "type": "invalid_request_error",
        "param": "prompt",
        "code": "invalid_value",
    }
    assert delta(before, engine.metrics(), "kvscope_engine_prompt_tokens_total", model="smollm2-135m") == 0

    attacker = BackgroundStream(
        engine.url,
        COMPLETIONS,
        completion(["Once upon a time"] * 4, n=64, max_tokens=16, ignore_eos=True),
        "n3-attacker",
    )
    try:
        wait_for(lambda: attacker.first_chunk is not None, timeout_s=120)
        finished_before = len(attacker.finish_times)
        sent = time.monotonic()
        plain = stream(client, CHAT, chat("Say hi.", max_tokens=4, ignore_eos=True))
        first_token = sent + next(t for t, event in plain.events if _has_content(event))
        finished_by_first_token = sum(t <= first_token for t in attacker.finish_times)
        attacker_open = attacker.first_chunk is not None and len(attacker.finish_times) < 256
    finally:
        attacker.close()
    assert plain.status == 200 and plain.parsed.data[-1] == "[DONE]"
    kvscope = log_line(engine, plain.parsed.chunks[0]["id"])["kvscope"]["engine"]
    assert kvscope["queue_blocked_steps"] == 0, kvscope
    assert finished_by_first_token - finished_before <= 4, (finished_before, finished_by_first_token)
    assert attacker_open


def _has_content(event: str) -> bool:
    """A chat chunk event carrying generated text."""
    if not event.startswith("data: {"):
        return False
    choices = json.loads(event[len("data: ") :])["choices"]
    return bool(choices and choices[0]["delta"].get("content"))


def test_metrics_after_known_workload(engine, client):
    before = engine.metrics()
    usages = [
        client.post(COMPLETIONS, json=completion(f"Workload {i}:", max_tokens=5, ignore_eos=True)).json()[
            "usage"
        ]
        for i in range(3)
    ]
    after = engine.metrics()
    m = {"model": "smollm2-135m"}
    assert delta(before, after, "kvscope_engine_prompt_tokens_total", **m) == sum(
        u["prompt_tokens"] for u in usages
    )
    assert delta(before, after, "kvscope_engine_generation_tokens_total", **m) == 15
    assert delta(before, after, "kvscope_engine_request_success_total", finish_reason="length", **m) == 3
    for name in ("time_to_first_token", "e2e_request_latency", "time_per_output_token", "queue_time"):
        assert delta(before, after, f"kvscope_engine_{name}_seconds_count", **m) == 3
    assert delta(before, after, "kvscope_engine_inter_token_latency_seconds_count", **m) == 12
    assert delta(before, after, "kvscope_engine_request_generation_tokens_sum", **m) == 15
    assert delta(before, after, "kvscope_engine_http_requests_total", route=COMPLETIONS, status="200") == 3


@pytest.fixture(scope="module")
def sdk(engine):
    import openai

    return openai.OpenAI(base_url=f"{engine.url}/v1", api_key="unused")


def test_openai_sdk_sync_chat_and_completions(sdk):
    messages = [{"role": "user", "content": "Name three fruits."}]
    plain = sdk.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=6, temperature=0)
    assert (plain.choices[0].finish_reason, plain.usage.completion_tokens) == ("length", 6)
    chunks = list(
        sdk.chat.completions.create(
            model="smollm2-135m",
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
    assert chunks[-1].usage.completion_tokens == 6
    text = sdk.completions.create(
        model="smollm2-135m", prompt="Once upon a time", max_tokens=5, temperature=0
    )
    streamed = sdk.completions.create(
        model="smollm2-135m", prompt="Once upon a time", max_tokens=5, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text
    assert [m.id for m in sdk.models.list()] == ["smollm2-135m"]


def test_openai_sdk_async(engine):
    import asyncio

    import openai

    async def run() -> tuple[str, str]:
        client = openai.AsyncOpenAI(base_url=f"{engine.url}/v1", api_key="unused")
        plain = await client.completions.create(
            model="smollm2-135m", prompt="Hello", max_tokens=4, temperature=0
        )
        stream_ = await client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
        )
        content = "".join([c.choices[0].delta.content or "" async for c in stream_])
        await client.close()
        return plain.choices[0].text, content

    text, content = asyncio.run(run())
    assert text and content


def test_openai_sdk_typed_errors(sdk):
    import openai

    with pytest.raises(openai.NotFoundError) as not_found:
        sdk.chat.completions.create(model="gpt-nothing", messages=[{"role": "user", "content": "hi"}])
    assert (not_found.value.code, not_found.value.param) == ("model_not_found", "model")
    with pytest.raises(openai.BadRequestError) as too_long:
        sdk.completions.create(model="smollm2-135m", prompt="hi", max_tokens=5000)
    assert too_long.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "hi"}], top_logprobs=2
        )
    assert bad.value.param == "top_logprobs"
    with pytest.raises(openai.APIError, match="injected fault"):
        for _ in sdk.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=30,
            extra_body={"ignore_eos": True},
            stream=True,
            extra_headers={"x-kvscope-fault": "after_tokens=2"},
        ):
            pass
