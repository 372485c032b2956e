"""``--from-log http://…``: the same synthetic log served by the Elasticsearch double, paged with
search_after."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime

from kvscope.cli.plan import plan_main
from kvscope.cli.plan_log import read_spans
from kvscope.gateway.logs.es_client import EsConnectionConfig, make_client
from kvscope.plan.replay_es import read_spans_es
from kvscope.testing.es_double import EsDouble
from tests.plan.test_replay import staircase_and_burst


def paging_handler(records: list[dict], queries: list[dict]):
    """A _search answer with ES's sort/search_after semantics over ``records`` (sort: start ms, then the sort
    field the query names last)."""

    def key(record: dict, tiebreak: str) -> list:
        start = datetime.fromisoformat(record["event"]["start"]).timestamp()
        section, name = tiebreak.split(".")
        return [int(round(start * 1000)), record[section][name]]

    def handler(index: str, body: dict):
        queries.append(body)
        tiebreak = next(iter(body["sort"][-1]))
        ordered = sorted(records, key=lambda r: key(r, tiebreak))
        after = body.get("search_after")
        page = [r for r in ordered if after is None or key(r, tiebreak) > after][: body["size"]]
        hits = [
            {"_index": index, "_id": r["event"]["id"], "_score": None, "_source": r, "sort": key(r, tiebreak)}
            for r in page
        ]
        return 200, {"took": 1, "timed_out": False, "hits": {"hits": hits}}

    return handler


async def test_es_pages_give_the_same_spans_as_the_jsonl_file(tmp_path):
    records = staircase_and_burst()
    for r in records[10:17]:  # the burst reuses one x-request-id: paging must not skip any of them
        r["http"]["request"]["id"] = "reused-id"
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    queries: list[dict] = []
    async with EsDouble(major=9) as es:
        es.search_handler = paging_handler(records, queries)
        client = make_client(EsConnectionConfig(hosts=(es.url,)))
        try:
            spans, meta = await read_spans_es(client, "kvscope-requests", page_size=5)
        finally:
            await client.close()
    assert meta == {"unparsed_lines": 0, "not_generations": 2}
    assert spans == read_spans(path)[0]
    assert len(queries) == 5  # 20 records in pages of 5: 5, 5, 5, 5, then an empty page
    assert "search_after" not in queries[0]
    assert queries[1]["search_after"] == [
        int(round(datetime.fromisoformat(records[4]["event"]["start"]).timestamp() * 1000)),
        "evt-000004",
    ]
    assert queries[0]["sort"] == [{"event.start": {"order": "asc"}}, {"event.id": {"order": "asc"}}]


async def test_cli_from_es_reports_the_known_peak(model_dir, capsys):
    records = staircase_and_burst()
    async with EsDouble(major=9) as es:
        es.search_handler = paging_handler(records, [])
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
