"""A request's place in the scheduler, from its body and headers, and the answer when admission refuses it
(issue 42; docs/engine-server.md "Priorities and admission").

* Tier: the body's ``service_tier`` (OpenAI's values: ``auto``/``default``/``scale`` → ``default``, ``flex``,
  ``priority``; engine/core/admission.py SERVICE_TIERS), else the ``x-kvscope-service-tier`` header (the
  gateway sets it from the API key's ``service_tier``), else ``default``. The header's tier is also the best
  its requests get: a key configured ``default`` asking for ``priority`` is served ``default``; any request
  may ask for a worse tier.
* Priority: the body's ``priority`` (vLLM's field: lower is earlier, inside a tier; default 0).
* Deadline: the ``x-kvscope-timeout`` header, seconds from the server's receipt of the request (so a
  grammar compile and the chat template count) after which the caller gives up (the gateway sends what is
  left of its first-token or total timeout): a request still waiting for its first admission then is
  dropped before any prefill.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from litestar import Request

from kvscope.common.deadline_header import TIMEOUT_HEADER, parse_timeout
from kvscope.engine.core.admission import DEFAULT_TIER, SERVICE_TIERS, TIER_RANK, TIERS, Refusal
from kvscope.engine.core.stats import KvscopeStats
from kvscope.engine.server.access_log import AccessRecord
from kvscope.engine.server.errors import OpenAIError, bad_request
from kvscope.engine.server.protocol import SamplingFields

SERVICE_TIER_HEADER = "x-kvscope-service-tier"
"""The API key's tier, set by the gateway (its ``api_keys[].service_tier``); one of TIERS."""
SHED_CODE = "ttft_slo_exceeded"
"""The ``code`` of admission's 503 (the gateway recognises it: a refusal is no replica failure)."""


@dataclass(frozen=True, slots=True)
class Schedule:
    """Where one request goes in the scheduler (EngineRequest.service_tier / priority / deadline)."""

    service_tier: str = DEFAULT_TIER
    priority: int = 0
    deadline: float | None = None
    """``time.monotonic()`` seconds at which its ``x-kvscope-timeout`` passes, counted from the server's
    receipt of the request (AccessRecord.received; now, outside the access middleware); None: none."""
    named: bool = False
    """The caller named a tier (the body's ``service_tier`` or the key's header): chat responses then say the
    tier served in ``service_tier``, as OpenAI's do when the request set one."""


def schedule_of(request: Request, body: SamplingFields) -> Schedule:
    """The request's tier, priority and timeout (see the module docstring). Raises OpenAIError (400,
    ``param`` the header) for a tier header that names no tier or a timeout that is not a positive number."""
    key_tier = request.headers.get(SERVICE_TIER_HEADER)
    if key_tier is not None and key_tier not in TIER_RANK:
        raise bad_request(
            f"{SERVICE_TIER_HEADER} must be one of {', '.join(TIERS)}.", param=SERVICE_TIER_HEADER
        )
    asked = SERVICE_TIERS[body.service_tier] if body.service_tier is not None else None
    tier = asked or key_tier or DEFAULT_TIER
    if key_tier is not None and TIER_RANK[tier] < TIER_RANK[key_tier]:
        tier = key_tier
    timeout = _timeout(request.headers.get(TIMEOUT_HEADER))
    deadline = None
    if timeout is not None:
        access = request.scope.get("kvscope.access")
        deadline = (access.received if isinstance(access, AccessRecord) else time.monotonic()) + timeout
    return Schedule(tier, body.priority or 0, deadline, named=asked is not None or key_tier is not None)


def _timeout(value: str | None) -> float | None:
    try:
        return parse_timeout(value)
    except ValueError as exc:
        raise bad_request(str(exc), param=TIMEOUT_HEADER) from None


def refusal_stats(refusal: Refusal) -> KvscopeStats:
    """The ``kvscope`` object of a refused request: the prediction, its tier and the requests ahead, and for
    one dropped from the queue its wait as ``queue_s`` (the fields an admitted request's object has under the
    same names)."""
    return KvscopeStats(
        predicted_ttft_s=refusal.predicted_ttft_s,
        service_tier=refusal.tier,
        queue_ahead=refusal.requests_ahead,
        queue_s=refusal.waited_s,
    )


def refusal_error(refusal: Refusal) -> OpenAIError:
    """Admission's answer: 503 ``ttft_slo_exceeded`` with the prediction in the message, ``Retry-After``
    (whole seconds until the queue would meet the objective) and the ``kvscope`` object of
    :func:`refusal_stats` beside ``error``."""
    return OpenAIError(
        503,
        refusal.message,
        code=SHED_CODE,
        headers={"Retry-After": str(refusal.retry_after_s)},
        kvscope=refusal_stats(refusal),
    )
