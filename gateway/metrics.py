"""Prometheus collectors of the gateway (``kvscope_gateway_*``, design.md §4.3), held by one object.

Labels are bounded: ``model`` is a served model name or ``"unknown"``, ``route`` one of :data:`ROUTES`,
``status`` the HTTP status code, ``upstream`` a configured upstream label, ``reason``/``type``/``outcome``
fixed vocabularies. vLLM equivalents are listed in docs/gateway.md.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.settings import MetricsConfig

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/*", "other")
UNKNOWN_MODEL = "unknown"


def route_label(path: str) -> str:
    """The bounded ``route`` label of a request path."""
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models"
    return "/v1/*" if path.startswith("/v1/") else "other"


class GatewayMetrics:
    """Every ``kvscope_gateway_*`` collector, registered on ``registry`` (no module globals)."""

    def __init__(self, registry: CollectorRegistry, config: MetricsConfig | None = None) -> None:
        config = config or MetricsConfig()
        self.registry = registry
        p = "kvscope_gateway_"
        kw = {"registry": registry}
        self.requests = Counter(p + "requests", "Requests answered, by final HTTP status.",
                                ["model", "route", "status"], **kw)
        self.request_duration = Histogram(p + "request_duration_seconds",
                                          "Request arrival to last byte sent (e2e at the gateway).",
                                          ["model", "route"], buckets=config.duration_buckets, **kw)
        self.ttft = Histogram(p + "time_to_first_token_seconds",
                              "Request arrival to the first token event sent to the client (streams).",
                              ["model"], buckets=config.ttft_buckets, **kw)
        self.tpot = Histogram(p + "time_per_output_token_seconds",
                              "(e2e - TTFT) / (output tokens - 1) of streams with at least 2 tokens.",
                              ["model"], buckets=config.tpot_buckets, **kw)
        self.overhead = Histogram(p + "overhead_seconds",
                                  "Time spent in the gateway: e2e minus the time waiting on upstreams.",
                                  ["route"], buckets=config.overhead_buckets, **kw)
        self.tokens = Counter(p + "tokens", "Tokens by type (input, output, cached input).",
                              ["model", "type"], **kw)
        self.in_flight = Gauge(p + "in_flight_requests", "Requests being served.", **kw)
        self.rate_limited = Counter(p + "rate_limited", "Requests refused by a limit.", ["reason"], **kw)
        self.stream_errors = Counter(p + "stream_errors",
                                     "Streams that failed after the response started (in-band error).",
                                     ["model", "reason"], **kw)
        self.upstream_up = Gauge(p + "upstream_up", "1 when the upstream replica is healthy.", ["upstream"], **kw)
        self.upstream_outstanding = Gauge(p + "upstream_outstanding_requests",
                                          "Requests in flight per upstream (least-outstanding balancing).",
                                          ["upstream"], **kw)
        self.upstream_errors = Counter(p + "upstream_errors", "Failed upstream attempts.",
                                       ["upstream", "reason"], **kw)
        self.log_records = Counter(p + "log_records", "Request-log records by sink and outcome.",
                                   ["sink", "outcome"], **kw)
        self.log_spool_bytes = Gauge(p + "log_spool_bytes", "Bytes of request-log records spooled to disk.", **kw)

    def model_label(self, model: str | None, served: bool) -> str:
        """``model`` if it is served, else ``"unknown"`` (keeps the series count bounded)."""
        return model if model and served else UNKNOWN_MODEL


class LogSinkMetrics:
    """Adapter a log sink reports through (``on_outcome``/``on_spool_bytes``, as the Elasticsearch sink
    expects) onto ``kvscope_gateway_log_records_total{sink,outcome}`` and ``kvscope_gateway_log_spool_bytes``."""

    def __init__(self, metrics: GatewayMetrics, sink: str) -> None:
        self._records, self._spool, self._sink = metrics.log_records, metrics.log_spool_bytes, sink

    def on_outcome(self, outcome: str, n: int) -> None:
        self._records.labels(self._sink, outcome).inc(n)

    def on_spool_bytes(self, n: int) -> None:
        self._spool.set(n)
