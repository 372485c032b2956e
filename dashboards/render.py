"""Draw a dashboard's panels from real Prometheus data into one PNG (matplotlib, no Grafana needed).

The figure keeps Grafana's grid (24 columns; rows of 1 unit): timeseries as lines, stat tiles as a coloured
value, heatmaps as bucket counts over time. Panels without data say so in red, so a reviewer sees what the
on-call engineer would see, gaps included.

    python -m kvscope.dashboards.render --prometheus http://127.0.0.1:9090 --minutes 10 --out
    test-artifacts/dashboards
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from matplotlib.dates import DateFormatter
from matplotlib.figure import Figure

from kvscope.dashboards.grafana import GRID_WIDTH, Json
from kvscope.dashboards.query import PrometheusAPI, PromQLError, Variables, legend

UNIT_H_IN, FIG_W_IN = 0.34, 22.0


@dataclass(frozen=True, slots=True)
class Window:
    """Time range of the range queries (unix seconds; ``step`` seconds)."""

    start: float
    end: float
    step: float


@dataclass(frozen=True, slots=True)
class QueryResult:
    ref: str
    expr: str
    """The expression as sent, variables substituted."""
    series: list[dict[str, Any]]
    error: str | None = None

    @property
    def has_data(self) -> bool:
        """At least one series with at least one non-NaN point."""
        return any(not math.isnan(float(v)) for s in self.series for _, v in s["values"])


@dataclass(frozen=True, slots=True)
class PanelResult:
    title: str
    type: str
    queries: list[QueryResult]


def evaluate(panel: Json, api: PrometheusAPI, window: Window, variables: Variables) -> PanelResult:
    """Run every target of ``panel`` as a range query; PromQL errors are captured, not raised."""
    results = []
    for target in panel.get("targets", []):
        expr = variables.substitute(target["expr"])
        try:
            series = api.query_range(expr, window.start, window.end, window.step)
            results.append(QueryResult(target["refId"], expr, series))
        except PromQLError as exc:
            results.append(QueryResult(target["refId"], expr, [], str(exc)))
    return PanelResult(panel["title"], panel["type"], results)


def format_value(value: float, unit: str) -> str:
    """Human-readable value in Grafana's unit (``s``, ``percentunit``, ``bytes``, ``reqps``, ``short``)."""
    if math.isnan(value):
        return "NaN"
    if unit == "percentunit":
        return f"{value * 100:.2f} %"
    if unit == "s":
        return f"{value * 1000:.1f} ms" if abs(value) < 1 else f"{value:.2f} s"
    if unit == "bytes":
        for suffix, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if abs(value) >= size:
                return f"{value / size:.1f} {suffix}"
        return f"{value:.0f} B"
    return f"{value:.3g} req/s" if unit == "reqps" else f"{value:.3g}"


def _points(series: dict[str, Any], step: float | None = None) -> tuple[list[datetime], list[float]]:
    """Times and values; with ``step``, a NaN where points are missing so the line breaks like Grafana's."""
    xs: list[datetime] = []
    ys: list[float] = []
    last = None
    for t, v in series["values"]:
        if step is not None and last is not None and t - last > 1.5 * step:
            xs.append(datetime.fromtimestamp(last + step))
            ys.append(math.nan)
        xs.append(datetime.fromtimestamp(t))
        ys.append(float(v))
        last = t
    return xs, ys


def _draw_timeseries(ax, panel: Json, result: PanelResult, window: Window) -> None:
    unit = panel["fieldConfig"]["defaults"]["unit"]
    for target, query in zip(panel["targets"], result.queries, strict=True):
        for series in query.series:
            xs, ys = _points(series, window.step)
            ax.plot(xs, ys, linewidth=1.2, label=legend(target["legendFormat"], series["metric"], query.ref))
    ax.xaxis.set_major_formatter(DateFormatter("%H:%M:%S"))
    ax.yaxis.set_major_formatter(lambda v, _pos: format_value(v, unit))
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    defaults = panel["fieldConfig"]["defaults"]
    ax.set_xlim(datetime.fromtimestamp(window.start), datetime.fromtimestamp(window.end))
    if ax.lines:
        top = defaults.get("max")
        ax.set_ylim(bottom=defaults.get("min"), top=None if top is None else top * 1.05)
    if ax.lines:
        ax.legend(fontsize=6, loc="upper left", ncols=2, framealpha=0.6)


def _draw_stat(ax, panel: Json, result: PanelResult, window: Window) -> None:
    defaults = panel["fieldConfig"]["defaults"]
    values = [float(v) for q in result.queries for s in q.series[:1] for _, v in s["values"]]
    value = next((v for v in reversed(values) if not math.isnan(v)), math.nan)
    color = "#777777"
    for step in defaults["thresholds"]["steps"]:
        if not math.isnan(value) and (step["value"] is None or value >= step["value"]):
            color = {"red": "#c4162a", "orange": "#ff780a", "green": "#37872d"}.get(
                step["color"], step["color"]
            )
    ax.set_facecolor(color)
    ax.text(
        0.5,
        0.45,
        format_value(value, defaults["unit"]),
        ha="center",
        va="center",
        fontsize=20,
        color="white",
        transform=ax.transAxes,
    )
    ax.set_xticks([])
    ax.set_yticks([])


def _draw_heatmap(ax, panel: Json, result: PanelResult, window: Window) -> None:
    series = sorted(result.queries[0].series, key=lambda s: float(s["metric"].get("le", "inf")))
    if not series:
        return
    rows = [_points(s)[1] for s in series]
    cells = [
        [max(v - (rows[i - 1][j] if i else 0.0), 0.0) for j, v in enumerate(row)]
        for i, row in enumerate(rows)
    ]
    ax.imshow(cells, aspect="auto", origin="lower", cmap="Oranges", interpolation="nearest")
    labels = [s["metric"].get("le", "?") for s in series]
    ticks = list(range(0, len(labels), max(1, len(labels) // 8)))
    ax.set_yticks(ticks, [labels[i] for i in ticks], fontsize=6)
    xs = _points(series[0])[0]
    xticks = list(range(0, len(xs), max(1, len(xs) // 6)))
    ax.set_xticks(xticks, [xs[i].strftime("%H:%M:%S") for i in xticks], fontsize=6)


DRAWERS = {"timeseries": _draw_timeseries, "stat": _draw_stat, "heatmap": _draw_heatmap}


def _title(ax, panel: Json, result: PanelResult) -> None:
    errors = [q.error for q in result.queries if q.error]
    empty = [q.ref for q in result.queries if not q.has_data]
    note = f"  [ERROR: {errors[0][:80]}]" if errors else (f"  [no data: {', '.join(empty)}]" if empty else "")
    ax.set_title(panel["title"] + note, fontsize=9, loc="left", color="#c4162a" if note else "black")


def render(
    dashboard: Json, api: PrometheusAPI, window: Window, out: Path, variables: Variables | None = None
) -> list[PanelResult]:
    """Evaluate every panel and write ``out`` (PNG). Returns the per-panel query results."""
    variables = variables or Variables()
    panels = dashboard["panels"]
    height = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    fig = Figure(figsize=(FIG_W_IN, height * UNIT_H_IN + 0.8))
    fig.suptitle(
        f"{dashboard['title']} — {datetime.fromtimestamp(window.start):%Y-%m-%d %H:%M:%S} → "
        f"{datetime.fromtimestamp(window.end):%H:%M:%S}",
        fontsize=12,
        x=0.01,
        ha="left",
    )
    scale_y = 1.0 - 0.8 / (height * UNIT_H_IN + 0.8)
    results = []
    for panel in panels:
        g = panel["gridPos"]
        top = scale_y * (1 - g["y"] / height)
        if panel["type"] == "row":
            fig.text(0.01, top - 0.3 / height, panel["title"], fontsize=11, weight="bold", va="top")
            continue
        left, width = g["x"] / GRID_WIDTH + 0.035, g["w"] / GRID_WIDTH - 0.045
        bottom, box = scale_y * (1 - (g["y"] + g["h"]) / height), scale_y * g["h"] / height
        ax = fig.add_axes((left, bottom + box * 0.12, width, box * 0.72))
        result = evaluate(panel, api, window, variables)
        DRAWERS[panel["type"]](ax, panel, result, window)
        _title(ax, panel, result)
        results.append(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Render kvscope dashboards from a Prometheus to PNG.")
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--scrape-interval", type=float, default=5.0, help="seconds (sets $__rate_interval)")
    parser.add_argument("--out", type=Path, default=Path("test-artifacts/dashboards"))
    args = parser.parse_args(argv)
    end = time.time()
    window = Window(end - args.minutes * 60, end, max(1.0, args.minutes * 60 / 300))
    variables = Variables(rate_interval=f"{4 * args.scrape_interval:g}s", range=f"{args.minutes * 60:g}s")
    api = PrometheusAPI(args.prometheus)
    for path in sorted((Path(__file__).parent / "json").glob("*.json")):
        dashboard = json.loads(path.read_text())
        render(dashboard, api, window, args.out / f"{dashboard['uid']}.png", variables)
        print(f"wrote {args.out / (dashboard['uid'] + '.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
