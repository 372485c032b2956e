"""``kvscope logs why ID`` takes every id a user holds (issue 45): the response id an OpenAI SDK shows
(``chatcmpl-…``, ``gen_ai.response.id``), the x-request-id, the trace id, the record's event id, or a unique
prefix of any of them; an ambiguous prefix lists the candidates. The JSONL back end runs for real; the
Elasticsearch query is checked as a body."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from kvscope.gateway.analytics.cli import logs_main
from kvscope.gateway.analytics.commands import one_request
from kvscope.gateway.analytics.es_logs import id_query
from kvscope.testing.records import engine_stats, make_record

RESPONSE_IDS = {7: "chatcmpl-7f3a91c2", 8: "chatcmpl-7f3b0000", 9: "chatcmpl-a1b2c3d4"}


def _records() -> list[dict]:
    """Three requests, each with the gateway's line (x-request-id, response id, trace id, event id) and, for
    request 9, the engine's line too (same trace id and response id, no event id, no gateway phases)."""
    out = []
    for i, response_id in RESPONSE_IDS.items():
        record = make_record(i, engine=engine_stats(0.01 * i, 0.02, 0.3))
        record["http"]["request"]["id"] = f"{i:02d}{'e' * 30}"
        record["gen_ai"]["response"]["id"] = response_id
        out.append(record)
    engine_line = json.loads(json.dumps(out[-1]))
    del (
        engine_line["event"]["id"],
        engine_line["kvscope"]["gateway"],
        engine_line["kvscope"]["gateway_overhead_s"],
    )
    out.append(engine_line)
    return out


@pytest.fixture
def log(tmp_path: Path) -> Path:
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _records()))
    return path


def why(log: Path, wanted: str) -> tuple[int, dict | None, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = logs_main(["why", wanted, "--source", str(log), "--format", "json"], env={})
    return code, json.loads(out.getvalue()) if code == 0 else None, err.getvalue()


@pytest.mark.parametrize(
    "wanted",
    [
        "chatcmpl-a1b2c3d4",  # the response id the SDK shows
        "chatcmpl-a1",  # a unique prefix of it
        "09eeeeeeeeeeeeeeeeeeeeeeeeeeeeee",  # the x-request-id
        "09ee",
        f"{9:032x}",  # the trace id
        "evt-000009",  # the gateway record's event id
    ],
)
def test_every_id_of_the_request_finds_the_gateways_record(log: Path, wanted: str) -> None:
    code, answer, err = why(log, wanted)
    assert (code, err) == (0, "")
    assert answer is not None
    assert answer["request_id"] == "09eeeeeeeeeeeeeeeeeeeeeeeeeeeeee"
    assert "gateway" in answer["text"]  # the gateway's line, not the engine's (same trace id)


def test_an_ambiguous_prefix_lists_the_candidates(log: Path) -> None:
    code, _, err = why(log, "chatcmpl-7f3")
    assert code == 1
    assert err == (
        "kvscope logs why: 'chatcmpl-7f3' is a prefix of the ids of 2 requests; give more characters, or one "
        "of these ids:\n"
        "  chatcmpl-7f3b0000  (response id, 2025-01-01 12:00:00, smollm2-135m)\n"
        "  chatcmpl-7f3a91c2  (response id, 2025-01-01 12:00:00, smollm2-135m)\n"
    )


def test_an_exact_id_wins_over_longer_ids_it_prefixes(log: Path) -> None:
    records = _records()
    records[0]["http"]["request"]["id"] = "chatcmpl-7f3"  # a client whose x-request-id is another's prefix
    chosen = one_request(records, "chatcmpl-7f3")
    assert [r["http"]["request"]["id"] for r in chosen] == ["chatcmpl-7f3"]


def test_no_match_names_the_ids_looked_at(log: Path) -> None:
    code, _, err = why(log, "chatcmpl-zzz")
    assert code == 1
    assert err == (
        "kvscope logs why: no request-log record whose response id, request id, trace id or event id is or "
        "starts with 'chatcmpl-zzz'\n"
    )


def test_quotes_in_an_id_are_data_not_sql(log: Path) -> None:
    code, _, err = why(log, "x' OR 1=1 --")
    assert code == 1 and "no request-log record" in err


def test_the_elasticsearch_query_matches_each_id_exactly_or_by_prefix() -> None:
    body = id_query("chatcmpl-a1", None, 50)
    fields = ["gen_ai.response.id", "http.request.id", "trace.id", "event.id"]
    exact = {"bool": {"should": [{"term": {f: "chatcmpl-a1"}} for f in fields]}}
    prefix = {"bool": {"should": [{"prefix": {f: "chatcmpl-a1"}} for f in fields]}}
    assert body == {  # exact ids score 2, prefixes 1 (constant_score: no BM25), then newest first
        "size": 50,
        "query": {
            "bool": {
                "should": [
                    {"constant_score": {"filter": exact, "boost": 1.0}},
                    {"constant_score": {"filter": prefix, "boost": 1.0}},
                ],
                "minimum_should_match": 1,
                "filter": [],
            }
        },
        "sort": [
            {"_score": {"order": "desc"}},
            {"@timestamp": {"order": "desc"}},
            {"event.id": {"order": "asc"}},
            {"trace.id": {"order": "asc"}},
        ],
    }


def search(log: Path, query: str) -> tuple[int, list[dict] | None, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = logs_main(["search", query, "--source", str(log), "--format", "json"], env={})
    records = [json.loads(line) for line in out.getvalue().splitlines()] if code == 0 else None
    return code, records, err.getvalue()


@pytest.mark.parametrize(
    ("query", "response_ids"),
    [
        ("chatcmpl-7f3", ["chatcmpl-7f3b0000", "chatcmpl-7f3a91c2"]),  # an id prefix: newest first
        ("chatcmpl-7f3a91c2", ["chatcmpl-7f3a91c2"]),
        ("08", ["chatcmpl-7f3b0000"]),  # a numeric x-request-id prefix, not the SQL constant 8 (true)
        ("12345", []),  # matches no id: nothing, never every record
        ("gen_ai.response.id = 'chatcmpl-7f3a91c2'", ["chatcmpl-7f3a91c2"]),  # still a SQL condition
    ],
)
def test_search_takes_an_id_or_prefix_alone(log: Path, query: str, response_ids: list[str]) -> None:
    code, records, err = search(log, query)
    assert (code, err) == (0, "")
    assert [r["gen_ai"]["response"]["id"] for r in records or []] == response_ids


def test_a_condition_that_does_not_parse_says_what_a_search_takes(log: Path) -> None:
    code, _, err = search(log, "chatcmpl-7f3 AND")
    assert code == 1
    assert err.startswith("kvscope logs search: Parser Error: syntax error")
    assert 'e.g. "kvscope.e2e_s > 5"' in err and "an id or id prefix alone lists that request" in err
