"""Test doubles for the benchmark client: a manual clock and an httpx MockTransport serving scripted SSE
streams whose events advance the clock by known amounts before they are delivered."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

Event = tuple[float, Any]  # (seconds after the previous event, payload: dict → data: JSON, str → raw line)


@dataclass
class FakeClock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def completion_chunk(text: str, finish_reason: str | None = None) -> dict[str, Any]:
    return {
        "object": "text_completion",
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason}],
    }


def chat_chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }


def usage_chunk(completion: int, prompt: int = 5, cached: int | None = None) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return {"choices": [], "usage": usage}


def token_stream(deltas: list[float], done_after: float, usage_tokens: int | None = None) -> list[Event]:
    """Completion tokens "t0", "t1", … arriving ``deltas`` apart, a finish chunk + usage right after the last
    token, then ``[DONE]`` ``done_after`` seconds later."""
    events: list[Event] = [(d, completion_chunk(f"t{i}")) for i, d in enumerate(deltas)]
    events.append((0.0, completion_chunk("", "length")))
    events.append((0.0, usage_chunk(len(deltas) if usage_tokens is None else usage_tokens)))
    events.append((done_after, "data: [DONE]"))
    return events


async def _body(events: list[Event], clock: FakeClock) -> AsyncIterator[bytes]:
    for delay, payload in events:
        clock.now += delay
        line = payload if isinstance(payload, str) else "data: " + json.dumps(payload)
        yield (line + "\n\n").encode()


@dataclass
class ScriptedServer:
    """Answers each POST with the script chosen by ``pick(body)``: a list of events (SSE, status 200) or a
    (status, JSON) tuple. Records every request body and URL."""

    clock: FakeClock
    pick: Callable[[dict[str, Any]], Any]
    bodies: list[dict[str, Any]] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)

    def handler(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        self.urls.append(str(request.url))
        script = self.pick(body)
        if isinstance(script, tuple):
            return httpx.Response(script[0], json=script[1])
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, content=_body(script, self.clock)
        )

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self.handler))


def write_word_tokenizer(path: Path) -> Path:
    """A tiny word-level tokenizer.json: 2 special tokens + 6 words, whitespace pre-tokenizer."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = ["<s>", "<unk>", "alpha", "beta", "gamma", "delta", "eps", "zeta"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([AddedToken("<s>", special=True), AddedToken("<unk>", special=True)])
    tokenizer.save(str(path))
    return path
