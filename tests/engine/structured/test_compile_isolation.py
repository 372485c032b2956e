"""Grammar compiles never stall other requests (serving case N2, engine/structured/backend.py): the cache
is read before anything waits, concurrent requests for one grammar share one compile, the compile queue is
bounded, oversized grammars and grammars the matcher cannot serve are refused at admission, errors are one
line."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import msgspec
import pytest

import kvscope.engine.structured.backend as backend
from kvscope.engine.errors import InvalidParameterError
from kvscope.engine.server.protocol import ChatCompletionRequest
from kvscope.engine.server.tools import tool_constraint, tool_mode
from kvscope.engine.structured.backend import CompileBusyError, StructuredOutputManager
from kvscope.engine.structured.params import CompileLimits, StructuredOutputsParams
from tests.engine.structured.llguidance_spy import HOLD_MARKER

VOCAB = 49152
MARKER = HOLD_MARKER


@pytest.fixture(scope="module")
def grammar_tokenizer(tokenizer):
    return StructuredOutputManager(tokenizer.hf.to_str, VOCAB, tokenizer.eos_token_id).tokenizer


def _manager(tokenizer, grammar_tokenizer, limits: CompileLimits | None = None) -> StructuredOutputManager:
    manager = StructuredOutputManager(tokenizer.hf.to_str, VOCAB, tokenizer.eos_token_id, limits=limits)
    manager._tokenizer = grammar_tokenizer  # the LLTokenizer takes ~0.3 s to build: share it between tests
    return manager


def _held(i: int = 0, param: str = "response_format") -> StructuredOutputsParams:
    """A small schema whose compile the spy holds until the test opens the gate."""
    return StructuredOutputsParams.json_schema(
        {"title": f"{MARKER}-{i}", "type": "object", "properties": {"a": {"type": "integer"}}}, param
    )


def _json_object() -> StructuredOutputsParams:
    return StructuredOutputsParams("json_object", "", "response_format")


def _start(fn, *args) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run() -> None:
        try:
            result["value"] = fn(*args)
        except Exception as exc:  # noqa: BLE001 - handed to the test
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def _until(condition) -> None:
    """Wait (up to 60 s) for ``condition()``, which another thread makes true."""
    for _ in range(6000):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError("condition not reached in 60 s")


def test_a_cached_grammar_answers_while_another_grammar_compiles(tokenizer, grammar_tokenizer, spy) -> None:
    manager = _manager(tokenizer, grammar_tokenizer)
    assert manager.compile(_json_object()) > 0
    slow, _ = _start(manager.compile, _held())
    assert spy.entered.wait(60)
    cached, result = _start(manager.compile, _json_object())  # a new request object, the same grammar
    cached.join(60)
    assert result == {"value": 0.0} and not spy.opened.is_set()  # done before the compile
    spy.open()
    slow.join(60)
    assert spy.compile_threads == ["grammar-compile_0", "grammar-compile_0"]


def test_concurrent_requests_for_one_grammar_share_one_compile(tokenizer, grammar_tokenizer, spy) -> None:
    manager = _manager(tokenizer, grammar_tokenizer)
    requests = [_held(param=p) for p in ("response_format", "guided_json", "structured_outputs")]
    threads = [_start(manager.compile, params) for params in requests]
    assert spy.entered.wait(60)
    assert manager.num_pending == 1
    spy.open()
    for thread, _ in threads:
        thread.join(60)
    seconds = sorted(result["value"] for _, result in threads)
    assert seconds[:2] == [0.0, 0.0] and seconds[2] > 0  # the one that queued it observes the compile time
    assert manager.num_compiles == 1 and len(spy.compile_threads) == 1
    assert len({id(params.pin.grammar) for params in requests}) == 1  # each request holds the same grammar


def test_a_running_compile_is_pending_before_its_submitter_resumes(
    tokenizer, grammar_tokenizer, spy, monkeypatch
) -> None:
    # The interleaving of a loaded machine, forced: the submitting thread is paused right after handing the
    # job to the compile thread (the compile is running) and before it records the job as in flight. A reader
    # of num_pending must still see it (it waits for the submitter), never 0 while a compile runs.
    read = threading.Event()

    class PausedAfterSubmit(backend.ThreadPoolExecutor):
        def submit(self, fn, /, *args, **kwargs):
            future = super().submit(fn, *args, **kwargs)
            assert spy.entered.wait(60)
            read.wait(2)  # a reader that does not wait for the submitter reads now; one that waits, after 2 s
            return future

    monkeypatch.setattr(backend, "ThreadPoolExecutor", PausedAfterSubmit)
    manager = _manager(tokenizer, grammar_tokenizer)
    thread, result = _start(manager.compile, _held())
    assert spy.entered.wait(60)
    pending = manager.num_pending
    read.set()
    assert pending == 1
    spy.open()
    thread.join(60)
    assert result["value"] > 0 and manager.num_pending == 0


def test_new_grammars_beyond_the_pending_limit_are_refused_at_once(tokenizer, grammar_tokenizer, spy) -> None:
    manager = _manager(tokenizer, grammar_tokenizer, CompileLimits(max_pending=2))
    first, second = _start(manager.compile, _held(1)), _start(manager.compile, _held(2))
    assert spy.entered.wait(60)
    _until(lambda: manager.num_pending == 2)
    with pytest.raises(CompileBusyError, match=r"2 new grammars are already waiting to compile \(limit 2\)"):
        manager.compile(_held(3))
    joiner = _start(manager.compile, _held(2, "guided_json"))  # the same grammar as a pending one: shares it
    spy.open()
    for thread, _ in (first, second, joiner):
        thread.join(60)
    assert joiner[1]["value"] == 0.0 and manager.num_pending == 0


async def test_a_cancelled_wait_leaves_the_shared_compile_to_the_others(tokenizer, grammar_tokenizer, spy):
    manager = _manager(tokenizer, grammar_tokenizer)
    leaving, staying = _held(param="response_format"), _held(param="guided_json")
    left = asyncio.create_task(manager.acquire_async(leaving))
    stays = asyncio.create_task(manager.acquire_async(staying))
    await asyncio.to_thread(spy.entered.wait, 60)
    left.cancel()
    spy.open()
    assert (await stays).compile_s >= 0.0 and staying.pin.grammar is not None
    assert left.cancelled() and manager.num_compiles == 1


SEVEN_THOUSAND = {
    "type": "object",
    "properties": {f"p{i}": {"type": "string", "maxLength": 5} for i in range(7000)},
}


def test_a_grammar_above_the_size_limit_is_a_400_and_its_refusal_is_cached(
    tokenizer, grammar_tokenizer, spy
) -> None:
    """The probe's schema: 7,000 optional string properties took 4.4 s to compile (56k grammar symbols)."""
    manager = _manager(tokenizer, grammar_tokenizer)
    for param in ("response_format", "tools"):
        with pytest.raises(InvalidParameterError) as caught:
            manager.compile(StructuredOutputsParams.json_schema(SEVEN_THOUSAND, param))
        assert (caught.value.param, str(caught.value)) == (
            param,
            (
                "The json constraint is too large to compile: its grammar has more than 20000 symbols (the "
                "engine's --structured-output-max-grammar-size)."
            ),
        )
    assert manager.num_compiles == 1  # the second request got the cached refusal


def _tool(parameters: dict, tool_choice) -> StructuredOutputsParams:
    """The constraint engine/server/tools.py builds for one tool ``f`` with these parameters."""
    request = msgspec.convert(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "tool_choice": tool_choice,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
        },
        ChatCompletionRequest,
    )
    return tool_constraint(request, tool_mode(request))


ANY_OF_3000 = {
    "anyOf": [
        {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
        for i in range(3000)
    ]
}
OPEN_ANY_OF_3000 = {"anyOf": [{**branch, "additionalProperties": True} for branch in ANY_OF_3000["anyOf"]]}
"""The same branches left open explicitly: kvscope closes objects without ``additionalProperties``
(engine/structured/schema_bounds.py), which keeps ANY_OF_3000 under the default size limit."""
SELF_REFERENCE = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}


@pytest.mark.parametrize(("constraint", "limits", "message"), [
    (StructuredOutputsParams.json_schema(OPEN_ANY_OF_3000), None,
     "The json constraint is too large to compile: its grammar has more than 20000 symbols"),
    (StructuredOutputsParams.json_schema(ANY_OF_3000), None,
     "The json constraint cannot be served: the grammar matcher fails after the forced start '{\"k' (Parser "
     "Error: Current row has 3000 items; max is 2000;"),
    (StructuredOutputsParams.json_schema(OPEN_ANY_OF_3000), CompileLimits(max_grammar_size=100_000),
     "The json constraint cannot be served: the grammar matcher fails after the forced start '{\"k' (Parser "
     "Error: Current row has 3000 items; max is 2000;"),
    (StructuredOutputsParams.json_schema(SELF_REFERENCE), None,
     "The json constraint cannot be served: the grammar matcher fails after the forced start "
     "'{\"a\":{\"a\":{\"a' (parser error: Too many items (limit 50000; ff_tokens)"),
    (_tool({"$ref": "#"}, "required"), None,
     "The json constraint cannot be served: the grammar matcher fails after the forced start "),
    (_tool({"$ref": "#"}, {"type": "function", "function": {"name": "f"}}), None,
     "The json constraint can never be satisfied: no output matches it (NoExtensionBias)"),
    (StructuredOutputsParams("regex", "a{0}", "structured_outputs"), None,
     "The regex constraint only allows an empty answer."),
])  # fmt: skip
def test_constraints_the_matcher_cannot_serve_are_a_400_at_admission(
    tokenizer, grammar_tokenizer, constraint, limits, message
) -> None:
    """Serving case N2's three: each answered ``{"`` or ``[`` with finish_reason stop before."""
    with pytest.raises(InvalidParameterError) as caught:
        _manager(tokenizer, grammar_tokenizer, limits).compile(constraint)
    assert caught.value.param == constraint.param
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


@pytest.mark.parametrize(("kind", "spec", "message"), [
    ("grammar", "start: foo |", 'Unsupported or invalid grammar constraint: at 1(8): unknown name: "foo"'),
    ("regex", "[a-z", 'Unsupported or invalid regex constraint: at 1(8): invalid regex "[a-z" (in regex): '
                      "regex parse error: [a-z error: unclosed character class"),
    ("json", json.dumps({"$ref": "#"}), "The json constraint can never be satisfied: no output matches it "
                                        "(NoExtensionBias)"),
])  # fmt: skip
def test_grammar_errors_are_one_line(tokenizer, grammar_tokenizer, kind, spec, message) -> None:
    with pytest.raises(InvalidParameterError) as caught:
        _manager(tokenizer, grammar_tokenizer).compile(StructuredOutputsParams(kind, spec, "guided_grammar"))
    assert str(caught.value) == message
