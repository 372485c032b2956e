"""engine/server/tool_stream.py: the incremental tool-call scanner behind streamed ``required``/``auto``."""

from __future__ import annotations

import json
import random

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from kvscope.engine.server.tool_stream import Arguments, CallEnd, CallStart, Content, ToolCallScanner, scan
from kvscope.engine.server.tools import ParsedCall, ToolMode, parse_tool_calls
from kvscope.engine.structured.backend import StructuredOutputManager
from tests.engine.server.conftest import chat_body
from tests.engine.server.fakes import FakeEngine, FakeInfo
from tests.engine.server.helpers import parse_sse

TRICKY = {"q": 'a "quoted" {brace} [bracket] \\ back', "city": "Zürich ☃", "n": [1, {"deep": "}"}], "e": {}}
REQUIRED_TWO = (
    '[{"name": "get_weather", "arguments": '
    + json.dumps(TRICKY, ensure_ascii=False)
    + '}, {"name": "get_time", "arguments": {"tz": "UTC"}}]'
)
AUTO = (
    'Let me check {that}.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris '
    '\\"<tool_call>\\""}}'
    "\n</tool_call>\nDone < soon."
)


def _chunked(text: str, seed: int) -> list[str]:
    rng, pieces, at = random.Random(seed), [], 0
    while at < len(text):
        step = rng.randint(1, 5)
        pieces.append(text[at : at + step])
        at += step
    return pieces


def _run(mode: str, pieces: list[str]) -> list:
    scanner, events = ToolCallScanner(mode), []
    for piece in pieces:
        events += scanner.feed(piece)
    return events + scanner.finish()


def _reassembled(events: list) -> tuple[list[tuple[str, str]], str, list[int]]:
    """(calls, content, call ends) from events, checking the order an OpenAI client relies on."""
    names, args, content, ends = [], [], "", []
    for event in events:
        if isinstance(event, CallStart):
            assert event.index == len(names)
            names.append(event.name)
            args.append("")
        elif isinstance(event, Arguments):
            assert event.index == len(names) - 1 and event.index not in ends
            args[event.index] += event.text
        elif isinstance(event, CallEnd):
            ends.append(event.index)
        else:
            content += event.text
    return list(zip(names, args, strict=True)), content, ends


@pytest.mark.parametrize(
    ("mode", "text", "calls", "content"),
    [
        (
            "required",
            REQUIRED_TWO,
            [("get_weather", json.dumps(TRICKY, ensure_ascii=False)), ("get_time", '{"tz": "UTC"}')],
            "",
        ),
        (
            "auto",
            AUTO,
            [("get_weather", '{"city": "Paris \\"<tool_call>\\""}')],
            "Let me check {that}.Done < soon.",
        ),
        (
            "auto",
            "a <tool_c b <tool_call>x</tool_call> <tool_call",
            [],
            "a <tool_c b <tool_call>x</tool_call> <tool_call",
        ),
        (
            "auto",
            '<tool_call>{"arguments": {"a": 1}, "name": "late"}</tool_call>',
            [("late", '{"a": 1}')],
            "",
        ),
        ("auto", '<tool_call>{"name": "f"}</tool_call>ok', [("f", "{}")], "ok"),
        (
            "auto",
            '<tool_call>{"name": "f", "arguments": "{\\"s\\": 1}"}</tool_call>',
            [("f", '{"s": 1}')],
            "",
        ),
        (
            "auto",
            '<tool_call>{"arguments": {}}</tool_call> plain',
            [],
            '<tool_call>{"arguments": {}}</tool_call> plain',
        ),
    ],
)
def test_every_chunking_gives_the_same_events_and_calls(mode, text, calls, content) -> None:
    whole = _run(mode, [text])
    assert _reassembled(whole) == (calls, content, list(range(len(calls))))
    for seed in range(200):
        events = _run(mode, _chunked(text, seed))
        assert _reassembled(events) == (calls, content, list(range(len(calls))))
    assert scan(mode, text) == (calls, content)


def test_arguments_stream_piece_by_piece_and_end_at_the_closing_brace() -> None:
    scanner = ToolCallScanner("required")
    assert scanner.feed('[{"name": "get_we') == []
    assert scanner.feed('ather", "argu') == [CallStart(0, "get_weather")]
    assert scanner.feed('ments": {"city": "Pa') == [Arguments(0, '{"city": "Pa')]
    assert scanner.feed('ris"}}, {"name": "g", "arguments": {}}]') == [
        Arguments(0, 'ris"}'),
        CallEnd(0),
        CallStart(1, "g"),
        Arguments(1, "{}"),
        CallEnd(1),
    ]
    assert scanner.finish() == []


def test_auto_streams_text_and_holds_only_a_tag_prefix() -> None:
    scanner = ToolCallScanner("auto")
    assert scanner.feed("Hi there <tool") == [Content("Hi there")]
    assert scanner.feed("box> ok  ") == [Content(" <toolbox> ok")]
    assert scanner.feed("\n<tool_call>\n") == []
    assert scanner.feed('{"name": "f", "arguments": {"a": "<"}}\n</tool_call>  \nbye') == [
        CallStart(0, "f"),
        Arguments(0, '{"a": "<"}'),
        CallEnd(0),
        Content("bye"),
    ]
    assert scanner.finish() == []
    unfinished = ToolCallScanner("auto")
    assert unfinished.feed('x <tool_call> {"na') == [Content("x")]
    assert unfinished.finish() == [Content(' <tool_call> {"na')]


def test_parse_tool_calls_keeps_the_models_own_arguments_text() -> None:
    assert parse_tool_calls(ToolMode("required"), REQUIRED_TWO) == (
        [
            ParsedCall("get_weather", json.dumps(TRICKY, ensure_ascii=False)),
            ParsedCall("get_time", '{"tz": "UTC"}'),
        ],
        None,
    )
    assert parse_tool_calls(ToolMode("auto"), AUTO) == (
        [ParsedCall("get_weather", '{"city": "Paris \\"<tool_call>\\""}')],
        "Let me check {that}.Done < soon.",
    )
    assert parse_tool_calls(ToolMode("required"), '[{"name": "f", "arguments": {"a": ') is None


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture
def fake_engine() -> FakeEngine:
    """The Hermes tool prompt is ~1000 byte-tokens: a context that holds it."""
    return FakeEngine(info=FakeInfo(max_model_len=4096))


HERMES_REPLY = (
    'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich {x}"}}\n</tool_call>'
)


def test_auto_streams_through_the_server_and_reassembles_to_the_json_answer(client, fake_engine) -> None:
    """The FakeEngine writes the Hermes answer one byte per token: content first, then the call
    incrementally."""
    fake_engine.reply = HERMES_REPLY.encode()
    body = chat_body(max_tokens=120, tools=[WEATHER])
    whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    assert whole["message"]["content"] == "Sure."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]] == [
        ("get_weather", '{"city": "Zürich {x}"}')
    ]
    stream = parse_sse(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    deltas = [c["choices"][0]["delta"] for c in stream.chunks]
    content = "".join(d.get("content") or "" for d in deltas)
    parts = [p for d in deltas for p in d.get("tool_calls") or ()]
    assert content == "Sure."
    assert parts[0]["index"] == 0 and parts[0]["type"] == "function" and parts[0]["id"].startswith("call_")
    assert parts[0]["function"] == {"name": "get_weather", "arguments": ""}
    fragments = [p["function"]["arguments"] for p in parts[1:]]
    assert "".join(fragments) == whole["message"]["tool_calls"][0]["function"]["arguments"]
    assert len(fragments) > 10  # one per token (UTF-8 bytes of "ü" held together by the detokenizer)
    assert [c["choices"][0]["finish_reason"] for c in stream.chunks if c["choices"][0]["finish_reason"]] == [
        "tool_calls"
    ]


def test_auto_without_a_call_streams_the_whole_text_as_content(client, fake_engine) -> None:
    fake_engine.reply = b"a <tool_call b"
    body = chat_body(max_tokens=40, tools=[WEATHER])
    stream = parse_sse(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    deltas = [c["choices"][0]["delta"] for c in stream.chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "a <tool_call b"
    assert all("tool_calls" not in d for d in deltas)
    assert stream.chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(("tool_choice", "reply"), [
    ("required", '[{"name":"get_weather","arguments":{"city":"Paris"}}]'),
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city":"Paris"}'),
])  # fmt: skip
def test_a_call_answer_has_content_null_in_the_body_and_in_the_streams_role_delta(
    client, fake_engine, tokenizer, tool_choice, reply
) -> None:
    """OpenAI sends ``content: null`` beside tool calls. A stream's role delta with ``content: ""`` made the
    SDK's accumulated message (``.stream()``'s final completion) end with ``""``; null stays null."""
    fake_engine.structured = StructuredOutputManager(tokenizer.hf.to_str, 49152, tokenizer.eos_token_id)
    fake_engine.reply = reply.encode()
    body = chat_body(max_tokens=120, tools=[WEATHER], tool_choice=tool_choice)
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("get_weather", '{"city":"Paris"}')
    ]
    stream = parse_sse(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    assert stream.chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    state = ChatCompletionStreamState()
    for chunk in stream.chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    final = state.get_final_completion().choices[0]
    assert (final.finish_reason, final.message.content) == ("tool_calls", None)
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls or ()] == [
        ("get_weather", '{"city":"Paris"}')
    ]
