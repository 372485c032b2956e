"""The gateway application factory.

``create_app(settings)`` returns a Litestar app: OpenAI-compatible routes (gateway/routes.py) behind the
observation middleware (one log record, metrics and a server span per request), OpenAI-shaped errors for
everything (gateway/errors.py), and a lifespan that runs the upstream client, health checks and log sinks.
Run it with ``kvscope gateway`` (gateway/cli.py) or any ASGI server.
"""

from __future__ import annotations

from collections.abc import Sequence

from litestar import Litestar
from litestar.datastructures import State
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.trace.export import SpanExporter
from prometheus_client import CollectorRegistry

from gateway.errors import EXCEPTION_HANDLERS
from gateway.lifespan import GatewayState, build_state, gateway_lifespan
from gateway.logs.sink import LogSink
from gateway.observe import ObserveMiddleware
from gateway.routes import ROUTES
from gateway.settings import GatewaySettings


def create_app(settings: GatewaySettings, *, registry: CollectorRegistry | None = None,
               span_exporter: SpanExporter | None = None, sinks: Sequence[LogSink] = (),
               metric_readers: Sequence[MetricReader] = ()) -> Litestar:
    """Build the gateway.

    Args:
        settings: validated settings (:func:`gateway.settings.load_settings`).
        registry: Prometheus registry for the ``kvscope_gateway_*`` collectors (default: a new one).
        span_exporter: also export spans here, synchronously (tests pass an ``InMemorySpanExporter``).
        sinks: extra request-log sinks (e.g. the Elasticsearch sink) besides the configured file/stdout ones.
        metric_readers: also read the OTel ``gen_ai.client.*`` metrics here (tests pass an
            ``InMemoryMetricReader``); OTLP export follows ``tracing.otlp_endpoint``.
    """
    gw = build_state(settings, registry=registry, span_exporter=span_exporter, sinks=sinks,
                     metric_readers=metric_readers)
    return Litestar(
        route_handlers=ROUTES,
        middleware=[ObserveMiddleware()],
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=[gateway_lifespan],
        state=State({"gateway": gw}),
        request_max_body_size=settings.max_body_bytes,
        openapi_config=None,
        logging_config=None,
        debug=False,
    )


def gateway_state(app: Litestar) -> GatewayState:
    """The app's :class:`~gateway.lifespan.GatewayState` (metrics, pool, sinks …)."""
    return app.state.gateway
