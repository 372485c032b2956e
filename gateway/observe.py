"""Per-request observation: the RequestContext every layer fills in, and the middleware that turns it into
exactly one log record, the request metrics and the server span, whatever the outcome.

:func:`observe` wraps the whole app (gateway/app.py calls it before Litestar routes the request), so every
request except the probes (``/healthz``, ``/readyz``, ``/metrics``) is observed: unknown paths, methods no
route declares (TRACE, PROPFIND …) and non-canonical targets (400, gateway/target.py) too. Requests the HTTP
parser refuses before any app runs are recorded by gateway/server.py. It also adds ``x-request-id`` (and the
admitted request's ``x-ratelimit-*`` headers) to every response.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from litestar.types import ASGIApp, Message, Receive, Scope, Send
from opentelemetry.trace import Span, Status, StatusCode

from gateway.errors import GatewayError, error_json
from gateway.metrics import route_label
from gateway.target import check_target
from gateway.tracing import span_ids

if TYPE_CHECKING:
    from gateway.lifespan import GatewayState

PROBE_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
CTX_KEY = "kvscope_ctx"
REFUSED_KEY = "kvscope_refused"
"""``scope["state"]`` key: (error, response bytes) when the HTTP server answered the request itself."""


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
    attempts: int = 0
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
    response_headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    cleanups: list[Callable[[RequestContext], Awaitable[None]]] = field(default_factory=list)

    async def run_cleanups(self) -> None:
        """Run (once) what must happen when the request is done, e.g. settling the rate limiter."""
        cleanups, self.cleanups = self.cleanups, []
        for cleanup in cleanups:
            await cleanup(self)

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

    @property
    def failed(self) -> bool:
        return (self.status or 500) >= 400 or self.stream_error is not None

    def epoch_ns(self, perf: float) -> int:
        """A perf_counter time as epoch nanoseconds."""
        return int((self.start_wall + (perf - self.start)) * 1e9)


def new_request_id(header: str | None) -> str:
    """The client's ``x-request-id`` when it is 1–128 of ``[A-Za-z0-9._:-]``, else a fresh uuid4 hex."""
    if header and _REQUEST_ID.fullmatch(header):
        return header
    return uuid.uuid4().hex


def begin(gw: GatewayState, scope: Scope) -> RequestContext:
    """Start observing a request: context, server span, in-flight gauge."""
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
    path, method = scope["path"], scope["method"]
    route = route_label(path)
    ctx = RequestContext(request_id=new_request_id(headers.get("x-request-id")), method=method, path=path,
                         route=route, start=time.perf_counter(), start_wall=time.time(),
                         client_ip=gw.client_address.resolve((scope.get("client") or (None,))[0], scope["headers"]),
                         user_agent=headers.get("user-agent"),
                         http_version=scope.get("http_version", "1.1"))
    name = f"{method} {route}" if route != "other" else method
    ctx.server_span = gw.tracer.start_server_span(name, headers, ctx.epoch_ns(ctx.start),
                                                  server_span_attributes(ctx, scope))
    ctx.trace_id, ctx.span_id = span_ids(ctx.server_span)
    gw.metrics.in_flight.inc()
    return ctx


async def finish(gw: GatewayState, ctx: RequestContext) -> None:
    """Metrics, span end, the log record, then cleanups not yet run (rate-limit settlement)."""
    ctx.end_at = ctx.end_at or time.perf_counter()
    e2e = ctx.end_at - ctx.start
    m = gw.metrics
    model = m.model_label(ctx.request_model, ctx.model_served)
    m.in_flight.dec()
    m.requests.labels(model, ctx.route, str(ctx.status or 500)).inc()
    m.request_duration.labels(model, ctx.route).observe(e2e, exemplar(ctx))
    m.overhead.labels(ctx.route).observe(ctx.overhead_s)
    if ctx.rate_limited:
        m.rate_limited.labels(ctx.rate_limited).inc()
    if ctx.stream_error:
        m.stream_errors.labels(model, ctx.stream_error).inc()
    _observe_tokens(ctx, model, gw)
    _end_server_span(ctx)
    record = gw.record_builder.build(ctx)
    for sink in gw.sinks:
        sink.emit(record)
    await ctx.run_cleanups()


def exemplar(ctx: RequestContext) -> dict[str, str] | None:
    """``{"trace_id": …}`` for a histogram observation when the request's trace is sampled (so the trace
    exists in the backend), else None. OpenMetrics 1.0 exemplars; Grafana links ``trace_id`` to Jaeger."""
    span = ctx.server_span
    if span is None or ctx.trace_id is None or not span.get_span_context().trace_flags.sampled:
        return None
    return {"trace_id": ctx.trace_id}


def _observe_tokens(ctx: RequestContext, model: str, gw: GatewayState) -> None:
    m = gw.metrics
    if ctx.ttft_s is not None:
        m.ttft.labels(model).observe(ctx.ttft_s, exemplar(ctx))
    if ctx.tpot_s is not None:
        m.tpot.labels(model).observe(ctx.tpot_s, exemplar(ctx))
    usage = ctx.usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    for kind, value in (("input", usage.get("prompt_tokens")), ("output", ctx.output_tokens)):
        if isinstance(value, int) and value > 0:
            m.tokens.labels(model, kind).inc(value)
    if isinstance(cached, int) and cached > 0:
        m.cached_tokens.labels(model).inc(cached)


def server_span_attributes(ctx: RequestContext, scope: Scope) -> dict[str, str | int]:
    """Start attributes of the HTTP SERVER span (OTel semconv 1.41 HTTP server span: required
    ``http.request.method``, ``url.path``, ``url.scheme``, ``http.route``; recommended
    ``network.protocol.version``, ``client.address``, ``user_agent.original``). The client's request id is
    ``kvscope.request.id``: OTel defines no ``http.request.id``."""
    attrs: dict[str, str | int] = {"http.request.method": ctx.method, "url.path": ctx.path,
                                   "url.scheme": scope.get("scheme") or "http", "http.route": ctx.route,
                                   "network.protocol.version": ctx.http_version,
                                   "kvscope.request.id": ctx.request_id}
    if ctx.client_ip:
        attrs["client.address"] = ctx.client_ip
    if ctx.user_agent:
        attrs["user_agent.original"] = ctx.user_agent
    return attrs


def server_span_error(ctx: RequestContext) -> str | None:
    """``error.type`` of the SERVER span, ``None`` when its status stays unset. OTel semconv 1.41 HTTP spans,
    "Status": a server span MUST leave the status unset for 4xx (the client's fault) and set Error for
    5xx, with ``error.type`` the status code as a string. A stream that failed after its 200 is an error
    too (``error.type`` = the stream error reason); a client that left (499) is not the server's error."""
    status = ctx.status or 500
    if status >= 500:
        return str(status)
    if ctx.stream_error and not ctx.client_disconnected:
        return ctx.stream_error
    return None


def _end_server_span(ctx: RequestContext) -> None:
    span = ctx.server_span
    if span is None:
        return
    span.set_attribute("http.response.status_code", ctx.status or 500)
    error_type = server_span_error(ctx)
    if error_type is not None:
        span.set_status(Status(StatusCode.ERROR, ctx.error_message or ""))
        span.set_attribute("error.type", error_type)
    span.end(end_time=ctx.epoch_ns(ctx.end_at or time.perf_counter()))


async def observe(gw: GatewayState, scope: Scope, receive: Receive, send: Send, app: ASGIApp) -> None:
    """Observe one HTTP request around ``app`` (the whole Litestar app, router included, so router-level
    404/405s are observed too): begin, refuse a non-canonical target with a 400 (gateway/target.py), run the
    app, then :func:`finish` exactly once."""
    ctx = begin(gw, scope)
    scope.setdefault("state", {})[CTX_KEY] = ctx
    if (refused := scope["state"].get(REFUSED_KEY)) is not None:  # the parser answered before the app started
        ctx.refused_by_parser(*refused)

    async def observed_send(message: Message) -> None:
        if message["type"] == "http.response.start":
            if not ctx.answered_by_server:
                ctx.status = message["status"]
            message = {**message, "headers": [*message.get("headers", ()),
                                              (b"x-request-id", ctx.request_id.encode()),
                                              *ctx.response_headers]}
            await send(message)
            return
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            await ctx.run_cleanups()  # limits are free again when the client sees the end
        await send(message)
        if message["type"] == "http.response.body":
            ctx.response_bytes += len(message.get("body", b""))
            if not message.get("more_body", False):
                ctx.end_at = time.perf_counter()

    try:
        try:
            check_target(scope.get("raw_path") or scope["path"].encode("latin-1"), scope.get("query_string", b""),
                         scope["path"])
        except GatewayError as err:
            ctx.set_error(err)
            await send_error(observed_send, err)
            return
        await app(scope, receive, observed_send)
    finally:
        await finish(gw, ctx)


async def record_refused(gw: GatewayState, method: str, path: str, client: str | None, err: GatewayError,
                         response_bytes: int) -> None:
    """The one log record (and metrics, span) of a request the HTTP server refused before any app saw it."""
    scope = {"type": "http", "method": method, "path": path, "headers": [], "client": (client, 0),
             "http_version": "1.1"}
    ctx = begin(gw, scope)  # type: ignore[arg-type]
    ctx.set_error(err)
    ctx.status, ctx.response_bytes, ctx.end_at = err.status, response_bytes, time.perf_counter()
    await finish(gw, ctx)


async def send_error(send: Send, err: GatewayError) -> None:
    """Answer with ``err``'s OpenAI error JSON (status, JSON content type, ``err.headers``)."""
    body = error_json(err)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *((k.encode("latin-1"), v.encode("latin-1")) for k, v in err.headers.items())]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
