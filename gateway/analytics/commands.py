"""Log analytics over either back end: JSONL files (DuckDB, exact) or Elasticsearch (aggregations).

``source`` is a file/directory path or an ``http(s)://`` Elasticsearch URL. Every function here is async
(Elasticsearch needs it); DuckDB calls run inline, they are local and fast.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from kvscope.gateway.analytics.duckdb_logs import DuckDBLogs
from kvscope.gateway.analytics.es_logs import EsLogs
from kvscope.gateway.analytics.plot import auto_bucket_s, plot_histogram, plot_latency
from kvscope.gateway.analytics.report import ID_FIELDS, Report, dotted, parse_since
from kvscope.gateway.logs.es_client import EsConnectionConfig, is_es_url, make_client
from kvscope.gateway.logs.why import Why, explain

ID_MATCHES = 50
"""Records read for one id (exact matches first): enough to name the candidates of an ambiguous prefix."""
CANDIDATES_SHOWN = 10
"""Requests listed when a prefix matches several."""


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


BARE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
"""A query that is one word of id characters (no space, operator, colon or quote): an id or id prefix."""


def is_bare_id(query: str) -> bool:
    """Whether ``query`` is an id or id prefix rather than a condition: one word of id characters that is
    not a SQL/Lucene constant (``true``, ``false``, ``null``). A bare number counts (x-request-ids may be
    numbers; as a SQL condition ``4301`` would match every record)."""
    word = query.strip()
    return BARE_ID.fullmatch(word) is not None and word.lower() not in ("true", "false", "null")


async def search(
    source: LogSource, query: str, *, since: str | None = None, limit: int = 20, now: datetime | None = None
) -> list[dict[str, Any]]:
    """Matching records, newest first: a DuckDB SQL condition for files, a query string for Elasticsearch;
    a bare id or id prefix (:func:`is_bare_id`) lists the records one of whose ids (:data:`ID_FIELDS`:
    response id, x-request-id, trace id, event id) starts with it, as ``kvscope logs why`` finds them.
    Raises ValueError for a condition the file back end cannot parse (the message shows examples)."""
    async with open_logs(source, parse_since(since, now)) as logs:
        if is_bare_id(query):
            return await _call(logs.find_id(query.strip(), limit))
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
    source: LogSource, request_id: str, *, since: str | None = None, now: datetime | None = None
) -> Why:
    """The latency explanation of the request one of whose ids (:data:`ID_FIELDS`: response id, x-request-id,
    trace id, event id) is ``request_id`` or starts with it (the gateway's record when both services logged
    it). Raises LookupError when no record matches or a prefix matches several requests (the message lists
    them), ValueError for an empty id or a record without attribution."""
    if not request_id.strip():
        raise ValueError("give a response id (chatcmpl-…), x-request-id, trace id or event id, or a prefix")
    async with open_logs(source, parse_since(since, now)) as logs:
        records = await _call(logs.find_id(request_id, ID_MATCHES))
    found = one_request(records, request_id)
    gateway_first = sorted(found, key=lambda r: "gateway_overhead_s" not in (r.get("kvscope") or {}))
    return explain(gateway_first[0])


def _request_key(record: dict[str, Any]) -> str:
    """What ties the records of one request together: the trace id (the gateway's and the engine's line share
    it), else the x-request-id, else the record's own event id."""
    for path in ("trace.id", "http.request.id", "event.id"):
        value = dotted(record, path)
        if value:
            return f"{path}={value}"
    return f"record={id(record)}"


def _matched(record: dict[str, Any], wanted: str, exact: bool) -> tuple[str, str] | None:
    """(the id's name, its full value) of the first of the record's ids that is ``wanted`` (``exact``) or
    starts with it; None when none does."""
    for path, name in ID_FIELDS.items():
        value = dotted(record, path)
        if isinstance(value, str) and (value == wanted if exact else value.startswith(wanted)):
            return name, value
    return None


def one_request(records: list[dict[str, Any]], wanted: str) -> list[dict[str, Any]]:
    """The records (the gateway's and the engine's lines) of the one request that ``wanted`` names: by an
    exact id when any record has one, else by a prefix. Raises LookupError for no match, and for several
    requests, naming up to :data:`CANDIDATES_SHOWN` of them with the full id that matched."""
    exact = [r for r in records if _matched(r, wanted, True)]
    matches = exact or [r for r in records if _matched(r, wanted, False)]
    if not matches:
        *first, last = ID_FIELDS.values()
        names = f"{', '.join(first)} or {last}"
        raise LookupError(f"no request-log record whose {names} is or starts with {wanted!r}")
    groups: dict[str, list[dict[str, Any]]] = {}
    for record in matches:
        groups.setdefault(_request_key(record), []).append(record)
    if len(groups) == 1:
        return matches
    truncated = not exact and len(records) >= ID_MATCHES  # more may match than were read
    shown = list(groups.values())[:CANDIDATES_SHOWN]
    lines = []
    for group in shown:
        name, value = _matched(group[0], wanted, bool(exact)) or ("?", "?")
        ts = str(dotted(group[0], "@timestamp") or "")[:19].replace("T", " ")
        lines.append(f"  {value}  ({name}, {ts}, {dotted(group[0], 'gen_ai.request.model') or '-'})")
    hidden = len(groups) - len(shown)
    if hidden or truncated:
        lines.append(f"  … and {hidden}{'+' if truncated else ''} more")
    what = "is the id of" if exact else "is a prefix of the ids of"
    count = f"{len(groups)}{'+' if truncated else ''}"
    raise LookupError(
        f"{wanted!r} {what} {count} requests; give more characters, or one of these ids:\n" + "\n".join(lines)
    )
