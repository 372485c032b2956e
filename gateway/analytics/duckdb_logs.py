"""The report, search and plot data over JSONL request logs, computed by DuckDB (no server needed).

Files: ``--source`` names the current log file (``requests.jsonl``: its rotated siblings ``requests.jsonl.1``,
``.2`` … and ``.gz`` variants are read too) or a directory (every ``*.jsonl`` family in it). Columns are read
with explicit types derived from the Elasticsearch mapping
(:func:`kvscope.gateway.logs.es_setup.record_properties`), so both back ends agree on every field's type. A
line that is not valid JSON or does not fit the types (a line torn by a crash) is skipped and counted in
``Report.extra["unparsed_lines"]``. The files are read once, when :class:`DuckDBLogs` is built (every query of
one report sees the same snapshot); a last line without its newline is a record still being written and is
left out (gateway/logs/jsonl.py), never counted as unparsable.

The answers are the Elasticsearch back end's (tests/gateway/logs/test_es_agreement.py checks both on the same
records): every order that lists records ends on ``event.id`` then ``trace.id``, ascending, nulls last, as
its queries do; ``--by
finish_reason`` counts a record once per distinct reason (a ``terms`` aggregation counts a document once per
distinct value); time buckets start at the Unix epoch (a ``date_histogram`` ``fixed_interval``'s origin;
DuckDB's ``time_bucket`` would otherwise count from 2000-01-03).
"""

from __future__ import annotations

import re
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

import duckdb

from kvscope.gateway.analytics.report import (
    ERROR_STATUS,
    GROUP_FIELDS,
    ID_FIELDS,
    LATENCY_FIELDS,
    MISSING,
    PERCENTS,
    Report,
    ReportRow,
    es_time,
    prune,
    slow_request,
)
from kvscope.gateway.logs.es_setup import record_properties
from kvscope.gateway.logs.jsonl import complete_copy

PERCENTILE_METHOD = "exact, linear interpolation (DuckDB quantile_cont, Hyndman-Fan type 7)"
TIEBREAK = '"event"."id" ASC NULLS LAST, "trace"."id" ASC NULLS LAST'
"""The last keys of every order that lists records (as the Elasticsearch queries': es_logs.TIEBREAK)."""
EPOCH = "TIMESTAMPTZ '1970-01-01 00:00:00+00'"
ARRAY_FIELDS = {"event.category", "event.type", "gen_ai.response.finish_reasons"}
"""Fields the record holds as JSON arrays (Elasticsearch mappings do not say which are arrays)."""
_DUCK_TYPES = {
    "long": "BIGINT",
    "double": "DOUBLE",
    "boolean": "BOOLEAN",
    "date": "TIMESTAMPTZ",
    "keyword": "VARCHAR",
    "match_only_text": "VARCHAR",
    "ip": "VARCHAR",
}
_ROTATED = r"(\.\d+)?(\.gz)?"


def duckdb_type(props: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """DuckDB column types for an Elasticsearch ``properties`` mapping (nested objects → STRUCT)."""
    out: dict[str, str] = {}
    for name, spec in props.items():
        path = prefix + name
        if spec.get("enabled") is False:
            continue
        if "properties" in spec:
            inner = duckdb_type(spec["properties"], path + ".")
            out[name] = "STRUCT(" + ", ".join(f'"{k}" {v}' for k, v in inner.items()) + ")"
        else:
            out[name] = _DUCK_TYPES[spec["type"]] + ("[]" if path in ARRAY_FIELDS else "")
    return out


def col(path: str) -> str:
    """SQL for a dotted record field: ``"http"."response"."status_code"``."""
    return ".".join(f'"{part}"' for part in path.split("."))


def log_files(source: str | Path) -> list[str]:
    """The log file and its rotated siblings (or every JSONL family in a directory). Raises
    FileNotFoundError."""
    path = Path(source).expanduser()
    if path.is_dir():
        pattern, folder = re.compile(r".+\.jsonl" + _ROTATED), path
    else:
        pattern, folder = re.compile(re.escape(path.name) + _ROTATED), path.parent
    files = sorted(str(p) for p in folder.glob("*") if p.is_file() and pattern.fullmatch(p.name))
    if not files:
        raise FileNotFoundError(f"no request log files at {source}")
    return files


def _sql_str(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


class DuckDBLogs:
    """A DuckDB view ``requests`` over one snapshot of the log files (read at construction), filtered to
    ``@timestamp >= since``."""

    def __init__(self, source: str | Path, since: datetime | None = None) -> None:
        self.source = str(source)
        self.con = duckdb.connect()
        self.con.execute("SET TimeZone = 'UTC'")
        columns = (
            "{"
            + ", ".join(f"{_sql_str(k)}: {_sql_str(v)}" for k, v in duckdb_type(record_properties()).items())
            + "}"
        )
        with tempfile.TemporaryDirectory(prefix="kvscope-logs-") as tmp:
            paths = [f if f.endswith(".gz") else str(complete_copy(f, tmp)) for f in log_files(source)]
            files = "[" + ", ".join(_sql_str(f) for f in paths) + "]"
            self.con.execute(
                f"CREATE TABLE raw AS SELECT * FROM read_json({files}, format = 'newline_delimited', "
                f"columns = {columns}, ignore_errors = true)"
            )
        where = '"@timestamp" IS NOT NULL'
        if since is not None:
            where += f' AND "@timestamp" >= TIMESTAMPTZ {_sql_str(es_time(since))}'
        self.con.execute(f"CREATE VIEW requests AS SELECT * FROM raw WHERE {where}")

    def _one_row(self, sql: str) -> tuple[Any, ...]:
        """The one row of an aggregate query (an aggregate without GROUP BY always answers one)."""
        row = self.con.execute(sql).fetchone()
        if row is None:
            raise RuntimeError(f"no row from {sql!r}")
        return row

    def unparsed_lines(self) -> int:
        return self._one_row('SELECT count(*) FROM raw WHERE "@timestamp" IS NULL')[0]

    # ---- report ------------------------------------------------------------------------------------
    def report(
        self, by: str | None = None, top: int = 10, max_groups: int = 50, since: str | None = None
    ) -> Report:
        """The report over all (filtered) records; ``by`` is a key of ``GROUP_FIELDS``. Raises ValueError."""
        if by is not None and by not in GROUP_FIELDS:
            raise ValueError(f"--by must be one of {', '.join(GROUP_FIELDS)}")
        total = self._rows(f"SELECT NULL AS grp, {_metrics_sql()} FROM requests")[0]
        groups = self._rows(self._group_sql(by, max_groups)) if by else []
        return Report(
            source=self.source,
            by=by,
            since=since,
            total=total,
            groups=tuple(groups),
            slowest=tuple(self.slowest(top)),
            percentile_method=PERCENTILE_METHOD,
            extra={"unparsed_lines": self.unparsed_lines()},
        )

    def _group_sql(self, by: str, limit: int) -> str:
        field = col(GROUP_FIELDS[by])
        if by == "finish_reason":  # each distinct reason once (list_distinct also drops nulls)
            reasons = f"list_distinct(coalesce({field}, []::VARCHAR[]))"
            source = (
                f"requests, unnest(CASE WHEN len({reasons}) > 0 THEN {reasons} "
                f"ELSE [{_sql_str(MISSING)}] END) AS u(g)"
            )
            expr = "u.g"
        else:
            source, expr = "requests", f"coalesce(CAST({field} AS VARCHAR), {_sql_str(MISSING)})"
        return (
            f"SELECT {expr} AS grp, {_metrics_sql()} FROM {source} GROUP BY grp "
            f"ORDER BY requests DESC, grp ASC LIMIT {int(limit)}"
        )

    def _rows(self, sql: str) -> list[ReportRow]:
        cursor = self.con.execute(sql)
        names = [d[0] for d in cursor.description]
        return [_row(dict(zip(names, values, strict=True))) for values in cursor.fetchall()]

    def slowest(self, top: int) -> list[Any]:
        """The ``top`` records with the largest ``kvscope.e2e_s`` (ties: request id ascending)."""
        sql = (
            f"SELECT * FROM requests WHERE {col('kvscope.e2e_s')} IS NOT NULL "
            f"ORDER BY {col('kvscope.e2e_s')} DESC, {col('http.request.id')} ASC NULLS LAST, {TIEBREAK} "
            f"LIMIT {int(top)}"
        )
        return [slow_request(doc) for doc in self._docs(sql)]

    # ---- search ------------------------------------------------------------------------------------
    def search(self, condition: str, limit: int = 20) -> list[dict[str, Any]]:
        """Records matching a DuckDB SQL ``condition`` (e.g. ``kvscope.e2e_s > 5``), newest first.

        Raises ValueError for a condition DuckDB cannot parse or bind (the message shows examples).
        """
        cond = condition.strip() or "true"
        try:
            return self._docs(
                f'SELECT * FROM requests WHERE ({cond}) ORDER BY "@timestamp" DESC, {TIEBREAK} '
                f"LIMIT {int(limit)}"
            )
        except (duckdb.ParserException, duckdb.BinderException) as exc:
            first = str(exc).splitlines()[0]
            raise ValueError(
                f"{first}. A search over files is a SQL condition on the log's fields, e.g. "
                '"kvscope.e2e_s > 5" or "http.response.status_code = 503 AND gen_ai.request.model = '
                "'smollm2-135m'\"; an id or id prefix alone lists that request"
            ) from None

    def find_id(self, wanted: str, limit: int = 50) -> list[dict[str, Any]]:
        """Records one of whose ids (:data:`~kvscope.gateway.analytics.report.ID_FIELDS`) is ``wanted`` or
        starts with it: exact matches first, then newest first; at most ``limit``. The id is a query
        parameter (any characters are safe)."""
        exact = " OR ".join(f"{col(f)} = $id" for f in ID_FIELDS)
        prefix = " OR ".join(f"starts_with({col(f)}, $id)" for f in ID_FIELDS)
        sql = (
            f"SELECT * FROM requests WHERE {prefix} ORDER BY coalesce({exact}, false) DESC, "
            f'"@timestamp" DESC, {TIEBREAK} LIMIT {int(limit)}'
        )
        return self._docs(sql, {"id": wanted})

    def _docs(self, sql: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        cursor = self.con.execute(sql, params)
        names = [d[0] for d in cursor.description]
        return [prune(dict(zip(names, values, strict=True))) for values in cursor.fetchall()]

    # ---- plot data ---------------------------------------------------------------------------------
    def timeseries(self, bucket_s: int) -> list[dict[str, Any]]:
        """Per time bucket: ``{"t": datetime, "requests": n, "ttft": [p50, p95, p99], "e2e": [...]}``."""
        q = _percent_list()
        sql = (
            f"SELECT time_bucket(INTERVAL '{int(bucket_s)} seconds', \"@timestamp\", {EPOCH}) AS t, "
            f"count(*) AS requests, quantile_cont({col(LATENCY_FIELDS['ttft'])}, {q}) AS ttft, "
            f"quantile_cont({col(LATENCY_FIELDS['e2e'])}, {q}) AS e2e FROM requests GROUP BY t ORDER BY t"
        )
        cursor = self.con.execute(sql)
        return [dict(zip(("t", "requests", "ttft", "e2e"), row, strict=True)) for row in cursor.fetchall()]

    def time_range(self) -> tuple[datetime | None, datetime | None]:
        first, last = self._one_row('SELECT min("@timestamp"), max("@timestamp") FROM requests')
        return first, last

    def ttft_histogram(self, bins: int = 40) -> tuple[list[float], list[int]]:
        """Bin edges (``bins + 1``) over [min, p99.5] of TTFT and counts; the last bin also holds the rest."""
        ttft = col(LATENCY_FIELDS["ttft"])
        lo, hi = self._one_row(f"SELECT min({ttft}), quantile_cont({ttft}, 0.995) FROM requests")
        if lo is None:
            return [], []
        width = (hi - lo) / bins if hi > lo else 1.0
        sql = (
            f"SELECT least(CAST(floor(({ttft} - {lo!r}) / {width!r}) AS BIGINT), {bins - 1}) AS b, count(*) "
            f"FROM requests WHERE {ttft} IS NOT NULL GROUP BY b"
        )
        counts = [0] * bins
        for b, n in self.con.execute(sql).fetchall():
            counts[b] += n
        return [lo + i * width for i in range(bins + 1)], counts


def _percent_list() -> str:
    return "[" + ", ".join(str(p / 100) for p in PERCENTS) + "]"


def _metrics_sql() -> str:
    q = _percent_list()
    parts = [
        "count(*) AS requests",
        f"count(*) FILTER (WHERE {col('http.response.status_code')} >= {ERROR_STATUS} "
        f"OR {col('event.outcome')} = 'failure') AS errors",
    ]
    parts += [f"quantile_cont({col(path)}, {q}) AS {name}" for name, path in LATENCY_FIELDS.items()]
    parts += [
        f"coalesce(sum({col('gen_ai.usage.input_tokens')}), 0) AS tokens_in",
        f"coalesce(sum({col('gen_ai.usage.output_tokens')}), 0) AS tokens_out",
        f"avg({col('kvscope.engine.batch_size_mean')}) AS batch_size_mean",
        f"quantile_cont({col('kvscope.engine.kv_cache_usage')}, 0.95) AS kv_usage_p95",
        f"coalesce(sum({col('kvscope.engine.num_preemptions')}), 0) AS preemptions",
    ]
    return ", ".join(parts)


def _row(values: dict[str, Any]) -> ReportRow:
    latency: dict[str, dict[int, float | None]] = {
        name: dict(zip(PERCENTS, values[name] or [None] * len(PERCENTS), strict=True))
        for name in LATENCY_FIELDS
    }
    return ReportRow(
        group=values["grp"],
        requests=int(values["requests"]),
        errors=int(values["errors"]),
        latency=latency,
        tokens_in=int(values["tokens_in"]),
        tokens_out=int(values["tokens_out"]),
        batch_size_mean=values["batch_size_mean"],
        kv_usage_p95=values["kv_usage_p95"],
        preemptions=int(values["preemptions"]),
    )
