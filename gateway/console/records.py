"""The console's request list: the newest request-log records, the very dicts the log writer hands every sink
(gateway/observe.py ``finish`` → each :class:`~kvscope.gateway.logs.sink.LogSink`'s ``emit``), kept in a
bounded ring by :class:`RecordRing`, itself one of the gateway's sinks; and what the console shows of one
record: its row (:func:`summary`), the filters of the list (:class:`RecordFilter`) and its
queue/prefill/decode waterfall (:func:`waterfall`).

The ring ships nothing and counts nothing in ``kvscope_gateway_log_records_total``: it is an in-memory view of
the newest records, and letting the oldest go is its purpose, not a loss. It also sums, as records arrive,
what only the records say (our engine's speculative draft and accepted tokens, preemptions per replica), for
the overview's series (gateway/console/series.py ``Counters``).

Prompts and completions are in a record only when ``logs.log_content`` is on (gateway/logs/record.py); a row
never carries them, so the list never shows anyone's prompt, and a request's page shows them only when
content logging put them in its record.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from kvscope.gateway.logs.sink import LogRecord


def dotted(record: Any, *path: str) -> Any:
    """``record[path[0]][path[1]]…``, None where a level is missing or not a mapping."""
    node = record
    for part in path:
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


class RecordRing:
    """A :class:`~kvscope.gateway.logs.sink.LogSink` keeping the newest ``capacity`` records in memory."""

    name = "console"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.records: deque[LogRecord] = deque(maxlen=capacity)
        self.appended = 0
        """Records kept so far (a version: the request list's cached answers are stale once it moves)."""
        self.spec_draft_tokens = 0.0
        self.spec_accepted_tokens = 0.0
        self.preemptions: dict[str, float] = {}
        """Replica label → preemptions of the requests it finished (``kvscope.engine.num_preemptions``)."""

    async def start(self) -> None:
        """Nothing to open."""

    def emit(self, record: LogRecord) -> None:
        """Keep ``record`` (the oldest goes when full) and add its speculative and preemption counts. Never
        raises: a record without those fields adds nothing."""
        self.records.append(record)
        self.appended += 1
        engine = dotted(record, "kvscope", "engine")
        if not isinstance(engine, dict):
            return
        self.spec_draft_tokens += _number(engine.get("spec_draft_tokens"))
        self.spec_accepted_tokens += _number(engine.get("spec_accepted_tokens"))
        preempted = _number(engine.get("num_preemptions"))
        if preempted:
            replica = str(dotted(record, "kvscope", "routing", "replica") or "?")
            self.preemptions[replica] = self.preemptions.get(replica, 0.0) + preempted

    async def aclose(self) -> None:
        """Nothing to flush."""

    def find(self, event_id: str) -> LogRecord | None:
        """The kept record whose ``event.id`` is ``event_id`` (None: never seen, or gone from the ring)."""
        for record in reversed(self.records):
            if dotted(record, "event", "id") == event_id:
                return record
        return None


@dataclass(frozen=True, slots=True)
class RecordFilter:
    """The request list's filters; None: any. ``status`` is a code (``429``), a class (``5xx``) or ``error``
    (every status from 400 up, and 200s whose stream broke); ``slower_than_s`` keeps requests whose
    end-to-end time at the gateway (``kvscope.e2e_s``) is at least that."""

    model: str | None = None
    key: str | None = None
    status: str | None = None
    finish_reason: str | None = None
    slower_than_s: float | None = None

    def __post_init__(self) -> None:
        status = self.status
        if status is not None and not (
            status == "error"
            or (len(status) == 3 and status.isdigit())
            or (len(status) == 3 and status[0] in "12345" and status[1:] == "xx")
        ):
            raise ValueError(f"status must be a code (429), a class (5xx) or 'error', got {status!r}")
        if self.slower_than_s is not None and not self.slower_than_s >= 0:
            raise ValueError(f"slower than must be a number of seconds >= 0, got {self.slower_than_s}")

    def matches(self, record: LogRecord) -> bool:
        """Whether ``record`` passes every filter that is set."""
        if self.model is not None and dotted(record, "gen_ai", "request", "model") != self.model:
            return False
        if self.key is not None and dotted(record, "user", "id") != self.key:
            return False
        if self.finish_reason is not None and self.finish_reason not in (
            dotted(record, "gen_ai", "response", "finish_reasons") or ()
        ):
            return False
        if (
            self.slower_than_s is not None
            and _number(dotted(record, "kvscope", "e2e_s")) < self.slower_than_s
        ):
            return False
        return self.status is None or _status_matches(self.status, record)


def _status_matches(wanted: str, record: LogRecord) -> bool:
    code = dotted(record, "http", "response", "status_code")
    if not isinstance(code, int):
        return False
    if wanted == "error":
        return code >= 400 or bool(dotted(record, "kvscope", "stream_error"))
    if wanted.endswith("xx"):
        return str(code)[0] == wanted[0]
    return str(code) == wanted


def summary(record: LogRecord) -> dict[str, Any]:
    """A record's row in the request list: who, what, how it ended and how long it took; never content."""
    kv = record.get("kvscope") or {}
    usage = dotted(record, "gen_ai", "usage") or {}
    return {
        "event_id": dotted(record, "event", "id"),
        "request_id": dotted(record, "http", "request", "id"),
        "timestamp": record.get("@timestamp"),
        "method": dotted(record, "http", "request", "method"),
        "path": dotted(record, "url", "path"),
        "model": dotted(record, "gen_ai", "request", "model"),
        "key": dotted(record, "user", "id"),
        "status": dotted(record, "http", "response", "status_code"),
        "stream": dotted(record, "gen_ai", "request", "stream"),
        "finish_reasons": dotted(record, "gen_ai", "response", "finish_reasons"),
        "input_tokens": usage.get("input_tokens"),
        "output_tokens": usage.get("output_tokens"),
        "ttft_s": kv.get("ttft_s"),
        "tpot_s": kv.get("tpot_s"),
        "e2e_s": kv.get("e2e_s"),
        "replica": dotted(kv, "routing", "replica") or dotted(record, "server", "address"),
        "error_type": dotted(record, "error", "type"),
        "stream_error": kv.get("stream_error"),
    }


def facets(records: list[LogRecord]) -> dict[str, list[str]]:
    """The values the list's filters can take among ``records`` (sorted): models, keys, statuses, finish
    reasons."""
    models, keys, statuses, reasons = set(), set(), set(), set()
    for r in records:
        models.add(dotted(r, "gen_ai", "request", "model"))
        keys.add(dotted(r, "user", "id"))
        statuses.add(dotted(r, "http", "response", "status_code"))
        reasons.update(dotted(r, "gen_ai", "response", "finish_reasons") or ())
    return {
        "models": sorted(str(m) for m in models if m is not None),
        "keys": sorted(str(k) for k in keys if k is not None),
        "statuses": sorted(str(s) for s in statuses if s is not None),
        "finish_reasons": sorted(str(f) for f in reasons if f is not None),
    }


GATEWAY_BEFORE = (
    ("auth_s", "gateway: auth"),
    ("rate_limit_s", "gateway: rate limit"),
    ("tokenize_s", "gateway: tokenize"),
    ("retry_s", "gateway: failed attempts (retries)"),
)
UPSTREAM = (
    ("upstream_connect_s", "upstream: request → response headers"),
    ("upstream_response_s", "upstream: response body"),
)
ENGINE = (("queue_s", "engine: queue"), ("prefill_s", "engine: prefill"), ("decode_s", "engine: decode"))
GATEWAY_AFTER = (("other_s", "gateway: other (body, routing, relay, log)"),)


def waterfall(record: LogRecord) -> list[dict[str, Any]]:
    """The request's waterfall: rows ``{"name", "field", "start_s", "seconds"}`` on one time axis from its
    arrival at the gateway. The first row is ``kvscope.e2e_s``; the gateway's phases (``kvscope.gateway``,
    which add up to e2e) follow one after the other: auth, rate limit, tokenize, failed attempts, the
    answering attempt (to its response headers, then its body), the rest of the gateway's own time last
    (``other_s``: spread over the request, drawn after the attempt); our engine's queue, prefill and decode
    (``kvscope.engine``) start with the answering attempt, one after the other, inside it. ``seconds`` is the
    log line's number as it is; a row whose number the line does not have (an upstream that reports no
    prefill time, a request refused before any upstream) is left out. ``field`` names the record field."""
    kv = record.get("kvscope") or {}
    rows: list[dict[str, Any]] = []
    e2e = kv.get("e2e_s")
    if isinstance(e2e, int | float):
        rows.append(
            {"name": "end to end (gateway)", "field": "kvscope.e2e_s", "start_s": 0.0, "seconds": e2e}
        )
    phases: dict[str, Any] = kv["gateway"] if isinstance(kv.get("gateway"), dict) else {}
    engine: dict[str, Any] = kv["engine"] if isinstance(kv.get("engine"), dict) else {}
    at = 0.0

    def add(section: dict[str, Any], prefix: str, fields: tuple[tuple[str, str], ...], start: float) -> float:
        for key, name in fields:
            seconds = section.get(key)
            if isinstance(seconds, int | float) and not isinstance(seconds, bool):
                rows.append({"name": name, "field": f"{prefix}.{key}", "start_s": start, "seconds": seconds})
                start += seconds
        return start

    at = add(phases, "kvscope.gateway", GATEWAY_BEFORE, at)
    attempt_start = at
    at = add(phases, "kvscope.gateway", UPSTREAM, at)
    add(engine, "kvscope.engine", ENGINE, attempt_start)
    add(phases, "kvscope.gateway", GATEWAY_AFTER, at)
    return rows
