"""The query DSL for the Elasticsearch double: which documents match and, where a sort needs it, their score
(Elasticsearch 8.x/9.x reference, "Query DSL").

Modelled, with the documented semantics:

- ``match_all``/``match_none``; ``term``/``terms`` (the query value read as the field's type: a keyword
  matches exactly and case-sensitively, ``case_insensitive`` on request; a date term is the range from the
  value rounded down to it rounded up); ``range`` (``gt``/``gte``/``lt``/``lte``, dates read with the
  query's ``format`` or the field's, missing date parts filled as "Missing date components" says; a keyword
  range compares strings); ``exists`` (at least one indexed value; an object path: any field under it);
  ``prefix`` and ``wildcard`` on keywords; ``constant_score``; ``bool`` (``must``/``filter``/``should``/
  ``must_not``; ``minimum_should_match`` an integer, a negative integer or a percentage, default 1 when the
  bool has only ``should`` clauses, else 0); ``query_string`` in the subset
  :mod:`kvscope.testing.es_double_query_string` parses.
- A term-level query on an unmapped field matches nothing (it is not an error).
- Scores: ``match_all`` and ``constant_score`` score their boost; ``terms``, ``range``, ``exists``,
  ``prefix`` and ``wildcard`` are constant-score queries (``prefix``/``wildcard`` rewrite
  ``constant_score_blended``, the default: "Multi-term query rewrite"); ``bool`` sums its ``must`` and
  matching ``should`` clauses (``filter``/``must_not`` score nothing). A ``term`` or ``query_string`` score
  is BM25 over the shard's statistics, which the double does not model: when a sort needs the score of one,
  the request is refused (wrap it in ``constant_score`` or ``filter``).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from typing import Any

from kvscope.testing.es_double_fields import Field, Mapping, SearchError, Unsupported, keyword_text

Scored = float | None
"""A query's result for one document: None (no match) or its score."""


def one_entry(clause: Any, what: str) -> tuple[str, Any]:
    """The single ``{name: body}`` of a clause. Raises SearchError (ES: ``parsing_exception``)."""
    if not isinstance(clause, dict) or len(clause) != 1:
        raise SearchError(400, "parsing_exception", f"[{what}] malformed query, expected one key")
    return next(iter(clause.items()))


class Evaluator:
    """Matches one query against documents of one mapping; ``scores``: whether the caller needs scores."""

    def __init__(self, mapping: Mapping, scores: bool) -> None:
        self.mapping = mapping
        self.scores = scores

    def run(self, query: dict[str, Any] | None, source: dict[str, Any]) -> Scored:
        """None when ``source`` does not match ``query`` (None: ``match_all``), else its score."""
        return self._eval(query or {"match_all": {}}, source, scoring=self.scores)

    def matches(self, query: dict[str, Any], source: dict[str, Any]) -> bool:
        """Filter context: whether ``source`` matches (no scores)."""
        return self._eval(query, source, scoring=False) is not None

    def _eval(self, query: Any, source: dict[str, Any], scoring: bool) -> Scored:
        kind, body = one_entry(query, "query")
        handler: Callable[[Any, dict[str, Any], bool], Scored] | None = getattr(self, f"_q_{kind}", None)
        if handler is None:
            known = (
                "match",
                "multi_match",
                "ids",
                "regexp",
                "fuzzy",
                "nested",
                "script",
                "simple_query_string",
            )
            if kind in known:
                raise Unsupported(f"the [{kind}] query")
            raise SearchError(400, "parsing_exception", f"unknown query [{kind}]")
        return handler(body, source, scoring)

    # ---- compound ----------------------------------------------------------------------------------------
    def _q_match_all(self, body: Any, source: dict[str, Any], scoring: bool) -> Scored:
        return float((body or {}).get("boost", 1.0))

    def _q_match_none(self, body: Any, source: dict[str, Any], scoring: bool) -> Scored:
        return None

    def _q_constant_score(self, body: dict[str, Any], source: dict[str, Any], scoring: bool) -> Scored:
        return float(body.get("boost", 1.0)) if self.matches(body["filter"], source) else None

    def _q_bool(self, body: dict[str, Any], source: dict[str, Any], scoring: bool) -> Scored:
        clauses = {k: _as_list(body.get(k)) for k in ("must", "filter", "should", "must_not")}
        unknown = set(body) - {*clauses, "minimum_should_match", "boost"}
        if unknown:
            raise SearchError(400, "parsing_exception", f"[bool] query does not support {sorted(unknown)}")
        score = 0.0
        for clause in clauses["must"]:
            s = self._eval(clause, source, scoring)
            if s is None:
                return None
            score += s
        if any(not self.matches(c, source) for c in clauses["filter"]):
            return None
        if any(self.matches(c, source) for c in clauses["must_not"]):
            return None
        should = clauses["should"]
        required = minimum_should_match(
            body.get("minimum_should_match"), len(should), bool(clauses["must"] or clauses["filter"])
        )
        matched = 0
        for clause in should:
            s = self._eval(clause, source, scoring)
            if s is not None:
                matched += 1
                score += s
        if matched < required:
            return None
        return score * float(body.get("boost", 1.0))

    def _q_query_string(self, body: dict[str, Any], source: dict[str, Any], scoring: bool) -> Scored:
        from kvscope.testing.es_double_query_string import parse_query_string

        extra = set(body) - {"query", "default_operator", "lenient"}
        if extra or body.get("default_operator", "OR").upper() != "OR" or body.get("lenient"):
            raise Unsupported(f"query_string options {sorted(extra) or body}")
        translated = parse_query_string(str(body["query"]))
        if scoring:
            raise Unsupported("query_string scores (BM25); sort by a field or wrap it in constant_score")
        return self._eval(translated, source, False)

    # ---- term level ----------------------------------------------------------------------------------------
    def _field_body(self, body: Any, what: str) -> tuple[Field | None, str, Any]:
        name, value = one_entry(
            {k: v for k, v in body.items() if k not in ("boost", "_name")}
            if isinstance(body, dict)
            else body,
            what,
        )
        return self.mapping.field(name), name, value

    def _q_term(self, body: dict[str, Any], source: dict[str, Any], scoring: bool) -> Scored:
        field, name, spec = self._field_body(body, "term")
        options = spec if isinstance(spec, dict) else {"value": spec}
        if scoring:
            raise Unsupported(f"term query scores (BM25, [{name}]); wrap it in constant_score or filter")
        if field is None:
            return None
        insensitive = bool(options.get("case_insensitive", False))
        if field.type == "date":
            lo, hi = (_query_value(field, options["value"], round_up=r) for r in (False, True))
            return 1.0 if any(lo <= v <= hi for v in field.indexed(source)) else None
        wanted = _query_value(field, options["value"])
        for value in field.indexed(source):
            if value == wanted or (insensitive and str(value).lower() == str(wanted).lower()):
                return 1.0
        return None

    def _q_terms(self, body: dict[str, Any], source: dict[str, Any], scoring: bool) -> Scored:
        field, name, values = self._field_body(body, "terms")
        if not isinstance(values, list):
            raise Unsupported(f"the terms lookup of [{name}]")
        if field is None:
            return None
        wanted = {_query_value(field, v) for v in values}
        boost = float(body.get("boost", 1.0))
        return boost if any(v in wanted for v in field.indexed(source)) else None

    def _q_range(self, body: dict[str, Any], source: dict[str, Any], scoring: bool) -> Scored:
        field, name, spec = self._field_body(body, "range")
        bounds = {k: spec[k] for k in ("gt", "gte", "lt", "lte") if spec.get(k) is not None}
        extra = set(spec) - {"gt", "gte", "lt", "lte", "format", "boost", "relation"}
        if extra or spec.get("time_zone") or spec.get("relation", "INTERSECTS").upper() != "INTERSECTS":
            raise Unsupported(f"range options {sorted(extra)} on [{name}]")
        if field is None:
            return None
        fmt = spec.get("format")
        limits = {
            k: _query_value(field, v, round_up=k in ("gt", "lte"), date_format=fmt) for k, v in bounds.items()
        }
        for value in field.indexed(source):
            if all(_compare(value, op, limit) for op, limit in limits.items()):
                return float(spec.get("boost", 1.0))
        return None

    def _q_exists(self, body: dict[str, Any], source: dict[str, Any], scoring: bool) -> Scored:
        leaves = self.mapping.leaves_under(str(body["field"]))
        return float(body.get("boost", 1.0)) if any(f.indexed(source) for f in leaves) else None

    def _q_prefix(self, body: dict[str, Any], source: dict[str, Any], scoring: bool) -> Scored:
        field, name, spec = self._field_body(body, "prefix")
        options = spec if isinstance(spec, dict) else {"value": spec}
        return self._pattern(field, name, options, lambda v, p: v.startswith(p), source)

    def _q_wildcard(self, body: dict[str, Any], source: dict[str, Any], scoring: bool) -> Scored:
        field, name, spec = self._field_body(body, "wildcard")
        options = spec if isinstance(spec, dict) else {"value": spec}
        return self._pattern(field, name, options, wildcard_match, source)

    def _pattern(
        self,
        field: Field | None,
        name: str,
        options: dict[str, Any],
        test: Callable[[str, str], bool],
        source: dict[str, Any],
    ) -> Scored:
        if options.get("rewrite") not in (None, "constant_score_blended", "constant_score"):
            raise Unsupported(f"the rewrite [{options['rewrite']}]")
        if field is None:
            return None
        if field.type != "keyword":
            raise Unsupported(f"prefix/wildcard queries on the {field.type} field [{name}]")
        pattern = keyword_text(options.get("value", options.get("wildcard")))
        insensitive = bool(options.get("case_insensitive", False))
        for value in field.indexed(source):
            if test(value.lower(), pattern.lower()) if insensitive else test(value, pattern):
                return float(options.get("boost", 1.0))
        return None


def wildcard_match(value: str, pattern: str) -> bool:
    """Lucene wildcard: ``*`` any run, ``?`` one character, ``\\`` escapes (nothing else is special)."""
    if not any(c in pattern for c in "*?\\"):
        return value == pattern
    return _wildcard_regex(pattern).fullmatch(value) is not None


@functools.lru_cache(maxsize=1024)
def _wildcard_regex(pattern: str) -> re.Pattern[str]:
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            out.append(re.escape(pattern[i + 1]))
            i += 2
            continue
        out.append(".*" if c == "*" else "." if c == "?" else re.escape(c))
        i += 1
    return re.compile("".join(out), re.DOTALL)


def _query_value(field: Field, raw: Any, *, round_up: bool = False, date_format: str | None = None) -> Any:
    """A query's value read as ``field``'s type; ES answers 400 ``query_shard_exception`` when it does not
    parse (``lenient`` off)."""
    try:
        value = field.read(raw, round_up=round_up, date_format=date_format)
    except (ValueError, TypeError, OverflowError) as exc:
        raise SearchError(400, "query_shard_exception", f"failed to create query: {exc}") from None
    if value is None:  # a keyword query term longer than ignore_above still searches as itself
        return keyword_text(raw)
    return value


def _compare(value: Any, op: str, limit: Any) -> bool:
    if op == "gt":
        return value > limit
    if op == "gte":
        return value >= limit
    if op == "lt":
        return value < limit
    return value <= limit


def minimum_should_match(spec: Any, n_should: int, has_required: bool) -> int:
    """The number of ``should`` clauses a document must match ("minimum_should_match parameter" page):
    default 1 when the bool has no ``must``/``filter``, else 0; an integer (negative: all but that many);
    a percentage of the clauses, rounded down (negative: all but that share)."""
    if spec is None:
        return 1 if n_should and not has_required else 0
    text = str(spec).strip()
    if any(c in text for c in "<| "):
        raise Unsupported(f"the combination minimum_should_match [{spec}]")
    if text.endswith("%"):
        pct = float(text[:-1])
        count = math.floor(n_should * abs(pct) / 100)
        required = count if pct >= 0 else n_should - count
    else:
        number = int(text)
        required = number if number >= 0 else n_should + number
    return max(0, min(required, n_should))


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]
