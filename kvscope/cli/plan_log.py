"""The joint of ``kvscope plan --from-log FILE`` and the gateway's request log: spans read by the gateway's
DuckDB log reader (kvscope.gateway.analytics), for the planner's replay (kvscope.plan.replay), which
imports no gateway code."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvscope.plan.replay import Span

_SPAN_SQL = """
SELECT epoch("event"."start") AS start_s, epoch("event"."end") AS end_s,
       "gen_ai"."usage"."input_tokens" AS input_tokens,
       coalesce("gen_ai"."usage"."output_tokens", 0) AS output_tokens,
       "kvscope"."ttft_s" AS ttft_s
FROM requests WHERE "event"."start" IS NOT NULL AND "event"."end" IS NOT NULL
  AND "gen_ai"."usage"."input_tokens" IS NOT NULL
ORDER BY start_s, "event"."id" NULLS LAST, "trace"."id" NULLS LAST
"""
"""Spans in start order, ties by the gateway's unique ``event.id``, then (an engine's line has none) the trace
id: the order the Elasticsearch reader (kvscope/plan/replay_es.py) returns, so both give the replay the same
list."""
_NOT_GENERATIONS_SQL = 'SELECT count(*) FROM requests WHERE "gen_ai"."usage"."input_tokens" IS NULL'


def read_spans(source: str | Path) -> tuple[list[Span], dict[str, Any]]:
    """Spans of every record of a JSONL request log (the file with its rotated siblings, or a directory),
    read by DuckDB with the typed columns ``kvscope logs`` uses. Returns (spans, {"unparsed_lines": n,
    "not_generations": m}).
    Raises FileNotFoundError when no log file matches."""
    import duckdb

    from kvscope.gateway.analytics.duckdb_logs import DuckDBLogs

    try:
        logs = DuckDBLogs(source)
    except duckdb.Error as exc:  # a damaged .gz or an unreadable file: bad input, not a crash
        raise ValueError(f"cannot read the request log {source}: {exc}") from None
    rows = logs.con.execute(_SPAN_SQL).fetchall()
    spans = [
        Span(float(a), float(b), int(i), int(o), None if t is None else float(t)) for a, b, i, o, t in rows
    ]
    row = logs.con.execute(_NOT_GENERATIONS_SQL).fetchone()
    not_generations = row[0] if row is not None else 0  # a count(*) answers one row
    return spans, {"unparsed_lines": logs.unparsed_lines(), "not_generations": int(not_generations)}
