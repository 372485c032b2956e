"""Structured output and tool calling through the gateway in front of a real engine server, with the official
OpenAI SDK (issue 14's "done when"). The gateway relays the new fields and answers unchanged.

Every sampled answer (temperature 0.8, several seeds) must validate with ``jsonschema``; requests run
concurrently so the engine batches them (constrained and unconstrained rows in the same steps).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI
from openai.lib._pydantic import to_strict_json_schema  # what parse() sends for a Pydantic model

from tests.e2e.gateway_engine_support import start_stack
from tests.e2e.structured_schemas import SCHEMAS
from tests.engine.server.e2e_support import delta

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]
MODEL = "smollm2-135m"
SEEDS = (11, 12, 13)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city", "unit"],
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time of a time zone",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["zone"],
            "properties": {"zone": {"type": "string", "pattern": "^[A-Z][a-z]{2,8}$"}},
        },
    },
}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris and the time in Tokyo?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    running = start_stack(
        tmp_path_factory.mktemp("structured"),
        "--max-model-len",
        "2048",
        "--kv-cache-memory",
        "256M",
        "--max-num-seqs",
        "64",
        "--num-threads",
        "2",
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def engine(stack):
    return stack.engine


@pytest.fixture(scope="module")
def client(stack):
    with OpenAI(base_url=f"{stack.url}/v1", api_key="unused", timeout=240, max_retries=0) as sdk:
        yield sdk


def _parallel(fn, items):
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(fn, items))


def test_parse_ten_schemas_at_temperature_is_always_valid(engine, client):
    before = engine.metrics()

    def parse(job):
        model, seed = job
        return model, client.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": f"Give me a {model.__name__} as JSON."}],
            response_format=model,
            temperature=0.8,
            seed=seed,
            max_tokens=160,
        )

    results = _parallel(parse, [(m, s) for m in SCHEMAS for s in SEEDS])
    assert len(results) == 30
    for model, completion in results:
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, model)
        jsonschema.validate(json.loads(choice.message.content), model.model_json_schema())
    after = engine.metrics()
    assert (
        delta(before, after, "kvscope_engine_structured_output_requests_total", model=MODEL, kind="json")
        == 30
    )
    assert delta(before, after, "kvscope_engine_structured_output_compile_seconds_count", model=MODEL) == 10
    assert delta(before, after, "kvscope_engine_structured_output_mask_seconds_count", model=MODEL) > 0


def test_streamed_json_concatenates_to_the_same_valid_answer(client):
    def both(model):
        kwargs = dict(
            model=MODEL,
            messages=[{"role": "user", "content": f"A {model.__name__}, as JSON."}],
            temperature=0.8,
            seed=5,
            max_tokens=160,
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": model.__name__,
                    "schema": to_strict_json_schema(model),
                    "strict": True,
                },
            },
        )
        whole = client.chat.completions.create(**kwargs).choices[0].message.content
        parts = [
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(**kwargs, stream=True)
            if c.choices
        ]
        return model, whole, "".join(parts)

    for model, whole, streamed in _parallel(both, SCHEMAS[:3]):
        assert streamed == whole
        jsonschema.validate(json.loads(streamed), model.model_json_schema())


def test_json_object_and_kvscope_kind(engine):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "A JSON object about a cat."}],
        "response_format": {"type": "json_object"},
        "temperature": 0.8,
        "seed": 3,
        "max_tokens": 6,
    }
    answer = httpx.post(f"{engine.url}/v1/chat/completions", json=body, timeout=240).json()  # engine direct
    assert answer["choices"][0]["message"]["content"][0] == "{"  # a 135M model's free JSON object runs long
    assert answer["kvscope"]["structured_output"] == "json_object"


def test_the_wait_for_a_new_grammar_is_logged_and_explained(stack, engine):
    """A new grammar's compile happens on the engine's server before the request reaches the engine's queue:
    the gateway's log line carries it as ``kvscope.engine.structured_compile_s`` (at least the compile the
    engine's histogram observed; 0.0 for the same grammar again, now cached) and ``kvscope logs why`` ranks
    it as ``grammar compile``, not as upstream transfer."""
    from kvscope.gateway.logs.why import explain

    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "A code."}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "code", "schema": {"type": "string", "pattern": "^K[0-9]{3}-why$"}},
        },
        "temperature": 0,
        "max_tokens": 12,
    }
    lines = []
    with stack.client() as http:
        for attempt in ("first", "again"):
            before = engine.metrics()
            request_id = f"compile-wait-{attempt}"
            answer = http.post("/v1/chat/completions", json=body, headers={"x-request-id": request_id})
            assert answer.status_code == 200, answer.text
            compiled = engine.metrics()
            lines.append((stack.gateway_line(request_id), before, compiled))
    (first, before, after), (again, _, _) = lines
    compile_s = first["kvscope"]["engine"]["structured_compile_s"]
    assert delta(before, after, "kvscope_engine_structured_output_compile_seconds_count", model=MODEL) == 1
    assert compile_s >= delta(
        before, after, "kvscope_engine_structured_output_compile_seconds_sum", model=MODEL
    )
    assert again["kvscope"]["engine"]["structured_compile_s"] == 0.0
    causes = dict(explain(first).causes)
    assert causes["grammar compile"] == compile_s
    assert f"grammar compile {compile_s:.3f} s before the engine's queue" in explain(first).text.splitlines()


def test_regex_and_choice_hold_on_100_samples_each(client):
    regex = r"[A-Z][0-9]{3}-[a-z]{2}"
    regex_out = client.completions.create(
        model=MODEL,
        prompt="Ticket id:",
        n=100,
        temperature=1.0,
        seed=1,
        max_tokens=12,
        extra_body={"structured_outputs": {"regex": regex}},
    )
    options = ["yes", "no", "maybe"]
    choice_out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is the sky green?"}],
        n=100,
        temperature=1.0,
        seed=2,
        max_tokens=8,
        extra_body={"guided_choice": options},
    )
    assert len(regex_out.choices) == len(choice_out.choices) == 100
    assert all(re.fullmatch(regex, c.text) and c.finish_reason == "stop" for c in regex_out.choices)
    assert all(c.message.content in options and c.finish_reason == "stop" for c in choice_out.choices)


@pytest.mark.parametrize(("extra", "param", "fragment"), [
    ({"guided_grammar": "start: foo |"}, "guided_grammar", 'unknown name: "foo"'),
    ({"structured_outputs": {"regex": "[a-z"}}, "structured_outputs", "unclosed character class"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "if": {"type": "string"}}}}}, "response_format", 'Unimplemented keys: ["if"]'),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice",
     "Only one structured-output constraint"),
])  # fmt: skip
def test_bad_constraints_are_400_naming_the_field(client, extra, param, fragment):
    with pytest.raises(BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=extra)
    error = caught.value.body
    assert (caught.value.status_code, error["param"], error["type"]) == (400, param, "invalid_request_error")
    assert fragment in error["message"]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_tool_calls_validate(client, tool_choice):
    def call(seed):
        return client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice=tool_choice,
            temperature=0.8,
            seed=seed,
            max_tokens=80,
        )

    for completion in _parallel(call, range(6)):
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None and len(choice.message.tool_calls) >= 1
        for tool_call in choice.message.tool_calls:
            assert tool_call.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", tool_call.id)
            if isinstance(tool_choice, dict):
                assert tool_call.function.name == "get_time"
            jsonschema.validate(json.loads(tool_call.function.arguments), PARAMETERS[tool_call.function.name])


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streamed_tool_call_reassembles_to_the_non_streamed_one(stack, client, tool_choice):
    kwargs = dict(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        temperature=0.8,
        seed=7,
        max_tokens=80,
    )
    rid = f"tools-{'required' if tool_choice == 'required' else 'named'}"
    whole = client.chat.completions.create(**kwargs, extra_headers={"x-request-id": rid}).choices[0]
    assert stack.gateway_line(rid)["gen_ai"]["response"]["finish_reasons"] == ["tool_calls"]
    calls: dict[int, dict] = {}
    fragments: dict[int, int] = {}
    finish = []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            finish.append(choice.finish_reason)
            for part in choice.delta.tool_calls or ():
                entry = calls.setdefault(
                    part.index,
                    {"id": part.id, "type": part.type, "name": part.function.name, "arguments": ""},
                )
                entry["arguments"] += part.function.arguments or ""
                fragments[part.index] = fragments.get(part.index, 0) + bool(part.function.arguments)
    assert [f for f in finish if f] == ["tool_calls"]
    assert all(n > 1 for n in fragments.values()), fragments  # arguments stream as written, not in one piece
    expected = [
        {"type": "function", "name": c.function.name, "arguments": c.function.arguments}
        for c in whole.message.tool_calls
    ]
    assert [{k: v for k, v in c.items() if k != "id"} for c in calls.values()] == expected
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c["id"]) for c in calls.values())


OPEN_SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer"},
            "height_m": {"type": "number"},
        },
        "required": ["name", "age", "height_m"],
    },
    "order": {
        "type": "object",
        "properties": {
            "item": {"type": "string", "maxLength": 16},
            "quantity": {"type": "integer"},
            "price": {"type": "number"},
            "shipping": {
                "type": "object",
                "properties": {"days": {"type": "integer"}, "cost": {"type": "number"}},
                "required": ["days", "cost"],
            },
        },
        "required": ["item", "quantity", "price", "shipping"],
    },
    "point": {
        "type": "object",
        "properties": {"x": {"type": "number"}, "y": {"type": "number"}, "z": {"type": "number"}},
        "required": ["x", "y", "z"],
    },
}
"""Open schemas (issue 45): no ``additionalProperties``, numbers without a range or ``multipleOf``. Strings
keep a ``maxLength``: kvscope bounds objects and numbers, not strings (nor do vLLM or llama.cpp)."""
OPEN_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "days": {"type": "integer"},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "days"],
        },
    },
}
OPEN_TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time at a place",
        "parameters": {
            "type": "object",
            "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
            "required": ["lat", "lon"],
        },
    },
}
OPEN_PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (OPEN_WEATHER, OPEN_TIME)}


def test_open_schemas_at_temperature_end_with_stop(client):
    """Before the bounds, an open object took invented keys and a number took digits until max_tokens
    (``finish_reason: "length"``, JSON that does not parse). Every sampled answer now ends."""

    def create(job):
        name, seed = job
        return name, client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Give me a {name} as JSON."}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": name, "schema": OPEN_SCHEMAS[name]},
            },
            temperature=0.8,
            seed=seed,
            max_tokens=160,
        )

    results = _parallel(create, [(name, seed) for name in OPEN_SCHEMAS for seed in range(6)])
    assert [c.choices[0].finish_reason for _, c in results] == ["stop"] * 18
    for name, completion in results:
        jsonschema.validate(json.loads(completion.choices[0].message.content), OPEN_SCHEMAS[name])


@pytest.mark.parametrize(("tool_choice", "parallel", "most"), [
    ("required", None, 1),
    ("required", False, 1),
    ("required", True, 8),
    ({"type": "function", "function": {"name": "get_time"}}, None, 1),
])  # fmt: skip
def test_tool_calls_on_open_parameters_end_with_tool_calls(client, tool_choice, parallel, most):
    """``required`` makes one call unless ``parallel_tool_calls: true``, then at most 8 (one seed's model
    calls until the cap); the arguments are open objects with unbounded numbers; ``content`` is null."""

    def call(seed):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        return client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "The weather in Paris for 3 days, and the time in Tokyo?"}],
            tools=[OPEN_WEATHER, OPEN_TIME],
            tool_choice=tool_choice,
            temperature=0.8,
            seed=seed,
            max_tokens=300,
            **extra,
        )

    choices = [completion.choices[0] for completion in _parallel(call, range(6))]
    assert [c.finish_reason for c in choices] == ["tool_calls"] * 6
    assert all(c.message.content is None and 1 <= len(c.message.tool_calls or ()) <= most for c in choices)
    for choice in choices:
        for tool_call in choice.message.tool_calls or ():
            arguments = json.loads(tool_call.function.arguments)
            jsonschema.validate(arguments, OPEN_PARAMETERS[tool_call.function.name])
            assert set(arguments) <= set(OPEN_PARAMETERS[tool_call.function.name]["properties"])
    if most > 1:
        assert max(len(c.message.tool_calls or ()) for c in choices) > 1


def test_tool_choice_none_and_tool_history_answer_text(client):
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris","unit":"c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    for messages, choice in ((ASK, "none"), (history, "auto")):
        completion = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=[WEATHER, TIME],
            tool_choice=choice,
            temperature=0,
            max_tokens=12,
        )
        answer = completion.choices[0]
        assert answer.message.tool_calls is None
        assert answer.finish_reason in ("stop", "length") and isinstance(answer.message.content, str)


def test_unknown_named_tool_is_400(client):
    with pytest.raises(BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER],
            max_tokens=4,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert (caught.value.status_code, caught.value.body["param"]) == (400, "tool_choice")


ANY_OF_3000 = {
    "anyOf": [
        {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
        for i in range(3000)
    ]
}
SELF_REFERENCE = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
SELF_REF_TOOL = {"type": "function", "function": {"name": "loop", "parameters": {"$ref": "#"}}}


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "wide", "schema": ANY_OF_3000}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "loop", "schema": SELF_REFERENCE}}},
     "response_format"),
    ({"tools": [SELF_REF_TOOL], "tool_choice": "required"}, "tools"),
])  # fmt: skip
def test_schemas_the_matcher_cannot_serve_are_400_at_admission(client, extra, param):
    """Serving case N2: these answered ``{"`` or ``[`` with finish_reason stop (invalid JSON) before."""
    with pytest.raises(BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, extra_body=extra)
    error = caught.value.body
    assert (caught.value.status_code, error["param"], error["type"]) == (400, param, "invalid_request_error")
    assert error["message"].startswith("The json constraint ") and "\n" not in error["message"]


def test_a_matcher_error_mid_answer_is_an_error_never_a_stop(engine):
    """An integer or a self-nesting object: admission passes, the answer ``{"`` (logit_bias) breaks
    llguidance's item limit at the next token: the client's grammar beyond the matcher's limits. JSON: a
    400 naming response_format and the cause; stream: an in-band invalid_request_error event and no [DONE]
    (serving case S3), never finish_reason stop on invalid JSON."""
    schema = {
        "anyOf": [
            {"type": "integer"},
            {"type": "object", "properties": {"a": {"$ref": "#/anyOf/1"}}, "required": ["a"]},
        ]
    }
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "A JSON value:"}],
        "temperature": 0,
        "max_tokens": 10,
        "logit_bias": {"39428": 100},  # 39428 = '{"' in SmolLM2's vocabulary
        "response_format": {"type": "json_schema", "json_schema": {"name": "nest", "schema": schema}},
    }
    error = {
        "message": "The json constraint exceeded the grammar matcher's limits while generating: parser "
        "error: Too many items (limit 50000; ff_tokens); try avoiding single-byte/short lexemes",
        "type": "invalid_request_error",
        "param": "response_format",
        "code": "invalid_value",
    }
    answer = httpx.post(f"{engine.url}/v1/chat/completions", json=body, timeout=240)
    assert (answer.status_code, answer.json()["error"]) == (400, error)
    with httpx.stream(
        "POST", f"{engine.url}/v1/chat/completions", json={**body, "stream": True}, timeout=240
    ) as streamed:
        events = [line.removeprefix("data: ") for line in streamed.iter_lines() if line.startswith("data: ")]
    assert "[DONE]" not in events
    chunks = [json.loads(event) for event in events]
    assert chunks[-1]["error"] == error
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1]) == '{"'
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
