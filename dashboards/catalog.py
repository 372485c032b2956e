"""The metric catalog: every metric the code defines, discovered from the collector classes themselves.

``discover()`` instantiates ``kvscope.engine.server.metrics.EngineMetrics`` and
``kvscope.gateway.metrics.GatewayMetrics`` on a fresh ``CollectorRegistry``, creates one child per labelled
metric (so that label names and histogram bounds show up as samples) and reads ``registry.collect()``.
Dashboards, alert rules and docs/metrics.md are checked against this catalog, so a renamed metric breaks the
build instead of a dashboard.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

COMPONENTS = {
    "engine": ("kvscope.engine.server.metrics", "EngineMetrics"),
    "gateway": ("kvscope.gateway.metrics", "GatewayMetrics"),
}
"""component → (module, class); each class takes a ``CollectorRegistry`` as first argument."""
_PLACEHOLDER = "catalog"


@dataclass(frozen=True, slots=True)
class MetricInfo:
    """One metric family as the code defines it."""

    name: str
    """Family name (a counter's family name has no ``_total``)."""
    type: str
    """``counter``, ``gauge``, ``histogram`` (prometheus_client's family type)."""
    help: str
    labels: tuple[str, ...]
    """Label names, ``le`` excluded."""
    series: tuple[str, ...]
    """Exposed series names, e.g. ``x_total`` or ``x_bucket``/``x_count``/``x_sum`` (``_created``
    excluded)."""
    buckets: tuple[float, ...]
    """Histogram upper bounds without ``+Inf``; empty for other types."""
    component: str

    @property
    def unit(self) -> str:
        """Base unit read from the name suffix (Prometheus naming conventions)."""
        for suffix, unit in (("_seconds", "seconds"), ("_bytes", "bytes"), ("_ratio", "ratio (0-1)")):
            if self.name.endswith(suffix):
                return unit
        return "tokens" if "tokens" in self.name else "count"


@dataclass(frozen=True, slots=True)
class Catalog:
    metrics: tuple[MetricInfo, ...]

    def series_index(self) -> dict[str, MetricInfo]:
        """Exposed series name → its family."""
        return {s: m for m in self.metrics for s in m.series}

    def lookup(self, series: str) -> MetricInfo:
        """The family exposing ``series``; raises KeyError naming the unknown series."""
        index = self.series_index()
        if series not in index:
            raise KeyError(f"metric {series!r} is not defined by {', '.join(COMPONENTS)} metrics classes")
        return index[series]

    def family(self, name: str) -> MetricInfo:
        """The family called ``name``; raises KeyError."""
        for metric in self.metrics:
            if metric.name == name:
                return metric
        raise KeyError(f"metric family {name!r} is not defined")


def discover(components: Iterable[str] = tuple(COMPONENTS)) -> Catalog:
    """Build the catalog of ``components`` from their metrics classes. Raises ImportError when a component's
    metrics module cannot be imported (a catalog that silently lacks a component would hide its metrics)."""
    registry = CollectorRegistry()
    owner: dict[str, str] = {}
    for component in components:
        module_name, class_name = COMPONENTS[component]
        module = importlib.import_module(module_name)
        before = set(_collector_names(registry))
        getattr(module, class_name)(registry)
        owner.update({n: component for n in set(_collector_names(registry)) - before})
    _touch_children(registry)
    metrics = tuple(_family_info(f, owner) for f in registry.collect())
    return Catalog(metrics=metrics)


def _collector_names(registry: CollectorRegistry) -> list[str]:
    # prometheus_client keeps collector → names privately; it is the only place label names are held.
    return [name for names in registry._collector_to_names.values() for name in names]  # noqa: SLF001


def _touch_children(registry: CollectorRegistry) -> None:
    """Create one child per labelled metric so that ``collect()`` shows its labels and buckets."""
    for collector in list(registry._collector_to_names):  # noqa: SLF001
        labelnames = getattr(collector, "_labelnames", ())
        if labelnames:
            collector.labels(*([_PLACEHOLDER] * len(labelnames)))


def _family_info(family, owner: dict[str, str]) -> MetricInfo:
    names = sorted({s.name for s in family.samples if not s.name.endswith("_created")})
    labels = sorted({k for s in family.samples for k in s.labels if k != "le"})
    bounds = sorted({float(s.labels["le"]) for s in family.samples if "le" in s.labels})
    return MetricInfo(
        name=family.name,
        type=family.type,
        help=family.documentation,
        labels=tuple(labels),
        series=tuple(names),
        buckets=tuple(b for b in bounds if not math.isinf(b)),
        component=owner.get(family.name, "unknown"),
    )
