"""Print reports and records as tables that fit the terminal, JSON or CSV (``--format table|json|csv``).

Tables (kvscope/common/tables.py): one line per row, ids never cut; on a narrow terminal the lower-priority
columns are left out and a note names them (``--wide`` shows every column, ``--format json`` every field). A
pipe or a file gets every column.
"""

from __future__ import annotations

import csv
import json
from datetime import UTC, datetime
from typing import IO, Any

from rich.text import Text

from kvscope.common.tables import Column, Justify, fixed_console, print_table
from kvscope.gateway.analytics.report import Report, dotted, es_time

FORMATS = ("table", "json", "csv")
RECORD_COLUMNS: dict[str, tuple[str, int, Justify]] = {
    "time (UTC)": ("@timestamp", 1, "left"),
    "request id": ("http.request.id", 0, "left"),
    "model": ("gen_ai.request.model", 3, "left"),
    "status": ("http.response.status_code", 2, "right"),
    "e2e s": ("kvscope.e2e_s", 2, "right"),
    "ttft s": ("kvscope.ttft_s", 4, "right"),
    "key": ("user.id", 6, "left"),
    "upstream": ("server.address", 7, "left"),
    "error": ("error.type", 5, "left"),
    "trace id": ("trace.id", 8, "left"),
}
"""``kvscope logs search``'s table: header → (record field, priority, alignment); priority 0 is always shown,
the highest number is left out first (kvscope.common.tables)."""
SLOW_COLUMNS: dict[str, tuple[str, int, Justify]] = {
    "time (UTC)": ("timestamp", 2, "left"),
    "request id": ("request_id", 0, "left"),
    "trace id": ("trace_id", 7, "left"),
    "model": ("model", 5, "left"),
    "status": ("status", 3, "right"),
    "e2e s": ("e2e_s", 0, "right"),
    "ttft s": ("ttft_s", 3, "right"),
    "queue s": ("queue_s", 4, "right"),
    "prefill s": ("prefill_s", 6, "right"),
    "decode s": ("decode_s", 6, "right"),
    "kv use": ("kv_cache_usage", 8, "right"),
    "preempt": ("num_preemptions", 8, "right"),
    "slowest\nphase": ("slowest_phase", 5, "left"),
    "cause": ("cause", 1, "left"),
}
"""The slowest-requests table of ``kvscope logs report``: header → (``SlowRequest.flat()`` key, priority,
alignment)."""
LATENCY_PRIORITY = {99: 1, 50: 2, 95: 6}
"""Priority of the report's latency percentile columns (p99 stays longest, p95 goes first)."""
TIME_FORMAT = "%m-%d %H:%M:%S"
"""Timestamps in tables: month-day and time of day, UTC (the full time is in ``--format json``)."""


def _fmt(value: Any, kind: str = "") -> str:
    if value is None:
        return "-"
    if kind == "pct":
        return f"{value * 100:.1f}%"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def short_time(value: Any) -> str:
    """``MM-DD HH:MM:SS`` in UTC of a datetime or an ISO-8601 string (a naive one is UTC); ``-`` for None;
    text that is not a time is returned as it is."""
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return value
    if isinstance(value, datetime):
        return (value.astimezone(UTC) if value.tzinfo else value).strftime(TIME_FORMAT)
    return _fmt(value)


def _cell(key: str, value: Any) -> str:
    return short_time(value) if key in ("@timestamp", "timestamp") else _fmt(value)


def render_report(report: Report, fmt: str, out: IO[str], width: int | None = None) -> None:
    """Write ``report`` to ``out``: tables fitted to ``width`` terminal cells (None: every column; rows, then
    slowest requests), JSON, or CSV (rows, blank line, slowest requests)."""
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
    console = fixed_console(out, width or 200)
    header = (
        f"source {report.source}"
        + (f" · since {report.since}" if report.since else "")
        + (f" · by {report.by}" if report.by else "")
    )
    console.print(Text(header, style="bold"))
    console.print(Text(f"percentiles: {report.percentile_method}"))
    columns, cells = _rows_table(rows, report.by or "group")
    print_table(out, "requests (latencies in seconds)", columns, cells, width)
    columns = [Column(h, p, j) for h, (_, p, j) in SLOW_COLUMNS.items()]
    cells = [[_cell(key, row.get(key)) for key, _, _ in SLOW_COLUMNS.values()] for row in slow]
    print_table(out, "slowest requests (why was P99 slow?)", columns, cells, width)
    for name, part in report.cause_breakdown().items():
        if part["requests"]:
            total = sum(part["causes"].values()) or 1.0
            shares = ", ".join(f"{c} {v:.3f} s ({v / total:.0%})" for c, v in part["causes"].items())
            what = "the slowest" if name == "slowest" else "those at or above the e2e p99"
            console.print(Text(f"causes of {what} ({part['requests']} requests): {shares}"))
    unparsed = report.extra.get("unparsed_lines")
    if unparsed:
        console.print(Text(f"{unparsed} unparsable log lines skipped", style="yellow"))


def _rows_table(rows: list[dict[str, Any]], group_title: str) -> tuple[list[Column], list[list[str]]]:
    """The report's rows: group, counts, one column per latency percentile (``TTFT`` over ``p99``), tokens,
    batch, KV and preemptions, with their priorities."""
    columns = [Column(group_title), Column("requests", 0, "right"), Column("errors", 1, "right")]
    keys: list[tuple[str, str]] = [("group", ""), ("requests", ""), ("error_rate", "pct")]
    for p in (99, 50, 95):
        for name, title in (("ttft", "TTFT"), ("e2e", "e2e"), ("tpot", "TPOT")):
            # e2e p99 and TTFT p99 first, TPOT after them at the same percentile
            priority = LATENCY_PRIORITY[p] + (1 if name == "tpot" else 0)
            columns.append(Column(f"{title}\np{p}", priority, "right"))
            keys.append((f"{name}_p{p}_s", ""))
    columns += [
        Column("tokens\nin/out", 4, "right"),
        Column("batch\nmean", 5, "right"),
        Column("KV\np95", 5, "right"),
        Column("preempt", 4, "right"),
    ]
    cells = []
    for r in rows:
        line = [str(r["group"]) if k == "group" else _fmt(r[k], kind) for k, kind in keys]
        line += [
            f"{r['tokens_in']}/{r['tokens_out']}",
            _fmt(r["batch_size_mean"]),
            _fmt(r["kv_usage_p95"]),
            str(r["preemptions"]),
        ]
        cells.append(line)
    return columns, cells


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


def render_records(records: list[dict[str, Any]], fmt: str, out: IO[str], width: int | None = None) -> None:
    """Write matching records: a table of key fields fitted to ``width`` terminal cells (None: every column),
    NDJSON (one record a line), or CSV of dotted fields."""
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
    columns = [Column(h, p, j) for h, (_, p, j) in RECORD_COLUMNS.items()]
    cells = [[_cell(path, dotted(r, path)) for path, _, _ in RECORD_COLUMNS.values()] for r in records]
    print_table(out, f"{len(records)} matching requests (newest first)", columns, cells, width)
