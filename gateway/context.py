"""The RequestContext: everything known about one request, filled in by admission, the proxy and the
observation wrapper, read by the log record builder, the span attributes and the metrics. A leaf module: it
imports no other gateway module, so every layer may import it without a circle.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field, fields
from typing import Any

from litestar.connection import ASGIConnection
from opentelemetry.trace import Span

from kvscope.gateway.errors import GatewayError

CTX_KEY = "kvscope_ctx"
"""``scope["state"]`` key of the request's RequestContext."""
REFUSED_KEY = "kvscope_refused"
"""``scope["state"]`` key: (error, response bytes) when the HTTP server answered the request itself."""
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


@dataclass(frozen=True, slots=True)
class GatewayPhases:
    """One request's end-to-end seconds at the gateway, by phase (all ``time.perf_counter()`` differences).
    They add up to ``kvscope.e2e_s``; the upstream's answer (and so everything the engine did:
    queue, prefill, decode) lies in ``upstream_connect_s + upstream_response_s``, never in the others."""

    auth_s: float
    rate_limit_s: float
    tokenize_s: float
    retry_s: float
    upstream_connect_s: float
    upstream_response_s: float
    other_s: float
    """The remainder: body read, parsing and checks, routing, relaying and logging in the gateway."""

    @property
    def total_s(self) -> float:
        return (
            self.auth_s
            + self.rate_limit_s
            + self.tokenize_s
            + self.retry_s
            + self.upstream_connect_s
            + self.upstream_response_s
            + self.other_s
        )

    def to_dict(self) -> dict[str, float]:
        """The log record's ``kvscope.gateway`` object."""
        return {name: getattr(self, name) for name in GATEWAY_PHASES}


GATEWAY_PHASES = tuple(f.name for f in fields(GatewayPhases))
"""The fields of ``kvscope.gateway`` in the request log record, in order."""


@dataclass(slots=True)
class RequestContext:
    """Everything known about one request; times are ``time.perf_counter()`` seconds unless noted."""

    request_id: str
    """The client's ``x-request-id`` (or a fresh id without one): echoed and sent upstream, logged as
    ``http.request.id``. Not unique: a client may reuse it."""
    method: str
    path: str
    route: str
    start: float
    start_wall: float
    """``time.time()`` at arrival (epoch seconds)."""
    event_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """The gateway's own id of this request, unique whatever the client sends: ECS ``event.id`` of the log
    record and its Elasticsearch ``_id`` (so a spool replayed after a crash de-duplicates)."""
    client_ip: str | None = None
    user_agent: str | None = None
    http_version: str = "1.1"
    server_span: Span | None = None
    trace_id: str | None = None
    span_id: str | None = None
    key_id: str | None = None
    operation: str | None = None
    request_model: str | None = None
    model_served: bool = False
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    prompt_tokens: int | None = None
    """Counted at the gateway (None without a tokenizer)."""
    request_bytes: int = 0
    status: int | None = None
    response_bytes: int = 0
    end_at: float | None = None
    first_token_at: float | None = None
    upstream: str | None = None
    upstream_s: float = 0.0
    """Seconds spent in upstream attempts, all of them (each: its start → the upstream's last byte)."""
    attempts: int = 0
    auth_s: float = 0.0
    """Seconds in the auth guard (gateway/guards.py)."""
    rate_limit_s: float = 0.0
    """Seconds acquiring the rate-limit lease (gateway/ratelimit_middleware.py; Redis round trips
    included)."""
    tokenize_s: float = 0.0
    """Seconds counting the prompt's tokens for the context-length check (gateway/admission.py)."""
    first_attempt_at: float | None = None
    retry_s: float = 0.0
    """First attempt's start → the last attempt's start: the failed attempts and the time between them."""
    upstream_connect_s: float = 0.0
    """Last attempt: its start → the upstream's response headers (connect, send, the upstream's own work
    before it sends headers; the whole attempt when no headers came)."""
    upstream_response_s: float = 0.0
    """Last attempt: the response headers → the upstream's last byte."""
    usage: dict[str, Any] | None = None
    engine: dict[str, Any] | None = None
    response_model: str | None = None
    response_id: str | None = None
    """The upstream's completion id (``chatcmpl-…``): ``gen_ai.response.id``."""
    finish_reasons: list[str] = field(default_factory=list)
    output_events: int = 0
    error_type: str | None = None
    error_message: str | None = None
    stream_error: str | None = None
    """Why a stream failed after its 200 (incomplete, upstream_error, timeout …)."""
    client_disconnected: bool = False
    disconnect_phase: str | None = None
    rate_limited: str | None = None
    answered_by_server: bool = False
    """The HTTP server answered this request itself (a broken body framing): its status is final."""
    input_content: Any = None
    output_content: list[str] | None = None

    def set_error(self, err: GatewayError) -> None:
        if self.answered_by_server:
            return  # the HTTP server's 400 is what the client got
        self.error_type, self.error_message = err.error_type, err.message
        if err.status == 429:
            self.rate_limited = getattr(err, "reason", "requests")

    def refused_by_parser(self, err: GatewayError, response_bytes: int) -> None:
        """The HTTP parser answered ``err`` while the app still held this request (gateway/server.py)."""
        self.set_error(err)
        self.status, self.response_bytes, self.answered_by_server = err.status, response_bytes, True
        self.end_at = time.perf_counter()

    def mark_disconnected(self, phase: str) -> None:
        if self.answered_by_server:
            return  # the server closed the connection after its 400, the client did not leave
        self.client_disconnected, self.disconnect_phase = True, phase
        self.error_type = self.error_type or "client_disconnected"
        self.error_message = self.error_message or f"client disconnected ({phase})"

    @property
    def output_tokens(self) -> int | None:
        if self.usage and isinstance(self.usage.get("completion_tokens"), int):
            return self.usage["completion_tokens"]
        return self.output_events if self.stream else None

    @property
    def ttft_s(self) -> float | None:
        """Arrival → first token event sent (streams only)."""
        return None if self.first_token_at is None else self.first_token_at - self.start

    @property
    def tpot_s(self) -> float | None:
        """(e2e − TTFT) / (output tokens per choice − 1); None below 2 tokens or without a TTFT."""
        tokens = self.output_tokens
        if self.first_token_at is None or self.end_at is None or tokens is None:
            return None
        per_choice = tokens // (len(self.finish_reasons) or 1)
        return (self.end_at - self.first_token_at) / (per_choice - 1) if per_choice >= 2 else None

    @property
    def overhead_s(self) -> float:
        """Seconds spent in the gateway: e2e minus the time spent waiting on upstream attempts."""
        end = self.end_at if self.end_at is not None else time.perf_counter()
        return max(0.0, end - self.start - self.upstream_s)

    def attempt_ended(self, start: float, headers_at: float | None, end: float) -> float:
        """Account one upstream attempt (perf_counter times: its start, its response headers or None, the
        upstream's last byte) in the retry/upstream phases and ``upstream_s``; the latest attempt is the
        one that answered. An end after the request's own end counts up to the request's end (the phases
        and ``upstream_s`` alike, so a failed attempt's share of ``upstream_s`` stays within ``retry_s``).
        Returns the end it counted."""
        if self.end_at is not None:
            end = min(end, self.end_at)
        self.upstream_s += end - start
        if self.first_attempt_at is None:
            self.first_attempt_at = start
        connected = end if headers_at is None else min(headers_at, end)
        self.retry_s = start - self.first_attempt_at
        self.upstream_connect_s, self.upstream_response_s = connected - start, end - connected
        return end

    def gateway_phases(self, e2e_s: float) -> GatewayPhases:
        """The request's ``e2e_s`` split into the phases of :class:`GatewayPhases`; ``other_s`` is the
        remainder, so the phases add up to ``e2e_s`` (asserted to 1e-9 s)."""
        measured = (
            self.auth_s,
            self.rate_limit_s,
            self.tokenize_s,
            self.retry_s,
            self.upstream_connect_s,
            self.upstream_response_s,
        )
        phases = GatewayPhases(*measured, other_s=e2e_s - sum(measured))
        assert abs(phases.total_s - e2e_s) <= 1e-9, (phases, e2e_s)
        return phases

    @property
    def failed(self) -> bool:
        return (self.status or 500) >= 400 or self.stream_error is not None

    def epoch_ns(self, perf: float) -> int:
        """A perf_counter time as epoch nanoseconds."""
        return int((self.start_wall + (perf - self.start)) * 1e9)


def context_of(connection: ASGIConnection) -> RequestContext:
    """The request's context (gateway/observe.py puts it in ``scope["state"]`` before any route runs)."""
    return connection.scope["state"][CTX_KEY]


def new_request_id(header: str | None) -> str:
    """The client's ``x-request-id`` when it is 1–128 of ``[A-Za-z0-9._:-]``, else a fresh uuid4 hex."""
    if header and _REQUEST_ID.fullmatch(header):
        return header
    return uuid.uuid4().hex
