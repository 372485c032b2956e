"""OpenTelemetry GenAI metrics, exported over OTLP/HTTP beside the Prometheus series (gateway and engine).

Names, units, attributes and bucket boundaries are those of OTel semantic conventions 1.41, "Semantic
conventions for generative AI metrics":

- client (the gateway calling an upstream): ``gen_ai.client.operation.duration`` (s),
  ``gen_ai.client.token.usage`` ({token}, attribute ``gen_ai.token.type`` = ``input`` | ``output``),
  ``gen_ai.client.operation.time_to_first_chunk`` and ``gen_ai.client.operation.time_per_output_chunk`` (s,
  streams, the latter once per chunk after the first; the duration buckets 0.01 … 81.92 s);
- server (the engine): ``gen_ai.server.request.duration``, ``gen_ai.server.time_to_first_token`` and
  ``gen_ai.server.time_per_output_token`` (s).

Each :class:`MeterProvider` is built here and owned by its service (the global provider is never set). With
an OTLP endpoint (the service's flag/config or the standard ``OTEL_EXPORTER_OTLP_*`` environment,
:mod:`kvscope.common.otel_env`) a periodic reader pushes over OTLP/HTTP or gRPC; tests pass their own reader
(e.g. ``InMemoryMetricReader``). Without either, instruments record into nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import Resource

from kvscope.common.otel_env import metric_reader

OPERATION_DURATION_BUCKETS = (
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.12,
    10.24,
    20.48,
    40.96,
    81.92,
)
"""``gen_ai.client.operation.duration`` and ``gen_ai.server.request.duration`` (semconv
ExplicitBucketBoundaries)."""
TOKEN_USAGE_BUCKETS = (
    1,
    4,
    16,
    64,
    256,
    1024,
    4096,
    16384,
    65536,
    262144,
    1048576,
    4194304,
    16777216,
    67108864,
)
"""``gen_ai.client.token.usage``."""
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)
"""``gen_ai.server.time_to_first_token``."""
CHUNK_BUCKETS = OPERATION_DURATION_BUCKETS
"""``gen_ai.client.operation.time_to_first_chunk`` and ``…time_per_output_chunk``: the semconv gives them the
operation duration's boundaries, 0.01 … 81.92 s."""
TIME_PER_OUTPUT_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
"""``gen_ai.server.time_per_output_token``."""


def build_meter_provider(
    resource: Mapping[str, str],
    otlp_endpoint: str | None = None,
    readers: Sequence[MetricReader] = (),
    export_interval_s: float | None = None,
) -> MeterProvider:
    """A provider with ``readers`` plus, when metrics are exported (``otlp_endpoint`` or the OTLP environment;
    not with ``OTEL_SDK_DISABLED=true``), a periodic OTLP push every ``export_interval_s`` (None:
    ``OTEL_METRIC_EXPORT_INTERVAL``, else 15 s) with a final push at :meth:`MeterProvider.shutdown`.
    ``resource`` is merged over ``OTEL_RESOURCE_ATTRIBUTES``. Raises ValueError on an unsupported
    ``OTEL_EXPORTER_OTLP_PROTOCOL``."""
    return _provider(resource, _all_readers(otlp_endpoint, readers, export_interval_s))


def build_client_metrics(
    resource: Mapping[str, str],
    version: str,
    otlp_endpoint: str | None = None,
    readers: Sequence[MetricReader] = (),
    export_interval_s: float | None = None,
) -> GenAiClientMetrics:
    """The gateway's ``gen_ai.client.*`` instruments on a provider built as :func:`build_meter_provider`
    builds it; they record only when some reader reads them (``readers`` or the OTLP push:
    :class:`GenAiClientMetrics` ``read``). Raises ValueError as :func:`build_meter_provider` does."""
    all_readers = _all_readers(otlp_endpoint, readers, export_interval_s)
    return GenAiClientMetrics(_provider(resource, all_readers), version, read=bool(all_readers))


def _all_readers(
    otlp_endpoint: str | None, readers: Sequence[MetricReader], export_interval_s: float | None
) -> list[MetricReader]:
    reader = metric_reader(otlp_endpoint, export_interval_s)
    return [*readers, reader] if reader is not None else list(readers)


def _provider(resource: Mapping[str, str], readers: list[MetricReader]) -> MeterProvider:
    return MeterProvider(resource=Resource.create(dict(resource)), metric_readers=readers)


class GenAiClientMetrics:
    """The gateway's ``gen_ai.client.*`` instruments."""

    def __init__(self, provider: MeterProvider, version: str, read: bool = True) -> None:
        """``read``: whether any metric reader reads ``provider``. False: :meth:`record` records nothing (the
        SDK would build each measurement, clean its attributes and hand it to no reader: one
        ``time_per_output_chunk`` observation per streamed token, ~1.7 ms of CPU per 256-token stream on a
        2-vCPU Zen 3, docs/benchmarks.md "The gateway's CPU per relayed token")."""
        meter = provider.get_meter("kvscope.gateway", version)
        self.provider = provider
        self.read = read
        self.duration = meter.create_histogram(
            "gen_ai.client.operation.duration",
            unit="s",
            description="GenAI operation duration.",
            explicit_bucket_boundaries_advisory=OPERATION_DURATION_BUCKETS,
        )
        self.token_usage = meter.create_histogram(
            "gen_ai.client.token.usage",
            unit="{token}",
            description="Number of input and output tokens used.",
            explicit_bucket_boundaries_advisory=TOKEN_USAGE_BUCKETS,
        )
        self.time_to_first_chunk = meter.create_histogram(
            "gen_ai.client.operation.time_to_first_chunk",
            unit="s",
            description="Time to receive the first chunk of a streamed response.",
            explicit_bucket_boundaries_advisory=CHUNK_BUCKETS,
        )
        self.time_per_output_chunk = meter.create_histogram(
            "gen_ai.client.operation.time_per_output_chunk",
            unit="s",
            description="Time per output chunk after the first of a streamed response.",
            explicit_bucket_boundaries_advisory=CHUNK_BUCKETS,
        )

    def record(
        self,
        attributes: Mapping[str, Any],
        duration_s: float,
        input_tokens: int | None,
        output_tokens: int | None,
        time_to_first_chunk_s: float | None,
        output_chunk_gaps_s: Sequence[float] = (),
    ) -> None:
        """One upstream call; ``attributes`` as :mod:`kvscope.gateway.genai_attrs` builds them (only the
        metric attributes of the semconv are kept: operation, provider, models, server address/port,
        error.type). ``output_chunk_gaps_s``: the stream's gaps between consecutive chunks after the first
        (seconds), each recorded as one ``time_per_output_chunk`` observation, as the semconv asks (one per
        chunk after the first). The relay only collects the chunk times (a list append per token); the
        histogram records all of them here, once the call ended, which keeps OTel out of the per-chunk
        path. Nothing at all when no reader reads the provider (``read``)."""
        if not self.read:
            return
        attrs = {k: v for k, v in attributes.items() if k in _METRIC_ATTRIBUTES}
        self.duration.record(duration_s, attrs)
        for kind, value in (("input", input_tokens), ("output", output_tokens)):
            if isinstance(value, int):
                self.token_usage.record(value, {**attrs, "gen_ai.token.type": kind})
        if time_to_first_chunk_s is not None:
            self.time_to_first_chunk.record(time_to_first_chunk_s, attrs)
        for gap in output_chunk_gaps_s:
            self.time_per_output_chunk.record(gap, attrs)


class GenAiServerMetrics:
    """The engine's ``gen_ai.server.*`` instruments (one observation per request)."""

    def __init__(self, provider: MeterProvider, version: str) -> None:
        meter = provider.get_meter("kvscope.engine", version)
        self.provider = provider
        self.request_duration = meter.create_histogram(
            "gen_ai.server.request.duration",
            unit="s",
            description=(
                "Generative AI server request duration such as time-to-last byte or last output token."
            ),
            explicit_bucket_boundaries_advisory=OPERATION_DURATION_BUCKETS,
        )
        self.time_to_first_token = meter.create_histogram(
            "gen_ai.server.time_to_first_token",
            unit="s",
            description="Time to generate first token for successful responses.",
            explicit_bucket_boundaries_advisory=TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self.time_per_output_token = meter.create_histogram(
            "gen_ai.server.time_per_output_token",
            unit="s",
            description="Time per output token generated after the first token for successful responses.",
            explicit_bucket_boundaries_advisory=TIME_PER_OUTPUT_TOKEN_BUCKETS,
        )

    def record(
        self, attributes: Mapping[str, Any], duration_s: float, ttft_s: float | None, tpot_s: float | None
    ) -> None:
        """One request. TTFT and TPOT only for successful responses (no ``error.type``), as the semconv
        says."""
        attrs = {k: v for k, v in attributes.items() if k in _METRIC_ATTRIBUTES}
        self.request_duration.record(duration_s, attrs)
        if "error.type" in attrs:
            return
        if ttft_s is not None:
            self.time_to_first_token.record(ttft_s, attrs)
        if tpot_s is not None:
            self.time_per_output_token.record(tpot_s, attrs)


_METRIC_ATTRIBUTES = frozenset(
    {
        "gen_ai.operation.name",
        "gen_ai.provider.name",
        "gen_ai.request.model",
        "gen_ai.response.model",
        "server.address",
        "server.port",
        "error.type",
    }
)
"""The attributes the GenAI metrics define (bounded): never ids, token counts or parameters."""
