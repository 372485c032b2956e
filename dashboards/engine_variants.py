"""The engine dashboard for vLLM and SGLang upstreams: the same panels in those engines' own metric names.

In front of vLLM or SGLang the gateway's dashboards keep working (they read the gateway's own series), but
our engine's panels have no ``kvscope_engine_*`` series to show. Each variant (``kvscope-engine-vllm``,
``kvscope-engine-sglang``) is generated from the panels of the overview's engine rows (saturation, engine
latency, request shapes) and of the engine-internals dashboard, through :class:`EngineDialect`: a PromQL
builder that writes each of our engine series as the kind's equivalent (engine_names.py, the table
docs/metrics.md shows), its labels as the kind spells them (``model`` → ``model_name``, vLLM's
``finished_reason``), and the dashboard variables over the kind's series. A query naming a series the kind
does not export is dropped, a panel left without queries is dropped, and so is a row left without panels:
what remains shows only what that engine measures. Threshold lines go too (our engine alerts watch our
series only: alerts/kvscope.rules.yaml). A template variable could not do this: the names, labels and
available series differ per engine, not only a prefix.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass

from kvscope.dashboards import engine_detail, overview
from kvscope.dashboards.catalog import Catalog
from kvscope.dashboards.coverage import metric_names, panel_queries
from kvscope.dashboards.engine_names import (
    KIND_TITLES,
    LABEL_NAMES,
    METRIC_PREFIX,
    VARIANT_KINDS,
    equivalent,
    variant_uid,
)
from kvscope.dashboards.grafana import Json, dashboard, dashboard_link, row, variables
from kvscope.dashboards.promql import COMMON_MATCHERS, PromQL

MISSING = "\u2204"
"""Marks the selector of a series the kind does not export (∄): a query holding it is dropped."""
_LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")
_MATCHER_LABEL = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)")
ALL = "all"
"""A legend's placeholder of a label the kind lacks (its ``by`` sums over everything)."""
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


@dataclass(frozen=True, slots=True)
class EngineDialect(PromQL):
    """PromQL builder writing our engine series as ``kind``'s equivalents (engine_names.ENGINE_EQUIVALENTS);
    our names are still checked against the catalog (KeyError/ValueError as :class:`PromQL`). A series with
    no equivalent, and every gateway series, becomes ``MISSING`` + its name."""

    kind: str = "vllm"

    def sel(self, series: str, *matchers: str) -> str:
        """``equivalent{job=~"$job", instance=~"$instance"[, model_name=~"$model"], *matchers}`` with the
        matchers' labels renamed; ``MISSING`` + ``series`` when the kind has no equivalent."""
        metric = self.checked(series, matchers)
        name = equivalent(metric.name, self.kind).series
        if metric.component != "engine" or name is None:
            return MISSING + series
        if metric.type == "histogram":
            name += series.removeprefix(metric.name)  # _bucket, _sum or _count
        renamed = []
        for matcher in matchers:
            found = _MATCHER_LABEL.match(matcher)
            label = self.label(found.group(1)) if found else None
            if found is None or label is None:  # a label the kind lacks: the query cannot be written
                return MISSING + series
            renamed.append(label + matcher[found.end() :])
        model = (f'{self.label("model") or "model"}=~"$model"',) if "model" in metric.labels else ()
        return f"{name}{{{', '.join((*COMMON_MATCHERS, *model, *renamed))}}}"

    def by_labels(self, by: tuple[str, ...]) -> tuple[str, ...]:
        """``by`` with each label as the kind spells it, those it lacks left out."""
        return tuple(n for n in (self.label(label) for label in by) if n is not None)

    def label(self, label: str) -> str | None:
        """Our label name as the kind spells it (engine_names.LABEL_NAMES; unchanged when not listed, None
        when the kind has no such label)."""
        return LABEL_NAMES[self.kind].get(label, label)


def _body(q: EngineDialect) -> list[Json]:
    latency = overview.latency_panels(q)
    return [
        *overview.engine_panels(q),
        row("Engine latency"),
        *latency[1:],  # without the overview's "gateway | engine" row: the gateway panels are dropped
        *overview.shape_panels(q),
        *engine_detail.panels(q),
    ]


def translate(panels: list[Json], kind: str) -> list[Json]:
    """``panels`` (built with an :class:`EngineDialect`) as the variant shows them: queries holding
    ``MISSING`` dropped, panels without queries and rows without panels dropped, legends' labels renamed,
    threshold lines removed, and each description ending with the kind's series the panel reads."""
    kept: list[Json] = []
    for panel in copy.deepcopy(panels):
        if panel["type"] == "row":
            if kept and kept[-1]["type"] == "row":
                kept.pop()  # the previous row lost every panel
            kept.append(panel)
            continue
        targets = [t for t in panel["targets"] if MISSING not in t["expr"]]
        if not targets:
            continue
        for target in targets:
            target["legendFormat"] = _LEGEND_LABEL.sub(
                lambda m: _legend_label(kind, m.group(1)), target["legendFormat"]
            )
        panel["targets"] = targets
        defaults = panel.get("fieldConfig", {}).get("defaults", {})
        if defaults.get("custom", {}).pop("thresholdsStyle", None) is not None:
            defaults.pop("thresholds", None)
        names = sorted(
            {n for t in targets for n in metric_names(t["expr"]) if n.startswith(METRIC_PREFIX[kind])}
        )
        panel["description"] += f" {KIND_TITLES[kind]}: " + ", ".join(f"`{n}`" for n in names) + "."
        kept.append(panel)
    if kept and kept[-1]["type"] == "row":
        kept.pop()
    return kept


def _legend_label(kind: str, label: str) -> str:
    name = LABEL_NAMES[kind].get(label, label)
    return ALL if name is None else "{{" + name + "}}"


def build(catalog: Catalog, kind: str) -> Json:
    """The engine dashboard's variant for ``kind`` (one of engine_names.VARIANT_KINDS); raises KeyError/
    ValueError when a panel names a metric or label our catalog lacks."""
    title = KIND_TITLES[kind]
    panels = translate(_body(EngineDialect(catalog, kind)), kind)
    links = [
        dashboard_link("Overview", overview.UID),
        dashboard_link("Engine internals (kvscope)", engine_detail.UID),
        *(
            dashboard_link(f"Engine internals ({KIND_TITLES[k]})", variant_uid(k))
            for k in VARIANT_KINDS
            if k != kind
        ),
    ]
    return dashboard(
        variant_uid(kind),
        f"kvscope / Engine internals ({title})",
        f"Our engine dashboard in {title}'s metric names (docs/metrics.md maps them): saturation, latency, "
        f"request shapes and what else {title} measures. The gateway's own view of these upstreams is on the "
        "overview.",
        panels,
        links,
        variables(f"{METRIC_PREFIX[kind]}.+", LABEL_NAMES[kind].get("model") or "model"),
    )


def variant_series(dashboard_json: Json) -> set[str]:
    """Series names that the variant's queries select (tests compare them with a real /metrics)."""
    return {n for _, expr in panel_queries(dashboard_json) for n in metric_names(expr)}


def exported_series(kind: str, catalog: Catalog) -> set[str]:
    """Every series name ``kind`` exports for one of our engine families (histograms expanded to
    ``_bucket``/``_sum``/``_count``): what a variant may select."""
    out: set[str] = set()
    for metric in catalog.metrics:
        name = equivalent(metric.name, kind).series
        if metric.component != "engine" or name is None:
            continue
        out |= {name + s for s in HISTOGRAM_SUFFIXES} if metric.type == "histogram" else {name}
    return out
