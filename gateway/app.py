"""The gateway application factory.

``create_app(settings)`` returns a Litestar app: OpenAI-compatible routes (gateway/routes.py) behind the
observation wrapper (one log record, metrics and a server span per request), OpenAI-shaped errors for
everything (gateway/errors.py), and a lifespan that runs the upstream client, health checks and log sinks.
Run it with ``kvscope gateway`` (gateway/cli.py) or any ASGI server.
"""

from __future__ import annotations

from collections.abc import Sequence

from litestar import Litestar
from litestar.datastructures import State
from litestar.types import Receive, Scope, Send
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.trace.export import SpanExporter
from prometheus_client import CollectorRegistry

from kvscope.gateway.errors import EXCEPTION_HANDLERS
from kvscope.gateway.lifespan import build_state, gateway_lifespan
from kvscope.gateway.logs.sink import LogSink
from kvscope.gateway.observe import PROBE_PATHS, observe
from kvscope.gateway.routes import ROUTES
from kvscope.gateway.settings import GatewaySettings, SettingsSource


class GatewayApp(Litestar):
    """The Litestar app with :func:`kvscope.gateway.observe.observe` around it, outside the router: a
    request no route or method matches is still observed (one log record, metrics, a span), and a
    non-canonical request target is refused before routing."""

    # Litestar's __call__ also takes lifespan scopes: they pass through to it below; the ASGI types cannot tie
    # receive and send to the scope's type, so the HTTP ones are declared
    async def __call__(  # pyright: ignore[reportIncompatibleMethodOverride]
        self, scope: Scope, receive: Receive, send: Send
    ) -> None:
        if scope["type"] != "http" or _plain_probe(scope):
            await super().__call__(scope, receive, send)
            return
        await observe(self.state.gateway, scope, receive, send, super().__call__)


def _plain_probe(scope: Scope) -> bool:
    """A probe (not observed) only when spelled exactly: ``/%6detrics`` or ``/healthz#x`` are observed and
    refused like any other non-canonical target."""
    path = scope["path"]
    return (
        path in PROBE_PATHS
        and scope.get("raw_path", path.encode()) == path.encode()
        and b"#" not in scope.get("query_string", b"")
    )


def create_app(
    settings: GatewaySettings,
    *,
    registry: CollectorRegistry | None = None,
    span_exporter: SpanExporter | None = None,
    sinks: Sequence[LogSink] = (),
    metric_readers: Sequence[MetricReader] = (),
    source: SettingsSource | None = None,
) -> GatewayApp:
    """Build the gateway.

    Args:
        settings: validated settings (:func:`kvscope.gateway.settings.load_settings`).
        registry: Prometheus registry for the ``kvscope_gateway_*`` collectors (default: a new one).
        span_exporter: also export spans here, synchronously (tests pass an ``InMemorySpanExporter``).
        sinks: extra request-log sinks (e.g. the Elasticsearch sink) besides the configured file/stdout ones.
        metric_readers: also read the OTel ``gen_ai.client.*`` metrics here (tests pass an
            ``InMemoryMetricReader``); OTLP export follows ``tracing.otlp_endpoint``.
        source: where ``settings`` came from (:class:`kvscope.gateway.settings.SettingsSource`): the config
            file that ``discovery.config_reload`` re-reads; None: no reload.
    """
    gw = build_state(
        settings,
        registry=registry,
        span_exporter=span_exporter,
        sinks=sinks,
        metric_readers=metric_readers,
        source=source,
    )
    return GatewayApp(
        route_handlers=ROUTES,
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=[gateway_lifespan],
        state=State({"gateway": gw}),
        request_max_body_size=settings.max_body_bytes,
        openapi_config=None,
        logging_config=None,
        debug=False,
    )
