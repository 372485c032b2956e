"""Lifecycle and observability cases L1, L2, M1 and M3 of serving-cases.md through the gateway (client →
gateway → a real engine subprocess, SmolLM2 on CPU), checked on both sides by ``x-request-id``.

The engine runs one sequence at a time (``--max-num-seqs 1``: "a full engine" is one running request) with
128-token prefill chunks (a ~980-token prompt prefills for seconds, so a client can leave mid-prefill) and a
1024-token context; gateway and engine export spans over OTLP/HTTP to one local receiver. Scaled for 2 shared
CPU cores (~10 tokens/s): M1 sends 5 streams (3 of 6 tokens, one ~960-token prompt whose TTFT is above 1 s,
one of 24 tokens) instead of ten of 50; the properties checked are the cases' own.
"""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.gateway_engine_support import (
    MODEL,
    M,
    engine_back_to,
    engine_gauges,
    plain_chat,
    start_stack,
    token_times,
    total,
)
from tests.engine.server.e2e_support import (
    CHAT,
    COMPLETIONS,
    BackgroundStream,
    chat,
    completion,
    delta,
    stream,
    wait_for,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]
TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
LONG_STORY = chat("Tell me a very long story.", max_tokens=900, ignore_eos=True)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    running = start_stack(
        tmp_path_factory.mktemp("gw-lifecycle"),
        "--kv-cache-memory",
        "64M",
        "--max-num-seqs",
        "1",
        "--max-num-batched-tokens",
        "128",
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


def gateway_idle(stack) -> bool:
    samples = stack.gateway_metrics()
    return (
        total(samples, "kvscope_gateway_in_flight_requests"),
        total(samples, "kvscope_gateway_upstream_outstanding_requests"),
    ) == (0, 0)


def test_l1_stream_disconnect_frees_everything(stack, client):
    before = stack.engine_metrics()
    idle = engine_gauges(before)
    result = stream(client, CHAT, LONG_STORY, {"x-request-id": "gw-l1"}, stop_after_data=6)  # role + 5 tokens
    after = engine_back_to(stack, idle)  # idle again: the 900-token request was aborted, not finished
    generated = delta(before, after, "kvscope_engine_generation_tokens_total", **M)
    line = stack.gateway_line("gw-l1")
    assert (line["kvscope"]["client_disconnected"], line["kvscope"]["disconnect_phase"]) == (True, "decode")
    assert (line["http"]["response"]["status_code"], line["event"]["outcome"]) == (200, "unknown")
    assert line["error"]["type"] == "client_disconnected"
    client_tokens = len(token_times(result))
    assert 5 <= client_tokens <= line["gen_ai"]["usage"]["output_tokens"] <= generated
    engine_line = stack.engine_line("gw-l1")
    assert (engine_line["kvscope"]["phase"], engine_line["gen_ai"]["usage"]["output_tokens"]) == (
        "decode",
        generated,
    )
    assert wait_for(lambda: gateway_idle(stack), 30)
    # a later request runs engine steps after the abort: a request still generating would add to the count
    admitted = client.post(CHAT, json=chat("hi", max_tokens=2, ignore_eos=True)).json()
    later = engine_back_to(stack, idle)  # its last step is counted once the gauges are idle again
    assert delta(before, later, "kvscope_engine_generation_tokens_total", **M) == generated + 2, (
        "generation must stop"
    )
    # behind the 900-token request (one sequence at a time) it would wait its remaining tokens at this pace
    k = engine_line["kvscope"]
    per_token_s = (k["e2e_s"] - k["ttft_s"]) / (generated - 1)
    assert admitted["kvscope"]["queue_s"] < (900 - generated) * per_token_s / 2


def test_l2_non_streaming_client_killed_after_1s(stack):
    idle = engine_gauges(stack.engine_metrics())
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=stack.url, timeout=1.0) as short:
        short.post(CHAT, json=LONG_STORY, headers={"x-request-id": "gw-l2-json"})
    engine_back_to(stack, idle)  # idle again: the 900-token request was aborted, not finished
    line = stack.gateway_line("gw-l2-json")
    assert (line["http"]["response"]["status_code"], line["kvscope"]["disconnect_phase"]) == (499, "response")
    assert line["kvscope"]["client_disconnected"] is True and line["event"]["outcome"] == "unknown"
    engine_line = stack.engine_line("gw-l2-json")
    assert (engine_line["http"]["response"]["status_code"], engine_line["kvscope"]["phase"]) == (
        499,
        "decode",
    )
    assert engine_line["kvscope"]["outcome"] == "client_disconnected"


def test_l2_stream_aborted_during_prefill_of_near_context_prompt(stack, client):
    prompt = "The ocean is deep and wide. " * 140  # ~980 tokens: eight 128-token prefill chunks
    n_prompt = client.post(stack.engine.url + "/tokenize", json={"prompt": prompt}).json()["count"]
    assert 900 < n_prompt <= 1024 - 8
    before = stack.engine_metrics()
    idle = engine_gauges(before)

    def prefilling(event: str) -> bool:  # a gateway keep-alive arrived and the engine runs the request
        return event.startswith(":") and engine_gauges(stack.engine_metrics())[0] == 1

    result = stream(
        client,
        COMPLETIONS,
        completion(prompt, max_tokens=8),
        {"x-request-id": "gw-l2-prefill"},
        until=prefilling,
    )
    assert result.status == 200 and result.parsed.data == []
    after = engine_back_to(stack, idle)  # the abort lands before the next step
    step_tokens = total(after, "kvscope_engine_step_tokens_sum", **M)
    # a later request's steps are the only ones after the abort: its uncached prompt, then one decode
    probe = client.post(COMPLETIONS, json=completion("Count:", max_tokens=2, ignore_eos=True)).json()["usage"]
    fresh = probe["prompt_tokens"] - ((probe.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    assert (
        total(engine_back_to(stack, idle), "kvscope_engine_step_tokens_sum", **M) == step_tokens + fresh + 1
    ), "engine must stop"
    assert delta(before, after, "kvscope_engine_prompt_tokens_total", **M) == 0
    assert step_tokens - total(before, "kvscope_engine_step_tokens_sum", **M) < n_prompt
    line = stack.gateway_line("gw-l2-prefill")
    assert (line["kvscope"]["disconnect_phase"], line["kvscope"]["client_disconnected"]) == (
        "first_token",
        True,
    )
    assert (line["kvscope"]["ttft_s"], line["gen_ai"]["usage"]["output_tokens"]) == (None, 0)
    assert line["kvscope"]["prompt_tokens_counted"] == n_prompt
    engine_line = stack.engine_line("gw-l2-prefill")
    assert (engine_line["kvscope"]["phase"], engine_line["kvscope"]["client_disconnected"]) == (
        "prefill",
        True,
    )


def test_l2_request_queued_behind_a_full_engine(stack):
    before = stack.engine_metrics()
    idle = engine_gauges(before)
    running = BackgroundStream(stack.url, CHAT, LONG_STORY, "gw-l2-running")
    wait_for(lambda: running.data_events >= 2, 30)
    queued = BackgroundStream(stack.url, CHAT, chat("Tell me another story.", max_tokens=900), "gw-l2-queued")
    wait_for(lambda: engine_gauges(stack.engine_metrics())[:2] == (1, 1), 10)
    queued.close()  # takes effect at the next gateway keep-alive
    wait_for(lambda: engine_gauges(stack.engine_metrics())[:2] == (1, 0))
    line = stack.gateway_line("gw-l2-queued")
    assert (line["kvscope"]["disconnect_phase"], line["gen_ai"]["usage"]["output_tokens"]) == (
        "first_token",
        0,
    )
    engine_line = stack.engine_line("gw-l2-queued")
    assert (engine_line["kvscope"]["phase"], engine_line["gen_ai"]["usage"]["output_tokens"]) == ("queued", 0)
    running.close()
    after = engine_back_to(stack, idle)
    assert stack.gateway_line("gw-l2-running")["kvscope"]["disconnect_phase"] == "decode"
    running_line = stack.engine_line("gw-l2-running")
    assert running_line["kvscope"]["phase"] == "decode"
    prompt_tokens = running_line["gen_ai"]["usage"]["input_tokens"]
    assert (
        delta(before, after, "kvscope_engine_prompt_tokens_total", **M) == prompt_tokens
    )  # not the queued one


def test_m1_latency_histograms_are_true(stack, client):
    bodies = [completion(f"Item {i}:", max_tokens=6, ignore_eos=True) for i in range(3)]
    # 961 prompt tokens in eight 128-token chunks: eight steps to the first token where the others take one,
    # so TTFTs spread over more than one bucket whatever the machine's speed (bounds ≤ 2.5x apart)
    bodies.append(completion("The history of the ocean. " * 160, max_tokens=6, ignore_eos=True))
    bodies.append(completion("A long one:", max_tokens=24, ignore_eos=True))
    first = before = stack.gateway_metrics()
    engine_before = stack.engine_metrics()
    client_seconds, lines = [], []  # client: send → the event of the second token arrived
    hist = {
        "ttft_s": "kvscope_gateway_time_to_first_token_seconds_sum",
        "tpot_s": "kvscope_gateway_time_per_output_token_seconds_sum",
        "e2e_s": "kvscope_gateway_request_duration_seconds_sum",
    }
    for i, body in enumerate(bodies):
        result = stream(client, COMPLETIONS, body, {"x-request-id": f"gw-m1-{i}"})
        client_seconds.append(token_times(result)[1])
        line = stack.gateway_line(f"gw-m1-{i}")  # written after the histograms are observed
        after = stack.gateway_metrics()
        for field, name in hist.items():  # exactly the logged value went into each histogram
            labels = {"route": COMPLETIONS} if field == "e2e_s" else {}
            assert delta(before, after, name, **labels, **M) == pytest.approx(
                line["kvscope"][field], abs=1e-9
            )
        k, tokens = line["kvscope"], line["gen_ai"]["usage"]["output_tokens"]
        assert tokens == body["max_tokens"]
        assert k["tpot_s"] == pytest.approx((k["e2e_s"] - k["ttft_s"]) / (tokens - 1), rel=1e-9)
        assert k["engine"]["ttft_s"] <= k["ttft_s"]
        lines.append(line)
        before = after
    assert delta(first, after, "kvscope_gateway_time_to_first_token_seconds_count", **M) == 5
    assert delta(first, after, "kvscope_gateway_time_per_output_token_seconds_count", **M) == 5
    assert (
        delta(engine_before, stack.engine_metrics(), "kvscope_engine_time_to_first_token_seconds_count", **M)
        == 5
    )
    ttft_sum = delta(first, after, "kvscope_gateway_time_to_first_token_seconds_sum", **M)
    # the gateway stamps a first token before it forwards the next (bounds that load only widens)
    assert all(line["kvscope"]["ttft_s"] < second for line, second in zip(lines, client_seconds, strict=True))
    assert ttft_sum < sum(client_seconds)
    ttfts = [line["kvscope"]["ttft_s"] for line in lines]
    assert max(ttfts) == ttfts[3]  # eight prefill steps take longer than one
    # every bucket holds exactly the requests at or under its bound, and some bound splits them
    bucket = "kvscope_gateway_time_to_first_token_seconds_bucket"
    bounds = [
        dict(labels)["le"] for name, labels in after if name == bucket and dict(labels).get("model") == MODEL
    ]
    assert {le: delta(first, after, bucket, le=le, **M) for le in bounds} == {
        le: sum(t <= float(le) for t in ttfts) for le in bounds
    }
    assert any(min(ttfts) <= float(le) < max(ttfts) for le in bounds), (ttfts, bounds)
    duration_bounds = {
        float(dict(labels)["le"])
        for (name, labels), _ in after.items()
        if name == "kvscope_gateway_request_duration_seconds_bucket"
    }
    assert {120.0, 300.0, 600.0} <= duration_bounds


def spans_by_trace(stack, trace_id: str) -> dict[tuple[str, str], object]:
    """(service.name, span name) → span, of every span of ``trace_id`` the receiver holds."""
    out = {}
    for request in stack.receiver.traces:
        for rs in request.resource_spans:
            service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
            for span in (s for ss in rs.scope_spans for s in ss.spans if s.trace_id.hex() == trace_id):
                assert (service, span.name) not in out, f"two spans named {span.name} in {service}"
                out[(service, span.name)] = span
    return out


GATEWAY_SPANS = ("POST /v1/chat/completions", f"chat {MODEL}")
ENGINE_SPANS = ("POST /v1/chat/completions", "llm_request", "queue", "prefill", "decode")


def one_trace(stack, trace_id: str) -> dict:
    """The request's seven spans (gateway server + client, engine HTTP server, llm_request, queue, prefill,
    decode), checked to form one tree: server → client → engine server → llm_request → queue|prefill|decode.
    Returns them by role: ``gateway server``, ``client``, ``engine server``, ``llm_request``, the phases."""
    named = wait_for(lambda: (s := spans_by_trace(stack, trace_id)) and len(s) == 7 and s, 10)
    assert set(named) == {("kvscope-gateway", n) for n in GATEWAY_SPANS} | {
        ("kvscope-engine", n) for n in ENGINE_SPANS
    }
    span = {
        "gateway server": named[("kvscope-gateway", GATEWAY_SPANS[0])],
        "client": named[("kvscope-gateway", GATEWAY_SPANS[1])],
        "engine server": named[("kvscope-engine", ENGINE_SPANS[0])],
        **{n: named[("kvscope-engine", n)] for n in ENGINE_SPANS[1:]},
    }
    assert span["client"].parent_span_id == span["gateway server"].span_id
    assert span["engine server"].parent_span_id == span["client"].span_id
    assert span["llm_request"].parent_span_id == span["engine server"].span_id
    assert all(span[c].parent_span_id == span["llm_request"].span_id for c in ENGINE_SPANS[2:])
    return span


def test_m3_one_trace_through_gateway_and_engine(stack, client):
    traced = client.post(
        CHAT, json=chat("hi", max_tokens=4), headers={"traceparent": TRACEPARENT, "x-request-id": "gw-m3"}
    )
    assert traced.status_code == 200
    span = one_trace(stack, TRACE_ID)
    server = span["gateway server"]
    assert server.parent_span_id.hex() == PARENT_ID
    line = stack.gateway_line("gw-m3")
    assert (line["trace"]["id"], line["span"]["id"]) == (TRACE_ID, server.span_id.hex())
    engine_line = stack.engine_line("gw-m3")
    assert (engine_line["trace"]["id"], engine_line["span"]["id"]) == (
        TRACE_ID,
        span["llm_request"].span_id.hex(),
    )

    plain = client.post(CHAT, json=chat("hi", max_tokens=2), headers={"x-request-id": "gw-m3-root"})
    trace_id = stack.gateway_line("gw-m3-root")["trace"]["id"]
    assert trace_id != TRACE_ID
    rooted = one_trace(stack, trace_id)
    assert rooted["gateway server"].parent_span_id == b""  # the gateway starts the trace
    assert stack.engine_line("gw-m3-root")["trace"]["id"] == trace_id
    roots = [
        s
        for s in stack.receiver.span_messages()
        if s.name == "llm_request" and _attr(s, "gen_ai.response.id") == plain.json()["id"]
    ]
    assert [s.trace_id.hex() for s in roots] == [trace_id], (
        "one trace holds the engine's spans of the request"
    )


def _attr(span, key: str) -> str | None:
    return next((a.value.string_value for a in span.attributes if a.key == key), None)
