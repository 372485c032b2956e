"""One bulk round: send a batch of log records with ``async_streaming_bulk`` and sort every record into an
outcome.

Each record becomes ``{"create": {"_index": <data stream>, "_id": <event.id>}}`` + the record, so a
record sent twice (a retry after a timeout, a spool replayed after a crash) is refused by Elasticsearch with
409 ``version_conflict_engine_exception`` instead of being indexed twice; a 409 therefore counts as shipped.
``event.id`` is the gateway's own per-request id (ECS: "unique ID to describe the event"), never the
client's ``x-request-id`` (``http.request.id``): a client reusing a request id would otherwise get its next
record refused with 409, counted as shipped and lost from the audit log without any alert.
(``_id`` uniqueness holds per backing index: a retry that lands after an ILM rollover would be indexed again;
retries happen within seconds to minutes and rollover is daily, so this is documented, not solved.)

Per-item statuses: 2xx and 409 → shipped; 429 and 5xx → retried by the helper with exponential backoff
(``initial_backoff_s·2^k`` up to ``max_backoff_s``, ``max_retries`` times), then handed back for the spool;
401/403/404/408 (security or a missing data stream: a cluster problem, not the record's) → handed back;
other 4xx (``document_parsing_exception``, ``strict_dynamic_mapping_exception`` …) → rejected for good.
A failure of the whole request (connection refused, timeout, 400 from a header mismatch, 401 …) hands
back every record that has no per-item answer yet: the cluster is the problem, never the record.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from elasticsearch import AsyncElasticsearch
from elasticsearch.helpers import async_streaming_bulk

logger = logging.getLogger(__name__)

YIELD_EVERY = 50
"""Records encoded or accounted between two yields to the event loop."""
RETRY_STATUSES = frozenset({429, *range(500, 600)})
"""Per-item statuses retried with backoff inside one bulk round."""
_CLUSTER_STATUSES = frozenset({401, 403, 404, 408})
"""Per-item statuses that say the cluster, not the record, is wrong: keep the record for later."""


@dataclass(frozen=True, slots=True)
class ShipperConfig:
    queue_size: int = 10_000
    """Records held in memory before ``emit`` writes straight to the spool."""
    batch_size: int = 500
    """Records per bulk request."""
    flush_interval_s: float = 1.0
    """A partial batch is sent after this long."""
    max_retries: int = 3
    """Per-item retries (429/5xx) inside one bulk round before the record goes to the spool."""
    initial_backoff_s: float = 0.5
    """First per-item retry wait and first wait before probing an unreachable cluster again."""
    max_backoff_s: float = 30.0
    """Cap of both backoffs (doubling)."""
    max_chunk_bytes: int = 10 << 20
    """Bulk body cap (Elasticsearch's ``http.max_content_length`` default is 100 MB)."""
    close_timeout_s: float = 5.0
    """``aclose`` ships what it can for this long, then spools the rest."""

    def __post_init__(self) -> None:
        if self.queue_size < 1 or self.batch_size < 1 or self.max_chunk_bytes < 1:
            raise ValueError("queue_size, batch_size and max_chunk_bytes must be >= 1")
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if min(self.flush_interval_s, self.initial_backoff_s, self.max_backoff_s, self.close_timeout_s) <= 0:
            raise ValueError("intervals, backoffs and close_timeout_s must be > 0")


@dataclass(slots=True)
class ShipResult:
    shipped: int = 0
    """Records now in Elasticsearch (including ``duplicates``)."""
    duplicates: int = 0
    """409s: the record was already indexed by an earlier attempt."""
    retry: list[dict[str, Any]] = field(default_factory=list)
    """Records to keep for later (spool), in batch order."""
    rejected: list[tuple[dict[str, Any], str]] = field(default_factory=list)
    """(record, reason) refused for good."""
    error: str | None = None
    """Why the round ended early (transport error), if it did."""


def record_id(record: dict[str, Any]) -> str:
    """The document ``_id``: ``event.id`` (the gateway's own id), else a content hash; both are stable across
    retries and replays. Never ``http.request.id``: the client chooses it and may reuse it."""
    rid = (record.get("event") or {}).get("id")
    if isinstance(rid, str) and rid:
        return rid
    return "sha1-" + hashlib.sha1(msgspec.json.encode(record, order="sorted")).hexdigest()


def _classify(status: int) -> str:
    if 200 <= status < 300:
        return "shipped"
    if status == 409:
        return "duplicate"
    if status in RETRY_STATUSES or status in _CLUSTER_STATUSES:
        return "retry"
    return "rejected"


def _reason(info: dict[str, Any]) -> str:
    error = info.get("error")
    if isinstance(error, dict):
        return f"{info.get('status')} {error.get('type')}: {error.get('reason')}"
    return f"{info.get('status')} {error}"


async def ship_batch(
    client: AsyncElasticsearch, index: str, records: Sequence[dict[str, Any]], config: ShipperConfig
) -> ShipResult:
    """Bulk-create ``records`` into ``index`` and account for every one of them (see the module docstring).

    Never raises for Elasticsearch or network failures: they end up in ``ShipResult.retry`` and ``error``.
    """
    by_id: dict[str, deque[dict[str, Any]]] = {}
    for record in records:
        by_id.setdefault(record_id(record), deque()).append(record)
    result, answered = ShipResult(), set()
    try:
        async for n, (_ok, item) in _aenumerate(
            async_streaming_bulk(
                client,
                _actions(records, index),
                chunk_size=config.batch_size,
                max_chunk_bytes=config.max_chunk_bytes,
                raise_on_error=False,
                raise_on_exception=False,
                max_retries=config.max_retries,
                initial_backoff=config.initial_backoff_s,
                max_backoff=config.max_backoff_s,
                retry_on_status=RETRY_STATUSES,
                yield_ok=True,
            )
        ):
            if n % YIELD_EVERY == YIELD_EVERY - 1:
                await asyncio.sleep(0)
            info = next(iter(item.values()))
            queue = by_id.get(str(info.get("_id")))
            if not queue:
                logger.error("bulk answered for an _id it was not sent: %r", info.get("_id"))
                continue
            record = queue.popleft()
            answered.add(id(record))
            _account(result, record, info)
    except Exception as exc:  # noqa: BLE001 - transport errors, product check, anything: keep the records
        result.error = f"{type(exc).__name__}: {exc}"
    kept = {id(r) for r in result.retry}
    result.retry = [r for r in records if id(r) not in answered or id(r) in kept]
    return result


async def _actions(records: Sequence[dict[str, Any]], index: str) -> AsyncIterator[dict[str, Any]]:
    """Bulk ``create`` actions; lets the event loop run every ``YIELD_EVERY`` records while the client
    serializes the body, so one batch never stalls the gateway's requests for more than a millisecond or
    so."""
    for n, record in enumerate(records):
        if n % YIELD_EVERY == YIELD_EVERY - 1:
            await asyncio.sleep(0)
        yield {"_op_type": "create", "_index": index, "_id": record_id(record), "_source": record}


async def _aenumerate(items: AsyncIterable[Any]) -> AsyncIterator[tuple[int, Any]]:
    n = 0
    async for item in items:
        yield n, item
        n += 1


def _account(result: ShipResult, record: dict[str, Any], info: dict[str, Any]) -> None:
    whole_request_failed = "exception" in info  # the helper's per-item form of an ApiError on _bulk itself
    outcome = "retry" if whole_request_failed else _classify(int(info.get("status", 500)))
    if outcome in ("shipped", "duplicate"):
        result.shipped += 1
        result.duplicates += outcome == "duplicate"
    elif outcome == "retry":
        result.retry.append(record)
        if result.error is None:
            result.error = _reason(info)
    else:
        result.rejected.append((record, _reason(info)))
