"""PromQL builders that only accept metrics and labels the catalog defines.

Every selector carries the dashboard variables ``job``, ``instance`` and, when the metric has a ``model``
label, ``model``. Means follow the issue's form ``sum(rate(x_sum)) / (sum(rate(x_count)) > 0)`` (no division
by zero: an idle window yields no point instead of NaN). Quantiles use ``histogram_quantile`` over
``sum by (le)`` of bucket rates (Prometheus docs, "Histograms and summaries").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvscope.dashboards.catalog import Catalog, MetricInfo

RATE = "$__rate_interval"
"""Grafana's rate window: max(4 × scrape interval, step + scrape interval)."""
COMMON_MATCHERS = ('job=~"$job"', 'instance=~"$instance"')
MODEL_MATCHER = 'model=~"$model"'
_LABEL = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)")


def le_regex(bound: float) -> str:
    """Regex matching the ``le`` label of ``bound`` whatever the exposition: prometheus_client writes ``1.0``,
    Prometheus 3 normalises it to ``1``. ``1.0 → '1|1.0'``, ``0.1 → '0.1'``."""
    if float(bound).is_integer():
        return f"{int(bound)}|{int(bound)}.0"
    return repr(float(bound))


def _sum(by: tuple[str, ...]) -> str:
    return f"sum by ({', '.join(by)}) " if by else "sum"


@dataclass(frozen=True, slots=True)
class PromQL:
    """Query builder bound to a catalog; raises KeyError for an undefined series and ValueError for an
    undefined label or a histogram bound that is not a bucket bound."""

    catalog: Catalog

    def sel(self, series: str, *matchers: str) -> str:
        """``series{job=~"$job", instance=~"$instance"[, model=~"$model"], *matchers}``."""
        metric = self.checked(series, matchers)
        model = (MODEL_MATCHER,) if "model" in metric.labels else ()
        return f"{series}{{{', '.join((*COMMON_MATCHERS, *model, *matchers))}}}"

    def checked(self, series: str, matchers: tuple[str, ...]) -> MetricInfo:
        """The family of ``series``; raises KeyError for an undefined series, ValueError for a matcher on a
        label it lacks."""
        metric = self.catalog.lookup(series)
        for matcher in matchers:
            found = _LABEL.match(matcher)
            if found is None or found.group(1) not in (*metric.labels, "le"):
                raise ValueError(f"{series} has no label for matcher {matcher!r} (labels: {metric.labels})")
        return metric

    def by_labels(self, by: tuple[str, ...]) -> tuple[str, ...]:
        """The label names of a ``by (…)`` clause as the queried series spell them (ours: unchanged)."""
        return by

    def sum_rate(self, series: str, *matchers: str, by: tuple[str, ...] = (), window: str = RATE) -> str:
        """Per-second rate summed over the ``by`` labels."""
        return f"{_sum(self.by_labels(by))}(rate({self.sel(series, *matchers)}[{window}]))"

    def sum_increase(self, series: str, *matchers: str, by: tuple[str, ...] = (), window: str = RATE) -> str:
        """Increase over ``window`` summed over the ``by`` labels (heatmaps)."""
        return f"{_sum(self.by_labels(by))}(increase({self.sel(series, *matchers)}[{window}]))"

    def gauge(self, series: str, *matchers: str, by: tuple[str, ...] = (), agg: str = "sum") -> str:
        """``agg by (by) (series{…})``."""
        prefix = f"{agg} by ({', '.join(self.by_labels(by))}) " if by else agg
        return f"{prefix}({self.sel(series, *matchers)})"

    def ratio(self, num: str, den: str) -> str:
        """``num / (den > 0)``: no point instead of NaN or +Inf when the denominator is zero."""
        return f"{num} / ({den} > 0)"

    def quantile(self, q: float, hist: str, by: tuple[str, ...] = (), window: str = RATE) -> str:
        """``histogram_quantile(q, sum by (le, …) (rate(hist_bucket[window])))`` for family ``hist``."""
        self._histogram(hist)
        return f"histogram_quantile({q}, {self.sum_rate(f'{hist}_bucket', by=('le', *by), window=window)})"

    def mean(self, hist: str, by: tuple[str, ...] = (), window: str = RATE) -> str:
        """Mean observation over the window: ``sum(rate(_sum)) / (sum(rate(_count)) > 0)``."""
        self._histogram(hist)
        return self.ratio(
            self.sum_rate(f"{hist}_sum", by=by, window=window),
            self.sum_rate(f"{hist}_count", by=by, window=window),
        )

    def le_matcher(self, hist: str, bound: float) -> str:
        """``le=~"…"`` for ``bound``; raises ValueError unless ``bound`` is one of the family's buckets."""
        metric = self._histogram(hist)
        if float(bound) not in metric.buckets:
            raise ValueError(f"{bound} is not a bucket bound of {hist} ({metric.buckets})")
        return f'le=~"{le_regex(bound)}"'

    def attainment(self, hist: str, bound: float, by: tuple[str, ...] = (), window: str = RATE) -> str:
        """Fraction of observations ≤ ``bound`` (SLO attainment), from the bucket at ``bound``."""
        good = self.sum_rate(f"{hist}_bucket", self.le_matcher(hist, bound), by=by, window=window)
        return self.ratio(good, self.sum_rate(f"{hist}_count", by=by, window=window))

    def _histogram(self, hist: str):
        metric = self.catalog.family(hist)
        if metric.type != "histogram":
            raise ValueError(f"{hist} is a {metric.type}, not a histogram")
        return metric


def up(*matchers: str) -> str:
    """Prometheus' own ``up`` series for the selected targets (1 = last scrape succeeded)."""
    return f"up{{{', '.join((*COMMON_MATCHERS, *matchers))}}}"
