"""``--from-log http://…``: the same synthetic log shipped to the Elasticsearch double (which evaluates the
queries: kvscope/testing/es_double_search.py), read in pages with search_after inside a point in time."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime

from kvscope.cli.plan import plan_main
from kvscope.cli.plan_log import read_spans
from kvscope.gateway.logs.es_client import EsConnectionConfig, make_client
from kvscope.gateway.logs.es_setup import EsIndexConfig
from kvscope.plan.replay_es import read_spans_es
from kvscope.testing.es_double import EsDouble
from kvscope.testing.es_load import load_records
from tests.plan.test_replay import staircase_and_burst


async def shipped(es: EsDouble, records: list[dict]) -> None:
    client = make_client(EsConnectionConfig(hosts=(es.url,)))
    try:
        await load_records(client, EsIndexConfig(dynamic="strict"), records)
    finally:
        await client.close()


def searches(es: EsDouble) -> list[dict]:
    return [r.json() for r in es.requests if r.path.endswith("/_search")]


async def test_es_pages_give_the_same_spans_as_the_jsonl_file(tmp_path):
    records = staircase_and_burst()
    for r in records[10:17]:  # the burst reuses one x-request-id: paging must not skip any of them
        r["http"]["request"]["id"] = "reused-id"
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    async with EsDouble(major=9) as es:
        await shipped(es, records)
        client = make_client(EsConnectionConfig(hosts=(es.url,)))
        try:
            spans, meta = await read_spans_es(client, "kvscope-requests", page_size=5)
        finally:
            await client.close()
        queries = searches(es)
        pit_requests = [(r.method, r.path) for r in es.requests if "_pit" in r.path]
        assert es.pits.open == {}  # closed at the end
    assert meta == {"unparsed_lines": 0, "not_generations": 2}
    assert spans == read_spans(path)[0]
    assert len(queries) == 5  # 20 records in pages of 5: 5, 5, 5, 5, then an empty page
    assert pit_requests == [("POST", "/kvscope-requests/_pit"), ("DELETE", "/_pit")]
    assert "search_after" not in queries[0] and all("pit" in q for q in queries)
    # the 5th record in (start, event.id) order: the staircase's 0-4 start first; the PIT adds _shard_doc
    assert queries[1]["search_after"][:2] == [
        int(round(datetime.fromisoformat(records[4]["event"]["start"]).timestamp() * 1000)),
        "evt-000004",
    ]
    assert queries[0]["sort"] == [
        {"event.start": {"order": "asc"}},
        {"event.id": {"order": "asc"}},
        {"trace.id": {"order": "asc"}},
    ]


async def test_cli_from_es_reports_the_known_peak(model_dir, capsys):
    async with EsDouble(major=9) as es:
        await shipped(es, staircase_and_burst())
        code = await asyncio.to_thread(
            plan_main,
            [
                "--model",
                str(model_dir),
                "--device",
                "h100",
                "--max-model-len",
                "1024",
                "--concurrency",
                "6",
                "--from-log",
                es.url,
                "--format",
                "json",
            ],
        )
    assert code == 0
    log = json.loads(capsys.readouterr().out)["log"]
    assert (log["requests"], log["peak_concurrency"], log["peak_kv_blocks"], log["queued_arrivals"]) == (
        18,
        7,
        28,
        1,
    )


async def test_cli_unreachable_es_is_exit_1(model_dir, capsys):
    async with EsDouble(major=9) as es:
        url = es.url
    code = await asyncio.to_thread(
        plan_main, ["--model", str(model_dir), "--device", "h100", "--from-log", url]
    )
    assert code == 1
    assert capsys.readouterr().err.startswith(f"kvscope plan: error: cannot read kvscope-requests at {url}: ")
