"""The gateway application factory.

``create_app(settings)`` returns a Litestar app: OpenAI-compatible routes (gateway/routes.py) behind the
observation wrapper (one log record, metrics and a server span per request), OpenAI-shaped errors for
everything (gateway/errors.py), and a lifespan that runs the upstream client, health checks and log sinks;
with ``console.enabled`` (the default) also the built-in console at ``/console`` (gateway/console/).
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

from kvscope.gateway.console.routes import CONSOLE_ROUTES, build_console, console_lifespan, is_console_path
from kvscope.gateway.errors import EXCEPTION_HANDLERS
from kvscope.gateway.lifespan import build_state, gateway_lifespan
from kvscope.gateway.logs.sink import LogSink
from kvscope.gateway.observe import PROBE_PATHS, observe
from kvscope.gateway.routes import ROUTES
from kvscope.gateway.settings import GatewaySettings, SettingsSource
from kvscope.gateway.state import WorkerSlot


class GatewayApp(Litestar):
    """The Litestar app with :func:`kvscope.gateway.observe.observe` around it, outside the router: a
    request no route or method matches is still observed (one log record, metrics, a span), and a
    non-canonical request target is refused before routing. Probes and the console (gateway/console/) are not
    observed."""

    serves_console = False
    """Whether ``/console`` is the console's (``console.enabled``): set by :func:`create_app`."""

    # Litestar's __call__ also takes lifespan scopes: they pass through to it below; the ASGI types cannot tie
    # receive and send to the scope's type, so the HTTP ones are declared
    async def __call__(  # pyright: ignore[reportIncompatibleMethodOverride]
        self, scope: Scope, receive: Receive, send: Send
    ) -> None:
        if scope["type"] != "http" or _unobserved(scope, self.serves_console):
            await super().__call__(scope, receive, send)
            return
        await observe(self.state.gateway, scope, receive, send, super().__call__)


def _unobserved(scope: Scope, console: bool) -> bool:
    """A probe or, with ``console``, a console request (neither observed: an open console's polling would
    fill the request log and counters it shows), only when spelled exactly: ``/%6detrics`` or ``/healthz#x``
    are observed and refused like any other non-canonical target."""
    path = scope["path"]
    return (
        (path in PROBE_PATHS or (console and is_console_path(path)))
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
    worker: WorkerSlot | None = None,
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
        worker: which worker of ``kvscope gateway --workers N`` this app serves (gateway/workers.py); None:
            the only process.

    In a worker (or with ``settings.workers`` > 1) the console is not served (each worker would show its own
    requests and counters only; docs/console.md).
    """
    gw = build_state(
        settings,
        registry=registry,
        span_exporter=span_exporter,
        sinks=sinks,
        metric_readers=metric_readers,
        source=source,
        worker=worker,
    )
    alone = worker is None and settings.workers == 1
    console = build_console(gw) if settings.console.enabled and alone else None
    app = GatewayApp(
        route_handlers=[*CONSOLE_ROUTES, *ROUTES] if console is not None else ROUTES,
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=[gateway_lifespan, console_lifespan],
        state=State({"gateway": gw, "console": console}),
        request_max_body_size=settings.max_body_bytes,
        openapi_config=None,
        logging_config=None,
        debug=False,
    )
    app.serves_console = console is not None
    return app
