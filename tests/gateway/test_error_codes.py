"""Every gateway 400 names its error in ``code`` (break-it finding F4): ``prompt: [[]]`` answered ``code:
null`` with a wrong message, where the engine says ``invalid_value`` "The prompt is empty". Empty prompts
get the engine's own words (serving case A1: a 400 ``invalid_request_error`` with a clear message)."""

from __future__ import annotations

import pytest

from kvscope.engine.errors import InvalidParameterError
from kvscope.engine.input_processor import InputProcessor
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.server.errors import OpenAIError
from kvscope.engine.server.serving_completions import completion_prompts
from kvscope.gateway.schemas import EMPTY_PROMPT, EMPTY_PROMPT_LIST
from tests.gateway.conftest import Stack


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([[]], EMPTY_PROMPT),
        ([[1, 2], []], EMPTY_PROMPT),
        ([], EMPTY_PROMPT_LIST),
    ],
    ids=["empty-ids", "second-ids-empty", "empty-list"],
)
def test_empty_prompts_are_400_invalid_value_in_the_engines_words(
    stack: Stack, prompt: list, message: str
) -> None:
    before = len(stack.fakes["main"].records)
    with stack.client() as c:
        resp = c.post("/v1/completions", json={"model": "fake-model", "prompt": prompt, "max_tokens": 2})
    assert resp.status_code == 400
    assert resp.json() == {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": "prompt",
            "code": "invalid_value",
        }
    }
    assert len(stack.fakes["main"].records) == before  # refused at the edge


def test_empty_prompt_messages_are_the_engines() -> None:
    """The gateway's words for an empty prompt are the ones the engine answers (engine/server and
    engine/input_processor.py): a client sees one message whichever refuses it."""
    with pytest.raises(OpenAIError) as empty_list:
        completion_prompts(None, [])  # type: ignore[arg-type]  # refused before any tokenizing
    assert (empty_list.value.message, empty_list.value.code) == (EMPTY_PROMPT_LIST, "invalid_value")
    with pytest.raises(InvalidParameterError) as empty_ids:
        InputProcessor(max_model_len=16, vocab_size=32).process([], SamplingParams(max_tokens=2))
    assert (str(empty_ids.value), empty_ids.value.param) == (EMPTY_PROMPT, "prompt")


MALFORMED = [
    ("/v1/completions", b'{"model": "fake-model", "prompt": [[]], "max_tokens": 2}'),
    ("/v1/completions", b'{"model": "fake-model", "prompt": [1, "a"]}'),
    ("/v1/completions", b'{"model": "fake-model", "prompt": [[1, "a"]]}'),
    ("/v1/completions", b'{"model": "fake-model", "prompt": [["a"]]}'),
    ("/v1/completions", b'{"model": "fake-model", "prompt": {"a": 1}}'),
    ("/v1/completions", b'{"model": "fake-model"}'),
    ("/v1/completions", b'{"prompt": "hi"}'),
    ("/v1/completions", b"[1, 2]"),
    ("/v1/completions", b'{"model": "fake-model", "prompt": "hi", "n": 0}'),
    ("/v1/chat/completions", b'{"model": "fake-model", "messages": "hi"}'),
    ("/v1/chat/completions", b'{"model": "fake-model", "messages": [], "temperature": 9}'),
    ("/v1/chat/completions", b'{"model": "fake-model", "messages": [{"content": "hi"}]}'),
    ("/v1/chat/completions", b'{"model": '),
    (
        "/v1/chat/completions",
        b'{"model": "fake-model", "messages": [], "max_tokens": 11}',
    ),  # the key's ceiling
]


@pytest.mark.parametrize(("path", "body"), MALFORMED, ids=[f"{i}" for i in range(len(MALFORMED))])
def test_every_400_names_its_code(stack: Stack, path: str, body: bytes) -> None:
    with stack.client("limited") as c:  # limited: max_tokens ceiling 10
        resp = c.post(path, content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert isinstance(error["code"], str) and error["code"] in ("invalid_value", "invalid_json")
    assert isinstance(error["message"], str) and error["message"]
