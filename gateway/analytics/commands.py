"""Log analytics over either back end: JSONL files (DuckDB, exact) or Elasticsearch (aggregations).

``source`` is a file/directory path or an ``http(s)://`` Elasticsearch URL. Every function here is async
(Elasticsearch needs it); DuckDB calls run inline, they are local and fast.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from kvscope.gateway.analytics.duckdb_logs import DuckDBLogs
from kvscope.gateway.analytics.es_logs import EsLogs
from kvscope.gateway.analytics.plot import auto_bucket_s, plot_histogram, plot_latency
from kvscope.gateway.analytics.report import Report, parse_since
from kvscope.gateway.analytics.why import Why, explain, why_query
from kvscope.gateway.logs.es_client import EsConnectionConfig, is_es_url, make_client


@dataclass(frozen=True, slots=True)
class LogSource:
    location: str
    """JSONL file or directory, or an Elasticsearch URL."""
    index: str = "kvscope-requests"
    """Data stream (or index pattern) when ``location`` is Elasticsearch."""
    connection: EsConnectionConfig = field(default_factory=EsConnectionConfig)
    """Auth/TLS for Elasticsearch (its ``hosts`` are replaced by ``location``)."""


@contextlib.asynccontextmanager
async def open_logs(source: LogSource, since: datetime | None) -> AsyncIterator[DuckDBLogs | EsLogs]:
    """A back end for ``source``. Raises FileNotFoundError when no log file matches a path."""
    if not is_es_url(source.location):
        yield DuckDBLogs(source.location, since)
        return
    client = make_client(replace(source.connection, hosts=(source.location,)), max_retries=3)
    try:
        yield EsLogs(client, source.index, source.location, since)
    finally:
        await client.close()


async def _call(result: Any) -> Any:
    return await result if inspect.isawaitable(result) else result


async def report(
    source: LogSource,
    *,
    since: str | None = None,
    by: str | None = None,
    top: int = 10,
    now: datetime | None = None,
) -> Report:
    """The report (totals, ``by`` groups, ``top`` slowest requests) since ``since`` (``1h``, ISO time)."""
    async with open_logs(source, parse_since(since, now)) as logs:
        return await _call(logs.report(by=by, top=top, since=since))


async def search(
    source: LogSource, query: str, *, since: str | None = None, limit: int = 20, now: datetime | None = None
) -> list[dict[str, Any]]:
    """Matching records, newest first: a DuckDB SQL condition for files, a query string for Elasticsearch."""
    async with open_logs(source, parse_since(since, now)) as logs:
        return await _call(logs.search(query, limit))


async def plot(
    source: LogSource,
    out_dir: Path,
    *,
    since: str | None = None,
    bucket_s: int | None = None,
    now: datetime | None = None,
) -> list[Path]:
    """Write ``latency_percentiles.png`` and ``ttft_histogram.png`` into ``out_dir``; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    async with open_logs(source, parse_since(since, now)) as logs:
        start, end = await _call(logs.time_range())
        bucket = bucket_s or auto_bucket_s(start, end)
        series = await _call(logs.timeseries(bucket))
        edges, counts = await _call(logs.ttft_histogram())
    where = f"{source.location}" + (f", since {since}" if since else "")
    return [
        plot_latency(
            series, out_dir / "latency_percentiles.png", f"latency percentiles per {bucket}s — {where}"
        ),
        plot_histogram(edges, counts, out_dir / "ttft_histogram.png", f"TTFT distribution — {where}"),
    ]


async def why(
    source: LogSource, request_or_trace_id: str, *, since: str | None = None, now: datetime | None = None
) -> Why:
    """The latency explanation of the newest record whose ``http.request.id`` or ``trace.id`` is the given id
    (the gateway's record when both services logged it). Raises LookupError when no record matches and
    ValueError when the record has no attribution."""
    async with open_logs(source, parse_since(since, now)) as logs:
        records = await _call(logs.search(why_query(request_or_trace_id, es=is_es_url(source.location)), 20))
    if not records:
        raise LookupError(f"no request-log record with http.request.id or trace.id {request_or_trace_id!r}")
    gateway_first = sorted(records, key=lambda r: "gateway_overhead_s" not in (r.get("kvscope") or {}))
    return explain(gateway_first[0])
