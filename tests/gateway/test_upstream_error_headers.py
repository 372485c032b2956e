"""An upstream's error answer keeps its back-off headers through the gateway (break-it finding F3): the
engine's 429 ``grammar_compile_busy`` says ``Retry-After: 1``, and the SDK's back-off needs it. The
upstream's ``x-ratelimit-*`` are relayed too, except where the gateway's own limits for the key replace
them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvscope.gateway.auth import hash_key
from kvscope.testing.harness import LoopThread
from tests.gateway.conftest import KEYS, Stack, build_stack

BUSY = {
    "status": 429,
    "error_code": "grammar_compile_busy",
    "error_headers": "Retry-After: 1, x-ratelimit-remaining-requests: 7",
}
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_upstream_429_keeps_retry_after(stack: Stack, path: str, stream: bool) -> None:
    body = {**CHAT, "stream": stream, "fake": BUSY}
    if path == "/v1/completions":
        body = {"model": "fake-model", "prompt": "hi", "max_tokens": 2, "stream": stream, "fake": BUSY}
    with stack.client() as c:
        resp = c.post(path, json=body)
    assert resp.status_code == 429
    assert resp.headers.get_list("retry-after") == ["1"]
    assert resp.headers.get_list("x-ratelimit-remaining-requests") == ["7"]  # the key has no gateway limits
    assert resp.headers["content-type"] == "application/json"
    assert resp.json()["error"]["code"] == "grammar_compile_busy"
    assert int(resp.headers["content-length"]) == len(resp.content)


def test_upstream_headers_of_other_kinds_are_not_relayed(stack: Stack) -> None:
    fake = {
        "status": 400,
        "error_code": "invalid_value",
        "error_headers": "x-upstream-secret: s, Retry-After: 3",
    }
    with stack.client() as c:
        resp = c.post("/v1/chat/completions", json={**CHAT, "fake": fake})
    assert resp.status_code == 400 and resp.headers.get_list("retry-after") == ["3"]
    assert "x-upstream-secret" not in resp.headers


@pytest.fixture
def limited_stack(loop: LoopThread, tmp_path: Path) -> Iterator[Stack]:
    """A stack where alice's key has a requests-per-minute limit: the gateway sets its own x-ratelimit-*."""
    keys = [{"name": "alice", "sha256": hash_key(KEYS["alice"]), "limits": {"requests_per_minute": 100}}]
    gateway, fakes, exporter = build_stack(loop, tmp_path, api_keys=keys)
    with gateway:
        yield Stack(gateway, fakes, exporter, tmp_path / "requests.jsonl")
    for fake in fakes.values():
        loop.run(fake.close())


def test_gateway_limits_replace_the_upstreams_x_ratelimit(limited_stack: Stack) -> None:
    with limited_stack.client() as c:
        resp = c.post("/v1/chat/completions", json={**CHAT, "fake": BUSY})
    assert resp.status_code == 429 and json.loads(resp.content)["error"]["code"] == "grammar_compile_busy"
    assert resp.headers.get_list("retry-after") == [
        "1"
    ]  # the upstream's hint: the gateway's limiter set none
    assert resp.headers.get_list("x-ratelimit-limit-requests") == ["100"]
    assert resp.headers.get_list("x-ratelimit-remaining-requests") == [
        "99"
    ]  # the key's, not the upstream's 7
