"""Per-key limits at the edge: requests/min and tokens/min token buckets plus a concurrent-request cap.

Token bucket (one per key and dimension): capacity ``C`` = the per-minute limit, refilled continuously at
``C / 60`` per second, level ``min(C, level + elapsed * C / 60)``. A request is admitted only if every
dimension admits it (1 request token, its estimated tokens, a free concurrency slot); then all are taken at
once. At the end the token bucket is settled with the real usage (refund or extra debit; the level may go
negative, which delays later requests). Source: the classic token bucket (Turner 1986) as used by
OpenAI-style ``x-ratelimit-*`` headers.

:class:`InMemoryRateLimiter` serves one gateway process; :class:`RedisRateLimiter` (``--redis-url``) runs the
same algorithm atomically in Redis Lua scripts on the Redis clock, so several gateway replicas share limits.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvscope.gateway.settings import KeyLimits

_log = logging.getLogger("kvscope.gateway")
CONCURRENCY_RETRY_S = 1.0
"""Retry-After for the concurrency cap (when a slot frees up is unknown)."""


@dataclass(frozen=True, slots=True)
class LimitDecision:
    allowed: bool
    reason: str | None = None
    """``requests``, ``tokens`` or ``concurrency`` when refused."""
    retry_after_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)
    """``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` (OpenAI names)."""


class RateLimiter(Protocol):
    async def acquire(self, key_id: str, limits: KeyLimits, tokens: int, lease_id: str) -> LimitDecision:
        """Admit (and charge) one request of ``tokens`` estimated tokens, or refuse it."""
        ...

    async def release(self, key_id: str, limits: KeyLimits, lease_id: str, token_delta: int) -> None:
        """Free the concurrency slot; add ``token_delta`` (estimate − actual) back to the token bucket."""
        ...

    async def aclose(self) -> None: ...


def refill(level: float, elapsed_s: float, limit: int) -> float:
    """Bucket level after ``elapsed_s`` seconds: ``min(limit, level + elapsed_s * limit / 60)``."""
    return min(float(limit), level + max(0.0, elapsed_s) * limit / 60.0)


def format_duration(seconds: float) -> str:
    """``x-ratelimit-reset-*`` value: ``"250ms"`` below a second, else ``"6s"``/``"1.5s"``."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    return f"{round(seconds, 3):g}s"


def limit_headers(limits: KeyLimits, req_level: float | None, tok_level: float | None) -> dict[str, str]:
    """OpenAI-style headers from the bucket levels after the decision (None: dimension not limited)."""
    headers: dict[str, str] = {}
    for kind, limit, level in (
        ("requests", limits.requests_per_minute, req_level),
        ("tokens", limits.tokens_per_minute, tok_level),
    ):
        if limit is None or level is None:
            continue
        headers[f"x-ratelimit-limit-{kind}"] = str(limit)
        headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(level)))
        headers[f"x-ratelimit-reset-{kind}"] = format_duration((limit - level) * 60.0 / limit)
    return headers


def decide(
    limits: KeyLimits, req_level: float | None, tok_level: float | None, tokens: int, in_flight: int
) -> tuple[str | None, float]:
    """(reason, retry_after_s) of a refusal, or (None, 0) to admit. Reasons checked in the order
    requests, tokens, concurrency; the wait is the longest of the failing dimensions."""
    reason, wait = None, 0.0
    rpm, tpm, cap = limits.requests_per_minute, limits.tokens_per_minute, limits.max_concurrent
    if rpm is not None and req_level is not None and req_level < 1:
        reason, wait = "requests", (1 - req_level) * 60.0 / rpm
    if tpm is not None and tok_level is not None and (tokens > tpm or tok_level < tokens):
        reason = reason or "tokens"
        wait = max(wait, 60.0 if tokens > tpm else (tokens - tok_level) * 60.0 / tpm)
    if cap is not None and in_flight >= cap:
        reason = reason or "concurrency"
        wait = max(wait, CONCURRENCY_RETRY_S)
    return reason, wait


@dataclass(slots=True)
class _KeyState:
    req_level: float
    tok_level: float
    stamp: float
    leases: set[str] = field(default_factory=set)


class InMemoryRateLimiter:
    """Process-local limiter; ``clock`` (seconds, monotonic) is injectable for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._keys: dict[str, _KeyState] = {}

    def _state(self, key_id: str, limits: KeyLimits) -> _KeyState:
        now = self._clock()
        state = self._keys.get(key_id)
        if state is None:
            state = self._keys[key_id] = _KeyState(
                float(limits.requests_per_minute or 0), float(limits.tokens_per_minute or 0), now
            )
        elapsed, state.stamp = now - state.stamp, now
        if limits.requests_per_minute:
            state.req_level = refill(state.req_level, elapsed, limits.requests_per_minute)
        if limits.tokens_per_minute:
            state.tok_level = refill(state.tok_level, elapsed, limits.tokens_per_minute)
        return state

    async def acquire(self, key_id: str, limits: KeyLimits, tokens: int, lease_id: str) -> LimitDecision:
        state = self._state(key_id, limits)
        req = state.req_level if limits.requests_per_minute else None
        tok = state.tok_level if limits.tokens_per_minute else None
        reason, wait = decide(limits, req, tok, tokens, len(state.leases))
        if reason is not None:
            return LimitDecision(False, reason, wait, limit_headers(limits, req, tok))
        state.req_level -= 1
        state.tok_level -= tokens
        if limits.max_concurrent is not None:
            state.leases.add(lease_id)
        req = state.req_level if limits.requests_per_minute else None
        tok = state.tok_level if limits.tokens_per_minute else None
        return LimitDecision(True, headers=limit_headers(limits, req, tok))

    async def release(self, key_id: str, limits: KeyLimits, lease_id: str, token_delta: int) -> None:
        state = self._state(key_id, limits)
        state.leases.discard(lease_id)
        if limits.tokens_per_minute:
            state.tok_level = min(float(limits.tokens_per_minute), state.tok_level + token_delta)

    async def aclose(self) -> None:
        self._keys.clear()


_NOW_LUA = """
local function clock(given)
  local now = tonumber(given)
  if now then return now end
  local tm = redis.call('TIME')
  return tonumber(tm[1]) + tonumber(tm[2]) / 1000000
end
"""
"""``clock(ARGV[i])``: the caller's time when it passed one (tests), else the Redis server's clock."""

_ACQUIRE_LUA = (
    _NOW_LUA
    + """
local now = clock(ARGV[8])
local rpm, tpm, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local cap, lease, ttl = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local function level(key, limit)
  local v = redis.call('HMGET', key, 'level', 'ts')
  if not v[1] then return limit end
  return math.min(limit, tonumber(v[1]) + math.max(0, now - tonumber(v[2])) * limit / 60)
end
local function store(key, lvl, limit)
  redis.call('HSET', key, 'level', tostring(lvl), 'ts', tostring(now))
  redis.call('EXPIRE', key, math.ceil((limit - lvl) * 60 / limit) + 1)
end
local req, tok, reason, wait = -1, -1, '', 0
if rpm > 0 then
  req = level(KEYS[1], rpm)
  if req < 1 then reason = 'requests'; wait = (1 - req) * 60 / rpm end
end
if tpm > 0 then
  tok = level(KEYS[2], tpm)
  if cost > tpm or tok < cost then
    if reason == '' then reason = 'tokens' end
    if cost > tpm then wait = math.max(wait, 60) else wait = math.max(wait, (cost - tok) * 60 / tpm) end
  end
end
local in_flight = 0
if cap > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - ttl)
  in_flight = redis.call('ZCARD', KEYS[3])
  if in_flight >= cap then
    if reason == '' then reason = 'concurrency' end
    wait = math.max(wait, tonumber(ARGV[7]))
  end
end
if reason == '' then
  if rpm > 0 then req = req - 1; store(KEYS[1], req, rpm) end
  if tpm > 0 then tok = tok - cost; store(KEYS[2], tok, tpm) end
  if cap > 0 then redis.call('ZADD', KEYS[3], now, lease); redis.call('EXPIRE', KEYS[3], ttl + 1) end
end
return {reason, tostring(wait), tostring(req), tostring(tok)}
"""
)

_RELEASE_LUA = (
    _NOW_LUA
    + """
redis.call('ZREM', KEYS[3], ARGV[3])
local tpm, delta = tonumber(ARGV[1]), tonumber(ARGV[2])
if tpm > 0 and delta ~= 0 then
  local now = clock(ARGV[4])
  local v = redis.call('HMGET', KEYS[2], 'level', 'ts')
  local lvl = tpm
  if v[1] then lvl = math.min(tpm, tonumber(v[1]) + math.max(0, now - tonumber(v[2])) * tpm / 60) end
  lvl = math.min(tpm, lvl + delta)
  redis.call('HSET', KEYS[2], 'level', tostring(lvl), 'ts', tostring(now))
  redis.call('EXPIRE', KEYS[2], math.ceil((tpm - lvl) * 60 / tpm) + 1)
end
return 1
"""
)


class RedisRateLimiter:
    """The same limits shared through Redis (``redis.asyncio``); one Lua script call per acquire/release.

    Concurrency slots are members of a sorted set scored by their start time; slots older than
    ``lease_ttl_s`` (a crashed gateway's) are dropped. If Redis is unreachable the limiter fails open
    (admits, logs a warning): an outage of the limiter must not take the API down.

    ``clock`` (seconds) replaces the Redis server's clock in the scripts; for tests only: replicas must
    share one clock, so the gateway never sets it.
    """

    def __init__(
        self,
        url: str,
        lease_ttl_s: float,
        prefix: str = "kvscope:ratelimit",
        clock: Callable[[], float] | None = None,
    ) -> None:
        import redis.asyncio as aioredis  # optional dependency: imported only when --redis-url is set

        self._redis = aioredis.Redis.from_url(url)
        self._errors = (aioredis.RedisError, OSError)
        self._acquire = self._redis.register_script(_ACQUIRE_LUA)
        self._release = self._redis.register_script(_RELEASE_LUA)
        self._ttl = max(1, math.ceil(lease_ttl_s))
        self._prefix = prefix
        self._clock = clock

    def _now(self) -> str:
        """The ``clock`` argument of the scripts: empty means the Redis server's clock."""
        return "" if self._clock is None else repr(self._clock())

    def _keys(self, key_id: str) -> list[str]:
        base = f"{self._prefix}:{{{key_id}}}"
        return [f"{base}:requests", f"{base}:tokens", f"{base}:concurrent"]

    async def acquire(self, key_id: str, limits: KeyLimits, tokens: int, lease_id: str) -> LimitDecision:
        args = [
            limits.requests_per_minute or 0,
            limits.tokens_per_minute or 0,
            tokens,
            limits.max_concurrent or 0,
            lease_id,
            self._ttl,
            CONCURRENCY_RETRY_S,
            self._now(),
        ]
        try:
            # the script's reply: a list (redis-py types an async script's reply as Awaitable | Any)
            reply: Any = await self._acquire(keys=self._keys(key_id), args=args)
            reason, wait, req, tok = reply
        except self._errors as exc:
            _log.warning("rate limiter: redis unavailable, admitting request (%s)", exc)
            return LimitDecision(True)
        req_level = float(req) if limits.requests_per_minute else None
        tok_level = float(tok) if limits.tokens_per_minute else None
        headers = limit_headers(limits, req_level, tok_level)
        if reason:
            return LimitDecision(
                False, reason.decode() if isinstance(reason, bytes) else reason, float(wait), headers
            )
        return LimitDecision(True, headers=headers)

    async def release(self, key_id: str, limits: KeyLimits, lease_id: str, token_delta: int) -> None:
        try:
            await self._release(
                keys=self._keys(key_id),
                args=[limits.tokens_per_minute or 0, token_delta, lease_id, self._now()],
            )
        except self._errors as exc:
            _log.warning("rate limiter: redis unavailable on release (%s)", exc)

    async def ping(self) -> bool:
        return bool(await self._redis.ping())

    async def aclose(self) -> None:
        await self._redis.aclose()
