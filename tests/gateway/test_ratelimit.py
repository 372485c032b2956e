"""Token buckets and the concurrency cap: in-memory (fake clock) and in a real redis-server (same script)."""

from __future__ import annotations

import asyncio

import pytest

from kvscope.gateway.ratelimit import InMemoryRateLimiter, RedisRateLimiter, format_duration, limit_headers
from kvscope.gateway.settings import KeyLimits
from kvscope.testing.harness import spawn_redis, wait_port
from tests.conftest import require_tool


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_requests_per_minute_bucket_refills_continuously() -> None:
    clock = Clock()
    limiter = InMemoryRateLimiter(clock)
    limits = KeyLimits(requests_per_minute=3)
    decisions = [await limiter.acquire("k", limits, 0, f"r{i}") for i in range(4)]
    assert [d.allowed for d in decisions] == [True, True, True, False]
    assert decisions[2].headers == {
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "60s",
    }
    refused = decisions[3]
    assert refused.reason == "requests" and refused.retry_after_s == pytest.approx(20.0)
    clock.now += 19.9
    assert not (await limiter.acquire("k", limits, 0, "r5")).allowed
    clock.now += 0.1
    ok = await limiter.acquire("k", limits, 0, "r6")
    assert ok.allowed and ok.headers["x-ratelimit-remaining-requests"] == "0"
    assert (await limiter.acquire("other", limits, 0, "o1")).allowed  # limits are per key


async def test_tokens_per_minute_charge_settle_and_too_large() -> None:
    clock = Clock()
    limiter = InMemoryRateLimiter(clock)
    limits = KeyLimits(tokens_per_minute=600)  # refills 10 tokens/s
    assert (await limiter.acquire("k", limits, 500, "a")).allowed
    refused = await limiter.acquire("k", limits, 200, "b")
    assert refused.reason == "tokens" and refused.retry_after_s == pytest.approx(10.0)
    assert refused.headers["x-ratelimit-remaining-tokens"] == "100"
    await limiter.release("k", limits, "a", 300)  # used 200 of the 500 charged
    ok = await limiter.acquire("k", limits, 200, "b")
    assert ok.allowed and ok.headers["x-ratelimit-remaining-tokens"] == "200"
    too_large = await limiter.acquire("k", limits, 601, "c")
    assert too_large.reason == "tokens" and too_large.retry_after_s == 60.0
    await limiter.release("k", limits, "b", -250)  # 250 more than estimated: the bucket goes negative
    clock.now += 1
    refused = await limiter.acquire("k", limits, 1, "d")
    assert refused.headers["x-ratelimit-remaining-tokens"] == "0" and refused.retry_after_s == pytest.approx(
        4.1
    )  # level -40, needs 1


async def test_concurrency_cap_frees_on_release() -> None:
    limiter = InMemoryRateLimiter(Clock())
    limits = KeyLimits(max_concurrent=2)
    assert [(await limiter.acquire("k", limits, 0, r)).allowed for r in "abc"] == [True, True, False]
    refused = await limiter.acquire("k", limits, 0, "c")
    assert refused.reason == "concurrency" and refused.retry_after_s == 1.0 and refused.headers == {}
    await limiter.release("k", limits, "a", 0)
    assert (await limiter.acquire("k", limits, 0, "c")).allowed


def test_header_formatting() -> None:
    assert (
        format_duration(0.25) == "250ms" and format_duration(6.0) == "6s" and format_duration(1.5) == "1.5s"
    )
    headers = limit_headers(KeyLimits(requests_per_minute=60, tokens_per_minute=1000), 59.5, -20.0)
    assert headers == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "500ms",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "0",
        "x-ratelimit-reset-tokens": "61.2s",
    }


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory):
    require_tool("redis-server")
    proc = spawn_redis(tmp_path_factory.mktemp("redis"))
    try:
        wait_port(proc.port)
        yield f"redis://127.0.0.1:{proc.port}/0"
    finally:
        proc.stop()


async def test_redis_limiter_matches_the_in_memory_semantics(redis_url: str) -> None:
    """The same buckets in Lua, on a frozen clock passed to the scripts: exact waits."""
    clock = Clock()
    limiter = RedisRateLimiter(redis_url, lease_ttl_s=60, prefix="t1", clock=clock)
    try:
        limits = KeyLimits(requests_per_minute=2, tokens_per_minute=600, max_concurrent=3)
        first = await limiter.acquire("k", limits, 500, "a")
        assert first.allowed
        assert first.headers["x-ratelimit-remaining-requests"] == "1"
        assert first.headers["x-ratelimit-remaining-tokens"] == "100"
        tokens = await limiter.acquire("k", limits, 200, "b")
        assert (tokens.allowed, tokens.reason) == (False, "tokens")
        assert tokens.retry_after_s == 10.0  # level 100, needs 200, refills 10/s
        await limiter.release("k", limits, "a", 400)
        assert (await limiter.acquire("k", limits, 200, "b")).allowed
        requests = await limiter.acquire("k", limits, 1, "c")
        assert (requests.allowed, requests.reason) == (False, "requests")
        assert requests.retry_after_s == 30.0  # level 0, needs 1, refills 1 per 30 s
        clock.now += 29.9
        assert not (await limiter.acquire("k", limits, 1, "c")).allowed
        clock.now += 0.1
        assert (await limiter.acquire("k", limits, 1, "c")).allowed
        cap = KeyLimits(max_concurrent=2)
        results = await asyncio.gather(*(limiter.acquire("c", cap, 0, f"l{i}") for i in range(5)))
        assert sorted(d.allowed for d in results) == [False, False, False, True, True]
        assert {d.reason for d in results if not d.allowed} == {"concurrency"}
    finally:
        await limiter.aclose()


async def test_redis_unreachable_fails_open() -> None:
    limiter = RedisRateLimiter("redis://127.0.0.1:1/0", lease_ttl_s=60)
    try:
        decision = await limiter.acquire("k", KeyLimits(requests_per_minute=1), 0, "a")
        assert decision.allowed and decision.headers == {}
    finally:
        await limiter.aclose()
