"""The console's sampler: every :data:`~kvscope.gateway.console.series.INTERVAL_S` seconds one
:class:`~kvscope.gateway.console.series.Tick` from what the gateway already has in memory — its own Prometheus
registry (the ``kvscope_gateway_*`` families of :data:`SAMPLE_NAMES` only, read by :func:`read_registry`
through ``CollectorRegistry.restricted_registry``: the values ``/metrics`` encodes, without collecting the
families the console does not draw, nor the process collector's reads of /proc), each replica's latest
engine sample (``Replica.engine_sample``, kept by gateway/engines/scraper.py; for our engine the
``kvscope_engine_*`` gauges), and the request-log records' counts
(gateway/console/records.py) — then the alert board's evaluation. One asyncio task, started and stopped by
the console's lifespan (gateway/console/routes.py); nothing on the request path waits for it, and it makes no
network call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.registry import RestrictedRegistry

from kvscope.gateway.console.alerts import AlertBoard
from kvscope.gateway.console.records import RecordRing
from kvscope.gateway.console.series import ConsoleSeries, Counters, Hist, Histograms, ReplicaState, Tick

_log = logging.getLogger("kvscope.gateway")

P = "kvscope_gateway_"
SAMPLE_NAMES = frozenset(
    {
        P + "requests_total",
        P + "time_to_first_token_seconds_bucket",
        P + "time_per_output_token_seconds_bucket",
        P + "tokens_total",
        P + "cached_tokens_total",
        P + "rate_limited_total",
        P + "stream_errors_total",
        P + "in_flight_requests",
        P + "log_records_total",
        P + "log_spool_bytes",
    }
)
"""The samples of the gateway's registry a tick reads (the names ``/metrics`` shows)."""
LOST_OUTCOMES = frozenset({"failed", "dropped"})
"""``log_records_total`` outcomes of a record that did not reach its sink (KvscopeLogShippingFailing)."""

Samples = dict[str, list[tuple[dict[str, str], float]]]


def read_registry(
    registry: CollectorRegistry | RestrictedRegistry, names: frozenset[str] = SAMPLE_NAMES
) -> Samples:
    """Sample name → its (labels, value) pairs, for the samples in ``names``, from ``registry.collect()``
    (the families ``/metrics`` encodes, so the values are the page's). ``registry`` is best a
    ``restricted_registry(names)`` view (what :class:`ConsoleSampler` reads): it collects only the families
    holding ``names``; a whole registry gives the same pairs, collecting everything."""
    out: Samples = {}
    for family in registry.collect():
        for s in family.samples:
            if s.name in names:
                out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _sum_by(pairs: Iterable[tuple[dict[str, str], float]], label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, value in pairs:
        key = labels.get(label, "")
        out[key] = out.get(key, 0.0) + value
    return out


def _histograms(pairs: Iterable[tuple[dict[str, str], float]]) -> dict[str, Hist]:
    """Model → its cumulative histogram from ``_bucket`` samples (``le`` bounds, summed over other labels)."""
    by_model: dict[str, dict[float, float]] = {}
    for labels, value in pairs:
        buckets = by_model.setdefault(labels.get("model", ""), {})
        le = float(labels["le"])
        buckets[le] = buckets.get(le, 0.0) + value
    return {model: (tuple(sorted(b)), tuple(b[le] for le in sorted(b))) for model, b in by_model.items()}


def counters_of(samples: Samples, records: RecordRing, generation_routes: Sequence[str]) -> Counters:
    """The :class:`Counters` of one read of the registry, and the records' counts."""
    requests = samples.get(P + "requests_total", [])
    generation = [(labels, v) for labels, v in requests if labels.get("route") in generation_routes]
    tokens = _sum_by(samples.get(P + "tokens_total", []), "type")
    streams = samples.get(P + "stream_errors_total", [])
    lost = [
        (labels, v)
        for labels, v in samples.get(P + "log_records_total", [])
        if labels.get("outcome") in LOST_OUTCOMES
    ]
    return Counters(
        requests=sum(v for _, v in requests),
        by_status=_sum_by(requests, "status"),
        generation=_sum_by(generation, "model"),
        generation_5xx=_sum_by(
            ((lb, v) for lb, v in generation if lb.get("status", "").startswith("5")), "model"
        ),
        stream_errors=_sum_by(streams, "reason"),
        stream_errors_by_model=_sum_by(streams, "model"),
        input_tokens=tokens.get("input", 0.0),
        output_tokens=tokens.get("output", 0.0),
        cached_tokens=sum(v for _, v in samples.get(P + "cached_tokens_total", [])),
        rate_limited=_sum_by(samples.get(P + "rate_limited_total", []), "reason"),
        log_failed=_sum_by(lost, "sink"),
        spool_bytes=sum(v for _, v in samples.get(P + "log_spool_bytes", [])),
        in_flight=sum(v for _, v in samples.get(P + "in_flight_requests", [])),
        spec_draft_tokens=records.spec_draft_tokens,
        spec_accepted_tokens=records.spec_accepted_tokens,
        preemptions=dict(records.preemptions),
    )


def replica_state(replica: Any, now: float) -> ReplicaState:
    """A replica (gateway/proxy/upstreams.py ``Replica``) as the console shows it at ``now`` (monotonic)."""
    sample = replica.engine_sample
    return ReplicaState(
        label=replica.label,
        url=replica.config.url,
        kind=str(replica.kind),
        healthy=bool(replica.healthy),
        draining=bool(replica.draining),
        outstanding=int(replica.outstanding),
        running=sample.requests_running if sample is not None else None,
        waiting=sample.requests_waiting if sample is not None else None,
        kv_usage=sample.kv_cache_usage if sample is not None else None,
        sample_age_s=sample.age_s(now) if sample is not None else None,
    )


class ConsoleSampler:
    """Reads one tick (:meth:`tick`) and keeps doing so every ``series.interval_s`` (:meth:`run`)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        replicas: Callable[[], Sequence[Any]],
        records: RecordRing,
        series: ConsoleSeries,
        board: AlertBoard,
        generation_routes: Sequence[str],
    ) -> None:
        self.registry = registry
        self.view = registry.restricted_registry(SAMPLE_NAMES)
        """The families of :data:`SAMPLE_NAMES` only (what a tick reads)."""
        self.replicas = replicas
        self.records = records
        self.series = series
        self.board = board
        self.generation_routes = tuple(generation_routes)

    def tick(self, now: float | None = None, wall: float | None = None) -> Tick:
        """Read the registry, the replicas and the records now, keep the tick and evaluate the alerts."""
        now = time.monotonic() if now is None else now
        wall = time.time() if wall is None else wall
        samples = read_registry(self.view)
        tick = Tick(
            at=now,
            wall=wall,
            counters=counters_of(samples, self.records, self.generation_routes),
            histograms=Histograms(
                ttft=_histograms(samples.get(P + "time_to_first_token_seconds_bucket", [])),
                tpot=_histograms(samples.get(P + "time_per_output_token_seconds_bucket", [])),
            ),
            replicas=tuple(replica_state(r, now) for r in self.replicas()),
        )
        self.series.add(tick)
        self.board.evaluate(self.series)
        return tick

    async def run(self) -> None:
        """Tick every ``interval_s`` on the monotonic clock until cancelled, the first one an interval from
        now (the lifespan takes the first tick itself, before the gateway serves). A failing tick is logged
        (once per kind of error) and skipped: the console must never take the gateway down."""
        interval = self.series.interval_s
        next_at = time.monotonic()
        failures: set[str] = set()
        while True:
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            if time.monotonic() - next_at > interval:  # the loop was held up: skip the missed ticks
                next_at = time.monotonic()
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 - logged, and the next tick tries again
                if type(exc).__name__ not in failures:
                    failures.add(type(exc).__name__)
                    _log.exception("console sampler tick failed")
