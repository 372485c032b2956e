"""OpenTelemetry traces of the gateway (docs/gateway.md, "Metrics and traces"): W3C ``traceparent`` in, OTLP
out.

Per request: a SERVER span ``POST /v1/chat/completions`` (parent: the client's ``traceparent``, if any) →
a CLIENT span ``chat {model}`` / ``text_completion {model}`` with gen_ai attributes, whose context goes to the
upstream in ``traceparent``. Our engine continues the trace with its own ``llm_request``/``queue``/
``prefill``/``decode`` spans; for a third-party upstream (no ``kvscope`` stats in the answer) the gateway
records ``prefill`` (upstream request → first token) and ``decode`` (first → last token) itself.

The TracerProvider is built by the app (never the global one); tests inject an in-memory exporter.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvscope.common.otel_env import span_exporter
from kvscope.gateway.settings import TracingConfig


def build_tracer_provider(
    config: TracingConfig,
    service_name: str,
    service_version: str,
    node: str,
    exporter: SpanExporter | None = None,
) -> TracerProvider:
    """A provider exporting to ``exporter`` (synchronously; for tests) and/or over OTLP (batched) to
    ``tracing.otlp_endpoint`` (an OTLP/HTTP base URL, spans to ``/v1/traces``, or a gRPC endpoint) or, when
    unset, to what the ``OTEL_EXPORTER_OTLP_*`` environment names
    (:func:`kvscope.common.otel_env.span_exporter`; the SDK reads it). Without either, spans are still made
    (ids for the log); ``OTEL_SDK_DISABLED=true`` makes the provider no-op and exports nothing. Raises
    ValueError on an unsupported ``OTEL_EXPORTER_OTLP_PROTOCOL``."""
    resource = Resource.create(
        {"service.name": service_name, "service.version": service_version, "service.instance.id": node}
    )
    provider = TracerProvider(resource=resource)
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    otlp = span_exporter(config.otlp_endpoint)
    if otlp is not None:
        provider.add_span_processor(BatchSpanProcessor(otlp))
    return provider


class GatewayTracer:
    """Span helpers over one TracerProvider."""

    def __init__(self, provider: TracerProvider, version: str) -> None:
        self.provider = provider
        self._tracer = provider.get_tracer("kvscope.gateway", version)
        self._propagator = TraceContextTextMapPropagator()

    def start_server_span(
        self, name: str, headers: Mapping[str, str], start_ns: int, attributes: Mapping[str, str | int]
    ) -> Span:
        """The request's SERVER span, child of the incoming ``traceparent`` when it is valid."""
        parent = self._propagator.extract(carrier=dict(headers))
        return self._tracer.start_span(
            name, context=parent, kind=SpanKind.SERVER, start_time=start_ns, attributes=dict(attributes)
        )

    def start_client_span(self, parent: Span | None, operation: str, model: str, attributes: Mapping) -> Span:
        """The gen_ai CLIENT span ``{operation} {model}`` under ``parent`` (None: a root span; attributes:
        see :mod:`kvscope.gateway.genai_attrs`)."""
        context = trace.set_span_in_context(parent if parent is not None else trace.INVALID_SPAN)
        attrs = {"gen_ai.operation.name": operation, "gen_ai.request.model": model, **attributes}
        return self._tracer.start_span(
            f"{operation} {model}", context=context, kind=SpanKind.CLIENT, attributes=attrs
        )

    def inject(self, span: Span, headers: dict[str, str]) -> None:
        """Add ``traceparent`` (and ``tracestate``) naming ``span`` to outgoing ``headers``."""
        self._propagator.inject(headers, context=trace.set_span_in_context(span))

    def record_phases(self, parent: Span, start_ns: int, first_token_ns: int, end_ns: int) -> None:
        """``prefill`` [start, first token] and ``decode`` [first token, end] under ``parent`` (third-party
        upstreams, which send no spans of their own)."""
        context = trace.set_span_in_context(parent)
        for name, begin, end in (("prefill", start_ns, first_token_ns), ("decode", first_token_ns, end_ns)):
            span = self._tracer.start_span(name, context=context, start_time=begin)
            span.end(end_time=end)

    def shutdown(self) -> None:
        self.provider.shutdown()


def span_ids(span: Span) -> tuple[str, str]:
    """(trace id, span id) as lowercase hex, the form logs and W3C headers use."""
    ctx = span.get_span_context()
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")
