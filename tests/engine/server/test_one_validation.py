"""One validation point (engine/input_processor.py): its checks, that an HTTP request runs it once per prompt
and nothing else re-checks, and that the server reaches the engine only through EngineClient."""

from __future__ import annotations

import inspect

import pytest

from kvscope.engine.async_engine import AsyncEngine
from kvscope.engine.errors import InvalidParameterError, PromptTooLongError
from kvscope.engine.input_processor import EngineRequest, InputProcessor
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.server.engine_client import EngineClient
from tests.engine.server.conftest import chat_body
from tests.engine.server.fakes import FakeEngine

PROCESSOR = InputProcessor(max_model_len=16, vocab_size=100)


@pytest.mark.parametrize(("prompt", "params", "param", "message"), [
    ([], SamplingParams(), "prompt", "The prompt is empty: it encodes to zero tokens."),
    ([1, 100], SamplingParams(), "prompt", "Token ids must be in [0, 99]."),
    ([1], SamplingParams(logit_bias={100: 1.0}), "logit_bias", "logit_bias token ids must be in [0, 99]."),
    ([1], SamplingParams(stop_token_ids=(100,)), "stop_token_ids",
     "stop_token_ids token ids must be in [0, 99]."),
    ([1] * 10, SamplingParams(max_tokens=None, min_tokens=7), "min_tokens",
     "min_tokens (7) exceeds the 6 tokens left in the context (16 - 10 prompt tokens)."),
])  # fmt: skip
def test_invalid_requests_name_the_param(prompt, params, param, message) -> None:
    with pytest.raises(InvalidParameterError) as caught:
        PROCESSOR.process(prompt, params)
    assert (type(caught.value), caught.value.param, str(caught.value)) == (
        InvalidParameterError,
        param,
        message,
    )


@pytest.mark.parametrize(("num_prompt", "max_tokens"), [(16, None), (10, 7), (17, 1)])
def test_too_long_requests(num_prompt: int, max_tokens: int | None) -> None:
    with pytest.raises(PromptTooLongError) as caught:
        PROCESSOR.process([1] * num_prompt, SamplingParams(max_tokens=max_tokens))
    assert (caught.value.max_model_len, caught.value.num_prompt_tokens, caught.value.max_tokens) == (
        16,
        num_prompt,
        max_tokens,
    )


def test_max_tokens_is_resolved() -> None:
    params = SamplingParams(max_tokens=None)
    assert PROCESSOR.process([1] * 10, params) == EngineRequest([1] * 10, params, 6)
    assert PROCESSOR.process([1] * 10, SamplingParams(max_tokens=6)).max_tokens == 6


def test_an_http_request_is_validated_once_per_prompt(client, fake_engine, monkeypatch) -> None:
    calls: list[int] = []
    process = InputProcessor.process

    def counting(self, prompt_token_ids, params):
        calls.append(len(prompt_token_ids))
        return process(self, prompt_token_ids, params)

    monkeypatch.setattr(InputProcessor, "process", counting)
    body = {"model": "fake-model", "prompt": ["ab", "abc"], "max_tokens": 2, "n": 2}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert client.post("/v1/chat/completions", json=chat_body(max_tokens=2, stream=True)).status_code == 200
    assert calls == [
        2,
        3,
        len(fake_engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])),
    ]


def _members(cls: type) -> dict[str, inspect.Signature | str]:
    found: dict[str, inspect.Signature | str] = {}
    for name in sorted(n for n in dir(EngineClient) if not n.startswith("_") or n == "__annotations__"):
        if name == "__annotations__":
            continue
        value = inspect.getattr_static(cls, name, None)
        found[name] = (
            "property"
            if isinstance(value, property)
            else (inspect.signature(value) if callable(value) else "missing")
        )
    return found


@pytest.mark.parametrize("engine", [AsyncEngine, FakeEngine])
def test_the_engines_satisfy_engine_client(engine: type) -> None:
    """Same methods with the same parameters (names, defaults) as the protocol; ``is_running`` readable."""
    expected = _members(EngineClient)
    got = _members(engine)
    for name, signature in expected.items():
        if signature == "property":
            assert name in ("is_running",)
            continue
        assert list(got[name].parameters) == list(signature.parameters), name  # type: ignore[union-attr]
        assert [p.default for p in got[name].parameters.values()] == [  # type: ignore[union-attr]
            p.default for p in signature.parameters.values()
        ], name
    assert set(EngineClient.__annotations__) == {
        "info",
        "tokenizer",
        "device",
        "structured",
        "speculative",
        "admission",
    }
