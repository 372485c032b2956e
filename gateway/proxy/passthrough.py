"""Pass-through of ``/v1/*`` paths the gateway does not interpret (embeddings, tokenize, files …).

Paths naming a generation API are never forwarded (404, :func:`forwardable`, the route's first guard;
gateway/target.py). Auth (the route's next guard) and the body-size limit apply; a JSON body naming a
``model`` is routed to a replica serving it (404 for an unknown model, 403 if the key may not use it). A
request naming no model goes to any healthy replica, except for a key restricted to some models: then only to
a replica serving nothing but models the key may use (the upstream answers it with its own default model),
403 ``model_not_allowed`` when there is none. Each request is charged to the key's limits like a generation
request (one request per minute and a concurrency slot, no tokens: 429 with the ``x-ratelimit-*`` headers when
spent; the route's rate-limit middleware settles it). Connection failures are retried on another replica; the
answer is streamed back unchanged (hop-by-hop headers removed).
"""

from __future__ import annotations

import posixpath
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING
from urllib.parse import unquote

import httpx
import msgspec
from litestar import Request
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.response import Stream

from kvscope.common.openai_errors import clip
from kvscope.gateway.auth import TENANT_HEADER, Principal
from kvscope.gateway.body import read_body
from kvscope.gateway.context import context_of
from kvscope.gateway.errors import (
    ModelNotFound,
    NotFound,
    PermissionDenied,
    UpstreamUnavailable,
    upstream_error_object,
    upstream_gateway_error,
)
from kvscope.gateway.proxy.upstreams import Replica
from kvscope.gateway.ratelimit_middleware import lease_of
from kvscope.gateway.target import names_generation_api

if TYPE_CHECKING:
    from kvscope.gateway.state import GatewayState

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-authenticate",
        "proxy-authorization",
        "host",
        "authorization",
        "content-length",
        "accept-encoding",
        "content-encoding",
    }
)
REQUEST_DROPPED = HOP_BY_HOP | {TENANT_HEADER}
"""Client request headers never forwarded: the tenant is the gateway's to set (the key's name), never the
client's."""
RESPONSE_DROPPED = HOP_BY_HOP | {"date", "server", "content-type", "x-request-id"}
"""Upstream response headers the gateway sets itself (no duplicated Date/Server/Content-Type/id)."""
MAX_ERROR_BYTES = 64 << 10
"""Bytes of an upstream error answer read for the log record's error fields (the whole answer is relayed)."""


def upstream_path(raw_path: str) -> str:
    """The path to forward: ``raw_path`` when it stays inside ``/v1/`` after resolving ``.``/``..`` segments
    (percent-encoded ones included) and names no generation API (gateway/target.py: those are served only by
    the admitted routes, in any spelling). Raises NotFound otherwise, so ``/v1/../metrics`` never reaches the
    upstream's private routes and ``/v1/Chat/Completions`` never skips admission."""
    decoded = unquote(raw_path)
    normal = posixpath.normpath(decoded)
    if normal != decoded.rstrip("/") or not normal.startswith("/v1/") or "//" in decoded:
        raise NotFound(f"Unknown path {raw_path!r}.")
    if names_generation_api(decoded):
        raise NotFound(
            f"Unknown path {raw_path!r}: generation is served only at POST /v1/chat/completions and "
            "POST /v1/completions."
        )
    return raw_path


def _raw_path(connection: ASGIConnection) -> str:
    return connection.scope.get("raw_path", b"").decode("latin-1") or connection.url.path


async def forwardable(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """Route guard: NotFound (404) unless the path may be forwarded (:func:`upstream_path`)."""
    upstream_path(_raw_path(connection))


def _model_of(body: bytes) -> str | None:
    try:
        obj = msgspec.json.decode(body) if body else None
    except msgspec.DecodeError:
        return None
    model = obj.get("model") if isinstance(obj, dict) else None
    return model if isinstance(model, str) else None


def _replicas_for(gw: GatewayState, principal: Principal, model: str | None) -> frozenset[str] | None:
    """Which replicas may take a request naming ``model`` (None: any healthy one serving it), checked in
    the order of admission: 404 ``model_not_found`` for a model no upstream serves, 403 when the key may
    not use it; for a body naming no model from a key restricted to some models, the models a replica may
    serve (403 when no replica serves only those); 503 when no such replica is healthy now."""
    only = None
    if model is not None:
        if not gw.pool.is_served(model):
            raise ModelNotFound(
                f"The model '{clip(model)}' does not exist or is not served here.", param="model"
            )
        gw.auth.check_model(principal, model)
    elif principal.models is not None:
        only = principal.models
        if not gw.pool.serving_only(only):
            raise PermissionDenied(
                "This API key may use only some models, and no upstream serves only those: "
                "name one of its models in the request body's 'model'.",
                param="model",
            )
    if not gw.pool.candidates(model, only=only):
        raise UpstreamUnavailable(
            "No healthy upstream is available right now.", headers={"retry-after": gw.pool.retry_after()}
        )
    return only


async def passthrough(gw: GatewayState, request: Request, principal: Principal) -> Stream:
    """Forward the request of ``principal`` (its path checked by :func:`forwardable`) to a replica its key may
    reach, charged to its rate limits (module docstring); raises ModelNotFound/PermissionDenied/
    UpstreamUnavailable/RateLimited before any upstream call."""
    ctx = context_of(request)
    path = _raw_path(request)
    body = await read_body(request, gw.settings.max_body_bytes)
    model = _model_of(body)
    if model is not None:
        ctx.request.model = model
        ctx.request.model_served = gw.pool.is_served(model)
    only = _replicas_for(gw, principal, model)
    await lease_of(request).acquire(gw.limiter, principal, ctx, 0, 0)
    headers = {k: v for k, v in request.headers.items() if k.lower() not in REQUEST_DROPPED}
    headers["x-request-id"] = ctx.request_id
    if ctx.edge.key_id is not None:
        headers[TENANT_HEADER] = ctx.edge.key_id
    if ctx.trace.span is not None:
        gw.tracer.inject(ctx.trace.span, headers)
    tried: list[Replica] = []
    for _ in range(gw.settings.routing.max_attempts):
        decision = gw.pool.route(model, None, exclude=tried, only=only)
        if decision is None:
            break
        replica = decision.replica
        ctx.upstream.routing = decision.record()
        tried.append(replica)
        url = replica.url + path + (f"?{request.url.query}" if request.url.query else "")
        upstream = gw.http.build_request(
            request.method, url, content=body, headers={**headers, **replica.auth_headers()}
        )
        ctx.upstream.started(replica.url)
        ctx.upstream.kind, ctx.upstream.kind_source = replica.kind.value, replica.kind_source
        start = time.perf_counter()
        try:
            response = await gw.http.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            connect = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
            gw.pool.report_failure(replica, "connect" if connect else "disconnect", eject=connect)
            failed_at = time.perf_counter()
            ctx.attempt_ended(start, None, failed_at)
            continue
        headers_at = time.perf_counter()
        gw.pool.acquire(replica)
        out_headers = {k: v for k, v in response.headers.items() if k.lower() not in RESPONSE_DROPPED}
        return Stream(
            _relay(gw, replica, response, ctx, start, headers_at),
            status_code=response.status_code,
            headers=out_headers,
            media_type=response.headers.get("content-type"),
        )
    raise UpstreamUnavailable(
        "No healthy upstream is available right now.", headers={"retry-after": gw.pool.retry_after()}
    )


async def _relay(
    gw: GatewayState, replica: Replica, response: httpx.Response, ctx, start: float, headers_at: float
) -> AsyncIterator[bytes]:
    """Relay the upstream's bytes as they come; an error answer's first bytes also fill the log record's
    ``error.type``/``error.message`` (as for the admitted routes)."""
    error_head = bytearray() if response.status_code >= 400 else None
    try:
        async for chunk in response.aiter_raw():
            if error_head is not None and len(error_head) < MAX_ERROR_BYTES:
                error_head += chunk[: MAX_ERROR_BYTES - len(error_head)]
            yield chunk
    finally:
        end = time.perf_counter()
        ctx.attempt_ended(start, headers_at, end)
        gw.pool.release(replica)
        await response.aclose()
        if error_head is not None:
            ctx.outcome.set_error(
                upstream_gateway_error(upstream_error_object(response.status_code, bytes(error_head))[0])
            )
