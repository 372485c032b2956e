"""Aggregations for the Elasticsearch double, with the documented semantics and response shapes
(Elasticsearch 8.x/9.x reference, "Aggregations").

- ``percentiles``: Elasticsearch ≥ 8.9 computes them with a hybrid t-digest that keeps every value and sorts
  them while an aggregation holds fewer than 20 × compression = 2,000 values (elastic/elasticsearch#96904;
  libs/tdigest ``HybridDigest``/``SortingDigest``), answering ``Dist.quantile``: with q = percent / 100 and
  the n values sorted, index = q·(n − 1), the value at ⌊index⌋ plus (index − ⌊index⌋) times the step to the
  next one: linear interpolation between closest ranks (Hyndman & Fan type 7). The double computes exactly
  that, for any n; above 1,999 values Elasticsearch switches to a merging t-digest whose error its source
  bounds at 0.1-1 % for most cases, which the double does not model. Keyed ``{"values": {"50.0": v}}`` or,
  with ``keyed: false``, ``[{"key": 50.0, "value": v}]``; null over no values.
- ``sum`` (0 over no values), ``avg``/``min``/``max`` (null over no values): compensated (Kahan) summation
  as Elasticsearch's ``CompensatedSum``; a date ``min``/``max`` also has ``value_as_string``.
- ``filter``, ``missing``: ``doc_count`` and sub-aggregations.
- ``terms``: one bucket per distinct value (a document with several values is in each of its buckets,
  once); ``missing`` puts documents without a value in a bucket of that value; ordered by ``doc_count``
  descending, ties by key ascending; ``size`` buckets (default 10), ``sum_other_doc_count`` for the rest;
  numeric keys are numbers, boolean and date keys have ``key_as_string``.
- ``date_histogram`` (``fixed_interval`` in ms/s/m/h/d, or ``calendar_interval`` minute/hour/day, UTC) and
  ``histogram``: bucket key = ⌊(value − offset) / interval⌋ · interval + offset ("Histogram aggregation");
  buckets in key order; ``min_doc_count`` 0 (the default) fills the empty buckets between the first and the
  last.
Anything else is refused (:class:`~kvscope.testing.es_double_fields.Unsupported`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

from kvscope.testing.es_double_fields import Doc, Field, SearchError, Unsupported, format_date
from kvscope.testing.es_double_query import Evaluator

DEFAULT_PERCENTS = (1.0, 5.0, 25.0, 50.0, 75.0, 95.0, 99.0)
SORTING_DIGEST_MAX = 2000
"""Elasticsearch's hybrid t-digest sorts every value below this many (20 × the default compression 100)."""
_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_CALENDAR_MS = {
    "minute": 60_000,
    "1m": 60_000,
    "hour": 3_600_000,
    "1h": 3_600_000,
    "day": 86_400_000,
    "1d": 86_400_000,
}


def aggregate(specs: dict[str, Any], docs: list[Doc]) -> dict[str, Any]:
    """The ``aggregations`` of a response for the request's ``aggs`` over ``docs``."""
    return {name: _one(name, spec, docs) for name, spec in specs.items()}


def _one(name: str, spec: dict[str, Any], docs: list[Doc]) -> dict[str, Any]:
    sub = spec.get("aggs", spec.get("aggregations", {}))
    kinds = [k for k in spec if k not in ("aggs", "aggregations", "meta")]
    if len(kinds) != 1:
        raise SearchError(
            400, "parsing_exception", f"Expected one aggregation type in [{name}], found {kinds}"
        )
    kind = kinds[0]
    body = spec[kind]
    metric = _METRICS.get(kind)
    if metric is not None:
        if sub:
            raise SearchError(
                400,
                "aggregation_initialization_exception",
                f"Aggregator [{name}] of type [{kind}] cannot accept sub-aggregations",
            )
        return metric(name, body, docs)
    bucket = _BUCKETS.get(kind)
    if bucket is None:
        raise Unsupported(f"the [{kind}] aggregation")
    return bucket(name, body, docs, sub)


# ---- values --------------------------------------------------------------------------------------------
def _field_of(docs: list[Doc], path: str) -> Field | None:
    for doc in docs:
        field = doc.mapping.field(path)
        if field is not None:
            return field
    return None


def _values(docs: Iterable[Doc], path: str) -> Iterable[Any]:
    for doc in docs:
        field = doc.mapping.field(path)
        if field is not None:
            yield from field.indexed(doc.source)


def _numeric_values(
    name: str, kind: str, body: dict[str, Any], docs: list[Doc]
) -> tuple[list[float], Field | None]:
    extra = set(body) - {"field", "percents", "keyed", "tdigest", "format"}
    if extra or "script" in body:
        raise Unsupported(f"{kind} options {sorted(extra)}")
    path = str(body["field"])
    field = _field_of(docs, path)
    if field is not None and not field.numeric and field.type != "boolean":
        raise SearchError(
            400,
            "illegal_argument_exception",
            f"Field [{path}] of type [{field.type}] is not supported for aggregation [{kind}]",
        )
    return [float(v) for v in _values(docs, path)], field


class KahanSum:
    """Elasticsearch's ``CompensatedSum``: Kahan summation in the order values come."""

    def __init__(self) -> None:
        self.value = 0.0
        self.delta = 0.0

    def add(self, x: float) -> None:
        if not math.isfinite(x):
            self.value += x
            return
        corrected = x - self.delta
        total = self.value + corrected
        self.delta = (total - self.value) - corrected
        self.value = total


def _kahan(values: Iterable[float]) -> float:
    acc = KahanSum()
    for v in values:
        acc.add(v)
    return acc.value


def es_quantile(q: float, ordered: list[float]) -> float | None:
    """``Dist.quantile`` of Elasticsearch's t-digest library over sorted values (module doc); None when
    empty."""
    n = len(ordered)
    if n == 0:
        return None
    index = q * (n - 1)
    low = math.floor(index)
    high, weight = low + 1, index - low
    if index <= 0:
        low = high = 0
        weight = 0.0
    if index >= n - 1:
        low = high = n - 1
        weight = 0.0
    return ordered[low] + weight * (ordered[high] - ordered[low])


def percent_key(p: float) -> str:
    """A percent as Java's ``Double.toString`` writes it (the keyed response's keys): ``50.0``, ``99.5``."""
    text = repr(float(p))
    return text if "e" not in text else str(float(p))


# ---- metrics -------------------------------------------------------------------------------------------
def _percentiles(name: str, body: dict[str, Any], docs: list[Doc]) -> dict[str, Any]:
    tdigest = body.get("tdigest") or {}
    if body.get("hdr") or set(tdigest) - {"compression"} or tdigest.get("compression", 100) != 100:
        raise Unsupported("percentiles other than the default t-digest")
    values, _ = _numeric_values(name, "percentiles", body, docs)
    values.sort()
    percents = [float(p) for p in body.get("percents", DEFAULT_PERCENTS)]
    results = [(p, es_quantile(p / 100, values)) for p in percents]
    if body.get("keyed", True):
        return {"values": {percent_key(p): v for p, v in results}}
    return {"values": [{"key": p, "value": v} for p, v in results]}


def _sum(name: str, body: dict[str, Any], docs: list[Doc]) -> dict[str, Any]:
    values, _ = _numeric_values(name, "sum", body, docs)
    return {"value": _kahan(values)}


def _avg(name: str, body: dict[str, Any], docs: list[Doc]) -> dict[str, Any]:
    values, _ = _numeric_values(name, "avg", body, docs)
    return {"value": _kahan(values) / len(values) if values else None}


def _extreme(kind: str):
    def metric(name: str, body: dict[str, Any], docs: list[Doc]) -> dict[str, Any]:
        values, field = _numeric_values(name, kind, body, docs)
        if not values:
            return {"value": None}
        value = min(values) if kind == "min" else max(values)
        out: dict[str, Any] = {"value": value}
        if field is not None and field.type == "date":
            out["value_as_string"] = format_date(value)
        return out

    return metric


def _value_count(name: str, body: dict[str, Any], docs: list[Doc]) -> dict[str, Any]:
    return {"value": sum(1 for _ in _values(docs, str(body["field"])))}


_METRICS = {
    "percentiles": _percentiles,
    "sum": _sum,
    "avg": _avg,
    "min": _extreme("min"),
    "max": _extreme("max"),
    "value_count": _value_count,
}


# ---- buckets -------------------------------------------------------------------------------------------
def _with_sub(bucket: dict[str, Any], sub: dict[str, Any], docs: list[Doc]) -> dict[str, Any]:
    return {**bucket, **aggregate(sub, docs)} if sub else bucket


def _filter(name: str, body: dict[str, Any], docs: list[Doc], sub: dict[str, Any]) -> dict[str, Any]:
    cache: dict[int, Evaluator] = {}
    inside = [
        d
        for d in docs
        if cache.setdefault(id(d.mapping), Evaluator(d.mapping, False)).matches(body, d.source)
    ]
    return _with_sub({"doc_count": len(inside)}, sub, inside)


def _missing(name: str, body: dict[str, Any], docs: list[Doc], sub: dict[str, Any]) -> dict[str, Any]:
    path = str(body["field"])
    inside = [d for d in docs if not ((f := d.mapping.field(path)) is not None and f.indexed(d.source))]
    return _with_sub({"doc_count": len(inside)}, sub, inside)


def _key_fields(field: Field | None, key: Any) -> dict[str, Any]:
    if field is None or field.type == "keyword" or field.type == "ip":
        return {"key": key}
    if field.type == "boolean":
        return {"key": 1 if key else 0, "key_as_string": "true" if key else "false"}
    if field.type == "date":
        return {"key": key, "key_as_string": format_date(key)}
    return {"key": key}


def _terms(name: str, body: dict[str, Any], docs: list[Doc], sub: dict[str, Any]) -> dict[str, Any]:
    extra = set(body) - {"field", "size", "missing", "min_doc_count", "order", "shard_size"}
    if extra:
        raise Unsupported(f"terms options {sorted(extra)}")
    path = str(body["field"])
    field = _field_of(docs, path)
    if field is not None and field.type in ("match_only_text", "text"):
        raise SearchError(400, "illegal_argument_exception", f"Fielddata is disabled on [{path}]")
    missing = body.get("missing")
    if missing is not None and field is not None:
        try:
            missing = field.read(missing)
        except (ValueError, TypeError) as exc:
            raise SearchError(400, "number_format_exception", str(exc)) from None
    groups: dict[Any, list[Doc]] = {}
    for doc in docs:
        f = doc.mapping.field(path)
        keys = set(f.indexed(doc.source)) if f is not None else set()
        if not keys and missing is not None:
            keys = {missing}
        for key in keys:
            groups.setdefault(key, []).append(doc)
    order = body.get("order", {"_count": "desc"})
    if isinstance(order, list):
        if len(order) != 1:
            raise Unsupported("compound terms orders")
        order = order[0]
    ((by, direction),) = order.items()
    if by not in ("_count", "_key"):
        raise Unsupported(f"terms order by [{by}]")
    reverse_key = by == "_key" and direction == "desc"
    items = sorted(groups.items(), key=lambda kv: _TermOrder(kv[0], len(kv[1]), by, direction, reverse_key))
    min_count = int(body.get("min_doc_count", 1))
    items = [kv for kv in items if len(kv[1]) >= min_count]
    size = int(body.get("size", 10))
    shown, rest = items[:size], items[size:]
    buckets = [
        _with_sub({**_key_fields(field, key), "doc_count": len(group)}, sub, group) for key, group in shown
    ]
    return {
        "doc_count_error_upper_bound": 0,
        "sum_other_doc_count": sum(len(g) for _, g in rest),
        "buckets": buckets,
    }


class _TermOrder:
    """Sort key of a terms bucket: by count (desc by default) with ties by key ascending, or by key."""

    __slots__ = ("key", "count", "by", "direction", "reverse_key")

    def __init__(self, key: Any, count: int, by: str, direction: str, reverse_key: bool) -> None:
        self.key, self.count, self.by, self.direction, self.reverse_key = (
            key,
            count,
            by,
            direction,
            reverse_key,
        )

    def __lt__(self, other: _TermOrder) -> bool:
        if self.by == "_count" and self.count != other.count:
            return self.count > other.count if self.direction == "desc" else self.count < other.count
        if self.reverse_key:
            return other.key < self.key
        return self.key < other.key


def _interval_ms(body: dict[str, Any]) -> int:
    if "interval" in body:
        raise Unsupported("date_histogram [interval] (removed in 8.0: use fixed_interval)")
    if "fixed_interval" in body:
        match = re.fullmatch(r"(\d+)(ms|s|m|h|d)", str(body["fixed_interval"]))
        if match is None or int(match.group(1)) == 0:
            raise SearchError(
                400,
                "illegal_argument_exception",
                "failed to parse setting [date_histogram.fixedInterval] with value "
                f"[{body['fixed_interval']}]",
            )
        return int(match.group(1)) * _UNITS_MS[match.group(2)]
    calendar = str(body.get("calendar_interval", ""))
    if calendar in _CALENDAR_MS:
        return _CALENDAR_MS[calendar]
    raise Unsupported(f"date_histogram intervals other than fixed_interval or minute/hour/day ({body})")


def _offset_ms(text: Any) -> int:
    if text in (None, 0, "0"):
        return 0
    match = re.fullmatch(r"([+-]?)(\d+)(ms|s|m|h|d)", str(text))
    if match is None:
        raise Unsupported(f"the date_histogram offset [{text}]")
    value = int(match.group(2)) * _UNITS_MS[match.group(3)]
    return -value if match.group(1) == "-" else value


def _date_histogram(name: str, body: dict[str, Any], docs: list[Doc], sub: dict[str, Any]) -> dict[str, Any]:
    extra = set(body) - {
        "field",
        "fixed_interval",
        "calendar_interval",
        "min_doc_count",
        "offset",
        "time_zone",
    }
    if extra or str(body.get("time_zone", "UTC")) not in ("UTC", "Z", "+00:00"):
        raise Unsupported(f"date_histogram options {sorted(extra) or body.get('time_zone')}")
    interval, offset = _interval_ms(body), _offset_ms(body.get("offset"))

    def key_of(ms: Any) -> int:
        return (int(ms) - offset) // interval * interval + offset

    return _histogram_buckets(docs, str(body["field"]), key_of, lambda k: k + interval, body, sub, dates=True)


def _histogram(name: str, body: dict[str, Any], docs: list[Doc], sub: dict[str, Any]) -> dict[str, Any]:
    extra = set(body) - {"field", "interval", "offset", "min_doc_count"}
    if extra:
        raise Unsupported(f"histogram options {sorted(extra)}")
    interval, offset = float(body["interval"]), float(body.get("offset", 0.0))
    if not interval > 0:
        raise SearchError(
            400, "illegal_argument_exception", f"[interval] must be >0 for histogram aggregation [{name}]"
        )

    def key_of(value: Any) -> float:
        return math.floor((float(value) - offset) / interval) * interval + offset

    return _histogram_buckets(
        docs, str(body["field"]), key_of, lambda k: key_of(k + interval), body, sub, dates=False
    )


def _histogram_buckets(docs, path, key_of, next_key, body, sub, *, dates: bool) -> dict[str, Any]:
    groups: dict[Any, list[Doc]] = {}
    for doc in docs:
        field = doc.mapping.field(path)
        if field is None:
            continue
        if dates and field.type != "date":
            raise SearchError(
                400,
                "illegal_argument_exception",
                f"Field [{path}] of type [{field.type}] is not supported for aggregation [date_histogram]",
            )
        for key in {key_of(v) for v in field.indexed(doc.source)}:
            groups.setdefault(key, []).append(doc)
    min_count = int(body.get("min_doc_count", 0))
    keys = sorted(groups)
    if min_count == 0 and keys:
        filled, key = [], keys[0]
        while key <= keys[-1]:
            filled.append(key)
            key = next_key(key)
        keys = sorted(set(filled) | set(keys))
    buckets = []
    for key in keys:
        group = groups.get(key, [])
        if len(group) < min_count:
            continue
        head = {"key_as_string": format_date(key), "key": key} if dates else {"key": key}
        buckets.append(_with_sub({**head, "doc_count": len(group)}, sub, group))
    return {"buckets": buckets}


_BUCKETS = {
    "filter": _filter,
    "missing": _missing,
    "terms": _terms,
    "date_histogram": _date_histogram,
    "histogram": _histogram,
}
