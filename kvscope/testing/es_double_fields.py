"""Field types and values for the Elasticsearch double's search: what a document's ``_source`` is indexed as,
per the mapping, and how a query value is read for a field (Elasticsearch 8.x/9.x reference, "Field data
types" and "Mapping parameters").

- ``keyword``: the value as a string (numbers and booleans too), strings longer than ``ignore_above`` are
  not indexed (ignore_above page); no normalizer, so matching is exact and case-sensitive (keyword page).
- ``long``/``integer``: numbers and numeric strings, fractions truncated (``coerce``, on by default);
  ``double``/``float``: floats (numeric field types page).
- ``date``: ``strict_date_optional_time||epoch_millis`` (date page, the default ``format``), stored as epoch
  milliseconds: a finer fraction is dropped (the ``date`` type has millisecond resolution, date_nanos page).
- ``boolean``: ``true``/``false``/``"true"``/``"false"``/``""`` (boolean page).
- a value the type cannot read is not indexed when ``index.mapping.ignore_malformed`` is on (the document
  is kept, the field is missing for search, sort and aggregations: ignore_malformed page).
- an object with ``enabled: false`` and a field the mapping does not list (``dynamic: false``) are kept in
  ``_source`` only: they match nothing (enabled page, dynamic page).
- ``null`` and ``[]`` are no value; an array holds several values (null_value page, arrays page).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any

LONG_MAX = 2**63 - 1
LONG_MIN = -(2**63)
_NUMERIC = {"long": int, "integer": int, "short": int, "byte": int, "double": float, "float": float}
DEFAULT_DATE_FORMAT = "strict_date_optional_time||epoch_millis"
_ISO = re.compile(
    r"(?P<year>[+-]?\d{4})(?:-(?P<month>\d{2})(?:-(?P<day>\d{2})"
    r"(?:T(?P<hour>\d{2})(?::(?P<minute>\d{2})(?::(?P<second>\d{2})(?:[.,](?P<fraction>\d{1,9}))?)?)?"
    r"(?P<zone>Z|[+-]\d{2}(?::?\d{2})?)?)?)?)?"
)
"""ISO 8601 as ``strict_date_optional_time`` reads it: the date's and the time's parts each optional from the
right, ``T`` between them, a zone only after a time (date formats page, built-in formats)."""


class SearchError(Exception):
    """A request Elasticsearch itself refuses: answered with ``status`` and an error of ``type_``."""

    def __init__(self, status: int, type_: str, reason: str) -> None:
        super().__init__(reason)
        self.status, self.type_, self.reason = status, type_, reason


class Unsupported(SearchError):
    """A request Elasticsearch accepts but the double does not model: answered 400 ``es_double_unsupported``
    so that a test sending it fails loudly instead of being answered wrongly."""

    def __init__(self, reason: str) -> None:
        super().__init__(400, "es_double_unsupported", f"the Elasticsearch double does not model {reason}")


@dataclass(frozen=True, slots=True)
class Field:
    """One mapped field: its dotted path and its mapping (``{"type": ..., ...}``)."""

    path: str
    spec: dict[str, Any]
    settings: dict[str, Any]

    @property
    def type(self) -> str:
        return str(self.spec.get("type", "object"))

    @property
    def numeric(self) -> bool:
        return self.type in _NUMERIC or self.type == "date"

    def indexed(self, source: dict[str, Any]) -> list[Any]:
        """The values this field of ``source`` is indexed as (empty: the field is missing)."""
        out = []
        for raw in source_values(source, self.path):
            try:
                value = self.read(raw, round_up=False)
            except (ValueError, TypeError, OverflowError):
                continue  # malformed: the double's _bulk accepted it only under ignore_malformed
            if value is not None:
                out.append(value)
        return out

    def read(self, raw: Any, *, round_up: bool = False, date_format: str | None = None) -> Any:
        """``raw`` as this field's type (a query value or a document's). Raises ValueError/TypeError when it
        does not parse; None for a keyword over ``ignore_above``."""
        kind = self.type
        if isinstance(raw, (dict, list)):
            raise TypeError(f"a {kind} value cannot be an object or an array")
        if kind == "keyword":
            text = keyword_text(raw)
            return None if len(text) > int(self.spec.get("ignore_above", 2**31 - 1)) else text
        if kind in ("long", "integer", "short", "byte"):
            return _long(raw)
        if kind in ("double", "float"):
            if isinstance(raw, bool):
                raise TypeError("a boolean is not a number")
            number = float(raw)
            if not math.isfinite(number):
                raise ValueError(f"[{raw}] is not a finite number")
            return number
        if kind == "date":
            return parse_date(raw, date_format or str(self.spec.get("format", DEFAULT_DATE_FORMAT)), round_up)
        if kind == "boolean":
            return _boolean(raw)
        if kind == "ip":
            return str(raw)
        if kind in ("match_only_text", "text"):
            raise Unsupported(f"queries, sorts or aggregations on the text field [{self.path}]")
        raise Unsupported(f"the field type [{kind}] of [{self.path}]")


def keyword_text(raw: Any) -> str:
    """A JSON scalar as a keyword term: strings as they are, booleans ``true``/``false``, numbers as JSON
    writes them."""
    if isinstance(raw, bool):
        return "true" if raw else "false"
    return raw if isinstance(raw, str) else str(raw)


def _long(raw: Any) -> int:
    if isinstance(raw, bool):
        raise TypeError("a boolean is not a number")
    if isinstance(raw, int):
        value = raw
    else:
        number = float(raw)
        if not math.isfinite(number):
            raise ValueError(f"[{raw}] is not a finite number")
        value = math.trunc(number)  # coerce: fractions are truncated
    if not LONG_MIN <= value <= LONG_MAX:
        raise ValueError(f"[{raw}] is out of range for a long")
    return value


def _boolean(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if raw in ("true", "false", ""):
        return raw == "true"
    raise ValueError(f"Failed to parse value [{raw}] as only [true] or [false] are allowed.")


def source_values(source: Any, path: str) -> list[Any]:
    """The scalar values at dotted ``path`` of a ``_source`` (nested objects; arrays flattened, also arrays of
    objects on the way; nulls dropped)."""
    nodes = [source]
    for part in path.split("."):
        nxt: list[Any] = []
        for node in nodes:
            for item in node if isinstance(node, list) else (node,):
                if isinstance(item, dict) and part in item:
                    nxt.append(item[part])
        nodes = nxt
    out: list[Any] = []
    for node in nodes:
        for item in node if isinstance(node, list) else (node,):
            if item is not None and not isinstance(item, dict):
                out.append(item)
    return out


class Mapping:
    """The fields of one data stream's mapping, by dotted path."""

    def __init__(self, mappings: dict[str, Any], settings: dict[str, Any]) -> None:
        self.fields: dict[str, Field] = {}
        self.objects: set[str] = set()
        self._walk(mappings.get("properties", {}), "", settings)

    def _walk(self, props: dict[str, Any], prefix: str, settings: dict[str, Any]) -> None:
        for name, spec in props.items():
            path = prefix + name
            if spec.get("enabled") is False:
                continue  # kept in _source, not indexed
            if "properties" in spec or spec.get("type") == "object":
                self.objects.add(path)
                self._walk(spec.get("properties", {}), path + ".", settings)
            else:
                self.fields[path] = Field(path, spec, settings)

    def field(self, path: str) -> Field | None:
        """The mapped leaf field at ``path``; None when unmapped (or an object)."""
        return self.fields.get(path)

    def leaves_under(self, path: str) -> list[Field]:
        """``path`` itself if it is a leaf, else every leaf of the object at ``path``."""
        if path in self.fields:
            return [self.fields[path]]
        return [f for p, f in self.fields.items() if p.startswith(path + ".")]


# ---- dates ---------------------------------------------------------------------------------------------
def parse_date(raw: Any, date_format: str, round_up: bool = False) -> int:
    """Epoch milliseconds of ``raw`` under a ``||``-separated ``date_format`` (the first that reads it).

    Supported formats: ``strict_date_optional_time`` (also ``_nanos``), ``epoch_millis``, ``epoch_second``.
    ``round_up`` (a range's ``gt``/``lte``, and the upper end of a date ``term``) fills the parts the value
    leaves out as Elasticsearch's range query does (range query page, "Missing date components"): month
    and day 01, hour 23, minute 59, second 59, fraction 999,999,999 ns; without it they are the minimum.
    Date math (``now``, ``||``, ``/d``) is not modelled. Raises ValueError when no format reads ``raw``."""
    if isinstance(raw, bool):
        raise ValueError(f"failed to parse date field [{raw}]")
    if isinstance(raw, str) and (raw.startswith("now") or "||" in raw):
        raise Unsupported(f"date math [{raw}]")
    for name in date_format.split("||"):
        name = name.strip()
        if name in ("strict_date_optional_time", "strict_date_optional_time_nanos"):
            if isinstance(raw, str) and (ms := _iso_millis(raw, round_up)) is not None:
                return ms
        elif name in ("epoch_millis", "epoch_second"):
            scale = 1000 if name == "epoch_second" else 1
            try:
                number = float(raw)
            except (TypeError, ValueError):
                continue
            if math.isfinite(number):
                return math.floor(number * scale)
        else:
            raise Unsupported(f"the date format [{name}]")
    raise ValueError(f"failed to parse date field [{raw}] with format [{date_format}]")


def _iso_millis(text: str, round_up: bool) -> int | None:
    match = _ISO.fullmatch(text)
    if match is None:
        return None
    g = match.groupdict()
    year = int(g["year"])
    month = int(g["month"] or 1)
    day = int(g["day"] or 1)
    hour = int(g["hour"]) if g["hour"] else (23 if round_up else 0)
    minute = int(g["minute"]) if g["minute"] else (59 if round_up else 0)
    second = int(g["second"]) if g["second"] else (59 if round_up else 0)
    if g["fraction"]:
        nanos = int(g["fraction"].ljust(9, "0"))
    else:
        nanos = 999_999_999 if round_up else 0
    try:
        days = date(year, month, day).toordinal() - date(1970, 1, 1).toordinal()
    except ValueError:
        return None
    if hour > 23 or minute > 59 or second > 59:
        return None
    offset_s = 0
    zone = g["zone"]
    if zone and zone != "Z":
        sign = -1 if zone[0] == "-" else 1
        digits = zone[1:].replace(":", "")
        offset_s = sign * (int(digits[:2]) * 3600 + int(digits[2:4] or 0) * 60)
    seconds = days * 86400 + hour * 3600 + minute * 60 + second - offset_s
    return seconds * 1000 + nanos // 1_000_000


def format_date(ms: int | float) -> str:
    """Epoch milliseconds as ``strict_date_optional_time`` prints them: ``2025-01-01T12:00:00.000Z``."""
    ms = int(ms)
    moment = datetime.fromtimestamp(ms // 1000, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S") + f".{ms % 1000:03d}Z"


@dataclass(frozen=True, slots=True)
class Doc:
    """One document as a search sees it."""

    index: str
    id: str
    source: dict[str, Any]
    mapping: Mapping
    shard_doc: int
    """``_shard_doc``: the backing index's number (its shard) in the high 32 bits, the document's in the
    low."""
