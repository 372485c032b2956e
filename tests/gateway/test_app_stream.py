"""Streaming through the in-process gateway: headers and pacing (S1), keep-alive (S4), failures after the
200 (S2/S3), timeouts, engine stats in the log, and one trace per request (M3)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from opentelemetry.trace import SpanKind

from kvscope.gateway.proxy.relay import DRAIN_BEFORE_END_S
from kvscope.testing.harness import LoopThread, metric_samples, records_by_id, sample, sse_events
from tests.gateway.conftest import KEYS, Stack, build_stack

HI = [{"role": "user", "content": "hi"}]
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def stream(c: httpx.Client, body: dict, rid: str) -> tuple[httpx.Response, list[tuple[float, bytes]]]:
    """POST a stream; returns the response and (arrival time, bytes) of every received piece."""
    pieces = []
    with c.stream(
        "POST",
        "/v1/chat/completions",
        json={"model": "fake-model", "messages": HI, "stream": True, **body},
        headers={"x-request-id": rid},
    ) as resp:
        for piece in resp.iter_raw():
            pieces.append((time.monotonic(), piece))
    return resp, pieces


def _tokens(data: bytes) -> int:
    return data.count(b'"content":"t')


@pytest.fixture(scope="module")
def quiet(loop: LoopThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A gateway that sends no keep-alive comments (interval 60 s): nothing but the events can unstick a
    client waiting for its next event."""
    tmp: Path = tmp_path_factory.mktemp("quiet")
    gateway, fakes, exporter = build_stack(loop, tmp, timeouts={"keepalive_s": 60})
    with gateway:
        yield Stack(gateway, fakes, exporter, tmp / "requests.jsonl")
    for fake in fakes.values():
        loop.run(fake.close())


def test_stream_headers_and_events_spread_over_time(quiet: Stack) -> None:
    """S1: SSE headers, no Content-Length, events arrive as they are produced: the upstream writes token ``i``
    only once the client has the role chunk and tokens ``0..i-1`` (gate ``s1/i``). The gateway sends no
    keep-alives here, so one that held back any event would stall the stream until the client's 30 s read
    timeout."""
    fake, released, seen = quiet.fakes["main"], 0, b""
    with (
        httpx.Client(
            base_url=quiet.url, headers={"authorization": f"Bearer {KEYS['alice']}"}, timeout=30
        ) as c,
        c.stream(
            "POST",
            "/v1/chat/completions",
            headers={"x-request-id": "s1"},
            json={
                "model": "fake-model",
                "messages": HI,
                "stream": True,
                "max_tokens": 10,
                "fake": {"hold": "s1"},
            },
        ) as resp,
    ):
        for piece in resp.iter_raw():
            seen += piece
            if released < 10 and b'"role":"assistant"' in seen and _tokens(seen) == released:
                fake.release(f"s1/{released}")
                released += 1
    assert resp.headers["content-type"] == "text/event-stream"
    assert resp.headers["cache-control"] == "no-cache" and resp.headers["x-accel-buffering"] == "no"
    assert "content-length" not in resp.headers and "content-encoding" not in resp.headers
    assert (released, _tokens(seen)) == (10, 10) and sse_events(seen)[-1] == "[DONE]"


def test_an_upstream_slow_to_end_its_body_does_not_hold_the_client(quiet: Stack) -> None:
    """An upstream that keeps its body open long after ``[DONE]`` (here 5 s): the client's response ends
    while the upstream's has not (the gateway waits ``DRAIN_BEFORE_END_S``, then ends the client's and drains
    the upstream in the background), and the answer is whole."""
    fake = quiet.fakes["main"]
    with httpx.Client(
        base_url=quiet.url, headers={"authorization": f"Bearer {KEYS['alice']}"}, timeout=30
    ) as c:
        resp, pieces = stream(c, {"max_tokens": 5, "fake": {"end_delay_s": 5.0}}, "late-end")
        [record] = [r for r in fake.records if r.headers.get("x-request-id", "").startswith("late-end")]
        assert not record.completed  # the upstream is still in its 5 s before the end of its body
    events = sse_events(b"".join(p for _, p in pieces))
    assert resp.status_code == 200 and _tokens(b"".join(p for _, p in pieces)) == 5 and events[-1] == "[DONE]"


KEEPALIVE = b": keep-alive\n\n"


@pytest.mark.parametrize("end_delay_s", [0.0, 0.01])
def test_streams_reuse_the_upstream_connection(quiet: Stack, end_delay_s: float) -> None:
    """The relay reads a stream's body off the connection itself (gateway/proxy/network.py ``tap_body``) and
    leaves httpcore the body's end: a stream's connection goes back to the pool, so sequential streams (and
    the JSON request between them) share one upstream connection, and each stream arrives whole and in order.

    The gateway waits for the upstream's end of body (up to ``DRAIN_BEFORE_END_S``) before it ends the
    client's response, so a client that sends its next request at once still finds the connection in the
    pool, even from an upstream that ends its body 10 ms after ``[DONE]`` (before, the client was the
    quicker one now and then, and the pool opened a second connection: seen once in test-fresh)."""
    assert end_delay_s < DRAIN_BEFORE_END_S / 2
    fake = quiet.fakes["main"]
    with httpx.Client(
        base_url=quiet.url, headers={"authorization": f"Bearer {KEYS['alice']}"}, timeout=30
    ) as c:
        stream(c, {"max_tokens": 3}, "reuse-warm")
        before = fake.connections
        for i in range(3):
            resp, pieces = stream(c, {"max_tokens": 40, "fake": {"end_delay_s": end_delay_s}}, f"reuse-{i}")
            events = sse_events(b"".join(p for _, p in pieces))
            assert resp.status_code == 200 and _tokens(b"".join(p for _, p in pieces)) == 40
            assert events[-1] == "[DONE]"
            assert (
                c.post(
                    "/v1/chat/completions", json={"model": "fake-model", "messages": HI, "max_tokens": 2}
                ).status_code
                == 200
            )
    assert fake.connections == before


def test_keepalive_comments_while_waiting_for_the_first_token(stack: Stack) -> None:
    """S4: ``: keep-alive`` comments (interval 0.3 s) while the upstream holds its first token (released after
    the third comment); never data-less events; the OpenAI SDK reads the stream; TTFT is the first real token.

    Bounds from the client's own clock, which load can only widen: the k-th comment arrives no earlier than
    0.3·k s after the request was sent; TTFT is at least release → headers (the token did not exist before its
    release, the gateway started before the headers) and less than send → token 1 (the gateway stamps the
    first token before it forwards the next)."""
    fake, body, comments, marks = stack.fakes["main"], b"", [], {}
    with stack.client() as c:
        sent_at = time.monotonic()
        with c.stream(
            "POST",
            "/v1/chat/completions",
            headers={"x-request-id": "s4"},
            json={
                "model": "fake-model",
                "messages": HI,
                "stream": True,
                "max_tokens": 2,
                "fake": {"hold": "s4"},
            },
        ) as resp:
            headers_at = time.monotonic()
            for piece in resp.iter_raw():
                now = time.monotonic()
                body += piece
                comments += [now] * (body.count(KEEPALIVE) - len(comments))
                if len(comments) >= 3 and "release" not in marks:
                    marks["release"] = time.monotonic()
                    fake.release("s4/0")
                if _tokens(body) >= 1 and "token0" not in marks:
                    marks["token0"] = now
                    fake.release("s4/1")
                if _tokens(body) >= 2 and "token1" not in marks:
                    marks["token1"] = now
    before_token = body[: body.index(b'"content":"t0')]
    assert before_token.count(KEEPALIVE) >= 3 and b"event:" not in body
    for k, arrived in enumerate(comments[: before_token.count(KEEPALIVE)], start=1):
        assert arrived - sent_at >= 0.3 * k - 1e-3, (k, arrived - sent_at)  # 1 ms: timer/float rounding
    ttft = records_by_id(stack.log, ["s4"])["s4"][0]["kvscope"]["ttft_s"]
    assert marks["release"] - headers_at <= ttft < marks["token1"] - sent_at
    with openai.OpenAI(base_url=stack.url + "/v1", api_key=KEYS["alice"], max_retries=0) as client:
        chunks = list(
            client.chat.completions.create(
                model="fake-model",
                messages=HI,
                max_tokens=2,
                stream=True,
                extra_body={"fake": {"first_token_delay_s": 0.7}},
            )
        )
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "t0 t1 "


@pytest.mark.parametrize(
    ("knobs", "code", "reason", "tokens"),
    [
        ({"error_after_tokens": 2}, "engine_error", "upstream_error", 2),
        ({"omit_finish": True}, "stream_incomplete", "incomplete", 4),
        ({"finish_reason": "abort"}, "stream_aborted", "aborted", 4),
    ],
)
def test_failures_after_the_200_are_in_band_errors(
    stack: Stack, knobs: dict, code: str, reason: str, tokens: int
) -> None:
    """S2/S3: ``data: {"error": …}``, no [DONE], no invalid finish_reason; logged and counted as errors."""
    before = sample(
        metric_samples(stack.metrics()),
        "kvscope_gateway_stream_errors_total",
        model="fake-model",
        reason=reason,
    )
    rid = f"inband-{reason}"
    with stack.client() as c:
        resp, pieces = stream(c, {"max_tokens": 4, "fake": knobs}, rid)
    events = sse_events(b"".join(p for _, p in pieces))
    assert resp.status_code == 200 and "[DONE]" not in events
    error = json.loads(events[-1])["error"]
    assert error["code"] == code
    reasons = {ch["finish_reason"] for e in events[:-1] for ch in json.loads(e).get("choices", [])}
    assert reasons <= {None, "stop", "length", "tool_calls", "content_filter"}
    record = records_by_id(stack.log, [rid])[rid][0]
    assert record["event"]["outcome"] == "failure" and record["log"]["level"] == "error"
    assert record["kvscope"]["stream_error"] == reason and record["error"]["type"] == code
    assert record["gen_ai"]["usage"]["output_tokens"] == tokens
    after = sample(
        metric_samples(stack.metrics()),
        "kvscope_gateway_stream_errors_total",
        model="fake-model",
        reason=reason,
    )
    assert after == before + 1


@pytest.mark.parametrize("knobs", [{"error_after_tokens": 2}, {"die_after_tokens": 2}])
def test_a_stream_failing_after_its_first_token_logs_the_counted_prompt_tokens(
    stack: Stack, knobs: dict
) -> None:
    """No usage chunk came, but the upstream read the prompt: the log's input tokens are the gateway's own
    count, not null (a break-it run found null beside prompt_tokens_counted)."""
    rid = f"counted-{next(iter(knobs))}"
    with stack.client() as c:
        resp, pieces = stream(c, {"model": "tok-model", "max_tokens": 4, "fake": knobs}, rid)
    assert resp.status_code == 200 and _tokens(b"".join(p for _, p in pieces)) == 2
    record = records_by_id(stack.log, [rid])[rid][0]
    assert record["kvscope"]["stream_error"] is not None
    assert (record["gen_ai"]["usage"]["input_tokens"], record["kvscope"]["prompt_tokens_counted"]) == (6, 6)


def test_engine_stats_reach_the_log(stack: Stack) -> None:
    with stack.client() as c:
        c.post(
            "/v1/chat/completions",
            json={"model": "fake-model", "messages": HI, "fake": {"kvscope_stats": True}},
            headers={"x-request-id": "engine-json"},
        )
        stream(c, {"fake": {"kvscope_stats": True}}, "engine-sse")
    records = records_by_id(stack.log, ["engine-json", "engine-sse"])
    for rid in ("engine-json", "engine-sse"):
        engine = records[rid][0]["kvscope"]["engine"]
        assert engine["kv_blocks"] == 2 and engine["num_preemptions"] == 0 and engine["ttft_s"] == 0.002
        # speculative decoding (issue 16): the engine's totals land in kvscope.engine unchanged
        assert {k: engine[k] for k in engine if k.startswith("spec_")} == {
            "spec_drafts": 4,
            "spec_draft_tokens": 12,
            "spec_accepted_tokens": 6,
            "spec_mean_accepted_length": 2.5,
        }


def _spans(stack: Stack, trace_id: int) -> dict[str, object]:
    """The finished spans of ``trace_id`` once its server span ended (spans export synchronously, and the
    server span ends last, in ``observe.finish``); the 30 s deadline only bounds a broken run."""
    deadline = time.monotonic() + 30
    while True:
        spans = {s.name: s for s in stack.exporter.get_finished_spans() if s.context.trace_id == trace_id}
        if "POST /v1/chat/completions" in spans or time.monotonic() > deadline:
            return spans
        time.sleep(0.02)


def test_one_trace_per_request_with_and_without_traceparent(stack: Stack) -> None:
    """M3: the client's trace continues through the gateway to the upstream; without a header the gateway
    roots a new trace. The log line carries the server span's ids."""
    with stack.client() as c:
        c.post(
            "/v1/chat/completions",
            json={"model": "fake-model", "messages": HI, "stream": True, "max_tokens": 3},
            headers={"traceparent": TRACEPARENT, "x-request-id": "m3-a"},
        )
        sent = stack.fakes["main"].records[-1].headers["traceparent"]
        c.post(
            "/v1/chat/completions",
            json={"model": "fake-model", "messages": HI, "max_tokens": 3},
            headers={"x-request-id": "m3-b"},
        )
        sent_b = stack.fakes["main"].records[-1].headers["traceparent"]
    spans = _spans(stack, 0x4BF92F3577B34DA6A3CE929D0E0E4736)
    assert set(spans) == {"POST /v1/chat/completions", "chat fake-model", "prefill", "decode"}
    server, client = spans["POST /v1/chat/completions"], spans["chat fake-model"]
    assert server.kind is SpanKind.SERVER and server.parent.span_id == 0x00F067AA0BA902B7
    assert client.kind is SpanKind.CLIENT and client.parent.span_id == server.context.span_id
    assert spans["prefill"].parent.span_id == client.context.span_id == spans["decode"].parent.span_id
    assert sent == f"00-4bf92f3577b34da6a3ce929d0e0e4736-{client.context.span_id:016x}-01"
    assert client.attributes["gen_ai.request.model"] == "fake-model"
    assert client.attributes["gen_ai.usage.output_tokens"] == 3
    assert spans["prefill"].end_time == spans["decode"].start_time
    records = records_by_id(stack.log, ["m3-a", "m3-b"])
    assert records["m3-a"][0]["trace"]["id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert records["m3-a"][0]["span"]["id"] == f"{server.context.span_id:016x}"
    trace_b = int(records["m3-b"][0]["trace"]["id"], 16)
    spans_b = _spans(stack, trace_b)
    assert set(spans_b) == {
        "POST /v1/chat/completions",
        "chat fake-model",
    }  # no token timing without a stream
    assert spans_b["POST /v1/chat/completions"].parent is None
    assert sent_b.split("-")[1] == records["m3-b"][0]["trace"]["id"]


@pytest.fixture(scope="module")
def strict(loop: LoopThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A gateway with short timeouts (first token 0.6 s, idle 0.5 s, total 2 s, keep-alive 10 s) that also
    logs prompts and completions."""
    tmp: Path = tmp_path_factory.mktemp("strict")
    gateway, fakes, exporter = build_stack(
        loop,
        tmp,
        timeouts={"first_token_s": 0.6, "idle_s": 0.5, "total_s": 2.0, "keepalive_s": 10},
        logs={"file": str(tmp / "requests.jsonl"), "log_content": True},
    )
    with gateway:
        yield Stack(gateway, fakes, exporter, tmp / "requests.jsonl")
    for fake in fakes.values():
        loop.run(fake.close())


def test_timeouts_before_the_response_are_504_json(strict: Stack) -> None:
    """The upstream holds its tokens for good (gates never released), so each timeout must fire; the total
    one no earlier than its 2 s and no later than the client saw the request's log record."""
    with strict.client() as c:
        first = c.post(
            "/v1/completions",
            json={"model": "fake-model", "prompt": "hi", "stream": True, "fake": {"hold": "t1"}},
            headers={"x-request-id": "t1"},
        )
        assert first.status_code == 504 and first.json()["error"]["code"] == "upstream_timeout"
        assert "no first token from the upstream within 0.6s" in first.json()["error"]["message"]
        # a chat stream starts with the role chunk, so the same timeout arrives in-band
        _, pieces = stream(c, {"fake": {"hold": "t1-chat"}}, "t1-chat")
        events = sse_events(b"".join(p for _, p in pieces))
        assert json.loads(events[0])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert json.loads(events[-1])["error"]["code"] == "upstream_timeout" and len(events) == 2
        t2_sent = time.monotonic()
        total = c.post(
            "/v1/chat/completions",
            json={"model": "fake-model", "messages": HI, "fake": {"hold": "t2"}},
            headers={"x-request-id": "t2"},
        )
        assert total.status_code == 504
    records = records_by_id(strict.log, ["t1", "t2"])
    t2_logged = time.monotonic()
    assert [records[r][0]["http"]["response"]["status_code"] for r in ("t1", "t2")] == [504, 504]
    assert 2.0 - 1e-3 <= records["t2"][0]["kvscope"]["e2e_s"] <= t2_logged - t2_sent  # 1 ms: timer rounding


def test_idle_timeout_after_the_first_token_is_in_band(strict: Stack) -> None:
    """Token 0 is released up front, token 1 never: the idle timeout ends the stream after one token."""
    strict.fakes["main"].release("t3/0")
    with strict.client() as c:
        resp, pieces = stream(c, {"max_tokens": 3, "fake": {"hold": "t3"}}, "t3")
    events = sse_events(b"".join(p for _, p in pieces))
    assert json.loads(events[-1])["error"]["message"] == "upstream sent nothing for 0.5s"
    assert "[DONE]" not in events and resp.status_code == 200
    record = records_by_id(strict.log, ["t3"])["t3"][0]
    assert record["kvscope"]["stream_error"] == "timeout" and record["gen_ai"]["usage"]["output_tokens"] == 1


def test_log_content_only_when_switched_on(stack: Stack, strict: Stack) -> None:
    for target in (stack, strict):
        with target.client() as c:
            stream(c, {"max_tokens": 2}, "content-sse")
            c.post(
                "/v1/completions",
                json={"model": "fake-model", "prompt": "hello", "max_tokens": 3},
                headers={"x-request-id": "content-json"},
            )
    for rid, text, role in (("content-sse", "t0 t1 ", "user"), ("content-json", "t0 t1 t2 ", "user")):
        on = records_by_id(strict.log, [rid])[rid][0]["gen_ai"]
        prompt = "hi" if rid == "content-sse" else "hello"
        # OTel GenAI input/output message schema: role + parts, finish_reason per output message
        assert on["input"] == {"messages": [{"role": role, "parts": [{"type": "text", "content": prompt}]}]}
        assert on["output"] == {
            "messages": [
                {"role": "assistant", "parts": [{"type": "text", "content": text}], "finish_reason": "length"}
            ]
        }
        off = records_by_id(stack.log, [rid])[rid][0]["gen_ai"]
        assert "input" not in off and "output" not in off
