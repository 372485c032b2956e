"""Which metrics do dashboards and alert rules name, and are they all defined? (both directions)

Metric names are read from PromQL text: string literals are dropped first, then every identifier that
starts with ``kvscope_`` or precedes a ``{`` selector is a metric name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import yaml

from kvscope.dashboards.catalog import Catalog
from kvscope.dashboards.grafana import Json

REPO = Path(__file__).resolve().parent.parent
RULES_FILE = REPO / "alerts" / "kvscope.rules.yaml"
PROMETHEUS_BUILTINS = frozenset({"up", "ALERTS", "ALERTS_FOR_STATE", "vector", "scrape_duration_seconds"})
"""Series Prometheus itself produces for every target (not defined by kvscope code)."""
_STRING = re.compile(r'"(?:\\.|[^"\\])*"|`[^`]*`|\'(?:\\.|[^\'\\])*\'')
_PREFIXED = re.compile(r"\b(kvscope_[A-Za-z0-9_:]*)")
_SELECTOR = re.compile(r"\b([A-Za-z_:][A-Za-z0-9_:]*)\s*\{")


def metric_names(expr: str) -> set[str]:
    """Series names that ``expr`` selects, e.g. ``rate(a_total{x="kvscope_y"}[5m])`` → ``{"a_total"}``."""
    bare = _STRING.sub('""', expr)
    return set(_PREFIXED.findall(bare)) | set(_SELECTOR.findall(bare))


def panel_queries(dashboard: Json) -> Iterator[tuple[Json, str]]:
    """(panel, expr) for every target of every non-row panel, rows' nested panels included."""
    for panel in dashboard["panels"]:
        for nested in [panel, *panel.get("panels", [])]:
            for target in nested.get("targets", []):
                yield nested, target["expr"]


def rule_queries(path: Path = RULES_FILE) -> Iterator[tuple[str, str]]:
    """(alert or record name, expr) for every rule of a Prometheus rule file."""
    for group in yaml.safe_load(path.read_text())["groups"]:
        for rule in group["rules"]:
            yield rule.get("alert") or rule["record"], rule["expr"]


def undefined(exprs: Iterable[str], catalog: Catalog) -> dict[str, set[str]]:
    """Series named in ``exprs`` that the catalog does not define → the expressions naming them."""
    index = catalog.series_index()
    out: dict[str, set[str]] = {}
    for expr in exprs:
        for name in metric_names(expr) - PROMETHEUS_BUILTINS:
            if name not in index:
                out.setdefault(name, set()).add(expr)
    return out


def shown_on(dashboards: Iterable[Json], catalog: Catalog) -> dict[str, list[str]]:
    """Family name → titles of the panels whose queries use it (``[]`` when no panel shows it)."""
    index = catalog.series_index()
    shown: dict[str, list[str]] = {m.name: [] for m in catalog.metrics}
    for dashboard in dashboards:
        for panel, expr in panel_queries(dashboard):
            for name in metric_names(expr) & index.keys():
                titles = shown[index[name].name]
                if panel["title"] not in titles:
                    titles.append(panel["title"])
    return shown


def alerted_by(catalog: Catalog, path: Path = RULES_FILE) -> dict[str, list[str]]:
    """Family name → alerts whose expression uses it."""
    index = catalog.series_index()
    out: dict[str, list[str]] = {m.name: [] for m in catalog.metrics}
    for name, expr in rule_queries(path):
        for series in sorted(metric_names(expr) & index.keys()):
            if name not in out[index[series].name]:
                out[index[series].name].append(name)
    return out


def not_shown(dashboards: Iterable[Json], catalog: Catalog) -> list[str]:
    """The reverse report: defined metric families that no dashboard panel shows."""
    return sorted(name for name, titles in shown_on(dashboards, catalog).items() if not titles)
