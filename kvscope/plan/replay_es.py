"""``--from-log http(s)://…``: the request records from Elasticsearch (the gateway's data stream), paged with
``search_after`` on (``event.start``, ``event.id``) — ES's documented deep-pagination method; the tiebreaker
must be unique, and ``event.id`` is the gateway's own id (a client may reuse its ``x-request-id``, and equal
sort values across a page boundary would be skipped) — reading only the fields the replay needs."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from kvscope.plan.replay import Span

FIELDS = [
    "event.start",
    "event.end",
    "gen_ai.usage.input_tokens",
    "gen_ai.usage.output_tokens",
    "kvscope.ttft_s",
    "event.id",
]
SORT = [{"event.start": {"order": "asc"}}, {"event.id": {"order": "asc"}}]


def page_query(after: list[Any] | None, size: int) -> dict[str, Any]:
    """One page of records that have a start and an end, in (start, event.id) order."""
    body: dict[str, Any] = {
        "size": size,
        "_source": FIELDS,
        "sort": SORT,
        "track_total_hits": False,
        "query": {
            "bool": {"filter": [{"exists": {"field": "event.start"}}, {"exists": {"field": "event.end"}}]}
        },
    }
    if after is not None:
        body["search_after"] = after
    return body


def _get(doc: dict[str, Any], dotted: str) -> Any:
    value: Any = doc
    for part in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def span_of(doc: dict[str, Any]) -> Span | None:
    """The Span of one ``_source`` (nested as the gateway writes it); None when a time does not parse."""
    try:
        start = datetime.fromisoformat(_get(doc, "event.start")).timestamp()
        end = datetime.fromisoformat(_get(doc, "event.end")).timestamp()
    except (TypeError, ValueError):
        return None
    ttft = _get(doc, "kvscope.ttft_s")
    return Span(
        start,
        end,
        int(_get(doc, "gen_ai.usage.input_tokens") or 0),
        int(_get(doc, "gen_ai.usage.output_tokens") or 0),
        None if ttft is None else float(ttft),
    )


async def read_spans_es(client: Any, index: str, page_size: int = 5000) -> tuple[list[Span], dict[str, Any]]:
    """Every generation of ``index`` as Spans (start order) and {"unparsed_lines": records without valid
    times, "not_generations": records without ``gen_ai.usage.input_tokens`` (they held no KV:
    kvscope/plan/replay.py)}."""
    spans: list[Span] = []
    unparsed, not_generations, after = 0, 0, None
    while True:
        body = (await client.search(index=index, body=page_query(after, page_size))).body
        hits = body["hits"]["hits"]
        for hit in hits:
            if _get(hit["_source"], "gen_ai.usage.input_tokens") is None:
                not_generations += 1
                continue
            span = span_of(hit["_source"])
            if span is None:
                unparsed += 1
            else:
                spans.append(span)
        if len(hits) < page_size:
            return spans, {"unparsed_lines": int(unparsed), "not_generations": not_generations}
        after = hits[-1]["sort"]
