"""The OTLP exporters of both services, configured by the OpenTelemetry SDK environment (gateway and engine).

OpenTelemetry specification, "Environment Variable Specification" and "OTLP Exporter Configuration": the SDK
reads its own variables, and so does this module wherever it can. What the services decide is only whether
a signal is exported at all and which exporter class speaks the protocol:

- ``OTEL_SDK_DISABLED=true``: no exporter is built; the SDK's providers themselves turn no-op.
- ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`` (used as is) or
  ``OTEL_EXPORTER_OTLP_ENDPOINT`` (the base: OTLP/HTTP appends ``/v1/traces`` and ``/v1/metrics``) switch a
  signal's export on; the exporter is built without an endpoint so that the SDK reads these variables
  itself (with ``…_HEADERS``, ``…_TIMEOUT``, ``…_COMPRESSION``, ``…_CERTIFICATE`` and the rest).
- ``OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]PROTOCOL``: ``http/protobuf`` (the default) or ``grpc``
  (opentelemetry-exporter-otlp-proto-grpc); ``http/json`` has no Python exporter and is a ValueError.
- ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER`` = ``none`` switch a signal's export off.
- ``OTEL_METRIC_EXPORT_INTERVAL`` (ms) and ``OTEL_METRIC_EXPORT_TIMEOUT`` are read by the SDK's periodic
  reader: no interval is passed unless the service's configuration sets one (without either, kvscope's
  default of :data:`DEFAULT_EXPORT_INTERVAL_MS` applies rather than the SDK's 60 s).
- ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` are read by the services' settings and by
  ``Resource.create``.

A flag or config-file endpoint overrides the environment: an OTLP/HTTP base URL gets the signal's path (a URL
already ending in ``/v1/traces`` or ``/v1/metrics`` is re-pointed at the other signal), a gRPC endpoint is
used as given.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal

from opentelemetry.sdk.metrics.export import MetricExporter, MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.trace.export import SpanExporter

Signal = Literal["traces", "metrics"]
Protocol = Literal["http/protobuf", "grpc"]
PROTOCOLS: tuple[Protocol, ...] = ("http/protobuf", "grpc")
DEFAULT_EXPORT_INTERVAL_MS = 15_000.0
"""Push interval of the OTLP metrics when neither the configuration nor ``OTEL_METRIC_EXPORT_INTERVAL`` sets
one (the SDK's own default is 60 s; kvscope's GenAI metrics were always pushed every 15 s)."""


def sdk_disabled(environ: Mapping[str, str] | None = None) -> bool:
    """``OTEL_SDK_DISABLED`` is ``true`` (case-insensitive, as the SDK reads it)."""
    env = os.environ if environ is None else environ
    return env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def protocol(signal: Signal, environ: Mapping[str, str] | None = None) -> Protocol:
    """``OTEL_EXPORTER_OTLP_{SIGNAL}_PROTOCOL``, else ``OTEL_EXPORTER_OTLP_PROTOCOL``, else ``http/protobuf``.
    Raises ValueError for any other value (``http/json`` included: no Python exporter speaks it)."""
    env = os.environ if environ is None else environ
    value = (
        env.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if value not in PROTOCOLS:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL must be one of {', '.join(PROTOCOLS)}, got {value!r}")
    return value


def exports(signal: Signal, explicit: str | None, environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``signal`` is exported: not with the SDK disabled or ``OTEL_{SIGNAL}_EXPORTER=none``; else when
    an endpoint is configured (``explicit``, the signal's variable or the generic one)."""
    env = os.environ if environ is None else environ
    if sdk_disabled(env) or env.get(f"OTEL_{signal.upper()}_EXPORTER", "").strip().lower() == "none":
        return False
    return bool(
        explicit
        or env.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT")
        or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def signal_url(base: str, signal: Signal) -> str:
    """An OTLP/HTTP base URL (or a ``…/v1/traces`` / ``…/v1/metrics`` URL) pointed at ``signal``'s path."""
    url = base.rstrip("/")
    for suffix in ("/v1/traces", "/v1/metrics"):
        url = url.removesuffix(suffix)
    return f"{url}/v1/{signal}"


def span_exporter(
    explicit: str | None = None, environ: Mapping[str, str] | None = None
) -> SpanExporter | None:
    """The OTLP span exporter the configuration asks for, None when traces are not exported (see
    :func:`exports`). ``explicit``: the flag/config endpoint, overriding the environment. Raises ValueError on
    an unsupported protocol."""
    env = os.environ if environ is None else environ
    if not exports("traces", explicit, env):
        return None
    if protocol("traces", env) == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter

        return GrpcSpanExporter(endpoint=explicit or None)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=signal_url(explicit, "traces") if explicit else None)


def metric_exporter(
    explicit: str | None = None, environ: Mapping[str, str] | None = None
) -> MetricExporter | None:
    """The OTLP metric exporter the configuration asks for, None when metrics are not exported (see
    :func:`exports`). Raises ValueError on an unsupported protocol."""
    env = os.environ if environ is None else environ
    if not exports("metrics", explicit, env):
        return None
    if protocol("metrics", env) == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
            OTLPMetricExporter as GrpcMetricExporter,
        )

        return GrpcMetricExporter(endpoint=explicit or None)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    return OTLPMetricExporter(endpoint=signal_url(explicit, "metrics") if explicit else None)


def metric_reader(
    explicit: str | None = None, interval_s: float | None = None, environ: Mapping[str, str] | None = None
) -> MetricReader | None:
    """A periodic reader pushing to :func:`metric_exporter`, None when metrics are not exported.
    ``interval_s`` (the service's configuration) overrides ``OTEL_METRIC_EXPORT_INTERVAL``, which the SDK
    reads when no interval is passed; with neither, :data:`DEFAULT_EXPORT_INTERVAL_MS`."""
    env = os.environ if environ is None else environ
    exporter = metric_exporter(explicit, env)
    if exporter is None:
        return None
    if interval_s is not None:
        millis: float | None = interval_s * 1000
    else:
        millis = None if env.get("OTEL_METRIC_EXPORT_INTERVAL") else DEFAULT_EXPORT_INTERVAL_MS
    return PeriodicExportingMetricReader(exporter, export_interval_millis=millis)
