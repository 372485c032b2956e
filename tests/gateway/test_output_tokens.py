"""``kvscope`` output tokens of a request: the upstream's usage, never fewer than the token events a stream
relayed (llama.cpp's usage with n > 1 counts one choice)."""

from __future__ import annotations

import pytest

from kvscope.gateway.context import RequestContext


def _ctx(stream: bool, usage: dict | None, events: int) -> RequestContext:
    ctx = RequestContext("r", "POST", "/v1/chat/completions", "/v1/chat/completions", 0.0, 0.0)
    ctx.request.stream = stream
    ctx.answer.usage = usage
    ctx.answer.output_events = events
    return ctx


@pytest.mark.parametrize(
    ("stream", "usage", "events", "expected"),
    [
        (True, {"completion_tokens": 12}, 24, 24),  # llama.cpp, n=2: usage counts one choice
        (True, {"completion_tokens": 30}, 12, 30),  # speculative decoding: several tokens per event
        (True, None, 7, 7),  # no usage chunk (include_usage not asked)
        (True, {"completion_tokens": "x"}, 5, 5),
        (False, {"completion_tokens": 12}, 0, 12),
        (False, None, 0, None),
    ],
)
def test_output_tokens(stream: bool, usage: dict | None, events: int, expected: int | None) -> None:
    assert _ctx(stream, usage, events).output_tokens == expected
