"""The engine's fairness tenant (issue 35, engine/core/fairness.py): the gateway tells the upstream who is
calling in ``x-kvscope-tenant``, the API key's name (``user.id``, never the key), so one key's many
requests share one slot share. Without keys it sends none (every request its own tenant), and a client
never picks its tenant: a header of that name sent by the client is never forwarded as it is."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvscope.gateway.auth import TENANT_HEADER
from kvscope.testing.harness import LoopThread
from tests.gateway.conftest import KEYS, Stack, build_stack

SPOOF = {TENANT_HEADER: "limited"}
"""A client claiming another key's tenant."""


def _sent(stack: Stack, path: str) -> dict[str, str]:
    """The headers of the last request the main fake upstream received at ``path``."""
    return next(r for r in reversed(stack.fakes["main"].records) if r.path == path).headers


def _calls(client: httpx.Client, headers: dict[str, str]) -> Iterator[str]:
    """Chat (JSON and stream), completions and a pass-through request, each with ``headers``; yields the
    upstream path after each."""
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert client.post("/v1/chat/completions", json=chat, headers=headers).status_code == 200
    yield "/v1/chat/completions"
    with client.stream(
        "POST", "/v1/chat/completions", json={**chat, "stream": True}, headers=headers
    ) as resp:
        assert resp.status_code == 200 and resp.read().endswith(b"data: [DONE]\n\n")
    yield "/v1/chat/completions"
    body = {"model": "fake-model", "prompt": "hi", "max_tokens": 2}
    assert client.post("/v1/completions", json=body, headers=headers).status_code == 200
    yield "/v1/completions"
    assert (
        client.post(
            "/v1/embeddings", json={"model": "fake-model", "input": "hi"}, headers=headers
        ).status_code
        == 200
    )
    yield "/v1/embeddings"


@pytest.mark.parametrize("headers", [{}, SPOOF], ids=["plain", "client-sent"])
def test_a_keyed_request_carries_its_keys_name_and_never_the_clients_own(stack: Stack, headers) -> None:
    with stack.client("alice") as client:
        for path in _calls(client, headers):
            sent = _sent(stack, path)
            assert sent[TENANT_HEADER] == "alice", path
            assert KEYS["alice"] not in sent.values()


@pytest.fixture
def keyless(loop: LoopThread, tmp_path: Path) -> Iterator[Stack]:
    gateway, fakes, exporter = build_stack(loop, tmp_path, api_keys=[])
    with gateway:
        yield Stack(gateway, fakes, exporter, tmp_path / "requests.jsonl")
    for fake in fakes.values():
        loop.run(fake.close())


def test_without_keys_no_tenant_is_sent_not_even_the_clients(keyless: Stack) -> None:
    with httpx.Client(base_url=keyless.url, timeout=10) as client:
        for path in _calls(client, SPOOF):
            assert TENANT_HEADER not in _sent(keyless, path), path
