"""Per-request observation: the wrapper that turns each request's RequestContext (gateway/context.py) into
exactly one log record, the request metrics and the server span, whatever the outcome.

:func:`observe` wraps the whole app (gateway/app.py calls it before Litestar routes the request), so every
request except the probes (``/healthz``, ``/readyz``, ``/metrics``) is observed: unknown paths, methods no
route declares (TRACE, PROPFIND …) and non-canonical targets (400, gateway/target.py) too. Requests the HTTP
parser refuses before any app runs are recorded by gateway/server.py. It also adds ``x-request-id`` to every
response.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from litestar.types import ASGIApp, Message, Receive, Scope, Send
from opentelemetry.trace import Status, StatusCode

from kvscope.gateway.context import CTX_KEY, REFUSED_KEY, RequestContext, new_request_id
from kvscope.gateway.errors import GatewayError, error_json
from kvscope.gateway.metrics import route_label
from kvscope.gateway.target import check_target
from kvscope.gateway.tracing import span_ids

if TYPE_CHECKING:
    from kvscope.gateway.state import GatewayState

PROBE_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


def begin(gw: GatewayState, scope: Mapping[str, Any]) -> RequestContext:
    """Start observing a request: context, server span, in-flight gauge. ``scope``: the ASGI HTTP scope, or
    the part of one a request refused by the HTTP server has (``method``, ``path``, ``headers``, ``client``,
    ``http_version``)."""
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
    path, method = scope["path"], scope["method"]
    route = route_label(path)
    ctx = RequestContext(
        request_id=new_request_id(headers.get("x-request-id")),
        method=method,
        path=path,
        route=route,
        start=time.perf_counter(),
        start_wall=time.time(),
        client_ip=gw.client_address.resolve((scope.get("client") or (None,))[0], scope["headers"]),
        user_agent=headers.get("user-agent"),
        http_version=scope.get("http_version", "1.1"),
    )
    name = f"{method} {route}" if route != "other" else method
    ctx.trace.span = gw.tracer.start_server_span(
        name, headers, ctx.epoch_ns(ctx.start), server_span_attributes(ctx, scope)
    )
    ctx.trace.trace_id, ctx.trace.span_id = span_ids(ctx.trace.span)
    gw.metrics.in_flight.inc()
    return ctx


async def finish(gw: GatewayState, ctx: RequestContext) -> None:
    """Metrics, span end, the log record."""
    ctx.outcome.end_at = ctx.outcome.end_at or time.perf_counter()
    e2e = ctx.outcome.end_at - ctx.start
    m = gw.metrics
    model = m.model_label(ctx.request.model, ctx.request.model_served)
    m.in_flight.dec()
    m.requests.labels(model, ctx.route, str(ctx.outcome.status or 500)).inc()
    m.request_duration.labels(model, ctx.route).observe(e2e, exemplar(ctx))
    m.overhead.labels(ctx.route).observe(ctx.overhead_s)
    if ctx.outcome.rate_limited:
        m.rate_limited.labels(ctx.outcome.rate_limited).inc()
    if ctx.outcome.stream_error:
        m.stream_errors.labels(model, ctx.outcome.stream_error).inc()
    _observe_tokens(ctx, model, gw)
    _end_server_span(ctx)
    record = gw.record_builder.build(ctx)
    for sink in gw.sinks:
        sink.emit(record)


def exemplar(ctx: RequestContext) -> dict[str, str] | None:
    """``{"trace_id": …}`` for a histogram observation when the request's trace is sampled (so the trace
    exists in the backend), else None. OpenMetrics 1.0 exemplars; Grafana links ``trace_id`` to Jaeger."""
    span = ctx.trace.span
    if span is None or ctx.trace.trace_id is None or not span.get_span_context().trace_flags.sampled:
        return None
    return {"trace_id": ctx.trace.trace_id}


def _observe_tokens(ctx: RequestContext, model: str, gw: GatewayState) -> None:
    m = gw.metrics
    if ctx.ttft_s is not None:
        m.ttft.labels(model).observe(ctx.ttft_s, exemplar(ctx))
    if ctx.tpot_s is not None:
        m.tpot.labels(model).observe(ctx.tpot_s, exemplar(ctx))
    usage = ctx.answer.usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    for kind, value in (("input", usage.get("prompt_tokens")), ("output", ctx.output_tokens)):
        if isinstance(value, int) and value > 0:
            m.tokens.labels(model, kind).inc(value)
    if isinstance(cached, int) and cached > 0:
        m.cached_tokens.labels(model).inc(cached)
    _observe_routing(ctx, model, gw, cached if isinstance(cached, int) else None)


def _observe_routing(ctx: RequestContext, model: str, gw: GatewayState, cached: int | None) -> None:
    """The request's routing decision, and how its predicted cached tokens compare with what the upstream
    reported (requests with both only: an upstream that reports no cached tokens cannot grade it)."""
    routing, m = ctx.upstream.routing, gw.metrics
    if routing is None:
        return
    m.routing_decisions.labels(model, routing.policy, routing.reason).inc()
    predicted = routing.predicted_cached_tokens
    if predicted is None or cached is None:
        return
    m.routing_cached_tokens.labels(model, "predicted").inc(predicted)
    m.routing_cached_tokens.labels(model, "reported").inc(cached)
    outcome = "exact" if predicted == cached else ("over" if predicted > cached else "under")
    m.routing_predictions.labels(model, outcome).inc()


def server_span_attributes(ctx: RequestContext, scope: Mapping[str, Any]) -> dict[str, str | int]:
    """Start attributes of the HTTP SERVER span (OTel semconv 1.41 HTTP server span: required
    ``http.request.method``, ``url.path``, ``url.scheme``, ``http.route``; recommended
    ``network.protocol.version``, ``client.address``, ``user_agent.original``). The client's request id is
    ``kvscope.request.id``: OTel defines no ``http.request.id``."""
    attrs: dict[str, str | int] = {
        "http.request.method": ctx.method,
        "url.path": ctx.path,
        "url.scheme": scope.get("scheme") or "http",
        "http.route": ctx.route,
        "network.protocol.version": ctx.http_version,
        "kvscope.request.id": ctx.request_id,
    }
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
    status = ctx.outcome.status or 500
    if status >= 500:
        return str(status)
    if ctx.outcome.stream_error and not ctx.outcome.client_disconnected:
        return ctx.outcome.stream_error
    return None


def _end_server_span(ctx: RequestContext) -> None:
    span = ctx.trace.span
    if span is None:
        return
    span.set_attribute("http.response.status_code", ctx.outcome.status or 500)
    error_type = server_span_error(ctx)
    if error_type is not None:
        span.set_status(Status(StatusCode.ERROR, ctx.outcome.error_message or ""))
        span.set_attribute("error.type", error_type)
    span.end(end_time=ctx.epoch_ns(ctx.outcome.end_at or time.perf_counter()))


async def observe(gw: GatewayState, scope: Scope, receive: Receive, send: Send, app: ASGIApp) -> None:
    """Observe one HTTP request around ``app`` (the whole Litestar app, router included, so router-level
    404/405s are observed too): begin, refuse a non-canonical target with a 400 (gateway/target.py), run the
    app, then :func:`finish` exactly once."""
    ctx = begin(gw, scope)
    scope.setdefault("state", {})[CTX_KEY] = ctx
    if (refused := scope["state"].get(REFUSED_KEY)) is not None:  # the parser answered before the app started
        ctx.outcome.refused_by_parser(*refused)

    async def observed_send(message: Message) -> None:
        if message["type"] == "http.response.start":
            if not ctx.outcome.answered_by_server:
                ctx.outcome.status = message["status"]
            message = {
                **message,
                "headers": [*message.get("headers", ()), (b"x-request-id", ctx.request_id.encode())],
            }
            await send(message)
            return
        await send(message)
        if message["type"] == "http.response.body":
            ctx.outcome.response_bytes += len(message.get("body", b""))
            if not message.get("more_body", False):
                ctx.outcome.end_at = time.perf_counter()

    try:
        try:
            check_target(
                scope.get("raw_path") or scope["path"].encode("latin-1"),
                scope.get("query_string", b""),
                scope["path"],
            )
        except GatewayError as err:
            ctx.outcome.set_error(err)
            await send_error(observed_send, err)
            return
        await app(scope, receive, observed_send)
    finally:
        await finish(gw, ctx)


async def record_refused(
    gw: GatewayState, method: str, path: str, client: str | None, err: GatewayError, response_bytes: int
) -> None:
    """The one log record (and metrics, span) of a request the HTTP server refused before any app saw it."""
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": [],
        "client": (client, 0),
        "http_version": "1.1",
    }
    ctx = begin(gw, scope)
    ctx.outcome.set_error(err)
    ctx.outcome.status, ctx.outcome.response_bytes, ctx.outcome.end_at = (
        err.status,
        response_bytes,
        time.perf_counter(),
    )
    await finish(gw, ctx)


async def send_error(send: Send, err: GatewayError) -> None:
    """Answer with ``err``'s OpenAI error JSON (status, JSON content type, ``err.headers``)."""
    body = error_json(err)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *((k.encode("latin-1"), v.encode("latin-1")) for k, v in err.headers.items()),
    ]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
