"""Grafana JSON builders: targets, timeseries/stat/heatmap/row panels, variables, layout, dashboard.

Output follows Grafana 11's dashboard model (schemaVersion 39). Panels use the ``${datasource}`` variable,
whose default is the provisioned Prometheus datasource (uid ``kvscope-prometheus``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Json = dict[str, Any]

DATASOURCE_UID = "kvscope-prometheus"
"""Pinned uid of the provisioned Prometheus datasource (dashboards/provisioning/datasources)."""
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_WIDTH = 24
SCHEMA_VERSION = 39
METRIC_REGEX = "kvscope_.+"
"""The series the variables' values are read from (engine variants: ``vllm:.+``, ``sglang:.+``)."""


@dataclass(frozen=True, slots=True)
class Target:
    expr: str
    legend: str = "__auto"
    heatmap: bool = False
    """Query in Grafana's heatmap format (one series per ``le`` bucket, de-cumulated by Grafana)."""
    exemplar: bool = False
    """Also fetch the series' exemplars (trace ids of sampled requests; linked to Jaeger by the
    datasource)."""


def _targets(targets: list[Target]) -> list[Json]:
    out = []
    for i, t in enumerate(targets):
        target = {
            "datasource": DATASOURCE,
            "editorMode": "code",
            "expr": t.expr,
            "legendFormat": t.legend,
            "range": True,
            "refId": chr(ord("A") + i),
        }
        if t.heatmap:
            target["format"] = "heatmap"
        if t.exemplar:
            target["exemplar"] = True
        out.append(target)
    return out


def _panel(kind: str, title: str, description: str, targets: list[Target], w: int, h: int) -> Json:
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {"h": h, "w": w, "x": 0, "y": 0},
        "targets": _targets(targets),
    }


def timeseries(
    title: str,
    description: str,
    targets: list[Target],
    unit: str,
    *,
    stack: bool = False,
    w: int = 12,
    h: int = 8,
    min_value: float | None = 0,
    max_value: float | None = None,
    threshold: float | None = None,
) -> Json:
    """Line chart; ``stack`` stacks series (breakdowns that add up to a total); ``threshold`` draws a dashed
    red line at that value (an alert's threshold: kvscope.dashboards.alert_thresholds)."""
    panel = _panel("timeseries", title, description, targets, w, h)
    custom = {
        "drawStyle": "line",
        "lineWidth": 1,
        "fillOpacity": 25 if stack else 10,
        "showPoints": "never",
        "spanNulls": False,
        "stacking": {"group": "A", "mode": "normal" if stack else "none"},
    }
    defaults: Json = {"unit": unit, "custom": custom}
    if threshold is not None:
        custom["thresholdsStyle"] = {"mode": "dashed"}
        defaults["thresholds"] = {
            "mode": "absolute",
            "steps": [{"color": "green", "value": None}, {"color": "red", "value": threshold}],
        }
    if min_value is not None:
        defaults["min"] = min_value
    if max_value is not None:
        defaults["max"] = max_value
    panel["fieldConfig"] = {"defaults": defaults, "overrides": []}
    panel["options"] = {
        "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
        "tooltip": {"mode": "multi", "sort": "desc"},
    }
    return panel


def stat(
    title: str,
    description: str,
    targets: list[Target],
    unit: str,
    steps: list[tuple[str, float | None]],
    *,
    w: int = 6,
    h: int = 4,
    decimals: int = 2,
) -> Json:
    """Single-value tile (last non-null value), coloured by threshold ``steps`` [(color, from_value)]."""
    panel = _panel("stat", title, description, targets, w, h)
    thresholds = {"mode": "absolute", "steps": [{"color": c, "value": v} for c, v in steps]}
    panel["fieldConfig"] = {
        "defaults": {"unit": unit, "decimals": decimals, "thresholds": thresholds},
        "overrides": [],
    }
    panel["options"] = {
        "colorMode": "background",
        "graphMode": "area",
        "justifyMode": "auto",
        "orientation": "auto",
        "textMode": "value",
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
    }
    return panel


def heatmap(title: str, description: str, target: Target, unit: str, *, w: int = 12, h: int = 8) -> Json:
    """Heatmap of a histogram's bucket increases over time (no re-bucketing: ``calculate: false``)."""
    panel = _panel("heatmap", title, description, [target], w, h)
    panel["fieldConfig"] = {"defaults": {"unit": unit}, "overrides": []}
    panel["options"] = {
        "calculate": False,
        "cellGap": 1,
        "yAxis": {"axisPlacement": "left", "unit": unit},
        "rowsFrame": {"layout": "le"},
        "legend": {"show": True},
        "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64, "exponent": 0.5, "reverse": False},
        "tooltip": {"mode": "single", "yHistogram": True},
        "filterValues": {"le": 1e-9},
    }
    return panel


def row(title: str) -> Json:
    return {
        "type": "row",
        "title": title,
        "collapsed": False,
        "panels": [],
        "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": 0},
    }


def layout(panels: list[Json]) -> list[Json]:
    """Assign ids and grid positions: rows span the width, panels flow left to right and wrap."""
    x = y = line_height = 0
    for panel_id, panel in enumerate(panels, start=1):
        pos = panel["gridPos"]
        if panel["type"] == "row" or x + pos["w"] > GRID_WIDTH:
            y, x, line_height = y + line_height, 0, 0
        pos["x"], pos["y"] = x, y
        panel["id"] = panel_id
        if panel["type"] == "row":
            y += 1
            continue
        x += pos["w"]
        line_height = max(line_height, pos["h"])
    return panels


def _query_variable(name: str, label: str, query: str) -> Json:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "definition": query,
        "query": {"query": query, "refId": f"{name}-variable"},
        "refresh": 2,
        "sort": 1,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "hide": 0,
        "regex": "",
    }


def variables(metric_regex: str = METRIC_REGEX, model_label: str = "model") -> list[Json]:
    """datasource, job, instance, model (multi-value, ``All`` = ``.*``), each filtered by the previous, their
    values read from the series whose name matches ``metric_regex``; ``model`` lists the ``model_label``
    label (vLLM and SGLang: ``model_name``)."""
    selector = f'{{__name__=~"{metric_regex}"'
    datasource = {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {"selected": True, "text": "Prometheus", "value": DATASOURCE_UID},
        "hide": 0,
        "refresh": 1,
        "regex": "",
    }
    return [
        datasource,
        _query_variable("job", "Job", f"label_values({selector}}}, job)"),
        _query_variable("instance", "Instance", f'label_values({selector}, job=~"$job"}}, instance)'),
        _query_variable(
            "model",
            "Model",
            f'label_values({selector}, job=~"$job", instance=~"$instance"}}, {model_label})',
        ),
    ]


def dashboard(
    uid: str,
    title: str,
    description: str,
    panels: list[Json],
    links: list[Json],
    template_variables: list[Json] | None = None,
) -> Json:
    """A complete dashboard (provisioned from a file: ``id`` null, ``version`` 1); ``template_variables``
    default to :func:`variables` over our series."""
    annotations = {
        "list": [
            {
                "builtIn": 1,
                "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                "enable": True,
                "hide": True,
                "iconColor": "rgba(0, 211, 255, 1)",
                "name": "Annotations & Alerts",
                "type": "dashboard",
            }
        ]
    }
    return {
        "annotations": annotations,
        "description": description,
        "editable": True,
        "graphTooltip": 1,
        "id": None,
        "links": links,
        "panels": layout(panels),
        "refresh": "10s",
        "schemaVersion": SCHEMA_VERSION,
        "tags": ["kvscope", "llm"],
        "templating": {"list": variables() if template_variables is None else template_variables},
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "title": title,
        "uid": uid,
        "version": 1,
    }


def dashboard_link(title: str, uid: str) -> Json:
    """Link to another kvscope dashboard keeping the time range and variables."""
    return {
        "title": title,
        "type": "link",
        "url": f"/d/{uid}",
        "keepTime": True,
        "includeVars": True,
        "icon": "dashboard",
        "targetBlank": False,
        "tags": [],
        "asDropdown": False,
        "tooltip": "",
    }
