"""``--from-log http(s)://…``: the request records from Elasticsearch (the gateway's data stream), read in
pages with ``search_after`` inside a point in time (PIT) — Elasticsearch's documented deep-pagination
method ("Paginate search results"): the PIT keeps the data stream as it was when the read began, so records
the gateway writes meanwhile (or a rollover) cannot shift the pages, and every search of it sorts with an
implicit ``_shard_doc`` tiebreaker. The sort is (``event.start``, ``event.id``, ``trace.id``): ``event.id``
is the gateway's own id, unique per record (an engine's line has none: its trace id decides), so the order
is the JSONL reader's (kvscope/cli/plan_log.py) too. Only
the fields the replay needs are read. The spans are returned in start order (their exact start, which
Elasticsearch's ``date`` sorts by the millisecond), ties in ``event.id`` order, as the JSONL reader does."""

from __future__ import annotations

import contextlib
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
    "trace.id",
]
SORT = [{"event.start": {"order": "asc"}}, {"event.id": {"order": "asc"}}, {"trace.id": {"order": "asc"}}]


KEEP_ALIVE = "2m"
"""How long the PIT lives after each page (it only has to outlast the time to ask for the next one)."""


def page_query(after: list[Any] | None, size: int, pit: str | None = None) -> dict[str, Any]:
    """One page of records that have a start and an end, in (start, event.id, trace.id) order; within the
    point in time ``pit`` when given (the request then names no index)."""
    body: dict[str, Any] = {
        "size": size,
        "_source": FIELDS,
        "sort": SORT,
        "track_total_hits": False,
        "query": {
            "bool": {"filter": [{"exists": {"field": "event.start"}}, {"exists": {"field": "event.end"}}]}
        },
    }
    if pit is not None:
        body["pit"] = {"id": pit, "keep_alive": KEEP_ALIVE}
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
    kvscope/plan/replay.py)}. Read within a point in time, closed at the end (a PIT that cannot be closed
    expires :data:`KEEP_ALIVE` later on its own). Raises the client's ApiError/TransportError."""
    from elastic_transport import TransportError
    from elasticsearch import ApiError

    spans: list[Span] = []
    unparsed, not_generations, after = 0, 0, None
    pit = str((await client.open_point_in_time(index=index, keep_alive=KEEP_ALIVE)).body["id"])
    try:
        while True:
            body = (await client.search(body=page_query(after, page_size, pit))).body
            pit = str(body.get("pit_id", pit))  # the id may change between searches: use the latest
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
                spans.sort(key=lambda s: s.start_s)  # stable: ties stay in (event.id, trace.id) order
                return spans, {"unparsed_lines": int(unparsed), "not_generations": not_generations}
            after = hits[-1]["sort"]
    finally:
        with contextlib.suppress(ApiError, TransportError):
            await client.close_point_in_time(id=pit)
