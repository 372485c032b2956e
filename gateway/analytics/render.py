"""Print reports and records as a rich table, JSON or CSV (``--format table|json|csv``)."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable
from typing import IO, Any

from rich.console import Console
from rich.table import Table

from kvscope.gateway.analytics.report import Report, dotted, es_time

FORMATS = ("table", "json", "csv")
RECORD_COLUMNS = {
    "time": "@timestamp",
    "request id": "http.request.id",
    "model": "gen_ai.request.model",
    "status": "http.response.status_code",
    "e2e s": "kvscope.e2e_s",
    "ttft s": "kvscope.ttft_s",
    "key": "user.id",
    "upstream": "server.address",
    "error": "error.type",
    "trace id": "trace.id",
}


_NO_WRAP = {"time", "time (UTC)", "request id", "trace id"}


def _console(out: IO[str]) -> Console:
    """A console on ``out``; wide (200 columns) when ``out`` is not a terminal, so pipes get whole rows."""
    probe = Console(file=out)
    return Console(file=out, width=probe.width if probe.is_terminal else 200)


def _fmt(value: Any, kind: str = "") -> str:
    if value is None:
        return "-"
    if kind == "pct":
        return f"{value * 100:.1f}%"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def render_report(report: Report, fmt: str, out: IO[str]) -> None:
    """Write ``report`` to ``out``: tables (rows, then slowest requests), JSON, or CSV (rows, blank line,
    slowest requests)."""
    if fmt == "json":
        json.dump(report.to_dict(), out, indent=2, default=str)
        out.write("\n")
        return
    rows = [report.total.flat(), *(g.flat() for g in report.groups)]
    slow = [s.flat() for s in report.slowest]
    if fmt == "csv":
        _csv(rows, out)
        out.write("\n")
        _csv(slow, out)
        return
    console = _console(out)
    header = (
        f"source {report.source}"
        + (f" · since {report.since}" if report.since else "")
        + (f" · by {report.by}" if report.by else "")
    )
    console.print(f"[bold]{header}[/bold]\npercentiles: {report.percentile_method}")
    console.print(_rows_table(rows, report.by or "group"))
    for row in slow:
        row["time"] = str(row["timestamp"])[5:19].replace("T", " ")
    console.print(
        _table(
            "slowest requests (why was P99 slow?)",
            slow,
            {
                "time (UTC)": "time",
                "request id": "request_id",
                "trace id": "trace_id",
                "model": "model",
                "status": "status",
                "e2e s": "e2e_s",
                "ttft s": "ttft_s",
                "queue s": "queue_s",
                "prefill s": "prefill_s",
                "decode s": "decode_s",
                "kv use": "kv_cache_usage",
                "preempt": "num_preemptions",
                "slowest phase": "slowest_phase",
                "cause": "cause",
            },
        )
    )
    for name, part in report.cause_breakdown().items():
        if part["requests"]:
            total = sum(part["causes"].values()) or 1.0
            shares = ", ".join(f"{c} {v:.3f} s ({v / total:.0%})" for c, v in part["causes"].items())
            what = "the slowest" if name == "slowest" else "those at or above the e2e p99"
            console.print(f"causes of {what} ({part['requests']} requests): {shares}")
    unparsed = report.extra.get("unparsed_lines")
    if unparsed:
        console.print(f"[yellow]{unparsed} unparsable log lines skipped[/yellow]")


def _rows_table(rows: list[dict[str, Any]], group_title: str) -> Table:
    table = Table(title="requests", show_lines=False)
    for title in (
        group_title,
        "requests",
        "errors",
        "TTFT p50/p95/p99 s",
        "TPOT p50/p95/p99 s",
        "e2e p50/p95/p99 s",
        "tokens in/out",
        "batch mean",
        "KV p95",
        "preempt",
    ):
        table.add_column(title, justify="left" if title == group_title else "right")
    for r in rows:
        lat = {n: "/".join(_fmt(r[f"{n}_p{p}_s"]) for p in (50, 95, 99)) for n in ("ttft", "tpot", "e2e")}
        table.add_row(
            str(r["group"]),
            str(r["requests"]),
            _fmt(r["error_rate"], "pct"),
            lat["ttft"],
            lat["tpot"],
            lat["e2e"],
            f"{r['tokens_in']}/{r['tokens_out']}",
            _fmt(r["batch_size_mean"]),
            _fmt(r["kv_usage_p95"]),
            str(r["preemptions"]),
        )
    return table


def _table(title: str, rows: Iterable[dict[str, Any]], columns: dict[str, str]) -> Table:
    table = Table(title=title)
    for name in columns:
        table.add_column(name, no_wrap=name in _NO_WRAP, overflow="fold")
    for row in rows:
        table.add_row(*(_fmt(row.get(key)) for key in columns.values()))
    return table


def _csv(rows: list[dict[str, Any]], out: IO[str]) -> None:
    if not rows:
        return
    writer = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)


def flatten(doc: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}`` (lists are kept as JSON text)."""
    out: dict[str, Any] = {}
    for key, value in doc.items():
        name = prefix + key
        if isinstance(value, dict):
            out |= flatten(value, name + ".")
        else:
            out[name] = json.dumps(value) if isinstance(value, list) else value
    return out


def render_records(records: list[dict[str, Any]], fmt: str, out: IO[str]) -> None:
    """Write matching records: a table of key fields, NDJSON (one record a line), or CSV of dotted fields."""
    if fmt == "json":
        for record in records:
            out.write(json.dumps(record, default=lambda v: es_time(v) if hasattr(v, "tzinfo") else str(v)))
            out.write("\n")
        return
    if fmt == "csv":
        flat = [flatten(r) for r in records]
        names = list(dict.fromkeys(k for row in flat for k in row))
        writer = csv.DictWriter(out, fieldnames=names, lineterminator="\n")
        writer.writeheader()
        writer.writerows(flat)
        return
    rows = [{k: dotted(r, path) for k, path in RECORD_COLUMNS.items()} for r in records]
    console = _console(out)
    console.print(
        _table(f"{len(records)} matching requests (newest first)", rows, {k: k for k in RECORD_COLUMNS})
    )
