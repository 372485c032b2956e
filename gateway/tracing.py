"""OpenTelemetry traces of the gateway (docs/gateway.md, "Metrics and traces"): W3C ``traceparent`` in, OTLP
out.

Per request: a SERVER span ``POST /v1/chat/completions`` (parent: the client's ``traceparent``, if any) →
a CLIENT span ``chat {model}`` / ``text_completion {model}`` with gen_ai attributes, whose context goes to the
upstream in ``traceparent``. Our engine continues the trace with its own ``llm_request``/``queue``/
``prefill``/``decode`` spans; for another upstream (no ``kvscope`` stats in the answer) the gateway records
``queue``, ``prefill`` and ``decode`` child spans itself (:func:`upstream_phases`): from the upstream's own
per-request timings where it reports them (llama.cpp's ``timings``, TGI's ``x-queue-time``;
gateway/engines/reports.py), non-streamed answers too, else from the stream's token times at the gateway;
each span's ``kvscope.timing.source`` says which (``per_request`` | ``gateway``).

The TracerProvider is built by the app (never the global one); tests inject an in-memory exporter. Where
nothing exports spans (no exporter, no OTLP endpoint: the default), the spans are ids only
(:meth:`GatewayTracer.unexported`): the log, the exemplars and the ``traceparent`` sent upstream carry the
same ids and sampling decision, without the SDK's span objects no processor would see.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvscope.common.otel_env import exports, sdk_disabled, span_exporter
from kvscope.gateway.engines.reports import UpstreamReport
from kvscope.gateway.settings import TracingConfig

TIMING_SOURCE_ATTRIBUTE = "kvscope.timing.source"
"""Attribute of the gateway's ``queue``/``prefill``/``decode`` spans: ``per_request`` (the upstream's own
timings of this request) or ``gateway`` (token times measured at the gateway)."""


@dataclass(frozen=True, slots=True)
class Phase:
    """One upstream phase of a request (``time.perf_counter()`` seconds)."""

    name: str
    """``queue``, ``prefill`` or ``decode``."""
    start: float
    end: float
    source: str
    """``per_request`` or ``gateway`` (:data:`TIMING_SOURCE_ATTRIBUTE`)."""


def upstream_phases(
    attempt_start: float,
    first_token_at: float | None,
    last_token_at: float | None,
    upstream_end: float | None,
    report: UpstreamReport | None,
) -> list[Phase]:
    """The answering attempt's phases at the upstream, in order, from its ``report`` where it has the
    duration, else from the stream's token times at the gateway (``first_token_at``, ``last_token_at``:
    None for a JSON answer). The upstream's clock is not the gateway's, so its durations are placed on the
    gateway's timeline by their known ends:

    - ``queue`` [attempt start, + ``queue_s``] (per_request; only where reported);
    - ``decode`` [last − ``decode_s``, last] with last = the last token event (streams) or the answer's last
      byte (``upstream_end``) (per_request), else [first token, last token] (gateway);
    - ``prefill`` [decode start − ``prefill_s``, decode start] (per_request), else [queue end or attempt
      start, first token] (gateway).

    Starts are never before the attempt's start. Empty when there is nothing to place (a JSON answer without
    timings)."""
    r = report or UpstreamReport()
    phases: list[Phase] = []
    queue_end = attempt_start
    if r.queue_s is not None:
        queue_end = attempt_start + r.queue_s
        phases.append(Phase("queue", attempt_start, queue_end, "per_request"))
    last = last_token_at if last_token_at is not None else upstream_end
    decode: Phase | None = None
    if r.decode_s is not None and last is not None:
        decode = Phase("decode", max(attempt_start, last - r.decode_s), last, "per_request")
    elif first_token_at is not None and last_token_at is not None:
        decode = Phase("decode", first_token_at, last_token_at, "gateway")
    if r.prefill_s is not None and decode is not None:
        phases.append(
            Phase("prefill", max(attempt_start, decode.start - r.prefill_s), decode.start, "per_request")
        )
    elif first_token_at is not None:
        phases.append(Phase("prefill", min(queue_end, first_token_at), first_token_at, "gateway"))
    if decode is not None:
        phases.append(decode)
    return phases


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
    (:func:`kvscope.common.otel_env.span_exporter`; the SDK reads it). Without either it has no span
    processor (:func:`build_tracer` then makes the spans ids only); ``OTEL_SDK_DISABLED=true`` makes the
    provider no-op and exports nothing. Raises ValueError on an unsupported
    ``OTEL_EXPORTER_OTLP_PROTOCOL``."""
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


def build_tracer(
    config: TracingConfig,
    service_name: str,
    service_version: str,
    node: str,
    exporter: SpanExporter | None = None,
) -> GatewayTracer:
    """The gateway's tracer over :func:`build_tracer_provider` (same arguments and errors), its spans
    :meth:`GatewayTracer.unexported` where nothing exports them (no ``exporter``, no OTLP endpoint, the SDK
    not disabled)."""
    provider = build_tracer_provider(config, service_name, service_version, node, exporter)
    exporting = exporter is not None or exports("traces", config.otlp_endpoint) or sdk_disabled()
    return GatewayTracer(provider, service_version, exporting=exporting)


class GatewayTracer:
    """Span helpers over one TracerProvider. ``exporting``: a span processor is configured (an exporter or
    OTLP, :func:`build_tracer_provider`); without one the spans are :meth:`unexported`."""

    def __init__(self, provider: TracerProvider, version: str, exporting: bool = True) -> None:
        self.provider = provider
        self.exporting = exporting
        self._tracer = provider.get_tracer("kvscope.gateway", version)
        self._propagator = TraceContextTextMapPropagator()

    def start_server_span(
        self, name: str, headers: Mapping[str, str], start_ns: int, attributes: Mapping[str, str | int]
    ) -> Span:
        """The request's SERVER span, child of the incoming ``traceparent`` when it is valid."""
        parent = self._propagator.extract(carrier=dict(headers))
        if not self.exporting:
            return self.unexported(name, SpanKind.SERVER, parent)
        return self._tracer.start_span(
            name, context=parent, kind=SpanKind.SERVER, start_time=start_ns, attributes=dict(attributes)
        )

    def start_client_span(self, parent: Span | None, operation: str, model: str, attributes: Mapping) -> Span:
        """The gen_ai CLIENT span ``{operation} {model}`` under ``parent`` (None: a root span; attributes:
        see :mod:`kvscope.gateway.genai_attrs`)."""
        context = trace.set_span_in_context(parent if parent is not None else trace.INVALID_SPAN)
        name = f"{operation} {model}"
        if not self.exporting:
            return self.unexported(name, SpanKind.CLIENT, context)
        attrs = {"gen_ai.operation.name": operation, "gen_ai.request.model": model, **attributes}
        return self._tracer.start_span(name, context=context, kind=SpanKind.CLIENT, attributes=attrs)

    def unexported(self, name: str, kind: SpanKind, parent: Context) -> Span:
        """A span no processor would see, as ids only: a new span id in the parent's trace (a new trace id
        without a valid parent, from the provider's id generator), the flags and trace state of the
        provider's sampler (the SDK's default, ``ParentBased(ALWAYS_ON)``, or ``OTEL_TRACES_SAMPLER``) as the
        SDK's ``Tracer.start_span`` sets them, so the log's ``trace.id``/``span.id``, the exemplars and the
        ``traceparent`` sent upstream are what the SDK's span would have carried. An SDK span costs its
        attributes, limits, lock and end (~175 µs a request for the server, client and phase spans on a
        2-vCPU AMD EPYC) for a processor that is not there. The span's methods (``set_attribute``, ``end``
        …) do nothing."""
        parent_context = trace.get_current_span(parent).get_span_context()
        ids = self.provider.id_generator
        if parent_context.is_valid:
            trace_id, random_trace_id = parent_context.trace_id, parent_context.trace_flags.random_trace_id
        else:
            trace_id, random_trace_id = ids.generate_trace_id(), ids.is_trace_id_random()
        sampling = self.provider.sampler.should_sample(parent, trace_id, name, kind)
        flags = TraceFlags.SAMPLED if sampling.decision.is_sampled() else TraceFlags.DEFAULT
        if random_trace_id:  # W3C Trace Context level 2, as the SDK's Tracer.start_span sets it
            flags |= TraceFlags.RANDOM_TRACE_ID
        context = SpanContext(
            trace_id,
            ids.generate_span_id(),
            is_remote=False,
            trace_flags=TraceFlags(flags),
            trace_state=sampling.trace_state,
        )
        return NonRecordingSpan(context)

    def inject(self, span: Span, headers: dict[str, str]) -> None:
        """Add ``traceparent`` (and ``tracestate``) naming ``span`` to outgoing ``headers``."""
        self._propagator.inject(headers, context=trace.set_span_in_context(span))

    def record_phases(self, parent: Span, phases: Sequence[Phase], epoch_ns: Callable[[float], int]) -> None:
        """One child span of ``parent`` per phase (:func:`upstream_phases`; upstreams that send no spans of
        their own), ``epoch_ns`` turning its perf_counter times into epoch nanoseconds. None where nothing
        exports them."""
        if not self.exporting:
            return
        context = trace.set_span_in_context(parent)
        for phase in phases:
            span = self._tracer.start_span(
                phase.name,
                context=context,
                start_time=epoch_ns(phase.start),
                attributes={TIMING_SOURCE_ATTRIBUTE: phase.source},
            )
            span.end(end_time=epoch_ns(phase.end))

    def shutdown(self) -> None:
        self.provider.shutdown()


def span_ids(span: Span) -> tuple[str, str]:
    """(trace id, span id) as lowercase hex, the form logs and W3C headers use."""
    ctx = span.get_span_context()
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")
