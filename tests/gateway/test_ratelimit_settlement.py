"""A metered key's request is settled with the limiter exactly once, with the real usage, however it ends:
a JSON answer, a stream, a client that leaves mid-stream, an upstream 5xx, a stream the upstream breaks; a
refused (429) request is never released (gateway/ratelimit_middleware.py)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import pytest

from kvscope.gateway.auth import hash_key
from kvscope.gateway.ratelimit import InMemoryRateLimiter, LimitDecision
from kvscope.gateway.settings import KeyLimits
from kvscope.testing.harness import LoopThread, records_by_id, sse_events
from tests.gateway.conftest import Stack, build_stack

KEYS = {"metered": "sk-metered", "tiny": "sk-tiny"}
MAX_TOKENS = 6


class RecordingLimiter:
    """The in-memory limiter, recording each acquire's charged tokens and each release's delta by lease id."""

    def __init__(self) -> None:
        self.inner = InMemoryRateLimiter()
        self.charged: dict[str, int] = {}
        self.released: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    async def acquire(self, key_id: str, limits: KeyLimits, tokens: int, lease_id: str) -> LimitDecision:
        decision = await self.inner.acquire(key_id, limits, tokens, lease_id)
        with self._lock:
            self.charged[lease_id] = tokens
        return decision

    async def release(self, key_id: str, limits: KeyLimits, lease_id: str, token_delta: int) -> None:
        with self._lock:
            self.released.setdefault(lease_id, []).append(token_delta)
        await self.inner.release(key_id, limits, lease_id, token_delta)

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.fixture(scope="module")
def metered(
    loop: LoopThread, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Stack, RecordingLimiter]]:
    tmp = tmp_path_factory.mktemp("metered")
    keys = [
        {
            "name": "metered",
            "sha256": hash_key(KEYS["metered"]),
            "limits": {"tokens_per_minute": 100_000, "max_concurrent": 8},
        },
        {"name": "tiny", "sha256": hash_key(KEYS["tiny"]), "limits": {"tokens_per_minute": 5}},
    ]
    gateway, fakes, exporter = build_stack(loop, tmp, api_keys=keys)
    limiter = RecordingLimiter()
    gateway.state.limiter = limiter
    with gateway:
        yield Stack(gateway, fakes, exporter, tmp / "requests.jsonl"), limiter
    for fake in fakes.values():
        loop.run(fake.close())


def _client(stack: Stack, key: str) -> httpx.Client:
    return httpx.Client(base_url=stack.url, headers={"authorization": f"Bearer {KEYS[key]}"}, timeout=20)


def _event_id(stack: Stack, rid: str) -> tuple[str, dict]:
    record = records_by_id(stack.log, [rid])[rid][0]
    return record["event"]["id"], record


def _body(**extra: object) -> dict:
    return {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "one two three"}],
        "max_tokens": MAX_TOKENS,
        **extra,
    }


def test_a_json_answer_is_settled_once_with_its_usage(metered: tuple[Stack, RecordingLimiter]) -> None:
    stack, limiter = metered
    with _client(stack, "metered") as c:
        resp = c.post("/v1/chat/completions", json=_body(), headers={"x-request-id": "settle-json"})
    assert resp.status_code == 200
    lease, _ = _event_id(stack, "settle-json")
    assert limiter.released[lease] == [limiter.charged[lease] - resp.json()["usage"]["total_tokens"]]


def test_a_stream_is_settled_once_with_its_usage(metered: tuple[Stack, RecordingLimiter]) -> None:
    stack, limiter = metered
    body = _body(stream=True, stream_options={"include_usage": True})
    with _client(stack, "metered") as c:
        resp = c.post("/v1/chat/completions", json=body, headers={"x-request-id": "settle-stream"})
    usage = json.loads([e for e in sse_events(resp.content) if e != "[DONE]"][-1])["usage"]
    lease, _ = _event_id(stack, "settle-stream")
    assert limiter.released[lease] == [limiter.charged[lease] - usage["total_tokens"]]


def test_a_client_leaving_mid_stream_is_settled_once(metered: tuple[Stack, RecordingLimiter]) -> None:
    """No usage arrived: the actual tokens are the prompt estimate (charge − max_tokens) + the tokens sent."""
    stack, limiter = metered
    body = _body(stream=True, max_tokens=200, fake={"token_delay_s": 0.05})
    with (
        _client(stack, "metered") as c,
        c.stream("POST", "/v1/chat/completions", json=body, headers={"x-request-id": "settle-left"}) as resp,
    ):
        lines = resp.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
    lease, record = _event_id(stack, "settle-left")
    assert record["kvscope"]["client_disconnected"] is True
    sent = record["gen_ai"]["usage"]["output_tokens"]
    assert limiter.released[lease] == [200 - sent]


def test_an_upstream_5xx_is_settled_once_at_the_estimate(metered: tuple[Stack, RecordingLimiter]) -> None:
    stack, limiter = metered
    with _client(stack, "metered") as c:
        resp = c.post(
            "/v1/chat/completions",
            json=_body(fake={"status": 500}),
            headers={"x-request-id": "settle-5xx", "x-kvscope-fault": "status=500"},
        )
    assert resp.status_code == 500
    lease, _ = _event_id(stack, "settle-5xx")
    assert limiter.released[lease] == [0]


def test_a_stream_the_upstream_breaks_is_settled_once(metered: tuple[Stack, RecordingLimiter]) -> None:
    stack, limiter = metered
    body = _body(stream=True, fake={"die_after_tokens": 2})
    with _client(stack, "metered") as c:
        resp = c.post(
            "/v1/chat/completions",
            json=body,
            headers={"x-request-id": "settle-broken", "x-kvscope-fault": "die_after_tokens=2"},
        )
    assert resp.status_code == 200
    lease, record = _event_id(stack, "settle-broken")
    assert record["kvscope"]["stream_error"] == "upstream_disconnected"
    assert limiter.released[lease] == [MAX_TOKENS - record["gen_ai"]["usage"]["output_tokens"]]


def test_a_refused_request_is_never_released(metered: tuple[Stack, RecordingLimiter]) -> None:
    stack, limiter = metered
    with _client(stack, "tiny") as c:
        resp = c.post("/v1/chat/completions", json=_body(), headers={"x-request-id": "settle-429"})
    assert resp.status_code == 429 and resp.headers["retry-after"] == "60"
    lease, _ = _event_id(stack, "settle-429")
    assert lease in limiter.charged and lease not in limiter.released


def test_the_models_route_touches_no_limiter(metered: tuple[Stack, RecordingLimiter]) -> None:
    stack, limiter = metered
    with _client(stack, "metered") as c:
        resp = c.get("/v1/models", headers={"x-request-id": "settle-models"})
    assert resp.status_code == 200
    lease, _ = _event_id(stack, "settle-models")
    assert lease not in limiter.charged and lease not in limiter.released
