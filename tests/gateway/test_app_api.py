"""API behaviour through the in-process gateway: OpenAI SDK round trips, usage chunk (S5), terminal events
(S2), malformed bodies (A3), unknown models (A4), context length (K1), per-key ceilings, pass-through."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from kvscope.testing.harness import metric_samples, records_by_id, sample, sse_events
from tests.gateway.conftest import CONTEXT_LEN, KEYS, Stack

HI = [{"role": "user", "content": "hi"}]


def sdk(stack: Stack, key: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=KEYS[key], max_retries=0)


def test_openai_sdk_chat_completion_and_models(stack: Stack) -> None:
    with sdk(stack) as client, sdk(stack, "limited") as limited:
        reply = client.chat.completions.create(model="fake-model", messages=HI, max_tokens=4)
        assert (
            reply.choices[0].message.content == "t0 t1 t2 t3 " and reply.choices[0].finish_reason == "length"
        )
        assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (
            1,
            4,
            5,
        )
        models = {m.id: m.model_extra.get("max_model_len") for m in client.models.list().data}
        assert models == {"fake-model": 2048, "tok-model": CONTEXT_LEN, "broken-model": 2048}
        assert [m.id for m in limited.models.list().data] == ["fake-model"]
        raw = client.models.with_raw_response.list()
        assert raw.http_response.status_code == 200
        with pytest.raises(openai.NotFoundError) as err:
            client.models.retrieve("nope")
        assert err.value.body["code"] == "model_not_found"


def _no_id(event: str) -> dict:
    return {k: v for k, v in json.loads(event).items() if k != "id"}


def test_usage_chunk_only_when_asked_and_equal_to_non_streaming_usage(stack: Stack) -> None:
    """S5, also with n=2 (completion tokens summed over choices, the prompt counted once)."""
    with stack.client() as c:
        for n in (1, 2):
            body = {
                "model": "fake-model",
                "messages": [{"role": "user", "content": "a b c"}],
                "max_tokens": 5,
                "n": n,
            }
            usage = c.post("/v1/chat/completions", json=body).json()["usage"]
            assert usage["prompt_tokens"] == 3 and usage["completion_tokens"] == 5 * n
            asked = sse_events(
                c.post(
                    "/v1/chat/completions",
                    json={**body, "stream": True, "stream_options": {"include_usage": True}},
                ).content
            )
            chunks = [json.loads(e) for e in asked[:-1]]
            usage_chunks = [ch for ch in chunks if ch.get("usage")]
            assert asked[-1] == "[DONE]" and usage_chunks == [chunks[-1]]
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == usage
            plain = sse_events(c.post("/v1/chat/completions", json={**body, "stream": True}).content)
            assert plain[-1] == "[DONE]"
            # the same chunks, without the "usage": null the upstream adds once usage is asked for
            assert [_no_id(e) for e in plain[:-1]] == [
                {k: v for k, v in _no_id(e).items() if k != "usage"} for e in asked[:-2]
            ]
            assert all("usage" not in json.loads(e) for e in plain[:-1])
    sent = [r.body for r in stack.fakes["main"].records[-2:]]
    assert [b["stream_options"] for b in sent] == [{"include_usage": True}, {"include_usage": True}]


def test_terminal_events_and_log_line(stack: Stack) -> None:
    """S2: one finish_reason per choice on the last chunk, then exactly ``data: [DONE]``."""
    with stack.client() as c:
        for path, body in (
            ("/v1/chat/completions", {"messages": HI}),
            ("/v1/completions", {"prompt": "Once upon a time"}),
        ):
            rid = f"s2-{path.rsplit('/', 1)[1]}"
            resp = c.post(
                path,
                json={"model": "fake-model", "max_tokens": 16, "stream": True, **body},
                headers={"x-request-id": rid},
            )
            events = sse_events(resp.content)
            assert events[-1] == "[DONE]"
            reasons = [ch["finish_reason"] for e in events[:-1] for ch in json.loads(e)["choices"]]
            assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
            record = records_by_id(stack.log, [rid])[rid][0]
            assert record["gen_ai"]["response"]["finish_reasons"] == ["length"]
            assert record["gen_ai"]["usage"]["output_tokens"] == 16
            assert (
                record["http"]["response"]["status_code"] == 200 and record["event"]["outcome"] == "success"
            )


def test_the_upstream_response_id_is_logged(stack: Stack) -> None:
    """``gen_ai.response.id`` is the id the upstream gave its answer (what an OpenAI SDK shows the user),
    from the JSON body and from a stream's chunks."""
    ids = {}
    with stack.client() as c:
        for stream in (False, True):
            rid = f"response-id-{'stream' if stream else 'json'}"
            resp = c.post(
                "/v1/chat/completions",
                json={"model": "fake-model", "messages": HI, "max_tokens": 2, "stream": stream},
                headers={"x-request-id": rid},
            )
            assert resp.status_code == 200
            chunks = [json.loads(e) for e in sse_events(resp.content)[:-1]] if stream else [resp.json()]
            assert len({chunk["id"] for chunk in chunks}) == 1
            ids[rid] = chunks[0]["id"]
    records = records_by_id(stack.log, list(ids))
    assert {rid: records[rid][0]["gen_ai"]["response"]["id"] for rid in ids} == ids
    assert all(i.startswith("chatcmpl-") for i in ids.values()) and len(set(ids.values())) == 2


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b'{"model": "fake-model", "messages": "hi"}', "messages"),
        (b'{"model": "fake-model"}', "messages"),
        (b'{"model": 5, "messages": []}', "model"),
        (b'{"model": "fake-model", "messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
        (b'{"model": "fake-model", "messages": [], "max_tokens": "4"}', "max_tokens"),
        (b'{"model": "fake-model", "messages": [], "max_tokens": 0}', "max_tokens"),
        (b'{"model": "fake-model", "messages": [], "temperature": 7}', "temperature"),
        (b'{"model": "fake-model", "messages": [], "stream": "yes"}', "stream"),
        (
            b'{"model": "fake-model", "messages": [{"role": "user", "content": "a\xff\xfeb"}]}',
            None,
        ),  # bad UTF-8
        (
            b'{"model": "fake-model", "messages": [], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            None,
        ),  # nesting
    ],
)
def test_malformed_bodies_are_openai_400s_logged_and_counted(
    stack: Stack, body: bytes, param: str | None
) -> None:
    """A3: 400 JSON with the OpenAI error body, never 500/plain text; log and counter under 400."""
    before = sample(
        metric_samples(stack.metrics()),
        "kvscope_gateway_requests_total",
        model="unknown",
        route="/v1/chat/completions",
        status="400",
    )
    before += sample(
        metric_samples(stack.metrics()),
        "kvscope_gateway_requests_total",
        model="fake-model",
        route="/v1/chat/completions",
        status="400",
    )
    rid = f"a3-{abs(hash(body))}"
    with stack.client() as c:
        resp = c.post(
            "/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json", "x-request-id": rid},
        )
    assert resp.status_code == 400 and resp.headers["content-type"] == "application/json"
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    record = records_by_id(stack.log, [rid])[rid]
    assert len(record) == 1 and record[0]["http"]["response"]["status_code"] == 400
    assert record[0]["error"]["type"] == error["code"] in ("invalid_json", "invalid_value")  # one vocabulary
    # the model the body named is logged even when another field is invalid (decodable bodies only)
    named = "fake-model" if b'"model": "fake-model"' in body and param is not None else None
    assert record[0]["gen_ai"]["request"]["model"] == named
    assert body.decode(errors="replace") not in json.dumps(record[0])
    samples = metric_samples(stack.metrics())
    after = sum(
        sample(samples, "kvscope_gateway_requests_total", model=m, route="/v1/chat/completions", status="400")
        for m in ("unknown", "fake-model")
    )
    assert after == before + 1


def test_wrong_method_unknown_path_and_big_body_are_openai_shaped(stack: Stack) -> None:
    with stack.client() as c:
        wrong = c.get("/v1/chat/completions")
        assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
        missing = c.get("/nope")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"
        big = c.post("/v1/chat/completions", content=b"x" * (8 * 1024 * 1024 + 1))
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
        assert "8388609 bytes" in big.json()["error"]["message"]
        chunked = c.post("/v1/chat/completions", content=iter([b"x" * 1024 * 1024] * 9))  # no Content-Length
        assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"
        root = c.post("/")
        assert root.status_code == 404 and root.json()["error"]["code"] == "not_found"
    assert httpx.post(stack.url + "/v1/chat/completions", json={}).status_code == 401


def test_unknown_models_map_to_one_label(stack: Stack) -> None:
    """A4: 1,000 random unknown names → 404 model_not_found, nothing generated, no new series."""
    before_requests = len(stack.fakes["main"].records)
    with stack.client() as c:
        c.post("/v1/chat/completions", json={"model": "warm-up-unknown", "messages": HI})
        series = len(metric_samples(stack.metrics()))
        for i in range(1000):
            resp = c.post(
                "/v1/chat/completions", json={"model": f"random-{i}-{time.time_ns()}", "messages": HI}
            )
            assert resp.status_code == 404
            assert resp.json()["error"] | {"message": ""} == {
                "message": "",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
    samples = metric_samples(stack.metrics())
    assert len(samples) == series
    assert (
        sample(
            samples,
            "kvscope_gateway_requests_total",
            model="unknown",
            route="/v1/chat/completions",
            status="404",
        )
        >= 1001
    )
    assert len(stack.fakes["main"].records) == before_requests


def test_context_length_is_checked_with_the_model_tokenizer(stack: Stack) -> None:
    """K1: L+100 prompt tokens, a short prompt with max_tokens L-3, and the first streamed: 400 before any
    upstream call, stating L, the prompt length and the requested tokens."""
    long_messages = [
        {"role": "user", "content": "hello " * (CONTEXT_LEN + 100 - 5)}
    ]  # template adds 5 tokens
    cases = [
        (
            {"messages": long_messages},
            f"maximum context length is {CONTEXT_LEN} tokens. However, your messages "
            f"resulted in {CONTEXT_LEN + 100} tokens",
        ),
        (
            {"messages": HI, "max_tokens": CONTEXT_LEN - 3},
            f"you requested {CONTEXT_LEN + 3} tokens (6 in the messages, {CONTEXT_LEN - 3} in the "
            "completion)",
        ),
        ({"messages": long_messages, "stream": True}, f"resulted in {CONTEXT_LEN + 100} tokens"),
    ]
    with stack.client() as c:
        for body, text in cases:
            resp = c.post("/v1/chat/completions", json={"model": "tok-model", **body})
            assert resp.status_code == 400 and resp.headers["content-type"] == "application/json"
            error = resp.json()["error"]
            assert text in error["message"], error["message"]
            assert (error["type"], error["param"], error["code"]) == (
                "invalid_request_error",
                "messages",
                "context_length_exceeded",
            )
        prompt = c.post(
            "/v1/completions", json={"model": "tok-model", "prompt": "hello " * 60, "max_tokens": 10}
        )
        assert (
            "you requested 71 tokens (61 in the prompt, 10 in the completion)"
            in prompt.json()["error"]["message"]
        )
        ok = c.post(
            "/v1/chat/completions", json={"model": "tok-model", "messages": HI, "max_tokens": CONTEXT_LEN - 6}
        )
        assert ok.status_code == 200
    assert [r.body["max_tokens"] for r in stack.fakes["tok"].records if r.method == "POST"] == [
        CONTEXT_LEN - 6
    ]


def test_tool_prompts_are_left_to_the_engine_to_count(stack: Stack) -> None:
    """The engine writes tool signatures and tool turns into the prompt (Hermes format): the gateway's plain
    template would undercount them, so it counts nothing (as without a tokenizer) and relays; without tools,
    or with tool_choice none, it counts as usual."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    cases = {
        "gw-tools": {"tools": [tool]},
        "gw-tools-none": {"tools": [tool], "tool_choice": "none"},
        "gw-tool-turn": {
            "messages": [
                *HI,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "42"},
            ]
        },
        "gw-plain": {},
    }
    with stack.client() as c:
        for rid, extra in cases.items():
            body = {"model": "tok-model", "messages": HI, "max_tokens": 4, **extra}
            assert c.post("/v1/chat/completions", json=body, headers={"x-request-id": rid}).status_code == 200
    records = records_by_id(stack.log, cases)
    counted = {rid: records[rid][0]["kvscope"]["prompt_tokens_counted"] for rid in cases}
    assert counted == {
        "gw-tools": None,
        "gw-tools-none": counted["gw-plain"],
        "gw-tool-turn": None,
        "gw-plain": counted["gw-plain"],
    }
    assert counted["gw-plain"] == 6


def test_per_key_models_and_max_tokens_ceiling(stack: Stack) -> None:
    with stack.client("limited") as c:
        over = c.post("/v1/chat/completions", json={"model": "fake-model", "messages": HI, "max_tokens": 11})
        assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"
        assert "above this API key's limit of 10" in over.json()["error"]["message"]
        default = c.post("/v1/chat/completions", json={"model": "fake-model", "messages": HI})
        assert default.json()["usage"]["completion_tokens"] == 10
        assert stack.fakes["main"].records[-1].body["max_tokens"] == 10
        denied = c.post("/v1/chat/completions", json={"model": "tok-model", "messages": HI})
        assert denied.status_code == 403 and denied.json()["error"]["code"] == "model_not_allowed"
    with sdk(stack, "limited") as limited, pytest.raises(openai.PermissionDeniedError):
        limited.chat.completions.create(model="tok-model", messages=HI)
    with (
        openai.OpenAI(base_url=stack.url + "/v1", api_key="sk-wrong", max_retries=0) as wrong,
        pytest.raises(openai.AuthenticationError),
    ):
        wrong.models.list()


def test_request_id_is_kept_or_generated_and_sent_upstream(stack: Stack) -> None:
    with stack.client() as c:
        kept = c.post(
            "/v1/chat/completions",
            json={"model": "fake-model", "messages": HI},
            headers={"x-request-id": "req-abc.1"},
        )
        assert kept.headers["x-request-id"] == "req-abc.1"
        assert stack.fakes["main"].records[-1].headers["x-request-id"] == "req-abc.1"
        fresh = c.post(
            "/v1/chat/completions",
            json={"model": "fake-model", "messages": HI},
            headers={"x-request-id": "bad id with spaces"},
        )
        rid = fresh.headers["x-request-id"]
        assert len(rid) == 32 and int(rid, 16) >= 0
        assert stack.fakes["main"].records[-1].headers["x-request-id"] == rid


def test_other_v1_paths_pass_through(stack: Stack) -> None:
    with stack.client() as c:
        emb = c.post("/v1/embeddings?x=1", json={"model": "fake-model", "input": "hi"})
        assert emb.json() == {
            "echo": "/v1/embeddings",
            "method": "POST",
            "body": {"model": "fake-model", "input": "hi"},
        }
        assert c.get("/v1/files").json()["echo"] == "/v1/files"
        assert c.post("/v1/embeddings", json={"model": "zzz", "input": "x"}).status_code == 404
    assert httpx.get(stack.url + "/v1/files").status_code == 401


def test_a_passed_through_upstream_error_fills_the_log_error_fields(stack: Stack) -> None:
    with stack.client() as c:
        missing = c.get("/v1/missing", headers={"x-request-id": "pt-404"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"  # relayed as sent
    [record] = records_by_id(stack.log, ["pt-404"])["pt-404"]
    assert record["http"]["response"]["status_code"] == 404
    assert record["error"] == {"type": "not_found", "message": "Unknown path /v1/missing."}


@pytest.mark.parametrize(
    "path", ["/v1/../metrics", "/v1/%2e%2e/health", "/v1/./files", "/v1//files", "/v1/files/../../tokenize"]
)
def test_passthrough_never_leaves_v1(stack: Stack, path: str) -> None:
    """Dot and empty segments (plain or percent-encoded) are refused before routing (gateway/target.py), so
    they never reach the upstream's private routes."""
    import http.client
    from urllib.parse import urlsplit

    url = urlsplit(stack.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    conn.request("GET", path, headers={"authorization": f"Bearer {KEYS['alice']}"})
    resp = conn.getresponse()
    body = json.loads(resp.read())
    conn.close()
    assert (resp.status, body["error"]["code"]) == (400, "invalid_request_target")
    assert "kvscope_" not in json.dumps(body)


def test_probes(stack: Stack) -> None:
    assert httpx.get(stack.url + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(stack.url + "/readyz", headers={"authorization": f"Bearer {KEYS['alice']}"})
    assert ready.status_code == 200
    assert ready.json()["models"] == {"tok-model": True, "fake-model": True, "broken-model": True}


def test_upstream_5xx_is_relayed_then_the_replica_is_ejected(own_stack: Stack) -> None:
    """Three consecutive 5xx (failure_threshold) eject the only replica of broken-model."""
    stack = own_stack
    with stack.client() as c:
        statuses = []
        for i in range(4):
            resp = c.post(
                "/v1/chat/completions",
                json={"model": "broken-model", "messages": HI},
                headers={"x-request-id": f"five-hundred-{i}"},
            )
            statuses.append(resp.status_code)
            if i == 0:
                assert resp.json()["error"]["message"] == "fake 500"
    assert statuses == [500, 500, 500, 503]
    record = records_by_id(stack.log, ["five-hundred-0"])["five-hundred-0"][0]
    assert record["kvscope"]["attempts"] == 1 and record["event"]["outcome"] == "failure"
    assert record["log"]["level"] == "error"
    samples = metric_samples(stack.metrics())
    label = stack.fakes["broken"].url.split("://")[1]
    series = {"upstream": label, "kind": "kvscope"}  # the fake's card says owned_by kvscope
    assert samples[("kvscope_gateway_upstream_up", tuple(sorted(series.items())))] == 0
    assert sample(samples, "kvscope_gateway_upstream_errors_total", **series, reason="status_5xx") == 3
    with stack.client() as c:
        assert c.get("/readyz").json()["models"]["broken-model"] is False


def test_huge_model_names_and_user_agents_are_clipped_in_errors_and_logs(stack: Stack) -> None:
    name, agent = (
        "m" * 200_000,
        "ua/" + "x" * 12_000,
    )  # the head stays under the 16 KiB limit (a 400 above it)
    with stack.client() as c:
        resp = c.post(
            "/v1/chat/completions",
            json={"model": name, "messages": HI},
            headers={"x-request-id": "huge-name", "user-agent": agent},
        )
    assert resp.status_code == 404
    message = resp.json()["error"]["message"]
    assert message == f"The model '{'m' * 256}…[+199744 chars]' does not exist or is not served here."
    [record] = records_by_id(stack.log, ["huge-name"])["huge-name"]
    assert record["gen_ai"]["request"]["model"] == "m" * 256 + "…[+199744 chars]"
    assert record["user_agent"]["original"] == agent[:1024] + f"…[+{len(agent) - 1024} chars]"
    assert record["error"]["message"] == message
    assert len(json.dumps(record)) < 8_000
