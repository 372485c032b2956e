"""The console's live series: one :class:`Tick` every :data:`INTERVAL_S` seconds (read by
gateway/console/sampler.py from the gateway's own Prometheus registry, the replicas' engine samples and the
request-log records), kept in bounded rings, and the chart values derived from them (:class:`Point`).

Three rings, all bounded:

- ticks: the last :data:`HISTORY_S` seconds of cumulative counters and replica gauges (one hour at 2 s: 1,801
  ticks of a few dozen numbers);
- histograms: TTFT and TPOT bucket counts for the last ``histogram_window_s`` seconds only (the longest window
  a chart or an evaluated alert reads: 10 minutes), the largest part of a tick;
- points: the chart values of each tick (rates over the last interval, quantiles and ratios over the last
  :data:`CHART_WINDOW_S` seconds, replica gauges as sampled), what the browser plots.

Rates are counter differences over the monotonic time between two ticks; quantiles are Prometheus'
``histogram_quantile`` over the bucket differences of a window (:func:`histogram_quantile`), so a chart's
latest value is what ``histogram_quantile(q, sum(increase(..._bucket[1m])) by (le))`` would say over the
same counters.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

INTERVAL_S = 2.0
"""Seconds between ticks."""
HISTORY_S = 3600.0
"""Seconds of ticks and chart points kept (one hour)."""
CHART_WINDOW_S = 60.0
"""Window of the charts' quantiles and ratios (TTFT/TPOT p50/p99, prefix-cache hit rate, speculative
acceptance)."""
QUANTILES = (0.5, 0.99)

Hist = tuple[tuple[float, ...], tuple[float, ...]]
"""A cumulative histogram: (upper bounds ascending, the last ``+Inf``; cumulative counts per bound)."""


def histogram_quantile(q: float, hist: Hist) -> float | None:
    """Prometheus' ``histogram_quantile`` (promql/quantile.go ``bucketQuantile``) of a cumulative histogram:
    the bucket whose cumulative count first reaches ``q`` x the total, linearly interpolated inside it from
    its lower bound (0 for the first bucket); the highest finite bound when that bucket is ``+Inf``. None
    where Prometheus gives NaN: no observations, fewer than two buckets, or no ``+Inf`` bucket. ``q`` in
    [0, 1]."""
    bounds, counts = hist
    if len(bounds) < 2 or not math.isinf(bounds[-1]) or counts[-1] <= 0:
        return None
    # cumulative counts never fall (a difference of two scrapes may, by float noise: keep it monotonic)
    fixed: list[float] = []
    for count in counts:
        fixed.append(max(count, fixed[-1]) if fixed else count)
    rank = q * fixed[-1]
    b = bisect.bisect_left(fixed, rank)
    if b == len(bounds) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start, end, count = 0.0, bounds[b], fixed[b]
    if b > 0:
        start = bounds[b - 1]
        count -= fixed[b - 1]
        rank -= fixed[b - 1]
    return start + (end - start) * (rank / count)


def hist_sum(hists: Iterable[Hist]) -> Hist | None:
    """The bucket-wise sum of histograms with the same bounds (``sum by (le)``); None for none."""
    total: Hist | None = None
    for bounds, counts in hists:
        if total is None:
            total = (bounds, counts)
        elif total[0] == bounds:
            total = (bounds, tuple(a + b for a, b in zip(total[1], counts, strict=True)))
    return total


def hist_delta(now: Hist | None, then: Hist | None) -> Hist | None:
    """``now - then`` bucket by bucket (``increase`` over the window); ``then`` None: ``now`` itself (the
    series did not exist at the window's start)."""
    if now is None:
        return None
    if then is None or then[0] != now[0]:
        return now
    return now[0], tuple(a - b for a, b in zip(now[1], then[1], strict=True))


@dataclass(frozen=True, slots=True)
class Counters:
    """Cumulative counters at one tick (since the gateway started), from its Prometheus registry unless said
    otherwise."""

    requests: float = 0.0
    """``kvscope_gateway_requests_total``, all labels."""
    by_status: Mapping[str, float] = field(default_factory=dict)
    """Status code → requests."""
    generation: Mapping[str, float] = field(default_factory=dict)
    """Model → requests on the generation routes (the availability SLO's denominator)."""
    generation_5xx: Mapping[str, float] = field(default_factory=dict)
    """Model → 5xx answers on the generation routes."""
    stream_errors: Mapping[str, float] = field(default_factory=dict)
    """Reason → ``kvscope_gateway_stream_errors_total``."""
    stream_errors_by_model: Mapping[str, float] = field(default_factory=dict)
    input_tokens: float = 0.0
    output_tokens: float = 0.0
    cached_tokens: float = 0.0
    """``kvscope_gateway_cached_tokens_total``: prompt tokens the upstreams reported from their prefix
    cache."""
    rate_limited: Mapping[str, float] = field(default_factory=dict)
    """Reason → ``kvscope_gateway_rate_limited_total``."""
    log_failed: Mapping[str, float] = field(default_factory=dict)
    """Sink → request-log records failed or dropped."""
    spool_bytes: float = 0.0
    in_flight: float = 0.0
    """A gauge: requests being served at the tick."""
    spec_draft_tokens: float = 0.0
    """From the request-log records (``kvscope.engine.spec_draft_tokens``, our engine only): draft tokens of
    the requests finished so far."""
    spec_accepted_tokens: float = 0.0
    """From the records: accepted draft tokens (``kvscope.engine.spec_accepted_tokens``)."""
    preemptions: Mapping[str, float] = field(default_factory=dict)
    """From the records: replica → preemptions of the requests it finished
    (``kvscope.engine.num_preemptions``)."""


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """One replica at a tick: the gateway's view (health, requests in flight) and its engine sample."""

    label: str
    url: str
    kind: str
    healthy: bool
    draining: bool
    outstanding: int
    running: float | None
    """Requests in its running batch (the engine sample; None: not exported or not scraped yet)."""
    waiting: float | None
    """Requests queued at it (the engine sample)."""
    kv_usage: float | None
    """KV-cache usage 0-1 (the engine sample)."""
    sample_age_s: float | None
    """Seconds since that sample was scraped (None: never)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "url": self.url,
            "kind": self.kind,
            "healthy": self.healthy,
            "draining": self.draining,
            "outstanding": self.outstanding,
            "running": self.running,
            "waiting": self.waiting,
            "kv_usage": self.kv_usage,
            "sample_age_s": self.sample_age_s,
        }


@dataclass(frozen=True, slots=True)
class Histograms:
    """TTFT and TPOT cumulative histograms at one tick, per model."""

    ttft: Mapping[str, Hist] = field(default_factory=dict)
    tpot: Mapping[str, Hist] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Tick:
    """Everything read at one moment."""

    at: float
    """``time.monotonic()``."""
    wall: float
    """``time.time()`` (the charts' x axis)."""
    counters: Counters
    histograms: Histograms
    replicas: tuple[ReplicaState, ...] = ()


@dataclass(frozen=True, slots=True)
class Point:
    """The chart values of one tick. Each group is one chart's series: a number (or None: no data), or a
    mapping member → number (errors by type, refusals by reason, per-replica gauges)."""

    wall: float
    dt: float | None
    """Seconds since the previous tick (None for the first): the span of this point's rates."""
    values: Mapping[str, float | None]
    groups: Mapping[str, Mapping[str, float | None]]


SCALARS = (
    "requests_per_s",
    "output_tokens_per_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "prefix_cache_hit_ratio",
    "spec_acceptance_ratio",
    "in_flight",
)
"""The scalar series of :class:`Point`."""
GROUPS = ("errors_per_s", "rate_limited_per_s", "kv_usage", "waiting", "running")
"""The grouped series: errors by type (HTTP status or ``stream:<reason>``), refusals by reason, and per
replica KV-cache usage, queue depth and running batch."""


def _rate(now: Mapping[str, float], then: Mapping[str, float] | None, dt: float) -> dict[str, float]:
    then = then or {}
    return {k: (v - then.get(k, 0.0)) / dt for k, v in now.items()}


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


class ConsoleSeries:
    """The rings and the derivation of chart points; fed one :class:`Tick` at a time (:meth:`add`), read by
    the console's API and the alert board. Not thread-safe: the event loop owns it."""

    def __init__(
        self,
        history_s: float = HISTORY_S,
        interval_s: float = INTERVAL_S,
        histogram_window_s: float = 0.0,
        chart_window_s: float = CHART_WINDOW_S,
    ) -> None:
        """``history_s``: how long ticks and points are kept; ``interval_s``: the ticks' period;
        ``histogram_window_s``: how long histograms are kept (at least ``chart_window_s``, the window of the
        charts' quantiles and ratios); all in seconds."""
        self.interval_s = interval_s
        self.history_s = history_s
        self.chart_window_s = chart_window_s
        self.histogram_window_s = max(histogram_window_s, chart_window_s)
        ticks = int(math.ceil(history_s / interval_s)) + 1
        self.ticks: deque[Tick] = deque(maxlen=ticks)
        self.points: deque[Point] = deque(maxlen=ticks)
        self.added = 0
        """Ticks added so far (what changes when a tick is added: the console's API caches by it)."""
        # histograms are kept for their window plus one interval, so a tick at or before the window's start
        # is still there
        self._hists: deque[tuple[float, Histograms]] = deque(
            maxlen=int(math.ceil(self.histogram_window_s / interval_s)) + 2
        )

    @property
    def latest(self) -> Tick | None:
        return self.ticks[-1] if self.ticks else None

    def add(self, tick: Tick) -> Point:
        """Keep ``tick`` and derive its chart point (rates against the previous tick, windows against the
        tick :data:`CHART_WINDOW_S` before)."""
        prev = self.ticks[-1] if self.ticks else None
        self.added += 1
        self.ticks.append(tick)
        self._hists.append((tick.at, tick.histograms))
        point = self._point(tick, prev)
        self.points.append(point)
        return point

    def tick_before(self, at: float) -> Tick | None:
        """The newest tick at or before ``at`` (monotonic), else the oldest kept (a window longer than the
        history reads what there is); None without ticks."""
        if not self.ticks:
            return None
        i = bisect.bisect_right(self.ticks, at, key=lambda t: t.at)
        return self.ticks[i - 1] if i > 0 else self.ticks[0]

    def ticks_since(self, at: float) -> list[Tick]:
        """The ticks at or after ``at`` (monotonic), oldest first: a window's ticks, found by bisection (the
        ticks are in time order) rather than by reading the whole history."""
        i = bisect.bisect_left(self.ticks, at, key=lambda t: t.at)
        return list(itertools.islice(self.ticks, i, None))

    def histograms_before(self, at: float) -> Histograms | None:
        """The histograms of the newest tick at or before ``at``, else the oldest kept."""
        if not self._hists:
            return None
        i = bisect.bisect_right(self._hists, at, key=lambda h: h[0])
        return self._hists[i - 1][1] if i > 0 else self._hists[0][1]

    def window_histogram(self, kind: str, window_s: float, model: str | None = None) -> Hist | None:
        """The ``kind`` (``ttft``/``tpot``) observations of the last ``window_s`` seconds, of one model or
        summed over all (``sum by (le) (increase(...[window]))``)."""
        latest = self.latest
        then = self.histograms_before(latest.at - window_s) if latest else None
        if latest is None or then is None:
            return None
        now_h: Mapping[str, Hist] = getattr(latest.histograms, kind)
        then_h: Mapping[str, Hist] = getattr(then, kind)
        if model is not None:
            return hist_delta(now_h.get(model), then_h.get(model))
        return hist_delta(hist_sum(now_h.values()), hist_sum(then_h.values()))

    def span_s(self) -> float:
        """Seconds between the oldest and the newest tick."""
        return self.ticks[-1].at - self.ticks[0].at if self.ticks else 0.0

    def _point(self, tick: Tick, prev: Tick | None) -> Point:
        c = tick.counters
        values: dict[str, float | None] = dict.fromkeys(SCALARS)
        groups: dict[str, dict[str, float | None]] = {g: {} for g in GROUPS}
        values["in_flight"] = c.in_flight
        dt = tick.at - prev.at if prev is not None else None
        if prev is not None and dt is not None and dt > 0:
            p = prev.counters
            values["requests_per_s"] = (c.requests - p.requests) / dt
            values["output_tokens_per_s"] = (c.output_tokens - p.output_tokens) / dt
            errors = _rate(
                {s: n for s, n in c.by_status.items() if s.isdigit() and int(s) >= 400}, p.by_status, dt
            )
            errors.update({f"stream:{r}": v for r, v in _rate(c.stream_errors, p.stream_errors, dt).items()})
            groups["errors_per_s"] = dict(errors)
            groups["rate_limited_per_s"] = dict(_rate(c.rate_limited, p.rate_limited, dt))
        base = self.tick_before(tick.at - self.chart_window_s)
        if base is not None and base is not tick:
            b = base.counters
            values["prefix_cache_hit_ratio"] = _ratio(
                c.cached_tokens - b.cached_tokens, c.input_tokens - b.input_tokens
            )
            values["spec_acceptance_ratio"] = _ratio(
                c.spec_accepted_tokens - b.spec_accepted_tokens, c.spec_draft_tokens - b.spec_draft_tokens
            )
        for kind in ("ttft", "tpot"):
            hist = self.window_histogram(kind, self.chart_window_s)
            for q in QUANTILES:
                key = f"{kind}_p{round(q * 100)}_s"
                values[key] = histogram_quantile(q, hist) if hist is not None else None
        for r in tick.replicas:
            groups["kv_usage"][r.label] = r.kv_usage
            groups["waiting"][r.label] = r.waiting
            groups["running"][r.label] = r.running
        return Point(tick.wall, dt, values, groups)

    def _points_after(self, since_wall: float) -> list[Point]:
        newer: list[Point] = []
        for p in reversed(self.points):
            if p.wall <= since_wall:
                break
            newer.append(p)
        newer.reverse()
        return newer

    def columns(self, since_wall: float | None = None) -> dict[str, Any]:
        """The points after ``since_wall`` (a ``time.time()``; None: all kept) as columns: ``t`` (epoch
        seconds), ``dt`` and, per scalar series, a list; per group, member → list (None where a member had no
        value; rates of a member not yet seen are 0; a rate's member only once it is not 0 in these points).
        What the browser's charts plot (uPlot's column layout). "After": the newest points back to the first
        at or before ``since_wall`` (read from the newest end: a poll for the last point or two reads only
        those; were the wall clock ever set back, a poll never gets older points a second time)."""
        points = list(self.points) if since_wall is None else self._points_after(since_wall)
        out: dict[str, Any] = {
            "t": [p.wall for p in points],
            "dt": [p.dt for p in points],
            "series": {k: [p.values.get(k) for p in points] for k in SCALARS},
        }
        for g in GROUPS:
            rates = g.endswith("_per_s")
            # a rate's member shows once it is not 0 (the registry's zero series of every stream-error reason
            # and limit are no line to draw); a gauge's member from its first point
            members = sorted({m for p in points for m, v in p.groups[g].items() if not rates or v})
            filler = 0.0 if rates else None
            out["series"][g] = {
                m: [p.groups[g].get(m, filler if p.dt is not None else None) for p in points] for m in members
            }
        return out
