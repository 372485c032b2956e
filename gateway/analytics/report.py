"""What ``kvscope logs report`` computes, independent of where the records live (DuckDB files or
Elasticsearch).

Definitions (the same for both back ends):

- a request is an **error** when ``http.response.status_code >= 400`` or ``event.outcome`` is ``failure``
  (a stream that broke after its 200; a client disconnect is ``unknown``, not an error);
- latency percentiles are over the records that have the field (``null``/missing are skipped):
  TTFT ``kvscope.ttft_s``, TPOT ``kvscope.tpot_s``, end-to-end ``kvscope.e2e_s`` (seconds, gateway side);
- DuckDB: ``quantile_cont`` = linear interpolation between closest ranks (Hyndman & Fan type 7, numpy's
  default): exact. Elasticsearch: the ``percentiles`` aggregation = TDigest (compression 100) approximation:
  exact for small sets, within a fraction of a percent of rank at the tails for large ones;
- tokens are sums of ``gen_ai.usage.input_tokens``/``output_tokens``; mean batch size is the mean of
  ``kvscope.engine.batch_size_mean``; KV usage p95 over ``kvscope.engine.kv_cache_usage``; preemptions the
  sum of ``kvscope.engine.num_preemptions``;
- ``--by finish_reason`` counts a request once per finish reason it has (n > 1 choices), like an
  Elasticsearch ``terms`` aggregation on an array; a missing group value is shown as ``(none)``;
- ``--by tier`` groups by the engine's service tier (``kvscope.engine.service_tier``: the tier that served or
  refused the request; ``(none)`` for requests no engine of ours saw).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from kvscope.gateway.logs.why import rank_causes

PERCENTS = (50, 95, 99)
LATENCY_FIELDS = {"ttft": "kvscope.ttft_s", "tpot": "kvscope.tpot_s", "e2e": "kvscope.e2e_s"}
GROUP_FIELDS = {
    "model": "gen_ai.request.model",
    "key": "user.id",
    "upstream": "server.address",
    "status": "http.response.status_code",
    "finish_reason": "gen_ai.response.finish_reasons",
    "tier": "kvscope.engine.service_tier",
}
ID_FIELDS = {
    "gen_ai.response.id": "response id",
    "http.request.id": "request id",
    "trace.id": "trace id",
    "event.id": "event id",
}
"""The ids a user may hold for one request → what to call them: the response's ``id`` (``chatcmpl-…``, what
an OpenAI SDK shows), the ``x-request-id`` header, the W3C trace id, the log record's own ``event.id``
(``kvscope logs why`` takes any of them, or a unique prefix)."""
MISSING = "(none)"
ERROR_STATUS = 400
_SINCE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_since(since: str | None, now: datetime | None = None) -> datetime | None:
    """``--since``: ``90s``/``15m``/``1h``/``2d``/``1w`` before ``now``, or an ISO-8601 time (UTC if naive).

    Raises ``ValueError`` for anything else.
    """
    if not since:
        return None
    match = _SINCE_RE.match(since.strip())
    if match:
        now = now or datetime.now(UTC)
        try:
            return now - timedelta(**{_UNITS[match.group(2)]: float(match.group(1))})
        except OverflowError as exc:  # further back than datetime reaches
            raise ValueError(f"--since {since!r}: use 15m, 1h, 2d or an ISO-8601 time") from exc
    try:
        ts = datetime.fromisoformat(since.replace("Z", "+00:00"))
    except ValueError as exc:
        raise ValueError(f"--since {since!r}: use 15m, 1h, 2d or an ISO-8601 time") from exc
    return ts if ts.tzinfo else ts.replace(tzinfo=UTC)


def es_time(ts: datetime) -> str:
    """UTC time as Elasticsearch ``strict_date_optional_time`` with milliseconds."""
    return ts.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


@dataclass(frozen=True, slots=True)
class ReportRow:
    group: str | None
    """Group value (``None``: all requests)."""
    requests: int
    errors: int
    latency: dict[str, dict[int, float | None]]
    """``latency["ttft"][99]``: seconds, ``None`` when no record has the field."""
    tokens_in: int
    tokens_out: int
    batch_size_mean: float | None
    kv_usage_p95: float | None
    preemptions: int

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def flat(self) -> dict[str, Any]:
        """One level of columns, in display order (table, CSV and JSON use it)."""
        out: dict[str, Any] = {
            "group": self.group if self.group is not None else "all",
            "requests": self.requests,
            "errors": self.errors,
            "error_rate": self.error_rate,
        }
        for name in LATENCY_FIELDS:
            for p in PERCENTS:
                out[f"{name}_p{p}_s"] = self.latency[name][p]
        out |= {
            "tokens_in": self.tokens_in,
            "tokens_out": self.tokens_out,
            "batch_size_mean": self.batch_size_mean,
            "kv_usage_p95": self.kv_usage_p95,
            "preemptions": self.preemptions,
        }
        return out


@dataclass(frozen=True, slots=True)
class SlowRequest:
    timestamp: str
    request_id: str | None
    trace_id: str | None
    model: str | None
    status: int | None
    e2e_s: float | None
    ttft_s: float | None
    tpot_s: float | None
    gateway_overhead_s: float | None
    queue_s: float | None
    prefill_s: float | None
    decode_s: float | None
    batch_size_max: int | None
    kv_cache_usage: float | None
    num_preemptions: int | None
    upstream: str | None
    causes: tuple[tuple[str, float], ...] = ()
    """Seconds by cause, largest first (gateway/logs/why.py); empty without the engine's attribution."""
    structured_compile_s: float | None = None
    """Structured output only: the wait for its grammar before the engine's queue."""

    @property
    def cause(self) -> str:
        """The largest cause and its share of the explained seconds, e.g. ``queue 62%``; ``?`` without one."""
        if not self.causes:
            return "?"
        return f"{self.causes[0][0]} {self.causes[0][1] / sum(s for _, s in self.causes):.0%}"

    @property
    def slowest_phase(self) -> str:
        """Where most of the time went: ``compile`` (the wait for a structured-output grammar), ``queue``,
        ``prefill``, ``decode`` (engine stats) or ``gateway``; ``preempted`` when the engine preempted the
        request; ``?`` without engine stats."""
        if self.num_preemptions:
            return "preempted"
        phases = {
            "compile": self.structured_compile_s,
            "queue": self.queue_s,
            "prefill": self.prefill_s,
            "decode": self.decode_s,
            "gateway": self.gateway_overhead_s,
        }
        known = {k: v for k, v in phases.items() if v is not None}
        return max(known, key=known.__getitem__) if set(known) - {"gateway"} else "?"

    def flat(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__slots__ if name != "causes"}
        out["slowest_phase"] = self.slowest_phase
        out["cause"] = self.cause
        return out


@dataclass(frozen=True, slots=True)
class Report:
    source: str
    by: str | None
    since: str | None
    total: ReportRow
    groups: tuple[ReportRow, ...] = ()
    slowest: tuple[SlowRequest, ...] = ()
    percentile_method: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def cause_breakdown(self) -> dict[str, dict[str, Any]]:
        """Seconds by cause summed over the slowest requests listed (``slowest``) and over those of them at
        or above the e2e p99 (``p99``; complete when the list holds at least 1 % of the requests), each with
        the number of requests it covers (``requests``) and ``causes`` (name → seconds, largest first)."""
        p99 = self.total.latency["e2e"][99]
        at_p99 = [s for s in self.slowest if p99 is not None and s.e2e_s is not None and s.e2e_s >= p99]
        return {"slowest": _sum_causes(self.slowest), "p99": _sum_causes(at_p99)}

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "by": self.by,
            "since": self.since,
            "percentile_method": self.percentile_method,
            "total": self.total.flat(),
            "groups": [g.flat() for g in self.groups],
            "slowest": [s.flat() for s in self.slowest],
            "causes": self.cause_breakdown(),
        }


def _sum_causes(requests: list[SlowRequest] | tuple[SlowRequest, ...]) -> dict[str, Any]:
    totals: dict[str, float] = {}
    for request in requests:
        for cause, seconds in request.causes:
            totals[cause] = totals.get(cause, 0.0) + seconds
    ranked = dict(sorted(totals.items(), key=lambda item: -item[1]))
    return {"requests": sum(1 for r in requests if r.causes), "causes": ranked}


def dotted(doc: dict[str, Any] | None, path: str) -> Any:
    """``dotted({"a": {"b": 1}}, "a.b") == 1``; ``None`` if any step is missing."""
    node: Any = doc
    for part in path.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


SLOW_FIELDS = {
    "timestamp": "@timestamp",
    "request_id": "http.request.id",
    "trace_id": "trace.id",
    "model": "gen_ai.request.model",
    "status": "http.response.status_code",
    "e2e_s": "kvscope.e2e_s",
    "ttft_s": "kvscope.ttft_s",
    "tpot_s": "kvscope.tpot_s",
    "gateway_overhead_s": "kvscope.gateway_overhead_s",
    "queue_s": "kvscope.engine.queue_s",
    "prefill_s": "kvscope.engine.prefill_s",
    "decode_s": "kvscope.engine.decode_s",
    "batch_size_max": "kvscope.engine.batch_size_max",
    "kv_cache_usage": "kvscope.engine.kv_cache_usage",
    "num_preemptions": "kvscope.engine.num_preemptions",
    "structured_compile_s": "kvscope.engine.structured_compile_s",
    "upstream": "server.address",
}
"""``SlowRequest`` attribute → record field."""


def slow_request(doc: dict[str, Any]) -> SlowRequest:
    """A :class:`SlowRequest` from a nested record (``_source`` or a DuckDB row as dict)."""
    values = {name: dotted(doc, path) for name, path in SLOW_FIELDS.items()}
    ts = values["timestamp"]
    values["timestamp"] = es_time(ts) if isinstance(ts, datetime) else str(ts or "")
    kv, engine = dotted(doc, "kvscope") or {}, dotted(doc, "kvscope.engine") or {}
    causes = tuple(rank_causes(engine, kv)) if engine.get("prefill_steps") is not None else ()
    return SlowRequest(**values, causes=causes)


def prune(value: Any) -> Any:
    """Drop ``None`` members (and objects left empty) recursively and turn datetimes into ISO strings: the
    form both back ends print records in (a DuckDB row has a column for every mapped field, an
    Elasticsearch ``_source`` the nulls the gateway wrote; pruned, the same record reads the same)."""
    if isinstance(value, dict):
        pruned = {k: prune(v) for k, v in value.items() if v is not None}
        return {k: v for k, v in pruned.items() if v != {}}
    if isinstance(value, list):
        return [prune(v) for v in value]
    if isinstance(value, datetime):
        return es_time(value)
    return value
