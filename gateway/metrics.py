"""Prometheus collectors of the gateway (``kvscope_gateway_*``, docs/metrics.md), held by one object.

Labels are bounded: ``model`` is a served model name or ``"unknown"``, ``route`` one of :data:`ROUTES`,
``status`` the HTTP status code, ``upstream`` an upstream label (a replica's series are removed when it
leaves the pool), ``kind`` the inference server behind an upstream (an ``UpstreamKind`` value,
gateway/engines/kinds.py, or ``"unknown"`` before it is known), ``source`` a discovery source (``config`` or
``dns:<name>``), ``reason``/``type``/``outcome`` fixed vocabularies. vLLM equivalents are listed in
docs/gateway.md.

The per-upstream series (``…_upstream_up``, ``…_upstream_outstanding_requests``, ``…_upstream_errors_total``)
carry ``kind`` as a label, so a panel or an alert filters and groups by kind without a join, and
``kvscope_gateway_upstream_info{upstream, kind, kind_source}`` (always 1) says which signal decided it. When
detection changes an upstream's kind (:meth:`GatewayMetrics.set_upstream_kind`: once for an ``auto``
upstream, ``unknown`` → the detected kind at its first good health check; rarely after), its series move to
the new label set: the gauges keep their values, the error counters start again at 0 under the new kind
(``rate``/``increase`` of a new series start from its first sample, so a sum over kinds loses no increase
but those of the scrape interval around the move), and the old series disappear (Prometheus marks them
stale at the next scrape).

With several worker processes (``kvscope gateway --workers N``) the values live in prometheus_client's
multiprocess files and ``/metrics`` reads :attr:`GatewayMetrics.exposed`, which adds up every worker
(gateway/metrics_workers.py): each gauge below says how its workers' values combine (``multiprocess_mode``;
ignored by a single process).
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvscope.common.version import kvscope_version
from kvscope.gateway.metrics_workers import WorkersCollector, WorkersProcessCollector
from kvscope.gateway.settings import MetricsConfig

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/*", "other")
UNKNOWN_MODEL = "unknown"
UNKNOWN_KIND = "unknown"
"""``kind``/``kind_source`` of an upstream whose kind is not known yet (an ``auto`` upstream before it first
answers)."""
TOKEN_TYPES = ("input", "output")
"""``type`` of ``kvscope_gateway_tokens_total``: disjoint, so ``sum`` over them is every token. Cached prompt
tokens are a subset of ``input`` and have their own counter, ``kvscope_gateway_cached_tokens_total``."""
LOG_OUTCOMES = ("shipped", "failed", "dropped")
"""Final ``outcome`` of ``kvscope_gateway_log_records_total``: every record ends in exactly one, so they add
up to the records emitted (minus those still queued). Being spooled is a transit state, counted apart in
``kvscope_gateway_log_records_spooled_total``."""
RATE_LIMIT_REASONS = ("requests", "tokens", "concurrency")
STREAM_ERROR_REASONS = ("upstream_error", "incomplete", "aborted", "timeout", "upstream_disconnected")
ROUTING_REASONS = {
    "cache_aware": ("prefix_match", "load", "fallback"),
    "least_outstanding": ("load", "fallback"),
    "round_robin": ("round_robin", "fallback"),
}
"""``policy`` → its ``reason`` values in ``kvscope_gateway_routing_decisions_total``
(gateway/routing/router.py)."""
CACHED_TOKEN_SOURCES = ("predicted", "reported")
PREDICTION_OUTCOMES = ("exact", "over", "under")
"""``outcome`` of ``kvscope_gateway_routing_predictions_total``: the router's predicted cached tokens equal,
exceed or fall short of what the upstream reported."""
UPSTREAM_ERROR_REASONS = (
    "connect",
    "disconnect",
    "timeout",
    "status_5xx",
    "stream_broken",
    "stream_incomplete",
    "stream_error",
)


@dataclass(slots=True)
class _UpstreamSeries:
    """The label values and gauge values of one upstream's series (moved when its kind changes)."""

    kind: str
    kind_source: str
    up: float = 0.0
    outstanding: float = 0.0


def route_label(path: str) -> str:
    """The bounded ``route`` label of a request path."""
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models"
    return "/v1/*" if path.startswith("/v1/") else "other"


class GatewayMetrics:
    """Every ``kvscope_gateway_*`` collector, registered on ``registry`` (no module globals).

    ``multiprocess_dir``: the folder of prometheus_client's multiprocess mode when this process is one of
    several workers (kvscope.gateway.settings ``multiprocess_dir``; the library itself already writes every
    value there): :attr:`exposed` is then a registry of its own that merges every worker's files, and series
    are never removed from the files (the merged view drops them, gateway/metrics_workers.py). None: one
    process, :attr:`exposed` is ``registry``."""

    def __init__(
        self,
        registry: CollectorRegistry,
        config: MetricsConfig | None = None,
        multiprocess_dir: Path | None = None,
    ) -> None:
        config = config or MetricsConfig()
        self.registry = registry
        """This process's collectors (tests and the console read them)."""
        self.multiprocess = multiprocess_dir is not None
        self.exposed = registry
        """What ``/metrics`` encodes: ``registry`` (one process) or every worker's series merged."""
        if multiprocess_dir is not None:
            self.exposed = CollectorRegistry()
            self.exposed.register(WorkersCollector(multiprocess_dir, self.live_upstream_series))
            self.exposed.register(WorkersProcessCollector(multiprocess_dir))
        p = "kvscope_gateway_"
        self.requests = Counter(
            p + "requests",
            "Requests answered, by final HTTP status.",
            ["model", "route", "status"],
            registry=registry,
        )
        self.request_duration = Histogram(
            p + "request_duration_seconds",
            "Request arrival to last byte sent (e2e at the gateway).",
            ["model", "route"],
            buckets=config.duration_buckets,
            registry=registry,
        )
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "Request arrival to the first token event sent to the client (streams).",
            ["model"],
            buckets=config.ttft_buckets,
            registry=registry,
        )
        self.tpot = Histogram(
            p + "time_per_output_token_seconds",
            "(e2e - TTFT) / (output tokens - 1) of streams with at least 2 tokens.",
            ["model"],
            buckets=config.tpot_buckets,
            registry=registry,
        )
        self.overhead = Histogram(
            p + "overhead_seconds",
            "Time spent in the gateway: e2e minus the time waiting on upstreams.",
            ["route"],
            buckets=config.overhead_buckets,
            registry=registry,
        )
        self.tokens = Counter(
            p + "tokens",
            "Tokens by type: input (prompt) and output (completion).",
            ["model", "type"],
            registry=registry,
        )
        self.cached_tokens = Counter(
            p + "cached_tokens",
            "Prompt tokens served from the upstream's prefix cache (a subset of input).",
            ["model"],
            registry=registry,
        )
        self.routing_decisions = Counter(
            p + "routing_decisions",
            "Requests by the routing policy and the reason their (last) replica was chosen.",
            ["model", "policy", "reason"],
            registry=registry,
        )
        self.routing_cached_tokens = Counter(
            p + "routing_cached_tokens",
            "Cache-aware routing: prompt tokens predicted to be in the chosen replica's prefix cache, and "
            "those the upstream reported cached, for requests with both.",
            ["model", "source"],
            registry=registry,
        )
        self.routing_predictions = Counter(
            p + "routing_predictions",
            "Cache-aware routing: requests whose predicted cached tokens were exact, over or under what the "
            "upstream reported.",
            ["model", "outcome"],
            registry=registry,
        )
        self.in_flight = Gauge(
            p + "in_flight_requests", "Requests being served.", registry=registry, multiprocess_mode="livesum"
        )
        self.rate_limited = Counter(
            p + "rate_limited", "Requests refused by a limit.", ["reason"], registry=registry
        )
        self.stream_errors = Counter(
            p + "stream_errors",
            "Streams that failed after the response started (in-band error).",
            ["model", "reason"],
            registry=registry,
        )
        self.upstream_up = Gauge(
            p + "upstream_up",
            "1 when the upstream replica is healthy.",
            ["upstream", "kind"],
            registry=registry,
            multiprocess_mode="livemostrecent",  # every worker checks every replica: the newest check
        )
        self.upstream_outstanding = Gauge(
            p + "upstream_outstanding_requests",
            "Requests in flight per upstream (least-outstanding balancing).",
            ["upstream", "kind"],
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.upstream_errors = Counter(
            p + "upstream_errors",
            "Failed upstream attempts.",
            ["upstream", "kind", "reason"],
            registry=registry,
        )
        self.upstream_info = Gauge(
            p + "upstream_info",
            "Always 1, labelled with the upstream's kind (the inference server behind it) and the signal "
            "that decided it (kind_source: config, models, metrics, info, props or default).",
            ["upstream", "kind", "kind_source"],
            registry=registry,
            multiprocess_mode="livemax",
        )
        self._upstreams: dict[str, _UpstreamSeries] = {}
        """Upstream label → its series' kind and gauge values (instance state: one per gateway)."""
        self.discovery_errors = Counter(
            p + "discovery_errors",
            "Discovery rounds that failed and kept the source's last known replicas (a DNS timeout or "
            "SERVFAIL, a config file that cannot be read or no longer loads).",
            ["source"],
            registry=registry,
        )
        self.log_records = Counter(
            p + "log_records",
            "Request-log records by sink and final outcome (shipped, failed, dropped).",
            ["sink", "outcome"],
            registry=registry,
        )
        self.log_records_spooled = Counter(
            p + "log_records_spooled",
            "Request-log records written to the on-disk spool on their way to the "
            "sink (a transit state; each also ends in one final outcome).",
            ["sink"],
            registry=registry,
        )
        self.log_spool_bytes = Gauge(
            p + "log_spool_bytes",
            "Bytes of request-log records spooled to disk.",
            registry=registry,
            multiprocess_mode="livesum",  # each worker spools to a folder of its own
        )
        self.build_info = Gauge(
            p + "build_info",
            "Always 1, labelled with the kvscope version and the Python "
            "version the gateway runs (the Prometheus build_info convention).",
            ["version", "python"],
            registry=registry,
            multiprocess_mode="livemax",
        )

    def initialize(self, upstreams: tuple[str, ...] = (), sinks: tuple[str, ...] = ()) -> None:
        """Create the zero series of every bounded label set known at start, so that rates read 0 instead of
        "No data" before the first event (Prometheus instrumentation practice: export 0 for label sets known
        in advance)."""
        self.build_info.labels(kvscope_version(), platform.python_version()).set(1)
        for reason in RATE_LIMIT_REASONS:
            self.rate_limited.labels(reason)
        for upstream in upstreams:
            self.initialize_upstream(upstream)
        for sink in sinks:
            self.log_records_spooled.labels(sink)
            for outcome in LOG_OUTCOMES:
                self.log_records.labels(sink, outcome)

    def initialize_upstream(
        self, upstream: str, kind: str | None = None, kind_source: str | None = None
    ) -> None:
        """The series of a replica that joined the pool: down, nothing in flight, zero errors by reason, its
        info series; ``kind``/``kind_source`` as far as known (None: ``"unknown"``). Starts afresh when
        ``upstream`` already has series."""
        if upstream in self._upstreams:
            self.remove_upstream(upstream)
        state = _UpstreamSeries(kind or UNKNOWN_KIND, kind_source or UNKNOWN_KIND)
        self._upstreams[upstream] = state
        self._create_series(upstream, state)

    def set_upstream_kind(self, upstream: str, kind: str | None, kind_source: str | None) -> None:
        """The pool says which inference server ``upstream`` is (an ``UpstreamKind`` value; None: not known)
        and which signal decided it (``config``, ``models``, ``metrics``, ``info``, ``props``, ``default``).
        Called at join and after each detection: a new kind moves all the upstream's series to the new
        labels (module docstring), a new source with the same kind only its info series, and an unchanged
        kind and source change nothing."""
        state = self._state(upstream)
        new_kind, new_source = kind or UNKNOWN_KIND, kind_source or UNKNOWN_KIND
        if new_kind != state.kind:
            self._remove_series(upstream, state)
            state.kind, state.kind_source = new_kind, new_source
            self._create_series(upstream, state)
        elif new_source != state.kind_source:  # same kind, another signal: only the info series moves
            if not self.multiprocess:  # (multiprocess: the merged view drops the old one)
                self.upstream_info.remove(upstream, state.kind, state.kind_source)
            state.kind_source = new_source
            self.upstream_info.labels(upstream, state.kind, state.kind_source).set(1)

    def set_upstream_up(self, upstream: str, healthy: bool) -> None:
        """``kvscope_gateway_upstream_up``: 1 when ``upstream``'s last health check passed, else 0."""
        state = self._state(upstream)
        state.up = 1.0 if healthy else 0.0
        self.upstream_up.labels(upstream, state.kind).set(state.up)

    def set_upstream_outstanding(self, upstream: str, requests: int) -> None:
        """``kvscope_gateway_upstream_outstanding_requests``: requests in flight to ``upstream``."""
        state = self._state(upstream)
        state.outstanding = float(requests)
        self.upstream_outstanding.labels(upstream, state.kind).set(state.outstanding)

    def count_upstream_error(self, upstream: str, reason: str) -> None:
        """One failed attempt on ``upstream`` (``reason``: one of :data:`UPSTREAM_ERROR_REASONS`)."""
        self.upstream_errors.labels(upstream, self._state(upstream).kind, reason).inc()

    def remove_upstream(self, upstream: str) -> None:
        """Drop every series of a replica that left the pool (gateway/proxy/discovery.py): a replica that is
        gone must not stay on dashboards as "down", nor keep its series forever as pods come and go. An
        upstream without series is left alone."""
        state = self._upstreams.pop(upstream, None)
        if state is not None:
            self._remove_series(upstream, state)

    def _state(self, upstream: str) -> _UpstreamSeries:
        """``upstream``'s label and gauge values; series of kind ``"unknown"`` for one not initialized."""
        if upstream not in self._upstreams:
            self.initialize_upstream(upstream)
        return self._upstreams[upstream]

    def _create_series(self, upstream: str, state: _UpstreamSeries) -> None:
        self.upstream_up.labels(upstream, state.kind).set(state.up)
        self.upstream_outstanding.labels(upstream, state.kind).set(state.outstanding)
        for reason in UPSTREAM_ERROR_REASONS:
            self.upstream_errors.labels(upstream, state.kind, reason)
        self.upstream_info.labels(upstream, state.kind, state.kind_source).set(1)

    def live_upstream_series(self) -> set[tuple[str, ...]]:
        """The per-upstream series this process holds now: ``(upstream, kind)`` and ``(upstream, kind,
        kind_source)`` label values (what the multiprocess view keeps, gateway/metrics_workers.py)."""
        live: set[tuple[str, ...]] = set()
        for upstream, state in self._upstreams.items():
            live.add((upstream, state.kind))
            live.add((upstream, state.kind, state.kind_source))
        return live

    def _remove_series(self, upstream: str, state: _UpstreamSeries) -> None:
        if self.multiprocess:  # the library cannot remove from its files: the merged view filters them
            return
        self.upstream_up.remove(upstream, state.kind)
        self.upstream_outstanding.remove(upstream, state.kind)
        for reason in UPSTREAM_ERROR_REASONS:
            self.upstream_errors.remove(upstream, state.kind, reason)
        self.upstream_info.remove(upstream, state.kind, state.kind_source)

    def initialize_model(self, model: str) -> None:
        """Zero series of a served model: tokens by type, cached tokens, stream errors by reason, routing
        decisions by policy and reason, the routing prediction's tokens and outcomes."""
        for kind in TOKEN_TYPES:
            self.tokens.labels(model, kind)
        self.cached_tokens.labels(model)
        for reason in STREAM_ERROR_REASONS:
            self.stream_errors.labels(model, reason)
        for policy, reasons in ROUTING_REASONS.items():
            for reason in reasons:
                self.routing_decisions.labels(model, policy, reason)
        for source in CACHED_TOKEN_SOURCES:
            self.routing_cached_tokens.labels(model, source)
        for outcome in PREDICTION_OUTCOMES:
            self.routing_predictions.labels(model, outcome)

    def model_label(self, model: str | None, served: bool) -> str:
        """``model`` if it is served, else ``"unknown"`` (keeps the series count bounded)."""
        return model if model and served else UNKNOWN_MODEL


class LogSinkMetrics:
    """Adapter a log sink reports through (``on_outcome``/``on_spool_bytes``, as the Elasticsearch sink
    expects) onto ``kvscope_gateway_log_records_total{sink,outcome}`` (final outcomes),
    ``kvscope_gateway_log_records_spooled_total{sink}`` (outcome ``spooled``) and
    ``kvscope_gateway_log_spool_bytes``."""

    def __init__(self, metrics: GatewayMetrics, sink: str) -> None:
        self._records, self._spool, self._sink = metrics.log_records, metrics.log_spool_bytes, sink
        self._spooled = metrics.log_records_spooled

    def on_outcome(self, outcome: str, n: int) -> None:
        if outcome == "spooled":
            self._spooled.labels(self._sink).inc(n)
        else:
            self._records.labels(self._sink, outcome).inc(n)

    def on_spool_bytes(self, n: int) -> None:
        self._spool.set(n)
