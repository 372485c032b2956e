"""The Elasticsearch double's ``_search`` against what the Elasticsearch reference documents, case by case,
where the agreement tests (tests/gateway/logs/test_es_agreement.py) cannot reach: the DuckDB back end has no
sort stand-ins, points in time, ``minimum_should_match``, date rounding or refusals to compare with."""

from __future__ import annotations

from typing import Any

import pytest

from kvscope.gateway.logs.es_client import EsConnectionConfig, make_client
from kvscope.gateway.logs.es_setup import EsIndexConfig
from kvscope.testing.es_double import EsDouble
from kvscope.testing.es_double_docs import DataStream
from kvscope.testing.es_double_fields import LONG_MAX, LONG_MIN, SearchError, Unsupported
from kvscope.testing.es_double_query_string import parse_query_string
from kvscope.testing.es_double_search import resolve, search
from kvscope.testing.es_load import load_records
from kvscope.testing.records import make_record

MAPPING = {
    "properties": {
        "@timestamp": {"type": "date"},
        "name": {"type": "keyword", "ignore_above": 8},
        "n": {"type": "long"},
        "x": {"type": "double"},
        "ok": {"type": "boolean"},
        "tags": {"type": "keyword"},
        "obj": {"properties": {"a": {"type": "long"}}},
        "blob": {"type": "object", "enabled": False},
        "msg": {"type": "match_only_text"},
    }
}


def stream(*docs: dict[str, Any]) -> dict[str, DataStream]:
    ds = DataStream.create(
        "s", "t", [{"mappings": MAPPING, "settings": {"index.mapping.ignore_malformed": True}}]
    )
    for i, doc in enumerate(docs):
        ds.write_index.docs[f"d{i}"] = {"@timestamp": "2025-01-01T12:00:00.000Z", **doc}
    return {"s": ds}


def ids(body: dict[str, Any], *docs: dict[str, Any]) -> list[str]:
    return [h["_id"] for h in search(resolve(stream(*docs), "s"), {"size": 100, **body})["hits"]["hits"]]


def matching(query: dict[str, Any], *docs: dict[str, Any]) -> list[str]:
    return ids({"query": query, "sort": ["_doc"]}, *docs)


def test_term_reads_the_value_as_the_fields_type():
    """Term query page: keyword terms are exact and case-sensitive unless ``case_insensitive``; a number
    matches a numeric field's value whatever its JSON type; a keyword holds numbers as their text."""
    docs = ({"name": "Alice", "n": 200}, {"name": "alice", "n": "200"}, {"name": 200, "n": 201})
    assert matching({"term": {"name": "alice"}}, *docs) == ["d1"]
    assert matching({"term": {"name": {"value": "alice", "case_insensitive": True}}}, *docs) == ["d0", "d1"]
    assert matching({"term": {"n": "200"}}, *docs) == ["d0", "d1"]
    assert matching({"term": {"name": "200"}}, *docs) == ["d2"]
    assert matching({"terms": {"n": [201, 7]}}, *docs) == ["d2"]
    assert matching({"term": {"unmapped": "x"}}, *docs) == []  # not an error: nothing matches
    with pytest.raises(SearchError, match="failed to create query"):
        matching({"term": {"n": "abc"}}, *docs)


def test_ignore_above_ignore_malformed_and_disabled_objects_are_not_indexed():
    """ignore_above, ignore_malformed and enabled pages: the document stays (and shows in ``_source``), the
    value matches nothing and counts as missing."""
    docs = ({"name": "longer-than-8", "n": "abc", "blob": {"k": 1}}, {"name": "short", "n": 3})
    assert matching({"exists": {"field": "name"}}, *docs) == ["d1"]
    assert matching({"exists": {"field": "n"}}, *docs) == ["d1"]
    assert matching({"exists": {"field": "blob"}}, *docs) == []
    assert ids({"query": {"match_all": {}}}, *docs) == ["d0", "d1"]


def test_exists_needs_an_indexed_value():
    """Exists query page: null, [] and a missing field do not exist; an object exists through its fields."""
    docs = ({"tags": None}, {"tags": []}, {"tags": [None, "a"]}, {"obj": {"a": 1}}, {"obj": {}})
    assert matching({"exists": {"field": "tags"}}, *docs) == ["d2"]
    assert matching({"exists": {"field": "obj"}}, *docs) == ["d3"]


def test_date_ranges_fill_missing_parts_and_take_a_format():
    """Range query page, "Missing date components": ``gte``/``lt`` fill the left-out parts with their
    minimum; ``gt``/``lte`` with hour 23, minute 59, second 59, fraction .999999999 (month and day 01)."""
    docs = tuple(
        {"@timestamp": t}
        for t in ("2025-01-01T00:00:00.000Z", "2025-01-01T23:59:59.999Z", "2025-01-02T00:00:00.000Z")
    )
    assert matching({"range": {"@timestamp": {"gte": "2025-01-01"}}}, *docs) == ["d0", "d1", "d2"]
    assert matching({"range": {"@timestamp": {"lte": "2025-01-01"}}}, *docs) == ["d0", "d1"]
    assert matching({"range": {"@timestamp": {"gt": "2025-01-01"}}}, *docs) == ["d2"]
    assert matching({"range": {"@timestamp": {"lt": "2025-01-01T23:59:59.999Z"}}}, *docs) == ["d0"]
    assert matching({"term": {"@timestamp": "2025-01-01"}}, *docs) == ["d0", "d1"]  # the whole day
    ms = {"gte": 1735776000000, "format": "epoch_millis"}  # 2025-01-02T00:00:00Z
    assert matching({"range": {"@timestamp": ms}}, *docs) == ["d2"]
    assert matching({"range": {"@timestamp": {"gte": "2025-01-01T01:00:00+01:00"}}}, *docs) == [
        "d0",
        "d1",
        "d2",
    ]
    with pytest.raises(Unsupported, match="date math"):
        matching({"range": {"@timestamp": {"gte": "now-1h"}}}, *docs)


def test_bool_minimum_should_match():
    """Bool query and minimum_should_match pages: default 1 with only ``should`` clauses, 0 beside a
    ``must``/``filter``; a negative number leaves that many out; a percentage rounds down."""
    docs = ({"n": 1}, {"n": 2}, {"n": 3, "x": 1.0}, {"x": 1.0})
    should = [{"term": {"n": 1}}, {"term": {"n": 2}}, {"exists": {"field": "x"}}]
    assert matching({"bool": {"should": should}}, *docs) == ["d0", "d1", "d2", "d3"]
    assert matching({"bool": {"should": should, "filter": [{"exists": {"field": "n"}}]}}, *docs) == [
        "d0",
        "d1",
        "d2",
    ]
    both = [{"exists": {"field": "n"}}, {"exists": {"field": "x"}}]
    assert matching({"bool": {"should": both, "minimum_should_match": -1}}, *docs) == ["d0", "d1", "d2", "d3"]
    assert matching({"bool": {"should": both, "minimum_should_match": "100%"}}, *docs) == ["d2"]
    assert matching({"bool": {"should": both, "minimum_should_match": "99%"}}, *docs) == [
        "d0",
        "d1",
        "d2",
        "d3",
    ]
    assert matching({"bool": {"must_not": [{"term": {"n": 2}}]}}, *docs) == ["d0", "d2", "d3"]


def test_sort_missing_values_and_several_values():
    """Sort page: several values sort by their minimum ascending and maximum descending; a document without
    the field is last (``missing: _last``) and shows Lucene's stand-in: Long.MAX_VALUE/MIN_VALUE for a long,
    ±Infinity for a double, null for a keyword (elastic/elasticsearch#77720)."""
    docs = ({"n": [5, 1], "x": 2.0, "name": "b"}, {"n": 3}, {"x": 1.0, "name": "a"})
    hits = search(resolve(stream(*docs), "s"), {"sort": [{"n": "asc"}]})["hits"]["hits"]
    assert [(h["_id"], h["sort"]) for h in hits] == [("d0", [1]), ("d1", [3]), ("d2", [LONG_MAX])]
    hits = search(resolve(stream(*docs), "s"), {"sort": [{"n": "desc"}]})["hits"]["hits"]
    assert [(h["_id"], h["sort"]) for h in hits] == [("d0", [5]), ("d1", [3]), ("d2", [LONG_MIN])]
    hits = search(resolve(stream(*docs), "s"), {"sort": [{"x": {"order": "desc", "missing": "_first"}}]})
    assert [(h["_id"], h["sort"]) for h in hits["hits"]["hits"]] == [
        ("d1", ["Infinity"]),
        ("d0", [2.0]),
        ("d2", [1.0]),
    ]
    hits = search(resolve(stream(*docs), "s"), {"sort": ["name"]})["hits"]
    assert [(h["_id"], h["sort"], h["_score"]) for h in hits["hits"]] == [
        ("d2", ["a"], None),
        ("d0", ["b"], None),
        ("d1", [None], None),
    ]
    assert hits["max_score"] is None
    with pytest.raises(SearchError, match="No mapping found for \\[nope\\]"):
        search(resolve(stream(*docs), "s"), {"sort": ["nope"]})
    assert ids({"sort": [{"nope": {"unmapped_type": "long"}}]}, *docs) == ["d0", "d1", "d2"]
    with pytest.raises(SearchError, match="Fielddata is disabled"):
        search(resolve(stream(*docs), "s"), {"sort": ["msg"]})


def test_search_after_pages_through_ties_and_missing_values_once():
    docs = tuple({"n": n, "name": name} for n, name in [(2, "b"), (1, "z"), (2, "a"), (None, "c"), (1, "y")])
    sort = [{"n": "asc"}, {"name": "asc"}]
    seen, after = [], None
    while True:
        body: dict[str, Any] = {"size": 2, "sort": sort, **({"search_after": after} if after else {})}
        hits = search(resolve(stream(*docs), "s"), body)["hits"]["hits"]
        seen += [h["_id"] for h in hits]
        if len(hits) < 2:
            break
        after = hits[-1]["sort"]
    assert seen == ["d4", "d1", "d2", "d0", "d3"]
    with pytest.raises(SearchError, match="search_after has 1 value"):
        search(resolve(stream(*docs), "s"), {"sort": sort, "search_after": [1]})


def test_total_hits_size_from_and_source_filtering():
    """Search API page: ``track_total_hits`` (a number: counted up to it, then ``gte``; false: no total),
    ``from``/``size`` and ``max_result_window``; "Retrieve selected fields": ``_source`` paths, wildcards,
    includes/excludes."""
    docs = tuple({"n": i, "obj": {"a": i}, "name": f"n{i}"} for i in range(5))
    s = stream(*docs)
    out = search(resolve(s, "s"), {"track_total_hits": 3, "size": 2, "from": 1, "sort": ["n"]})
    assert out["hits"]["total"] == {"value": 3, "relation": "gte"}
    assert [h["_id"] for h in out["hits"]["hits"]] == ["d1", "d2"]
    assert "total" not in search(resolve(s, "s"), {"track_total_hits": False})["hits"]
    assert search(resolve(s, "s"), {})["hits"]["total"] == {"value": 5, "relation": "eq"}
    hit = search(resolve(s, "s"), {"size": 1, "sort": ["n"], "_source": ["obj", "na*"]})["hits"]["hits"][0]
    assert hit["_source"] == {"obj": {"a": 0}, "name": "n0"}
    spec = {"includes": ["*"], "excludes": ["obj.a", "@timestamp"]}
    hit = search(resolve(s, "s"), {"size": 1, "sort": ["n"], "_source": spec})["hits"]["hits"][0]
    assert hit["_source"] == {"n": 0, "obj": {}, "name": "n0"}
    assert "_source" not in search(resolve(s, "s"), {"size": 1, "_source": False})["hits"]["hits"][0]
    with pytest.raises(SearchError, match="Result window is too large"):
        search(resolve(s, "s"), {"from": 9_999, "size": 2})


def test_scores_are_modelled_for_constant_score_queries_only():
    """Without a sort, hits are by score: match_all and constant_score score their boost, a bool sums its
    scoring clauses; a term's BM25 score is refused, not guessed."""
    docs = ({"n": 1, "name": "a"}, {"n": 2, "name": "a"}, {"n": 2})
    query = {
        "bool": {
            "should": [
                {"constant_score": {"filter": {"term": {"n": 2}}, "boost": 2.0}},
                {"constant_score": {"filter": {"term": {"name": "a"}}}},
            ]
        }
    }
    hits = search(resolve(stream(*docs), "s"), {"query": query})["hits"]
    assert [(h["_id"], h["_score"]) for h in hits["hits"]] == [("d1", 3.0), ("d2", 2.0), ("d0", 1.0)]
    assert hits["max_score"] == 3.0
    with pytest.raises(Unsupported, match="BM25"):
        search(resolve(stream(*docs), "s"), {"query": {"term": {"n": 2}}})
    assert ids({"query": {"term": {"n": 2}}, "sort": ["_doc"]}, *docs) == ["d1", "d2"]  # no score needed


def aggs(spec: dict[str, Any], *docs: dict[str, Any]) -> dict[str, Any]:
    return search(resolve(stream(*docs), "s"), {"size": 0, "aggs": spec})["aggregations"]


def test_metric_aggregations():
    """Percentiles (module doc of kvscope/testing/es_double_aggs.py: Elasticsearch's ``Dist.quantile`` below
    2,000 values), sum (0 over nothing), avg/min/max (null over nothing), keyed and unkeyed."""
    docs = tuple({"x": x} for x in (4.0, 1.0, 3.0, 2.0)) + ({"n": 1},)
    out = aggs(
        {
            "p": {"percentiles": {"field": "x", "percents": [0, 50, 99, 100]}},
            "q": {"percentiles": {"field": "x", "percents": [50], "keyed": False}},
            "e": {"percentiles": {"field": "missing_everywhere", "percents": [50]}},
            "s": {"sum": {"field": "x"}},
            "a": {"avg": {"field": "x"}},
            "none": {"avg": {"field": "obj.a"}},
            "nosum": {"sum": {"field": "obj.a"}},
            "lo": {"min": {"field": "@timestamp"}},
        },
        *docs,
    )
    assert out["p"] == {"values": {"0.0": 1.0, "50.0": 2.5, "99.0": 3 + (0.99 * 3 - 2), "100.0": 4.0}}
    assert out["q"] == {"values": [{"key": 50.0, "value": 2.5}]}
    assert out["e"] == {"values": {"50.0": None}}
    assert (out["s"], out["a"], out["none"], out["nosum"]) == (
        {"value": 10.0},
        {"value": 2.5},
        {"value": None},
        {"value": 0.0},
    )
    assert out["lo"] == {"value": 1735732800000.0, "value_as_string": "2025-01-01T12:00:00.000Z"}


def test_terms_aggregation():
    """Terms aggregation page: count descending, ties by key ascending; a document once per distinct value;
    ``missing`` buckets the documents without one; ``size`` and ``sum_other_doc_count``; numeric keys."""
    docs = (
        {"tags": ["b", "b", "a"], "n": 2},
        {"tags": "c", "n": 1},
        {"tags": ["c"], "n": 2},
        {"tags": [], "n": 2},
        {"n": 1},
    )
    out = aggs(
        {
            "t": {"terms": {"field": "tags", "size": 3, "missing": "(none)"}},
            "n": {"terms": {"field": "n"}, "aggs": {"c": {"value_count": {"field": "tags"}}}},
        },
        *docs,
    )
    assert out["t"]["buckets"] == [
        {"key": "(none)", "doc_count": 2},
        {"key": "c", "doc_count": 2},
        {"key": "a", "doc_count": 1},
    ]
    assert out["t"]["sum_other_doc_count"] == 1
    assert out["n"]["buckets"] == [
        {"key": 2, "doc_count": 3, "c": {"value": 4}},
        {"key": 1, "doc_count": 2, "c": {"value": 1}},
    ]
    with pytest.raises(SearchError):
        aggs({"bad": {"terms": {"field": "n", "missing": "(none)"}}}, *docs)


def test_histograms():
    """Date histogram (``fixed_interval``, buckets from the epoch, empty ones filled between the first and
    the last with ``min_doc_count`` 0) and histogram (key = floor((v − offset) / interval) · interval +
    offset)."""
    docs = tuple(
        {"@timestamp": t, "x": x}
        for t, x in (("2025-01-01T12:00:01.000Z", 0.5), ("2025-01-01T12:00:16.000Z", 2.9))
    )
    out = aggs(
        {
            "t": {"date_histogram": {"field": "@timestamp", "fixed_interval": "7s"}},
            "h": {"histogram": {"field": "x", "interval": 1.0, "offset": 0.25, "min_doc_count": 1}},
        },
        *docs,
    )
    # 12:00:01 is 1735732801 s: 1735732801 // 7 * 7 = 1735732796 (11:59:56), then 12:00:03, 12:00:10
    assert [(b["key_as_string"], b["doc_count"]) for b in out["t"]["buckets"]] == [
        ("2025-01-01T11:59:56.000Z", 1),
        ("2025-01-01T12:00:03.000Z", 0),
        ("2025-01-01T12:00:10.000Z", 1),
    ]
    assert out["h"]["buckets"] == [{"key": 0.25, "doc_count": 1}, {"key": 2.25, "doc_count": 1}]


def test_query_string_subset():
    """Query string syntax page; what Lucene's classic parser does unexpectedly is refused."""
    assert parse_query_string('a.b:>5 AND c:"x y"') == {
        "bool": {"must": [{"range": {"a.b": {"gt": "5"}}}, {"term": {"c": "x y"}}], "must_not": []}
    }
    assert parse_query_string("n:[1 TO *} OR _exists_:x OR m:ab*") == {
        "bool": {
            "should": [
                {"range": {"n": {"gte": "1"}}},
                {"exists": {"field": "x"}},
                {"wildcard": {"m": {"value": "ab*"}}},
            ],
            "minimum_should_match": 1,
        }
    }
    assert parse_query_string("NOT n:1") == {
        "bool": {"must": [{"match_all": {}}], "must_not": [{"term": {"n": "1"}}]}
    }
    for text in ("a:1 AND b:2 OR c:3", "a:1 OR NOT b:2", "a:1 b:2", "alone", "a:x~2", "-a:1"):
        with pytest.raises(Unsupported):
            parse_query_string(text)
    docs = ({"name": "smollm2", "n": 5}, {"name": "qwen3", "n": 7}, {"n": 9})
    q = {"query_string": {"query": "(name:smoll* OR n:>8) AND NOT n:7"}}
    assert matching(q, *docs) == ["d0", "d2"]


async def test_points_in_time_and_errors_over_http():
    """Point in time API: a search within a PIT does not see documents written after it opened, names no
    index, answers ``pit_id`` and sorts with an implicit ``_shard_doc`` tiebreaker; ``DELETE /_pit`` frees it.
    An index that does not exist is 404 ``index_not_found_exception``."""
    async with EsDouble() as es:
        client = make_client(EsConnectionConfig(hosts=(es.url,)))
        try:
            await load_records(client, EsIndexConfig(dynamic="strict"), [make_record(i) for i in range(3)])
            pit = (await client.open_point_in_time(index="kvscope-requests", keep_alive="1m")).body["id"]
            await load_records(client, EsIndexConfig(dynamic="strict"), [make_record(3)])
            body = {"pit": {"id": pit, "keep_alive": "1m"}, "sort": [{"event.id": "asc"}]}
            out = (await client.search(body=body)).body
            assert out["pit_id"] == pit
            assert [h["sort"] for h in out["hits"]["hits"]] == [
                ["evt-000000", 0],
                ["evt-000001", 1],
                ["evt-000002", 2],
            ]
            now = (await client.search(index="kvscope-requests", body={"size": 0})).body
            assert now["hits"]["total"]["value"] == 4
            assert (await client.close_point_in_time(id=pit)).body == {"succeeded": True, "num_freed": 1}
            with pytest.raises(Exception, match="index_not_found_exception"):
                await client.search(index="nope", body={})
            with pytest.raises(Exception, match="es_double_unsupported"):
                await client.search(index="kvscope-requests", body={"query": {"match": {"message": "x"}}})
        finally:
            await client.close()
