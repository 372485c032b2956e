"""The report, search and plot data from Elasticsearch: request bodies and response parsing.

One ``_search`` per report (request shape in :func:`report_query`): ``size`` = the number of slowest
requests, sorted by ``kvscope.e2e_s`` desc; top-level metric aggregations for the totals; the same metrics
under a ``terms`` aggregation for ``--by`` (and, for the numeric ``status``, whose ``terms`` cannot take the
``(none)`` stand-in, a sibling ``missing`` aggregation for the records without one). ``percentiles`` answers
``{"values": {"50.0": x, ...}}`` (keyed, the default); ``filter`` and ``missing`` answer ``{"doc_count": n}``;
``sum``/``avg`` ``{"value": x}`` (``avg`` is null over no values); totals use ``hits.total.value`` with
``track_total_hits: true`` (Search API and aggregation reference, Elasticsearch 8.x/9.x).

Every order has the same ties as the DuckDB back end (kvscope/gateway/analytics/duckdb_logs.py), so the two
answer the same records: ties end on ``event.id`` (the gateway's own id, unique per record), then ``trace.id``
(for the engine's lines, which have no ``event.id``), ascending, records without them last.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from elasticsearch import AsyncElasticsearch

from kvscope.gateway.analytics.report import (
    ERROR_STATUS,
    GROUP_FIELDS,
    ID_FIELDS,
    LATENCY_FIELDS,
    MISSING,
    PERCENTS,
    SLOW_FIELDS,
    Report,
    ReportRow,
    dotted,
    es_time,
    prune,
    slow_request,
)

PERCENTILE_METHOD = (
    "TDigest (Elasticsearch percentiles aggregation): since 8.9 exact, linear interpolation between "
    "closest ranks, below 2,000 values per aggregation; approximate above"
)
TIEBREAK = ({"event.id": {"order": "asc"}}, {"trace.id": {"order": "asc"}})
"""The last sort keys of every query that lists records (the DuckDB back end ends its orders the same way):
the gateway's own id, unique per record, then, for an engine's line (which has none), its trace id."""
_NUMERIC_GROUPS = {"status"}


def time_filter(since: datetime | None) -> dict[str, Any]:
    """``{"bool": {"filter": [range @timestamp >= since]}}`` or ``match_all``."""
    if since is None:
        return {"match_all": {}}
    return {"bool": {"filter": [{"range": {"@timestamp": {"gte": es_time(since)}}}]}}


def metric_aggs() -> dict[str, Any]:
    """The per-row metric aggregations (see kvscope.gateway.analytics.report for the definitions)."""
    errors = {
        "bool": {
            "should": [
                {"range": {"http.response.status_code": {"gte": ERROR_STATUS}}},
                {"term": {"event.outcome": "failure"}},
            ],
            "minimum_should_match": 1,
        }
    }
    aggs: dict[str, Any] = {"errors": {"filter": errors}}
    for name, field in LATENCY_FIELDS.items():
        aggs[name] = {"percentiles": {"field": field, "percents": list(PERCENTS)}}
    aggs |= {
        "tokens_in": {"sum": {"field": "gen_ai.usage.input_tokens"}},
        "tokens_out": {"sum": {"field": "gen_ai.usage.output_tokens"}},
        "batch_size_mean": {"avg": {"field": "kvscope.engine.batch_size_mean"}},
        "kv_usage_p95": {"percentiles": {"field": "kvscope.engine.kv_cache_usage", "percents": [95]}},
        "preemptions": {"sum": {"field": "kvscope.engine.num_preemptions"}},
    }
    return aggs


def report_query(
    by: str | None, since: datetime | None, top: int = 10, max_groups: int = 50
) -> dict[str, Any]:
    """The ``_search`` body of a report. Raises ValueError for an unknown ``by``."""
    aggs = metric_aggs()
    if by is not None:
        if by not in GROUP_FIELDS:
            raise ValueError(f"--by must be one of {', '.join(GROUP_FIELDS)}")
        terms: dict[str, Any] = {"field": GROUP_FIELDS[by], "size": max_groups}
        if by in _NUMERIC_GROUPS:  # a long field's missing value must be a number: count them aside
            aggs["groups_missing"] = {"missing": {"field": GROUP_FIELDS[by]}, "aggs": metric_aggs()}
        else:
            terms["missing"] = MISSING
        aggs["groups"] = {"terms": terms, "aggs": metric_aggs()}
    return {
        "size": top,
        "track_total_hits": True,
        "query": time_filter(since),
        "sort": [{"kvscope.e2e_s": {"order": "desc"}}, {"http.request.id": {"order": "asc"}}, *TIEBREAK],
        # the slow-request fields, with the whole kvscope.engine and kvscope.gateway objects and upstream_s
        # for the causes
        "_source": sorted(
            {f for f in SLOW_FIELDS.values() if not f.startswith("kvscope.engine.")}
            | {"kvscope.engine", "kvscope.gateway", "kvscope.upstream_s"}
        ),
        "aggs": aggs,
    }


def percentile_values(agg: dict[str, Any]) -> dict[float, float | None]:
    """``{50.0: x, ...}`` from a percentiles aggregation, keyed (dict) or ``keyed: false`` (list)."""
    values = agg.get("values", {})
    if isinstance(values, list):
        return {float(v["key"]): v.get("value") for v in values}
    return {float(k): v for k, v in values.items()}


def _row(group: str | None, requests: int, aggs: dict[str, Any]) -> ReportRow:
    latency = {}
    for name in LATENCY_FIELDS:
        values = percentile_values(aggs[name])
        latency[name] = {p: values.get(float(p)) for p in PERCENTS}
    return ReportRow(
        group=group,
        requests=requests,
        errors=int(aggs["errors"]["doc_count"]),
        latency=latency,
        tokens_in=int(aggs["tokens_in"]["value"] or 0),
        tokens_out=int(aggs["tokens_out"]["value"] or 0),
        batch_size_mean=aggs["batch_size_mean"]["value"],
        kv_usage_p95=percentile_values(aggs["kv_usage_p95"]).get(95.0),
        preemptions=int(aggs["preemptions"]["value"] or 0),
    )


def total_hits(body: dict[str, Any]) -> int:
    total = body["hits"]["total"]
    return int(total["value"] if isinstance(total, dict) else total)


def parse_report(
    body: dict[str, Any], by: str | None, source: str, since: str | None = None, max_groups: int = 50
) -> Report:
    """A :class:`Report` from the response to :func:`report_query`: at most ``max_groups`` groups, the
    largest first, ties by group name (the ``(none)`` group of a numeric field merged into that order)."""
    aggs = body.get("aggregations", {})
    groups = [
        _row(str(b.get("key_as_string", b["key"])), int(b["doc_count"]), b)
        for b in aggs.get("groups", {}).get("buckets", [])
    ]
    none = aggs.get("groups_missing")
    if none is not None and int(none["doc_count"]) > 0:
        groups.append(_row(MISSING, int(none["doc_count"]), none))
        groups = sorted(groups, key=lambda g: (-g.requests, g.group or ""))[:max_groups]
    slowest = tuple(
        slow_request(h["_source"])
        for h in body["hits"]["hits"]
        if dotted(h.get("_source"), "kvscope.e2e_s") is not None
    )
    return Report(
        source=source,
        by=by,
        since=since,
        total=_row(None, total_hits(body), aggs),
        groups=tuple(groups),
        slowest=slowest,
        percentile_method=PERCENTILE_METHOD,
    )


def search_query(query: str, since: datetime | None, limit: int = 20) -> dict[str, Any]:
    """``query_string`` search (Lucene syntax, e.g. ``kvscope.e2e_s:>5 AND
    gen_ai.request.model:smollm2*``)."""
    must = [{"query_string": {"query": query}}] if query.strip() else [{"match_all": {}}]
    filters = time_filter(since).get("bool", {}).get("filter", [])
    return {
        "size": limit,
        "query": {"bool": {"must": must, "filter": filters}},
        "sort": [{"@timestamp": {"order": "desc"}}, *TIEBREAK],
    }


def id_query(wanted: str, since: datetime | None, limit: int = 50) -> dict[str, Any]:
    """Records one of whose ids (``ID_FIELDS``, keyword fields) is ``wanted`` or starts with it: ``term``
    and ``prefix`` queries (term-level, so the id needs no escaping), exact matches first, then newest first.

    The order is by score, and each group of clauses is a ``constant_score`` of boost 1: a record that has
    the id exactly matches both groups (score 2), a record that only starts with it matches the prefix group
    (score 1). Bare ``term`` clauses would score by BM25 (an exact id then ranks by how rare it is in the
    shard, and a prefix that fits two of a record's ids would outscore it): the order would no longer be
    the DuckDB back end's "exact first, then newest"."""
    exact = {"bool": {"should": [{"term": {f: wanted}} for f in ID_FIELDS]}}
    prefix = {"bool": {"should": [{"prefix": {f: wanted}} for f in ID_FIELDS]}}
    filters = time_filter(since).get("bool", {}).get("filter", [])
    should = [{"constant_score": {"filter": q, "boost": 1.0}} for q in (exact, prefix)]
    return {
        "size": limit,
        "query": {"bool": {"should": should, "minimum_should_match": 1, "filter": filters}},
        "sort": [{"_score": {"order": "desc"}}, {"@timestamp": {"order": "desc"}}, *TIEBREAK],
    }


def prelude_query(since: datetime | None) -> dict[str, Any]:
    """Time range and TTFT range, to size the plot's buckets and bins."""
    return {
        "size": 0,
        "query": time_filter(since),
        "aggs": {
            "t_min": {"min": {"field": "@timestamp"}},
            "t_max": {"max": {"field": "@timestamp"}},
            "ttft_min": {"min": {"field": LATENCY_FIELDS["ttft"]}},
            "ttft_hi": {"percentiles": {"field": LATENCY_FIELDS["ttft"], "percents": [99.5]}},
        },
    }


def timeseries_query(since: datetime | None, bucket_s: int) -> dict[str, Any]:
    pct = {
        name: {"percentiles": {"field": LATENCY_FIELDS[name], "percents": list(PERCENTS)}}
        for name in ("ttft", "e2e")
    }
    return {
        "size": 0,
        "query": time_filter(since),
        "aggs": {
            "t": {
                "date_histogram": {
                    "field": "@timestamp",
                    "fixed_interval": f"{int(bucket_s)}s",
                    "min_doc_count": 1,
                },
                "aggs": pct,
            }
        },
    }


def parse_timeseries(body: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for b in body["aggregations"]["t"]["buckets"]:
        row: dict[str, Any] = {"t": datetime.fromtimestamp(b["key"] / 1000, UTC), "requests": b["doc_count"]}
        for name in ("ttft", "e2e"):
            values = percentile_values(b[name])
            row[name] = [values.get(float(p)) for p in PERCENTS]
        out.append(row)
    return out


def histogram_query(since: datetime | None, lo: float, width: float) -> dict[str, Any]:
    return {
        "size": 0,
        "query": time_filter(since),
        "aggs": {
            "ttft": {
                "histogram": {
                    "field": LATENCY_FIELDS["ttft"],
                    "interval": width,
                    "offset": lo % width,
                    "min_doc_count": 1,
                }
            }
        },
    }


class EsLogs:
    """Report/search/plot data from an Elasticsearch data stream through ``client``."""

    def __init__(self, client: AsyncElasticsearch, index: str, source: str, since: datetime | None) -> None:
        self.client, self.index, self.source, self.since = client, index, source, since

    async def _search(self, body: dict[str, Any]) -> dict[str, Any]:
        response = await self.client.search(index=self.index, body=body)
        return dict(response.body)

    async def report(
        self, by: str | None = None, top: int = 10, max_groups: int = 50, since: str | None = None
    ) -> Report:
        body = await self._search(report_query(by, self.since, top, max_groups))
        return parse_report(body, by, self.source, since, max_groups)

    async def search(self, query: str, limit: int = 20) -> list[dict[str, Any]]:
        body = await self._search(search_query(query, self.since, limit))
        return [prune(h["_source"]) for h in body["hits"]["hits"]]

    async def find_id(self, wanted: str, limit: int = 50) -> list[dict[str, Any]]:
        body = await self._search(id_query(wanted, self.since, limit))
        return [prune(h["_source"]) for h in body["hits"]["hits"]]

    async def time_range(self) -> tuple[datetime | None, datetime | None]:
        aggs = (await self._search(prelude_query(self.since)))["aggregations"]
        first, last = (aggs[k]["value"] for k in ("t_min", "t_max"))
        return _from_epoch_ms(first), _from_epoch_ms(last)

    async def timeseries(self, bucket_s: int) -> list[dict[str, Any]]:
        return parse_timeseries(await self._search(timeseries_query(self.since, bucket_s)))

    async def ttft_histogram(self, bins: int = 40) -> tuple[list[float], list[int]]:
        aggs = (await self._search(prelude_query(self.since)))["aggregations"]
        lo, hi = aggs["ttft_min"]["value"], percentile_values(aggs["ttft_hi"]).get(99.5)
        if lo is None or hi is None:
            return [], []
        width = (hi - lo) / bins if hi > lo else 1.0
        counts = [0] * bins
        body = await self._search(histogram_query(self.since, lo, width))
        for b in body["aggregations"]["ttft"]["buckets"]:
            index = min(max(round((b["key"] - lo) / width), 0), bins - 1)
            counts[index] += int(b["doc_count"])
        return [lo + i * width for i in range(bins + 1)], counts


def _from_epoch_ms(value: float | None) -> datetime | None:
    """An Elasticsearch date aggregation's value (epoch milliseconds, None for no documents) as a UTC
    datetime."""
    return None if value is None else datetime.fromtimestamp(value / 1000, UTC)
