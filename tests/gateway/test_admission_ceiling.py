"""A key's max_tokens ceiling caps what a request may generate without changing what the client asked for:
a request without max_tokens gets the upstream's own default capped at the ceiling (16 for completions, the
rest of the context for chat), and the context-length check uses what the client asked for."""

from __future__ import annotations

import msgspec
import pytest

from kvscope.gateway.admission import CHAT, COMPLETION, _injected_max_tokens
from kvscope.gateway.schemas import ChatCompletionRequest, CompletionRequest

HI = [{"role": "user", "content": "hi"}]


def chat(**extra) -> ChatCompletionRequest:
    return msgspec.convert({"model": "m", "messages": HI, **extra}, ChatCompletionRequest)


def completion(**extra) -> CompletionRequest:
    return msgspec.convert({"model": "m", "prompt": "hi", **extra}, CompletionRequest)


@pytest.mark.parametrize(
    ("ceiling", "request_", "op", "max_len", "counts", "expected"),
    [
        (4096, completion(), COMPLETION, 8192, [5], 16),  # OpenAI's completions default, not the ceiling
        (10, completion(), COMPLETION, 8192, [5], 10),
        (4096, chat(), CHAT, 8192, [5000], 3192),  # the rest of the context: a 5000-token prompt still fits
        (100, chat(), CHAT, 8192, [5000], 100),
        (4096, chat(), CHAT, None, None, 4096),  # no tokenizer / unknown context: the ceiling
        (4096, chat(n=2), CHAT, 8192, [30, 8000], 192),  # the longest prompt bounds every choice
        (4096, chat(max_tokens=7), CHAT, 8192, [5], None),  # the client asked: nothing injected
        (None, chat(), CHAT, 8192, [5], None),  # no ceiling: nothing injected
    ],
)
def test_injected_max_tokens(ceiling, request_, op, max_len, counts, expected) -> None:
    assert _injected_max_tokens(ceiling, request_, op, max_len, counts) == expected
