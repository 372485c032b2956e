"""OpenTelemetry traces of engine requests: ``POST /v1/chat/completions`` (HTTP SERVER) → ``llm_request``
(INTERNAL, the generation) → ``queue``, ``prefill``, ``decode``.

The HTTP SERVER span follows the OTel semconv 1.41 HTTP server span (``http.request.method``, ``url.path``,
``url.scheme``, ``network.protocol.version``, ``client.address``, ``user_agent.original``, then
``http.route``, ``http.response.status_code`` and, for a 5xx only, ``error.type`` with status ERROR): the
access-log middleware opens it for every API request (probes and scrapes excepted: :data:`UNTRACED_ROUTES`),
so a request refused before admission (400, 429, 503) has its span too. A client that disconnects is not an
error of the server: its ``llm_request`` keeps an unset status and says ``kvscope.outcome =
client_disconnected``.

Spans are built retrospectively when a request ends, with explicit start/end times taken from the request's
monotonic timestamps (arrival, first scheduled, first token, last token) mapped onto the wall clock at
arrival. This records the engine's real phases without touching the step loop. Prefill chunks and preemptions
are events collected by :class:`RequestTimeline` from the step listener (engine thread); speculative
decoding's accepted runs are totals on the ``decode`` span (:func:`spec_decode_attributes`).

The trace continues an incoming W3C ``traceparent`` (the gateway's span becomes the parent of
``llm_request``). Export: OTLP (HTTP protobuf or gRPC) when ``--otlp-endpoint`` or the standard
``OTEL_EXPORTER_OTLP_*`` environment configures it (:mod:`kvscope.common.otel_env`; none with
``OTEL_SDK_DISABLED=true``), an injected exporter in tests (e.g. ``InMemorySpanExporter``), nothing otherwise.
Each :class:`Tracing` owns its TracerProvider; the global OTel provider is never set. Attribute names follow
the OTel GenAI semantic conventions (``gen_ai.*``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvscope.common.otel_env import span_exporter
from kvscope.common.version import kvscope_version
from kvscope.engine.core.request import Request


@dataclass(slots=True)
class TimelineEvent:
    name: str
    """``prefill_chunk`` or ``preemption``."""
    time: float
    """time.monotonic() at the end of the engine step that produced it."""
    attributes: dict[str, Any]
    initial_prefill: bool = False
    """A chunk of the first prefill (before any output token); recomputation after preemption is not."""


@dataclass(slots=True)
class RequestTimeline:
    """Per-request engine events, passed to the engine as the opaque ``trace_context`` of the request (and of
    its n > 1 siblings). Written by the step-listener thread, read by the server once the request ended."""

    parent: Context | None = None
    """OTel context extracted from the incoming ``traceparent`` (None: a new trace)."""
    events: list[TimelineEvent] = field(default_factory=list)
    _seen: dict[str, tuple[int, int]] = field(default_factory=dict)

    def observe(self, request: Request, now: float) -> None:
        """Compare the request with the previous step: a preemption (``num_preemptions`` grew) or a prefill
        chunk (``num_computed_tokens`` advanced by more than one decode token) becomes an event."""
        computed_before, preemptions_before = self._seen.get(request.request_id, (0, 0))
        preemptions = request.stats.num_preemptions if request.stats else 0
        if preemptions > preemptions_before:
            self.events.append(
                TimelineEvent(
                    "preemption",
                    now,
                    {
                        "kvscope.request_id": request.request_id,
                        "kvscope.num_preemptions": preemptions,
                        "kvscope.num_output_tokens": request.num_output_tokens,
                    },
                )
            )
            computed_before = 0
        computed = request.num_computed_tokens
        if computed > computed_before and (
            computed - computed_before > 1 or computed_before < request.num_prompt_tokens
        ):
            self._chunk(
                request.request_id,
                computed_before,
                computed,
                now,
                preemptions == 0 and computed_before < request.num_prompt_tokens,
            )
        self._seen[request.request_id] = (computed, preemptions)

    def finish_prefill(self, request_id: str, num_prompt_tokens: int, first_token_time: float | None) -> None:
        """Add the last prefill chunk when the request finished in the step that completed its prefill (the
        listener no longer sees a finished request)."""
        computed, preemptions = self._seen.get(request_id, (0, 0))
        if first_token_time is not None and preemptions == 0 and computed < num_prompt_tokens:
            self._chunk(request_id, computed, num_prompt_tokens, first_token_time, True)
            self._seen[request_id] = (num_prompt_tokens, 0)

    def _chunk(self, request_id: str, start: int, end: int, now: float, initial: bool) -> None:
        self.events.append(
            TimelineEvent(
                "prefill_chunk",
                now,
                {
                    "kvscope.request_id": request_id,
                    "kvscope.chunk.start": start,
                    "kvscope.chunk.end": end,
                    "kvscope.chunk.num_tokens": end - start,
                },
                initial_prefill=initial,
            )
        )


def observe_step(requests: Iterable[Request], now: float | None = None) -> None:
    """Step-listener hook: update the timeline of every unfinished request that carries one."""
    now = time.monotonic() if now is None else now
    for request in requests:
        if isinstance(request.trace_context, RequestTimeline):
            request.trace_context.observe(request, now)


@dataclass(slots=True)
class RequestSpans:
    """What one ended request contributes to its trace (monotonic seconds; None = the phase never began)."""

    timeline: RequestTimeline
    arrival: float
    arrival_wall_ns: int
    end: float
    first_scheduled: float | None
    first_token: float | None
    last_token: float | None
    attributes: dict[str, Any]
    error: str | None = None
    """Status description when the request did not succeed (client disconnected, engine failure)."""
    decode_attributes: dict[str, Any] = field(default_factory=dict)
    """Attributes of the ``decode`` span: the speculative-decoding totals (:func:`spec_decode_attributes`)."""


def spec_decode_attributes(
    drafts: int | None,
    draft_tokens: int | None,
    accepted_tokens: int | None,
    mean_accepted_length: float | None,
) -> dict[str, int | float]:
    """The ``decode`` span's speculative-decoding attributes, ``kvscope.spec_decode.{drafts, draft_tokens,
    accepted_tokens, mean_accepted_length}`` (the request's totals, the kvscope object's ``spec_*`` fields);
    empty when the request never speculated. Totals rather than one event per verification: a long answer
    has hundreds of verifications, and the SDK keeps at most 128 events per span (OTEL_SPAN_EVENT_COUNT_LIMIT)
    and drops the rest silently; the per-verification distribution is the acceptance-length histogram."""
    if not drafts:
        return {}
    return {
        "kvscope.spec_decode.drafts": drafts,
        "kvscope.spec_decode.draft_tokens": draft_tokens or 0,
        "kvscope.spec_decode.accepted_tokens": accepted_tokens or 0,
        "kvscope.spec_decode.mean_accepted_length": mean_accepted_length or 1.0,
    }


UNTRACED_ROUTES = ("/health", "/metrics")
"""Path prefixes that get no HTTP SERVER span: liveness probes and scrapes (several a second, never a user's
request)."""


class RecordedSpan(NamedTuple):
    """The ids of a request's ``llm_request`` span (lowercase hex) and whether its trace is sampled (exported:
    only then may a metric exemplar point at it)."""

    trace_id: str
    span_id: str
    sampled: bool


class Tracing:
    """Owns a TracerProvider; :meth:`record` writes the spans of one request."""

    def __init__(
        self,
        service_name: str = "kvscope-engine",
        exporter: SpanExporter | None = None,
        *,
        batch: bool = True,
        service_version: str | None = None,
    ) -> None:
        """Resource: ``service.name`` and ``service.version`` (OTel resource semconv; the installed
        ``kvscope`` package version unless ``service_version`` is given)."""
        version = service_version or kvscope_version()
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": service_name, "service.version": version})
        )
        if exporter is not None:
            processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
            self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("kvscope.engine")
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def otlp(cls, service_name: str, endpoint: str | None) -> Tracing:
        """OTLP export to ``endpoint`` (the ``--otlp-endpoint`` flag: an OTLP/HTTP base or ``…/v1/traces``
        URL, or a gRPC endpoint) or, when None, to what the ``OTEL_EXPORTER_OTLP_*`` environment names (the
        SDK reads it); no export when neither is set or ``OTEL_SDK_DISABLED=true``
        (:func:`kvscope.common.otel_env.span_exporter`). Raises ValueError on an unsupported
        ``OTEL_EXPORTER_OTLP_PROTOCOL``."""
        return cls(service_name, span_exporter(endpoint))

    def extract(self, headers: Mapping[str, str]) -> Context | None:
        """The context of an incoming ``traceparent`` header, None when absent or malformed."""
        if "traceparent" not in headers:
            return None
        context = self._propagator.extract(
            {"traceparent": headers["traceparent"], "tracestate": headers.get("tracestate", "")}
        )
        return context or None

    def start_server_span(self, scope: Mapping[str, Any]) -> Span | None:
        """The HTTP SERVER span of the ASGI request ``scope`` (child of its ``traceparent``), None for
        :data:`UNTRACED_ROUTES`; end it with :meth:`end_server_span`."""
        path = scope.get("path", "")
        if path.startswith(UNTRACED_ROUTES):
            return None
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        method = scope.get("method", "GET")
        attributes: dict[str, Any] = {
            "http.request.method": method,
            "url.path": path,
            "url.scheme": scope.get("scheme", "http"),
            "network.protocol.version": scope.get("http_version", "1.1"),
        }
        if scope.get("client"):
            attributes["client.address"] = scope["client"][0]
        if "user-agent" in headers:
            attributes["user_agent.original"] = headers["user-agent"]
        return self.tracer.start_span(
            method, context=self.extract(headers), kind=SpanKind.SERVER, attributes=attributes
        )

    def end_server_span(
        self, span: Span, method: str, status: int, route: str | None, error_type: str | None
    ) -> None:
        """Name the span ``{method} {route}`` and end it with the response status: ERROR with ``error.type``
        (``error_type``, else the status code) for a 5xx only (4xx stays unset on a server span, as the HTTP
        semconv says)."""
        if route:
            span.set_attribute("http.route", route)
            span.update_name(f"{method} {route}")
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_attribute("error.type", error_type or str(status))
            span.set_status(Status(StatusCode.ERROR))
        span.end()

    def record(self, spans: RequestSpans, server_span: Span | None = None) -> RecordedSpan:
        """Emit ``llm_request`` (INTERNAL, under ``server_span``, the request's HTTP SERVER span, else
        under the incoming ``traceparent``) with children ``queue``, ``prefill`` (chunk/preemption events)
        and ``decode``. Returns the trace id and span id of ``llm_request`` (lowercase hex) and whether it
        is sampled."""

        def wall(mono: float) -> int:
            return spans.arrival_wall_ns + int((mono - spans.arrival) * 1e9)

        parent = set_span_in_context(server_span) if server_span is not None else spans.timeline.parent
        root = self.tracer.start_span(
            "llm_request",
            context=parent,
            kind=SpanKind.INTERNAL,
            start_time=wall(spans.arrival),
            attributes=spans.attributes,
        )
        parent = set_span_in_context(root)
        queue_end = spans.first_scheduled if spans.first_scheduled is not None else spans.end
        prefill_end = spans.first_token if spans.first_token is not None else spans.end
        self._child("queue", parent, wall(spans.arrival), wall(queue_end), [], wall)
        if spans.first_scheduled is not None:
            events = [e for e in spans.timeline.events if e.initial_prefill or e.time <= prefill_end]
            self._child("prefill", parent, wall(spans.first_scheduled), wall(prefill_end), events, wall)
        if spans.first_token is not None:
            ok_end = spans.last_token if spans.last_token is not None else spans.first_token
            decode_end = ok_end if spans.error is None else spans.end
            late = [e for e in spans.timeline.events if not e.initial_prefill and e.time > prefill_end]
            self._child(
                "decode",
                parent,
                wall(spans.first_token),
                wall(decode_end),
                late,
                wall,
                spans.decode_attributes,
            )
        if spans.error is not None:
            root.set_status(Status(StatusCode.ERROR, spans.error))
        root.end(end_time=wall(spans.end))
        ctx = root.get_span_context()
        return RecordedSpan(f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}", ctx.trace_flags.sampled)

    def _child(
        self,
        name: str,
        parent: Context,
        start_ns: int,
        end_ns: int,
        events: list[TimelineEvent],
        wall: Callable[[float], int],
        attributes: Mapping[str, Any] | None = None,
    ) -> None:
        end_ns = max(end_ns, start_ns)
        span = self.tracer.start_span(name, context=parent, start_time=start_ns, attributes=attributes)
        for event in events:
            span.add_event(
                event.name, event.attributes, timestamp=min(max(wall(event.time), start_ns), end_ns)
            )
        span.end(end_time=end_ns)

    def shutdown(self) -> None:
        """Flush pending spans and stop the exporter."""
        self.provider.shutdown()
