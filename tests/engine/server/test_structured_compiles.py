"""Serving case N2 through the HTTP server: ten concurrent requests with distinct 7,000-property schemas, one
``json_object`` request and one plain chat. The plain chat and the cached ``json_object`` request are answered
while the compiles still hold the compile thread (the spy keeps them there until the test opens its gate); the
ten are a 400 naming ``response_format`` (their grammars exceed the size limit); a full compile queue is a
429.

The scripted FakeEngine generates; the grammar compiler is the real one (engine/structured/backend.py) on
SmolLM2's tokenizer."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import kvscope.engine.server.generation as generation
from kvscope.engine.server.scheduling import TIMEOUT_HEADER
from kvscope.engine.structured.backend import StructuredOutputManager
from kvscope.engine.structured.batch import ERROR_PREFIX
from kvscope.engine.structured.params import CompileLimits
from tests.engine.server.conftest import chat_body
from tests.engine.server.fakes import FakeEngine
from tests.engine.server.helpers import metric_samples, parse_sse, sample
from tests.engine.structured.llguidance_spy import HOLD_MARKER

MARKER = HOLD_MARKER
CHAT = "/v1/chat/completions"
PROPERTIES = {f"p{i}": {"type": "string", "maxLength": 5} for i in range(7000)}


@pytest.fixture
def grammar_manager(tokenizer) -> StructuredOutputManager:
    return StructuredOutputManager(tokenizer.hf.to_str, 49152, tokenizer.eos_token_id)


@pytest.fixture
def fake_engine(grammar_manager) -> FakeEngine:
    engine = FakeEngine()
    engine.structured = grammar_manager  # what the server compiles with (EngineClient.structured)
    return engine


def _schema_body(i: int) -> dict:
    schema = {"title": f"{MARKER}-{i}", "type": "object", "properties": PROPERTIES}
    return chat_body(
        f"form {i}",
        max_tokens=4,
        response_format={"type": "json_schema", "json_schema": {"name": f"form{i}", "schema": schema}},
    )


def _until(condition) -> None:
    for _ in range(6000):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError("condition not reached in 60 s")


def test_plain_and_cached_requests_never_wait_for_grammar_compiles(client, grammar_manager, spy) -> None:
    json_object = chat_body("a cat", max_tokens=4, response_format={"type": "json_object"})
    assert (
        client.post(CHAT, json=json_object).status_code == 200
    )  # compiled and cached (and the tokenizer built)
    pool = ThreadPoolExecutor(12)
    try:
        schemas = [pool.submit(client.post, CHAT, json=_schema_body(i)) for i in range(10)]
        assert spy.entered.wait(60)
        _until(
            lambda: grammar_manager.num_pending == 10
        )  # one holds the compile thread, nine queue behind it
        quick = [
            pool.submit(client.post, CHAT, json=json_object),
            pool.submit(client.post, CHAT, json=chat_body()),
        ]
        answers = [future.result(timeout=60) for future in quick]
        assert [a.status_code for a in answers] == [200, 200]
        assert answers[1].json()["choices"][0]["message"]["content"] == "Hello world"
        assert not any(future.done() for future in schemas)  # answered before any of the ten compiles ended
        spy.open()
        refused = [future.result(timeout=120) for future in schemas]
    finally:
        spy.open()
        pool.shutdown(wait=True)
    for answer in refused:
        error = answer.json()["error"]
        assert (answer.status_code, error["param"], error["type"], error["message"]) == (
            400,
            "response_format",
            "invalid_request_error",
            "The json constraint is too large to compile: its "
            "grammar has more than 20000 symbols (the engine's --structured-output-max-grammar-size).",
        )
    assert (
        spy.compile_threads == ["grammar-compile_0"] * 11
    )  # the json_object and the ten, on their own thread


def test_a_full_compile_queue_is_a_429(client, grammar_manager, spy) -> None:
    grammar_manager.set_limits(CompileLimits(max_pending=1))
    pool = ThreadPoolExecutor(1)
    try:
        held = pool.submit(client.post, CHAT, json=_schema_body(0))
        assert spy.entered.wait(60)
        busy = client.post(CHAT, json=_schema_body(1))
        spy.open()
        assert held.result(timeout=120).status_code == 400
    finally:
        spy.open()
        pool.shutdown(wait=True)
    error = busy.json()["error"]
    assert (busy.status_code, busy.headers["retry-after"], error["code"], error["type"]) == (
        429,
        "1",
        "grammar_compile_busy",
        "rate_limit_error",
    )
    assert error["message"] == (
        "Too many new grammars are compiling: 1 new grammars are already waiting to compile "
        "(limit 1); retry later."
    )


def test_a_deadline_that_passes_while_the_grammar_compiles_is_a_504_at_once(
    client, grammar_manager, spy
) -> None:
    """``x-kvscope-timeout`` bounds the wait for the grammar too (break-it: a 1 s deadline behind 20 queued
    compiles waited 6.7 s for its 504): past it the request is answered 504 ``deadline_exceeded`` while the
    compile is still held, counted as shed for ``deadline``, and never queued."""
    before = metric_samples(client.get("/metrics").text)
    try:
        late = client.post(CHAT, json=_schema_body(0), headers={TIMEOUT_HEADER: "0.3"})
        compiling = (
            grammar_manager.num_pending
        )  # its compile (held by the spy) had not ended when it answered
    finally:
        spy.open()
    after = metric_samples(client.get("/metrics").text)
    assert (late.status_code, late.json()["error"]["code"], compiling) == (504, "deadline_exceeded", 1)
    shed = "kvscope_engine_requests_shed_total"
    labels = {"model": "fake-model", "tier": "default", "reason": "deadline"}
    assert sample(after, shed, **labels) - sample(before, shed, **labels) == 1


GRAMMAR_LIMIT = ERROR_PREFIX + "Parser Error: Current row has 2007 items; max is 2000"


def test_a_matcher_limit_mid_answer_is_the_clients_400_never_an_engine_5xx(client, monkeypatch) -> None:
    """The grammar matcher failing while generating (AsyncEngine's GrammarLimitError, injected here after
    two tokens) is the client's constraint beyond llguidance's limits: a 400 naming ``response_format``, an
    in-band ``invalid_request_error`` when streamed (no [DONE]); the engine counts no 5xx (the gateway
    ejects a replica on 5xx) and no broken stream. Before: a 500 ``request_failed``."""
    monkeypatch.setattr(generation, "FAULT_REASON", GRAMMAR_LIMIT)
    body = chat_body("Give JSON.", max_tokens=10, response_format={"type": "json_object"})
    fault = {"x-kvscope-fault": "after_tokens=2"}
    before = metric_samples(client.get("/metrics").text)
    answer = client.post(CHAT, json=body, headers=fault)
    message = (
        "The json_object constraint exceeded the grammar matcher's limits while generating: Parser Error: "
        "Current row has 2007 items; max is 2000"
    )
    assert answer.status_code == 400
    assert answer.json()["error"] == {
        "message": message,
        "type": "invalid_request_error",
        "param": "response_format",
        "code": "invalid_value",
    }
    streamed = client.post(CHAT, json={**body, "stream": True}, headers=fault)
    events = parse_sse(streamed.text)
    assert streamed.status_code == 200 and "[DONE]" not in events.data
    assert events.data[-1] == {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": "response_format",
            "code": "invalid_value",
        }
    }
    after = metric_samples(client.get("/metrics").text)
    http = "kvscope_engine_http_requests_total"
    assert sample(after, http, route=CHAT, status="400") - sample(before, http, route=CHAT, status="400") == 1
    assert sample(after, http, route=CHAT, status="500") == sample(before, http, route=CHAT, status="500")
    broken = {k: v for k, v in after.items() if k[0] == "kvscope_engine_stream_errors_total"}
    assert broken == {k: v for k, v in before.items() if k[0] == "kvscope_engine_stream_errors_total"}
