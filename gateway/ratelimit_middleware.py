"""Rate limiting of the generation routes, in one place: a Litestar middleware and the lease it hands out.

:class:`RateLimitMiddleware` wraps each generation request. It puts an empty :class:`RateLimitLease` in
``scope["state"]``; admission's last check (gateway/admission.py) takes it with :meth:`RateLimitLease.acquire`
once the request's token estimate is known (429 ``rate_limit_exceeded`` with ``retry-after`` and the
``x-ratelimit-*`` headers when a limit refuses it). The middleware adds the lease's ``x-ratelimit-*`` headers
to the response and settles the lease exactly once: just before the response's last body message (so the
limits are free again when the client sees the end), else when the request ends however it ends (the client
left, the upstream failed, a bug). Settling frees the concurrency slot and corrects the token bucket by the
estimate minus the actual usage (gateway/ratelimit.py has the algorithm).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

from litestar.connection import ASGIConnection
from litestar.enums import ScopeType
from litestar.middleware import ASGIMiddleware
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from kvscope.gateway.auth import Principal
from kvscope.gateway.context import CTX_KEY, RequestContext
from kvscope.gateway.errors import RateLimited
from kvscope.gateway.ratelimit import RateLimiter
from kvscope.gateway.settings import KeyLimits

LEASE_KEY = "kvscope_rate_lease"
"""``scope["state"]`` key of the request's RateLimitLease."""


@dataclass(frozen=True, slots=True)
class _Charge:
    limiter: RateLimiter
    key_id: str
    limits: KeyLimits
    lease_id: str
    prompt_estimate: int
    estimate: int


class RateLimitLease:
    """One request's charge against its key's limits: acquired by admission, settled once."""

    def __init__(self) -> None:
        self._charge: _Charge | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        """``x-ratelimit-*`` headers of the admitted request."""

    async def acquire(
        self,
        limiter: RateLimiter,
        principal: Principal,
        ctx: RequestContext,
        prompt_estimate: int,
        estimate: int,
    ) -> None:
        """Charge one request of ``estimate`` tokens (``prompt_estimate`` of them the prompt) to the key;
        nothing when the key has no limits. Raises RateLimited (429) when a limit refuses it."""
        limits = principal.limits
        if not (limits.requests_per_minute or limits.tokens_per_minute or limits.max_concurrent):
            return
        started = time.perf_counter()
        try:
            decision = await limiter.acquire(principal.key_id, limits, estimate, ctx.event_id)
        finally:
            ctx.edge.rate_limit_s += time.perf_counter() - started  # kvscope.gateway.rate_limit_s
        if not decision.allowed:
            retry = max(1, math.ceil(decision.retry_after_s))
            raise RateLimited(
                f"Rate limit reached for this API key ({decision.reason}). Retry after {retry}s.",
                reason=decision.reason or "requests",
                headers={**decision.headers, "retry-after": str(retry)},
            )
        self.headers = [(k.encode(), v.encode()) for k, v in decision.headers.items()]
        self._charge = _Charge(limiter, principal.key_id, limits, ctx.event_id, prompt_estimate, estimate)

    async def settle(self, ctx: RequestContext) -> None:
        """Release the request (once; later calls do nothing): the actual tokens are the upstream's
        ``usage.total_tokens``, else the prompt estimate + the output tokens seen, else the estimate."""
        charge, self._charge = self._charge, None
        if charge is None:
            return
        actual = (ctx.answer.usage or {}).get("total_tokens")
        if not isinstance(actual, int):
            actual = (
                charge.estimate if ctx.output_tokens is None else charge.prompt_estimate + ctx.output_tokens
            )
        await charge.limiter.release(charge.key_id, charge.limits, charge.lease_id, charge.estimate - actual)


def with_own_limits(
    headers: Iterable[tuple[bytes, bytes]], own: list[tuple[bytes, bytes]]
) -> list[tuple[bytes, bytes]]:
    """A response's ``headers`` with the gateway's own ``x-ratelimit-*`` (``own``) in place of any an upstream
    sent (a relayed answer or a passed-through response): the client sees its key's limits, once each."""
    return [*((k, v) for k, v in headers if not k.lower().startswith(b"x-ratelimit-")), *own]


def lease_of(connection: ASGIConnection) -> RateLimitLease:
    """The request's lease (the route must list :class:`RateLimitMiddleware`)."""
    return connection.scope["state"][LEASE_KEY]


class RateLimitMiddleware(ASGIMiddleware):
    """Owns the request's :class:`RateLimitLease`: its headers on the response, its settlement (module
    docstring)."""

    scopes = (ScopeType.HTTP,)

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        lease = RateLimitLease()
        scope["state"][LEASE_KEY] = lease
        ctx: RequestContext = scope["state"][CTX_KEY]

        async def settling_send(message: Message) -> None:
            if message["type"] == "http.response.start" and lease.headers:
                message = {**message, "headers": with_own_limits(message.get("headers", ()), lease.headers)}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                await lease.settle(ctx)  # the limits are free again when the client sees the end
            await send(message)

        try:
            await next_app(scope, receive, settling_send)
        finally:
            await lease.settle(ctx)  # the client left, the upstream failed, or no body was sent
