"""The Elasticsearch back end of ``kvscope logs``: documented request shape, documented response parsing,
and the CLI through the real client against the double."""

from __future__ import annotations

import asyncio
import copy
import json
from datetime import datetime, timedelta

import pytest

from kvscope.gateway.analytics.cli import logs_main
from kvscope.gateway.analytics.es_logs import parse_report, parse_timeseries, report_query, search_query
from kvscope.gateway.logs.es_client import EsConnectionConfig, make_client
from kvscope.gateway.logs.es_setup import EsIndexConfig
from kvscope.testing.es_double import EsDouble
from kvscope.testing.es_load import load_records
from kvscope.testing.records import T0, make_record

PCT = {"percents": [50, 95, 99]}
METRICS = {
    "errors": {
        "filter": {
            "bool": {
                "should": [
                    {"range": {"http.response.status_code": {"gte": 400}}},
                    {"term": {"event.outcome": "failure"}},
                ],
                "minimum_should_match": 1,
            }
        }
    },
    "ttft": {"percentiles": {"field": "kvscope.ttft_s", **PCT}},
    "tpot": {"percentiles": {"field": "kvscope.tpot_s", **PCT}},
    "e2e": {"percentiles": {"field": "kvscope.e2e_s", **PCT}},
    "tokens_in": {"sum": {"field": "gen_ai.usage.input_tokens"}},
    "tokens_out": {"sum": {"field": "gen_ai.usage.output_tokens"}},
    "batch_size_mean": {"avg": {"field": "kvscope.engine.batch_size_mean"}},
    "kv_usage_p95": {"percentiles": {"field": "kvscope.engine.kv_cache_usage", "percents": [95]}},
    "preemptions": {"sum": {"field": "kvscope.engine.num_preemptions"}},
}
DOCUMENTED_QUERY = {  # docs/logs.md, "Elasticsearch query"
    "size": 3,
    "track_total_hits": True,
    "query": {"bool": {"filter": [{"range": {"@timestamp": {"gte": "2025-01-01T12:00:00.000Z"}}}]}},
    "sort": [
        {"kvscope.e2e_s": {"order": "desc"}},
        {"http.request.id": {"order": "asc"}},
        {"event.id": {"order": "asc"}},
        {"trace.id": {"order": "asc"}},
    ],
    "_source": [
        "@timestamp",
        "gen_ai.request.model",
        "http.request.id",
        "http.response.status_code",
        "kvscope.e2e_s",
        "kvscope.engine",
        "kvscope.gateway",
        "kvscope.gateway_overhead_s",
        "kvscope.tpot_s",
        "kvscope.ttft_s",
        "kvscope.upstream_s",
        "server.address",
        "trace.id",
    ],
    "aggs": {
        **METRICS,
        "groups": {
            "terms": {"field": "gen_ai.request.model", "size": 50, "missing": "(none)"},
            "aggs": METRICS,
        },
    },
}


def metrics_body(errors: int, ttft: list, e2e: list, tin: float, tout: float, batch, kv, pre: float) -> dict:
    """Metric aggregation results in the documented format (keyed percentiles, "50.0" keys)."""

    def pct(values: list) -> dict:
        return {"values": dict(zip(("50.0", "95.0", "99.0"), values, strict=True))}

    return {
        "errors": {"doc_count": errors},
        "ttft": pct(ttft),
        "tpot": pct([0.01, 0.02, 0.03]),
        "e2e": pct(e2e),
        "tokens_in": {"value": tin},
        "tokens_out": {"value": tout},
        "batch_size_mean": {"value": batch},
        "kv_usage_p95": {"values": {"95.0": kv}},
        "preemptions": {"value": pre},
    }


HIT = {
    "_index": ".ds-kvscope-requests-2025.01.01-000001",
    "_id": "req-000042",
    "_score": None,
    "_source": {
        "@timestamp": "2025-01-01T12:00:42.000Z",
        "http": {"request": {"id": "req-000042"}, "response": {"status_code": 200}},
        "trace": {"id": "4bf92f3577b34da6a3ce929d0e0e4736"},
        "gen_ai": {"request": {"model": "smollm2-135m"}},
        "server": {"address": "engine-0:8000"},
        "kvscope": {
            "e2e_s": 12.5,
            "ttft_s": 9.0,
            "tpot_s": 0.02,
            "gateway_overhead_s": 0.001,
            "engine": {
                "queue_s": 8.5,
                "prefill_s": 0.4,
                "decode_s": 3.4,
                "batch_size_max": 16,
                "kv_cache_usage": 0.97,
                "num_preemptions": 0,
            },
        },
    },
    "sort": [12.5, "req-000042"],
}
RESPONSE = {
    "took": 12,
    "timed_out": False,
    "_shards": {"total": 1, "successful": 1, "skipped": 0, "failed": 0},
    "hits": {
        "total": {"value": 120, "relation": "eq"},
        "max_score": None,
        "hits": [
            HIT,
            {
                "_index": "x",
                "_id": "no-e2e",
                "_score": None,
                "_source": {"kvscope": {}},
                "sort": [None, "no-e2e"],
            },
        ],
    },
    "aggregations": {
        **metrics_body(6, [0.2, 1.5, 9.0], [1.0, 6.0, 12.5], 24000.0, 9600.0, 7.25, 0.97, 3.0),
        "groups": {
            "doc_count_error_upper_bound": 0,
            "sum_other_doc_count": 0,
            "buckets": [
                {
                    "key": "smollm2-135m",
                    "doc_count": 100,
                    **metrics_body(5, [0.2, 1.6, 9.0], [1.1, 6.5, 12.5], 20000.0, 8000.0, 8.0, 0.97, 3.0),
                },
                {
                    "key": "(none)",
                    "doc_count": 20,
                    **metrics_body(1, [None, None, None], [0.5, 0.9, 1.0], 4000.0, 1600.0, None, None, 0.0),
                },
            ],
        },
    },
}


def test_report_query_has_the_documented_shape():
    assert (
        report_query("model", datetime.fromisoformat("2025-01-01T12:00:00+00:00"), top=3) == DOCUMENTED_QUERY
    )
    numeric = report_query("status", None)
    assert numeric["query"] == {"match_all": {}}
    assert numeric["aggs"]["groups"]["terms"] == {"field": "http.response.status_code", "size": 50}
    assert numeric["aggs"]["groups_missing"] == {
        "missing": {"field": "http.response.status_code"},
        "aggs": METRICS,
    }
    with pytest.raises(ValueError):
        report_query("colour", None)


def test_parse_a_response_in_the_documented_format():
    rep = parse_report(RESPONSE, "model", "http://es:9200")
    total = rep.total.flat()
    assert total == {
        "group": "all",
        "requests": 120,
        "errors": 6,
        "error_rate": 0.05,
        "ttft_p50_s": 0.2,
        "ttft_p95_s": 1.5,
        "ttft_p99_s": 9.0,
        "tpot_p50_s": 0.01,
        "tpot_p95_s": 0.02,
        "tpot_p99_s": 0.03,
        "e2e_p50_s": 1.0,
        "e2e_p95_s": 6.0,
        "e2e_p99_s": 12.5,
        "tokens_in": 24000,
        "tokens_out": 9600,
        "batch_size_mean": 7.25,
        "kv_usage_p95": 0.97,
        "preemptions": 3,
    }
    assert [(g.group, g.requests, g.errors) for g in rep.groups] == [
        ("smollm2-135m", 100, 5),
        ("(none)", 20, 1),
    ]
    assert (
        rep.groups[1].latency["ttft"] == {50: None, 95: None, 99: None}
        and rep.groups[1].batch_size_mean is None
    )
    (slow,) = rep.slowest  # the hit without kvscope.e2e_s is not a "slowest request"
    assert (slow.request_id, slow.trace_id, slow.e2e_s, slow.queue_s) == (
        "req-000042",
        "4bf92f3577b34da6a3ce929d0e0e4736",
        12.5,
        8.5,
    )
    assert slow.slowest_phase == "queue"
    assert "TDigest" in rep.percentile_method


def test_unkeyed_percentiles_and_int_total_parse_too():
    body = copy.deepcopy(RESPONSE)
    body["hits"]["total"] = 120
    body["aggregations"]["ttft"] = {
        "values": [{"key": 50.0, "value": 0.2}, {"key": 95.0, "value": 1.5}, {"key": 99.0, "value": 9.0}]
    }
    assert parse_report(body, None, "x").total.latency["ttft"] == {50: 0.2, 95: 1.5, 99: 9.0}


def test_search_and_timeseries_shapes():
    assert search_query("kvscope.e2e_s:>5", None, 7) == {
        "size": 7,
        "query": {"bool": {"must": [{"query_string": {"query": "kvscope.e2e_s:>5"}}], "filter": []}},
        "sort": [
            {"@timestamp": {"order": "desc"}},
            {"event.id": {"order": "asc"}},
            {"trace.id": {"order": "asc"}},
        ],
    }
    series = parse_timeseries(
        {
            "aggregations": {
                "t": {
                    "buckets": [
                        {
                            "key_as_string": "2025-01-01T12:00:00.000Z",
                            "key": 1735732800000,
                            "doc_count": 4,
                            "ttft": {"values": {"50.0": 0.1, "95.0": 0.2, "99.0": 0.3}},
                            "e2e": {"values": {"50.0": 1.0, "95.0": 2.0, "99.0": 3.0}},
                        }
                    ]
                }
            }
        }
    )
    assert series == [{"t": T0, "requests": 4, "ttft": [0.1, 0.2, 0.3], "e2e": [1.0, 2.0, 3.0]}]


def test_cli_report_and_search_through_the_client(capsys):
    """The CLI through the real client against the double, which evaluates the query and the aggregations:
    the answers are the records' own numbers (percentiles: type-7 interpolation, by hand below)."""
    records = [
        make_record(i, e2e_s=e2e, status=status, ts=T0 + timedelta(seconds=i))
        for i, (e2e, status) in enumerate([(1.0, 200), (4.0, 200), (2.0, 500), (3.0, 200), (9.0, 404)])
    ]
    records[3]["event"]["outcome"] = "failure"  # a stream that broke after its 200: an error too

    async def run(argv: list[str]) -> int:
        async with EsDouble(major=8) as es8:
            client = make_client(EsConnectionConfig(hosts=(es8.url,)))
            try:
                await load_records(client, EsIndexConfig(dynamic="strict"), records)
            finally:
                await client.close()
            return await asyncio.to_thread(logs_main, [*argv, "--source", es8.url])

    argv = ["report", "--by", "status", "--top", "2", "--since", "2025-01-01T12:00:01Z", "--format", "json"]
    assert asyncio.run(run(argv)) == 0
    body = json.loads(capsys.readouterr().out)
    # since 12:00:01: records 1-4 (e2e 4, 2, 3, 9); errors: the 500, the 404 and the broken stream
    total = body["total"]
    assert (total["requests"], total["errors"]) == (4, 3)
    # e2e sorted [2, 3, 4, 9] (n = 4): rank q·(n − 1), then linear interpolation, in floating point
    assert (total["e2e_p50_s"], total["e2e_p95_s"], total["e2e_p99_s"]) == (
        3 + (0.5 * 3 - 1) * 1,
        4 + (0.95 * 3 - 2) * 5,
        4 + (0.99 * 3 - 2) * 5,
    )
    assert [(g["group"], g["requests"], g["errors"]) for g in body["groups"]] == [
        ("200", 2, 1),
        ("404", 1, 1),
        ("500", 1, 1),
    ]
    assert [s["request_id"] for s in body["slowest"]] == ["req-000004", "req-000001"]
    assert asyncio.run(run(["search", "http.response.status_code:500", "--format", "json"])) == 0
    assert json.loads(capsys.readouterr().out)["http"]["request"]["id"] == "req-000002"
