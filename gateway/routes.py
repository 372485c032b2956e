"""HTTP routes. Generation routes return a :class:`~kvscope.gateway.proxy.call.ProxyCall` (an ASGI app that
owns the exchange); the others are small. Every path lands on some route (catch-alls raise OpenAI-shaped
404/405); methods no route declares get Litestar's 405, mapped to the same JSON. The observation wrapper
(gateway/observe.py) sits outside the router, so every request is logged either way.

What each route requires is declared on it: guards (gateway/guards.py: the method, the operation, the API
key; the pass-through's path check) run in order before the handler, and the generation routes carry the
rate-limit middleware (gateway/ratelimit_middleware.py)."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get, route
from litestar.types import ASGIApp, Method
from prometheus_client.exposition import choose_encoder

from kvscope.common.openai_errors import clip
from kvscope.gateway.admission import CHAT, COMPLETION, Operation, admit
from kvscope.gateway.context import context_of
from kvscope.gateway.errors import AuthenticationFailed, ModelNotFound, NotFound, PermissionDenied
from kvscope.gateway.guards import authenticated, in_order, names_operation, only, principal_of
from kvscope.gateway.proxy.call import ProxyCall
from kvscope.gateway.proxy.passthrough import forwardable, passthrough
from kvscope.gateway.ratelimit_middleware import RateLimitMiddleware
from kvscope.gateway.state import GatewayState, state_of

ALL_METHODS: tuple[Method, ...] = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD")
RATE_LIMITS = RateLimitMiddleware()


async def _generation(request: Request, op: Operation) -> ASGIApp:
    gw = state_of(request)
    plan = await admit(gw, request, op, principal_of(request))
    return ProxyCall(gw, context_of(request), plan)


@route(
    "/v1/chat/completions",
    http_method=ALL_METHODS,
    middleware=[RATE_LIMITS],
    guards=[in_order(only("POST"), names_operation(CHAT.name), authenticated)],
)
async def chat_completions(request: Request) -> ASGIApp:
    return await _generation(request, CHAT)


@route(
    "/v1/completions",
    http_method=ALL_METHODS,
    middleware=[RATE_LIMITS],
    guards=[in_order(only("POST"), names_operation(COMPLETION.name), authenticated)],
)
async def completions(request: Request) -> ASGIApp:
    return await _generation(request, COMPLETION)


def _visible_models(request: Request) -> list[str]:
    principal = principal_of(request)
    served = state_of(request).pool.served_models()
    return served if principal.models is None else [m for m in served if m in principal.models]


@route("/v1/models", http_method=ALL_METHODS, status_code=200, guards=[in_order(only("GET"), authenticated)])
async def list_models(request: Request) -> dict[str, Any]:
    """Models of all upstreams merged (the upstream's cards, with ``max_model_len``), as the key may see."""
    pool = state_of(request).pool
    return {"object": "list", "data": [pool.model_card(m) for m in _visible_models(request)]}


@route(
    "/v1/models/{model:path}",
    http_method=ALL_METHODS,
    status_code=200,
    guards=[in_order(only("GET"), authenticated)],
)
async def retrieve_model(request: Request) -> dict[str, Any]:
    name = str(request.path_params["model"]).lstrip("/")
    if name not in _visible_models(request):
        raise ModelNotFound(f"The model '{clip(name)}' does not exist or is not served here.", param="model")
    return state_of(request).pool.model_card(name)


@route(
    "/v1/{path:path}",
    http_method=ALL_METHODS,
    middleware=[RATE_LIMITS],
    guards=[in_order(forwardable, authenticated)],
)
async def other_v1(request: Request) -> Response:
    """Any other ``/v1/*`` path, passed through to an upstream (by ``model`` when the body names one)."""
    return await passthrough(state_of(request), request, principal_of(request))


@get("/healthz", sync_to_thread=False)
def healthz() -> dict[str, str]:
    """Liveness: the process serves HTTP."""
    return {"status": "ok"}


@get("/readyz")
async def readyz(request: Request) -> Response:
    """Readiness: 200 when a healthy upstream serves each configured model (each known model if none). The
    per-model map is in the answer only for callers who may see those models (:func:`_readiness_models`)."""
    gw = state_of(request)
    models = gw.pool.ready()
    ok = bool(models) and all(models.values())
    body: dict[str, Any] = {"status": "ready" if ok else "not_ready"}
    visible = _readiness_models(gw, request, models)
    if visible is not None:
        body["models"] = visible
    return Response(body, status_code=200 if ok else 503)


def _readiness_models(gw: GatewayState, request: Request, models: dict[str, bool]) -> dict[str, bool] | None:
    """The per-model readiness map a caller of ``/readyz`` may see: all of it without API keys; with keys,
    only to a caller presenting a valid key, filtered by that key's models (as ``/v1/models``); None (no
    map) for anyone else. Readiness probes send no key: they get the status alone, never a 401, and
    unauthenticated callers learn no model name."""
    if not gw.settings.auth_enabled:
        return models
    try:
        principal = gw.auth.authenticate(request.headers.get("authorization"))
    except AuthenticationFailed:
        return None
    return models if principal.models is None else {m: v for m, v in models.items() if m in principal.models}


def _check_metrics_access(gw: GatewayState, request: Request) -> None:
    """With API keys configured and ``metrics_public`` off, ``/metrics`` (whose series name every served
    model and upstream) needs a key that may use every model: 401 without a valid key, 403 for a key
    restricted to some models. Without keys, or with ``metrics_public``, anyone may scrape."""
    settings = gw.settings
    if not settings.auth_enabled or settings.metrics_public:
        return
    principal = gw.auth.authenticate(request.headers.get("authorization"))
    if principal.models is not None:
        raise PermissionDenied(
            "/metrics names every served model: it needs an API key that may use all models "
            "(or `metrics_public: true` in the gateway config).",
            code="permission_denied",
        )


@get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text format, or OpenMetrics (with exemplars: the trace of a sampled request on the
    latency histograms) when the scraper's ``Accept`` asks for ``application/openmetrics-text``; with several
    workers every worker's series added up (gateway/metrics_workers.py: no exemplars then). Access:
    :func:`_check_metrics_access` (401/403 when keys are configured, unless ``metrics_public``)."""
    _check_metrics_access(state_of(request), request)
    encode, content_type = choose_encoder(request.headers.get("accept", ""))
    # Litestar appends "; charset=utf-8" to text/* media types itself: do not send it twice
    media_type = (
        content_type.removesuffix("; charset=utf-8") if content_type.startswith("text/") else content_type
    )
    return Response(encode(state_of(request).metrics.exposed), media_type=media_type)


@route("/{path:path}", http_method=ALL_METHODS)
async def not_found(request: Request) -> None:
    raise NotFound(f"Unknown path {request.url.path}.")


ROUTES = [
    chat_completions,
    completions,
    list_models,
    retrieve_model,
    other_v1,
    healthz,
    readyz,
    metrics,
    not_found,
]
