"""Lifecycle and observability cases L1, L2, M1, M2, M3 against a real engine server (SmolLM2 on CPU).

The server runs with a 1024-token context, 2 sequences per step and 128-token prefill chunks, so "a full
engine" and "the prefill of a near-context prompt" happen within seconds; spans go over OTLP/HTTP to a local
receiver. Scaled from the cases: M1 uses 6 requests of 8 tokens (one with a 961-token prompt, one of 40
tokens), M2 4 concurrent streams; the properties checked are the cases' own.
"""

from __future__ import annotations

import httpx
import pytest

from tests.engine.server.e2e_support import (
    CHAT,
    COMPLETIONS,
    BackgroundStream,
    chat,
    completion,
    delta,
    line_by_http_id,
    log_line,
    stream,
    wait_for,
)
from tests.engine.server.helpers import sample, start_engine
from tests.otlp_receiver import OtlpReceiver

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]
M = {"model": "smollm2-135m"}
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as otlp:
        yield otlp


@pytest.fixture(scope="module")
def engine(tmp_path_factory, receiver):
    process = start_engine(
        tmp_path_factory.mktemp("engine"),
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        "96M",
        "--max-num-seqs",
        "2",
        "--max-num-batched-tokens",
        "128",
        "--sse-keepalive-s",
        "0.25",
        "--otlp-endpoint",
        receiver.url,
        env={"OTEL_BSP_SCHEDULE_DELAY": "100"},
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


def gauges(samples: dict) -> tuple[float, float, float]:
    return (
        sample(samples, "kvscope_engine_requests_running", **M),
        sample(samples, "kvscope_engine_requests_waiting", **M),
        sample(samples, "kvscope_engine_kv_cache_usage_ratio", **M),
    )


def back_to(engine, idle: tuple, timeout_s: float = 30.0) -> dict:
    return wait_for(lambda: (m := engine.metrics()) and gauges(m) == idle and m, timeout_s)


def test_l1_stream_disconnect_frees_everything(engine, client):
    before = engine.metrics()
    idle = gauges(before)
    result = stream(
        client, CHAT, chat("Tell me a very long story.", max_tokens=900, ignore_eos=True), stop_after_data=6
    )  # role chunk + 5 tokens, then the client leaves
    after = back_to(engine, idle)  # idle again: the 900-token request was aborted, not finished
    generated = delta(before, after, "kvscope_engine_generation_tokens_total", **M)
    line = log_line(engine, result.parsed.chunks[0]["id"])
    assert line["kvscope"]["client_disconnected"] is True and line["kvscope"]["phase"] == "decode"
    assert 5 <= line["gen_ai"]["usage"]["output_tokens"] == generated
    # a later request runs engine steps after the abort: a request still generating would add to the count
    admitted = client.post(CHAT, json=chat("hi", max_tokens=2, ignore_eos=True)).json()
    later = back_to(engine, idle)  # its last step is counted once the gauges are idle again
    assert delta(before, later, "kvscope_engine_generation_tokens_total", **M) == generated + 2, (
        "generation must stop"
    )
    # behind the 900-token request it would wait its remaining tokens at this engine's own pace
    k = line["kvscope"]
    per_token_s = (k["e2e_s"] - k["ttft_s"]) / (generated - 1)
    assert admitted["kvscope"]["queue_s"] < (900 - generated) * per_token_s / 2


def test_l2_non_streaming_client_killed_after_1s(engine):
    before = engine.metrics()
    idle = gauges(before)
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=engine.url, timeout=1.0) as short:
        short.post(
            CHAT,
            json=chat("Tell me a very long story.", max_tokens=900, ignore_eos=True),
            headers={"x-request-id": "l2-non-streaming"},
        )
    back_to(engine, idle)
    line = line_by_http_id(engine, "l2-non-streaming")
    assert (line["http"]["response"]["status_code"], line["kvscope"]["phase"]) == (499, "decode")
    assert line["kvscope"]["outcome"] == "client_disconnected"


def test_l2_stream_aborted_during_prefill_of_near_context_prompt(engine, client):
    prompt = "The ocean is deep and wide. " * 140  # ~980 tokens: eight 128-token prefill chunks
    n_prompt = client.post("/tokenize", json={"prompt": prompt}).json()["count"]
    assert 900 < n_prompt <= 1016
    before = engine.metrics()
    idle = gauges(before)

    def prefilling(event: str) -> bool:  # a keep-alive arrived and the engine reports the request running
        return event.startswith(":") and gauges(engine.metrics())[0] == 1

    result = stream(
        client,
        COMPLETIONS,
        completion(prompt, max_tokens=8),
        {"x-request-id": "l2-prefill"},
        until=prefilling,
    )
    assert result.parsed.data == []
    after = back_to(engine, idle)  # the abort lands before the next step
    step_tokens = sample(after, "kvscope_engine_step_tokens_sum", **M)
    # a later request's steps are the only ones after the abort: its uncached prompt, then one decode
    probe = client.post("/v1/completions", json=completion("Count:", max_tokens=2, ignore_eos=True)).json()[
        "usage"
    ]
    fresh = probe["prompt_tokens"] - ((probe.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    assert sample(back_to(engine, idle), "kvscope_engine_step_tokens_sum", **M) == step_tokens + fresh + 1, (
        "engine must stop"
    )
    assert delta(before, after, "kvscope_engine_prompt_tokens_total", **M) == 0
    assert step_tokens - sample(before, "kvscope_engine_step_tokens_sum", **M) < n_prompt
    line = line_by_http_id(engine, "l2-prefill")
    assert (line["kvscope"]["phase"], line["kvscope"]["client_disconnected"]) == ("prefill", True)


def test_l2_m2_queued_request_and_kv_gauge(engine):
    before = engine.metrics()
    idle = gauges(before)
    body = chat("Tell me a very long story.", max_tokens=900, ignore_eos=True)
    streams = []
    for i in range(4):
        streams.append(BackgroundStream(engine.url, CHAT, body, f"m2-{i}"))
        if i < 2:  # admit the first two before queueing the others
            wait_for(lambda i=i: streams[i].data_events >= 2, 30)
    busy = wait_for(lambda: (m := engine.metrics()) and gauges(m)[:2] == (2, 2) and m, 10)
    usage = sample(busy, "kvscope_engine_kv_cache_usage_ratio", **M)
    blocks = [
        sample(busy, "kvscope_engine_kv_cache_blocks", state=s, **M) for s in ("used", "cached", "free")
    ]
    assert idle[2] < usage <= 1.0 and usage == pytest.approx(blocks[0] / sum(blocks))
    streams[3].close()  # a queued request leaves
    wait_for(lambda: gauges(engine.metrics())[:2] == (2, 1))
    queued = line_by_http_id(engine, "m2-3")
    assert (queued["kvscope"]["phase"], queued["gen_ai"]["usage"]["output_tokens"]) == ("queued", 0)
    for run in streams[:3]:
        run.close()
    after = back_to(engine, idle)
    lines = [line_by_http_id(engine, f"m2-{i}") for i in range(3)]
    started = sum(1 for line in lines if line["gen_ai"]["usage"]["output_tokens"] > 0)
    prompt_len = lines[0]["gen_ai"]["usage"]["input_tokens"]
    assert delta(before, after, "kvscope_engine_prompt_tokens_total", **M) == started * prompt_len
    assert [line["kvscope"]["client_disconnected"] for line in lines] == [True] * 3


def test_m1_latency_histograms_are_true(engine, client):
    before = engine.metrics()
    bodies = [completion(f"Item {i}:", max_tokens=8, ignore_eos=True) for i in range(4)]
    # 961 prompt tokens in eight 128-token chunks: eight steps to the first token where the others take one,
    # so TTFTs spread over more than one bucket whatever the machine's speed (bounds ≤ 2.5x apart)
    bodies.append(completion("The history of the ocean. " * 160, max_tokens=8, ignore_eos=True))
    bodies.append(completion("A long one:", max_tokens=40, ignore_eos=True))
    client_seconds, lines = [], []  # client: send → the event of the second token arrived
    for body in bodies:
        result = stream(client, COMPLETIONS, body)
        client_seconds.append(result.data_times()[1])
        lines.append(log_line(engine, result.parsed.chunks[0]["id"]))
    after = engine.metrics()
    assert delta(before, after, "kvscope_engine_time_to_first_token_seconds_count", **M) == 6
    ttft_sum = delta(before, after, "kvscope_engine_time_to_first_token_seconds_sum", **M)
    assert ttft_sum == pytest.approx(sum(line["kvscope"]["ttft_s"] for line in lines), abs=1e-6)
    # the engine stamps a first token before the client can read the next one (bounds that load only widens)
    assert all(
        0 < line["kvscope"]["ttft_s"] < second for line, second in zip(lines, client_seconds, strict=True)
    )
    assert ttft_sum < sum(client_seconds)
    ttfts = [line["kvscope"]["ttft_s"] for line in lines]
    assert max(ttfts) == ttfts[4]  # eight prefill steps take longer than one
    # every bucket holds exactly the requests at or under its bound, and some bound splits them
    bucket = "kvscope_engine_time_to_first_token_seconds_bucket"
    bounds = [
        dict(labels)["le"]
        for name, labels in after
        if name == bucket and dict(labels).get("model") == M["model"]
    ]
    assert {le: delta(before, after, bucket, le=le, **M) for le in bounds} == {
        le: sum(t <= float(le) for t in ttfts) for le in bounds
    }
    assert any(min(ttfts) <= float(le) < max(ttfts) for le in bounds), (ttfts, bounds)
    e2e_sum = delta(before, after, "kvscope_engine_e2e_request_latency_seconds_sum", **M)
    assert e2e_sum == pytest.approx(sum(line["kvscope"]["e2e_s"] for line in lines), abs=1e-6)
    for line in lines:
        k, tokens = line["kvscope"], line["gen_ai"]["usage"]["output_tokens"]
        # TPOT is the decode time (first to last token) per later token; the decode ends before the request
        decode_s = k["engine"]["decode_s"]
        assert k["tpot_s"] == pytest.approx(decode_s / (tokens - 1), rel=1e-9)
        assert 0 < decode_s <= k["e2e_s"] - k["ttft_s"]
    assert (
        "kvscope_engine_e2e_request_latency_seconds_bucket",
        (("le", "600.0"), ("model", "smollm2-135m")),
    ) in after


def _span_tree(receiver, trace_hex: str) -> dict:
    spans = [s for s in receiver.span_messages() if s.trace_id.hex() == trace_hex]
    return {s.name: s for s in spans} if len(spans) == 5 else {}


def test_m3_one_trace_per_request_over_otlp(engine, client, receiver):
    body = client.post(CHAT, json=chat("hi", max_tokens=4), headers={"traceparent": TRACEPARENT}).json()
    named = wait_for(lambda: _span_tree(receiver, "4bf92f3577b34da6a3ce929d0e0e4736"), 10)
    assert set(named) == {"POST /v1/chat/completions", "llm_request", "queue", "prefill", "decode"}
    server, root = named["POST /v1/chat/completions"], named["llm_request"]
    assert server.parent_span_id.hex() == "00f067aa0ba902b7" and root.parent_span_id == server.span_id
    assert all(named[c].parent_span_id == root.span_id for c in ("queue", "prefill", "decode"))
    attrs = {a.key: a.value for a in root.attributes}
    assert attrs["gen_ai.request.model"].string_value == "smollm2-135m"
    assert attrs["gen_ai.usage.output_tokens"].int_value == 4
    assert [v.string_value for v in attrs["gen_ai.response.finish_reasons"].array_value.values] == ["length"]
    assert {e.name for e in named["prefill"].events} == {"prefill_chunk"}
    assert set(receiver.content_types) == {"application/x-protobuf"}
    line = log_line(engine, body["id"])
    assert (line["trace"]["id"], line["span"]["id"]) == (
        "4bf92f3577b34da6a3ce929d0e0e4736",
        root.span_id.hex(),
    )
    plain = client.post(CHAT, json=chat("hi", max_tokens=2)).json()
    trace = log_line(engine, plain["id"])["trace"]["id"]
    tree = wait_for(lambda: _span_tree(receiver, trace), 10)
    assert tree["POST /v1/chat/completions"].parent_span_id == b""
