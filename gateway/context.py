"""The RequestContext: everything known about one request, read by the log record builder, the span
attributes and the metrics. Its arrival fields are fixed when it is made (gateway/observe.py); what later
phases learn lives in one part per phase (trace, edge, request, upstream, answer, outcome), each written
only by the modules its class names. Imports only gateway/errors.py (itself a leaf) and, for types only,
gateway/engines/ (which imports nothing of the gateway's request path), so every layer may import it without a
circle.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal

from litestar.connection import ASGIConnection
from opentelemetry.trace import Span

from kvscope.gateway.errors import GatewayError

if TYPE_CHECKING:
    from kvscope.gateway.engines.reports import UpstreamReport
    from kvscope.gateway.engines.section import SampleStamp

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
        """The log record's ``kvscope.gateway`` object (keys in :data:`GATEWAY_PHASES` order)."""
        return {
            "auth_s": self.auth_s,
            "rate_limit_s": self.rate_limit_s,
            "tokenize_s": self.tokenize_s,
            "retry_s": self.retry_s,
            "upstream_connect_s": self.upstream_connect_s,
            "upstream_response_s": self.upstream_response_s,
            "other_s": self.other_s,
        }


GATEWAY_PHASES = tuple(f.name for f in fields(GatewayPhases))
"""The fields of ``kvscope.gateway`` in the request log record, in order."""


@dataclass(slots=True)
class ServerTrace:
    """The request's HTTP SERVER span and its ids (lowercase hex). Written by gateway/observe.py only."""

    span: Span | None = None
    trace_id: str | None = None
    span_id: str | None = None


@dataclass(slots=True)
class EdgePhase:
    """What the route's guards and the rate-limit lease learnt. Written by gateway/guards.py (operation, key
    id, auth seconds) and gateway/ratelimit_middleware.py (rate-limit seconds) only."""

    operation: str | None = None
    """``gen_ai.operation.name`` (``chat``, ``text_completion``)."""
    key_id: str | None = None
    """The authenticated API key's name (None: anonymous)."""
    service_tier: str | None = None
    """The key's engine tier (``x-kvscope-service-tier``; None: none configured)."""
    auth_s: float = 0.0
    """Seconds in the auth guard."""
    rate_limit_s: float = 0.0
    """Seconds acquiring the rate-limit lease (Redis round trips included)."""


@dataclass(slots=True)
class ClientRequest:
    """What the client asked for. Written by gateway/body.py (``body_bytes``), gateway/admission.py (the
    rest) and gateway/proxy/passthrough.py (model and whether it is served) only."""

    body_bytes: int = 0
    model: str | None = None
    model_served: bool = False
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    prompt_tokens: int | None = None
    """Counted at the gateway (None without a tokenizer)."""
    tokenize_s: float = 0.0
    """Seconds counting the prompt's tokens for the context-length check."""
    input_content: Any = None
    """The messages or prompt, kept only when content is logged."""


@dataclass(frozen=True, slots=True)
class RoutingRecord:
    """A routing decision as the request log and metrics carry it (gateway/routing/router.py
    RouteDecision)."""

    policy: str
    """cache_aware, least_outstanding or round_robin."""
    reason: str
    """prefix_match, load, round_robin or fallback."""
    replica: str
    """The chosen replica's label (the ``upstream`` label of the gateway's metrics)."""
    predicted_cached_tokens: int | None
    """cache_aware: prompt tokens the replica most likely serves from its prefix cache."""
    prefix_unit: str | None
    """What the prediction hashed: ``tokens`` (the prompt's ids) or ``text`` (no tokenizer)."""


@dataclass(slots=True)
class UpstreamAttempts:
    """The upstream attempts (``time.perf_counter()`` seconds). Written by gateway/proxy/call.py and
    gateway/proxy/passthrough.py only, through :meth:`started` and :meth:`ended`."""

    address: str | None = None
    """The URL of the last replica tried (``server.address`` of the log record)."""
    attempts: int = 0
    total_s: float = 0.0
    """Seconds spent in upstream attempts, all of them (each: its start → the upstream's last byte)."""
    first_attempt_at: float | None = None
    retry_s: float = 0.0
    """First attempt's start → the last attempt's start: the failed attempts and the time between them."""
    connect_s: float = 0.0
    """Last attempt: its start → the upstream's response headers (connect, send, the upstream's own work
    before it sends headers; the whole attempt when no headers came)."""
    response_s: float = 0.0
    """Last attempt: the response headers → the upstream's last byte."""

    routing: RoutingRecord | None = None
    """How the last attempt's replica was chosen (None where the request reached no replica)."""
    kind: str | None = None
    """The last attempt's replica's kind (gateway/engines/kinds.py ``UpstreamKind``) when it started."""
    kind_source: str | None = None
    """Which signal decided that kind (``config``, ``models``, ``metrics``, ``info``, ``props``,
    ``default``)."""
    arrival_sample: SampleStamp | None = None
    """The last attempt's replica's latest engine sample when the attempt started (None: none scraped)."""
    finish_sample: SampleStamp | None = None
    """Its latest engine sample when the attempt ended."""

    def started(self, address: str) -> None:
        """One more attempt, at the replica ``address``."""
        self.attempts += 1
        self.address = address

    def ended(self, start: float, headers_at: float | None, end: float, request_end: float | None) -> float:
        """Account one attempt (its start, its response headers or None, the upstream's last byte) in the
        retry/upstream phases and ``total_s``; the latest attempt is the one that answered. An end after
        ``request_end`` (the request's own end, None: not yet) counts up to it (the phases and ``total_s``
        alike, so a failed attempt's share of ``total_s`` stays within ``retry_s``). Returns the end it
        counted."""
        if request_end is not None:
            end = min(end, request_end)
        self.total_s += end - start
        if self.first_attempt_at is None:
            self.first_attempt_at = start
        connected = end if headers_at is None else min(headers_at, end)
        self.retry_s = start - self.first_attempt_at
        self.connect_s, self.response_s = connected - start, end - connected
        return end


@dataclass(slots=True)
class Generation:
    """What the upstream answered, from the relay's RelayOutcome. Written by gateway/proxy/call.py only."""

    usage: dict[str, Any] | None = None
    engine: dict[str, Any] | None = None
    """The engine's ``kvscope`` object (the log record's ``kvscope.engine``), when it sent one."""
    response_model: str | None = None
    response_id: str | None = None
    """The upstream's completion id (``chatcmpl-…``): ``gen_ai.response.id``."""
    finish_reasons: list[str] = field(default_factory=list)
    output_events: int = 0
    """Stream events that carried a token."""
    output_content: list[str] | None = None
    first_token_at: float | None = None
    """When the first token event was sent to the client (perf_counter seconds; streams only)."""
    upstream_end: float | None = None
    """When the answer's last byte came from the upstream (perf_counter seconds; a stream's ``[DONE]``)."""
    report: UpstreamReport | None = None
    """What the upstream reported about the request (gateway/engines/reports.py), from its answer's body
    and headers."""


@dataclass(slots=True)
class Outcome:
    """How the request ended: the response the client got and what went wrong. The status, byte count and
    end are written by gateway/observe.py (and by gateway/proxy/call.py for the body bytes it writes past
    the ASGI send, and for a client that left before the response started); the error fields only through
    the methods below (errors, disconnects, a stream that failed after its 200)."""

    status: int | None = None
    response_bytes: int = 0
    end_at: float | None = None
    """perf_counter seconds when the response's last byte was sent."""
    error_type: str | None = None
    error_message: str | None = None
    stream_error: str | None = None
    """Why a stream failed after its 200 (incomplete, upstream_error, timeout …)."""
    client_disconnected: bool = False
    disconnect_phase: str | None = None
    rate_limited: str | None = None
    """The rate limit's reason (``requests``, ``tokens`` …) when the request got a 429."""
    answered_by_server: bool = False
    """The HTTP server answered this request itself (a broken body framing): its status is final."""

    def set_error(self, err: GatewayError) -> None:
        if self.answered_by_server:
            return  # the HTTP server's 400 is what the client got
        self.error_type, self.error_message = err.error_type, err.message
        if err.status == 429:
            self.rate_limited = getattr(err, "reason", "requests")

    def stream_failed(self, reason: str, error_type: str | None = None, message: str | None = None) -> None:
        """The stream failed after its 200 for ``reason``; ``error_type`` / ``message``: the upstream's own
        error event, when it sent one (else the error fields stay as they are)."""
        self.stream_error = reason
        if error_type is not None:
            self.error_type, self.error_message = error_type, message

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
    def failed(self) -> bool:
        return (self.status or 500) >= 400 or self.stream_error is not None


@dataclass(frozen=True, slots=True)
class RequestContext:
    """Everything known about one request; times are ``time.perf_counter()`` seconds unless noted.

    The arrival fields are set once, by gateway/observe.py, when the request arrives; the rest is held in
    one part per phase, each written by the modules its docstring names: :class:`ServerTrace` (observe),
    :class:`EdgePhase` (guards, rate limit), :class:`ClientRequest` (body, admission),
    :class:`UpstreamAttempts` and :class:`Generation` (the proxy), :class:`Outcome` (observe, the proxy,
    errors). The log record (gateway/logs/record.py), the spans and the metrics read them; the properties
    below combine them."""

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
    trace: ServerTrace = field(default_factory=ServerTrace)
    edge: EdgePhase = field(default_factory=EdgePhase)
    request: ClientRequest = field(default_factory=ClientRequest)
    upstream: UpstreamAttempts = field(default_factory=UpstreamAttempts)
    answer: Generation = field(default_factory=Generation)
    outcome: Outcome = field(default_factory=Outcome)

    @property
    def output_tokens(self) -> int | None:
        """The upstream's ``usage.completion_tokens``; for a stream at least the token events relayed (an
        event carries one token or more), so an upstream whose usage counts one choice of ``n`` (llama.cpp
        0c1e570 with ``n`` > 1 reports the last choice's tokens) does not halve the count; None for a JSON
        answer without usage."""
        usage = self.answer.usage
        reported = usage.get("completion_tokens") if usage else None
        if not isinstance(reported, int):
            reported = None
        if not self.request.stream:
            return reported
        return (
            max(reported or 0, self.answer.output_events)
            if reported is not None
            else self.answer.output_events
        )

    @property
    def ttft_s(self) -> float | None:
        """Arrival → first token event sent (streams only)."""
        first = self.answer.first_token_at
        return None if first is None else first - self.start

    @property
    def tpot_s(self) -> float | None:
        """(e2e − TTFT) / (output tokens per choice − 1); None below 2 tokens or without a TTFT."""
        tokens, first, end = self.output_tokens, self.answer.first_token_at, self.outcome.end_at
        if first is None or end is None or tokens is None:
            return None
        per_choice = self._per_choice(tokens)
        return (end - first) / (per_choice - 1) if per_choice >= 2 else None

    def _per_choice(self, tokens: int) -> int:
        return tokens // (len(self.answer.finish_reasons) or 1)

    @property
    def reported_ttft_s(self) -> float | None:
        """A non-streamed answer's TTFT from the upstream's report: (the upstream's last byte − its reported
        ``decode_s``) − arrival, so it also holds the upstream's time from its last token to its last byte
        (serialising, sending); None for streams (:attr:`ttft_s` measures them), without ``decode_s``, or
        when ``decode_s`` is longer than the request had lasted (a report that cannot be this request's)."""
        report, end = self.answer.report, self.answer.upstream_end
        if self.request.stream or report is None or report.decode_s is None or end is None:
            return None
        ttft = end - report.decode_s - self.start
        return ttft if ttft >= 0 else None

    @property
    def reported_tpot_s(self) -> float | None:
        """A non-streamed answer's TPOT from the upstream's report: its ``tpot_s``, else ``decode_s`` /
        (output tokens per choice − 1); None for streams, below 2 tokens or without a report."""
        report = self.answer.report
        if self.request.stream or report is None:
            return None
        if report.tpot_s is not None:
            return report.tpot_s
        tokens = self.output_tokens
        if report.decode_s is None or tokens is None or self._per_choice(tokens) < 2:
            return None
        return report.decode_s / (self._per_choice(tokens) - 1)

    @property
    def ttft_source(self) -> Literal["gateway", "per_request"] | None:
        """Where the log's ``kvscope.ttft_s`` comes from: ``gateway`` (a stream's first token event,
        measured), ``per_request`` (:attr:`reported_ttft_s`), None (neither)."""
        if self.ttft_s is not None:
            return "gateway"
        return "per_request" if self.reported_ttft_s is not None else None

    @property
    def tpot_source(self) -> Literal["gateway", "per_request"] | None:
        """Where the log's ``kvscope.tpot_s`` comes from: ``gateway`` (:attr:`tpot_s`, a stream's token
        times), ``per_request`` (:attr:`reported_tpot_s`), None (neither)."""
        if self.tpot_s is not None:
            return "gateway"
        return "per_request" if self.reported_tpot_s is not None else None

    @property
    def overhead_s(self) -> float:
        """Seconds spent in the gateway: e2e minus the time spent waiting on upstream attempts."""
        end = self.outcome.end_at if self.outcome.end_at is not None else time.perf_counter()
        return max(0.0, end - self.start - self.upstream.total_s)

    def attempt_ended(self, start: float, headers_at: float | None, end: float) -> float:
        """:meth:`UpstreamAttempts.ended` up to the request's own end; returns the end it counted."""
        return self.upstream.ended(start, headers_at, end, self.outcome.end_at)

    def gateway_phases(self, e2e_s: float) -> GatewayPhases:
        """The request's ``e2e_s`` split into the phases of :class:`GatewayPhases`; ``other_s`` is the
        remainder, so the phases add up to ``e2e_s`` (asserted to 1e-9 s)."""
        edge, upstream = self.edge, self.upstream
        measured = (
            edge.auth_s
            + edge.rate_limit_s
            + self.request.tokenize_s
            + upstream.retry_s
            + upstream.connect_s
            + upstream.response_s
        )
        phases = GatewayPhases(
            auth_s=edge.auth_s,
            rate_limit_s=edge.rate_limit_s,
            tokenize_s=self.request.tokenize_s,
            retry_s=upstream.retry_s,
            upstream_connect_s=upstream.connect_s,
            upstream_response_s=upstream.response_s,
            other_s=e2e_s - measured,
        )
        assert abs(phases.total_s - e2e_s) <= 1e-9, (phases, e2e_s)
        return phases

    @property
    def failed(self) -> bool:
        return self.outcome.failed

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
