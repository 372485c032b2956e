"""``_search``, point in time and ``_count`` for the Elasticsearch double (Elasticsearch 8.x/9.x reference:
"Search API", "Sort search results", "Paginate search results", "Point in time API", "Retrieve selected
fields").

- ``query`` (:mod:`kvscope.testing.es_double_query`), ``aggs`` (:mod:`kvscope.testing.es_double_aggs`),
  ``size`` (default 10), ``from`` (default 0; ``from + size`` at most ``index.max_result_window`` 10,000),
  ``_source`` (true/false, paths and wildcards, ``includes``/``excludes``), ``track_total_hits`` (default:
  exact up to 10,000 then ``relation: gte``; ``true`` exact; ``false`` no total), ``track_scores``.
- ``sort``: fields (``asc`` by default), ``_score`` (``desc`` by default), ``_doc``, ``_shard_doc``; a field
  with several values sorts by its minimum ascending and its maximum descending (``mode``); a document
  without the field sorts last (``missing: _last``, the default) or first, and its sort value is
  Lucene's stand-in: ``Long.MAX_VALUE``/``Long.MIN_VALUE`` for long, date and boolean fields,
  ``"Infinity"``/``"-Infinity"`` for double fields, null for keywords (elastic/elasticsearch#77720: a real
  value equal to the stand-in ties with it); a field no index maps is refused unless ``unmapped_type``
  is given; text fields cannot be sorted. Without a sort, hits are by score, descending, then index order.
  A hit has ``sort`` (the values) when the request sorts; ``_score``/``max_score`` are null when it sorts
  by fields without ``_score`` or ``track_scores``.
- ``search_after``: the hits strictly after those values in the sort order (``from`` must be 0).
- Point in time: ``POST /<target>/_pit?keep_alive=`` keeps the documents of that moment (later writes are
  not seen); a ``_search`` with ``pit`` names no index, answers ``pit_id``, and sorts with an implicit
  ``_shard_doc`` ascending tiebreaker appended ("Paginate search results"); ``DELETE /_pit`` frees it.
- Target: a data stream, a backing index, a comma list or a ``*`` pattern; a name that matches nothing is
  404 ``index_not_found_exception`` (a pattern that matches nothing: no hits).
"""

from __future__ import annotations

import base64
import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvscope.testing.es_double_aggs import aggregate
from kvscope.testing.es_double_fields import (
    LONG_MAX,
    LONG_MIN,
    Doc,
    Field,
    Mapping,
    SearchError,
    Unsupported,
)
from kvscope.testing.es_double_query import Evaluator, one_entry, wildcard_match

if TYPE_CHECKING:
    from kvscope.testing.es_double_docs import DataStream

MAX_RESULT_WINDOW = 10_000
TOTAL_HITS_DEFAULT = 10_000
_BODY_KEYS = {
    "query",
    "size",
    "from",
    "sort",
    "search_after",
    "pit",
    "aggs",
    "aggregations",
    "_source",
    "track_total_hits",
    "track_scores",
    "timeout",
}


@dataclass(slots=True)
class PointsInTime:
    """Open points in time: id → the documents of the moment it was opened."""

    open: dict[str, list[Doc]] = field(default_factory=dict)
    opened: int = 0

    def create(self, docs: list[Doc]) -> str:
        self.opened += 1
        pit_id = base64.urlsafe_b64encode(f"es-double-pit-{self.opened}".encode()).decode()
        self.open[pit_id] = docs
        return pit_id


def resolve(data_streams: dict[str, DataStream], target: str) -> list[Doc]:
    """The documents of ``target`` (module doc). Raises SearchError 404 for a concrete name that matches
    nothing."""
    docs: list[Doc] = []
    shard = 0
    for name in target.split(","):
        found = False
        for ds in data_streams.values():
            names = [ds.name, *(i.name for i in ds.indices)]
            if not any(wildcard_match(n, name) for n in names):
                continue
            found = True
            mapping = Mapping(ds.mappings, ds.settings)
            whole = wildcard_match(ds.name, name)
            for index in ds.indices:
                if whole or wildcard_match(index.name, name):
                    for n, (doc_id, source) in enumerate(index.docs.items()):
                        docs.append(Doc(index.name, doc_id, source, mapping, (shard << 32) | n))
                shard += 1
        if not found and "*" not in name:
            raise SearchError(404, "index_not_found_exception", f"no such index [{name}]")
    return docs


@dataclass(frozen=True, slots=True)
class SortKey:
    kind: str
    """``field``, ``_score``, ``_doc`` or ``_shard_doc``."""
    name: str
    desc: bool
    missing_last: bool = True
    missing_value: Any = None
    mode: str | None = None
    field: Field | None = None
    unmapped: bool = False


def _sort_keys(spec: Any, docs: list[Doc], pit: bool) -> list[SortKey] | None:
    if spec is None:
        return None
    entries = spec if isinstance(spec, list) else [spec]
    keys = []
    for entry in entries:
        if isinstance(entry, str):
            name, options = entry, {}
        else:
            name, options = one_entry(entry, "sort")
            options = {"order": options} if isinstance(options, str) else dict(options)
        order = str(options.pop("order", "desc" if name == "_score" else "asc"))
        desc = order == "desc"
        if name in ("_score", "_doc", "_shard_doc"):
            keys.append(SortKey(name, name, desc))
            continue
        missing = options.pop("missing", "_last")
        mode = options.pop("mode", None)
        unmapped_type = options.pop("unmapped_type", None)
        options.pop("numeric_type", None)
        if options:
            raise Unsupported(f"sort options {sorted(options)} on [{name}]")
        mapped = next((f for d in docs if (f := d.mapping.field(name)) is not None), None)
        if mapped is None and unmapped_type is None and docs:
            raise SearchError(
                400, "query_shard_exception", f"No mapping found for [{name}] in order to sort on"
            )
        if mapped is not None and mapped.type in ("match_only_text", "text"):
            raise SearchError(
                400,
                "illegal_argument_exception",
                f"Fielddata is disabled on [{name}] in [{docs[0].index}]. Text fields are not optimised for "
                "operations that require per-document field data like aggregations and sorting",
            )
        custom = None if missing in ("_last", "_first") else missing
        if custom is not None and mapped is not None:
            custom = mapped.read(custom)
        keys.append(
            SortKey("field", name, desc, missing != "_first", custom, mode, mapped, unmapped=mapped is None)
        )
    if pit and not any(k.kind == "_shard_doc" for k in keys):
        keys.append(SortKey("_shard_doc", "_shard_doc", False))  # the implicit PIT tiebreaker
    return keys


def _sort_value(key: SortKey, doc: Doc, score: float) -> Any:
    """The value a hit shows in ``sort`` for ``key`` (module doc for the stand-ins of missing values)."""
    if key.kind == "_score":
        return score
    if key.kind in ("_doc", "_shard_doc"):
        return doc.shard_doc
    f = doc.mapping.field(key.name) if not key.unmapped else None
    values = f.indexed(doc.source) if f is not None else []
    if values:
        mode = key.mode or ("max" if key.desc else "min")
        if mode == "min":
            value = min(values)
        elif mode == "max":
            value = max(values)
        elif mode in ("sum", "avg", "median") and key.field is not None and key.field.numeric:
            ordered = sorted(values)
            value = (
                sum(ordered)
                if mode == "sum"
                else sum(ordered) / len(ordered)
                if mode == "avg"
                else (ordered[(len(ordered) - 1) // 2] + ordered[len(ordered) // 2]) / 2
            )
        else:
            raise Unsupported(f"sort mode [{mode}] on [{key.name}]")
        return _sort_output(key, value)
    if key.missing_value is not None:
        return _sort_output(key, key.missing_value)
    kind = key.field.type if key.field is not None else "keyword"
    high = key.missing_last != key.desc  # _last ascending / _first descending: the largest stand-in
    if kind in ("double", "float"):
        return "Infinity" if high else "-Infinity"
    if kind in ("long", "integer", "short", "byte", "date", "boolean"):
        return LONG_MAX if high else LONG_MIN
    return None


def _sort_output(key: SortKey, value: Any) -> Any:
    if isinstance(value, bool):
        return 1 if value else 0
    if key.field is not None and key.field.type in ("double", "float"):
        return float(value)
    return value


def _comparable(key: SortKey, value: Any) -> tuple[int, Any]:
    """A sort value as something Python orders the way Elasticsearch does (nulls: where ``missing`` puts
    them)."""
    if value is None:
        return (1 if key.missing_last != key.desc else -1, 0)
    if isinstance(value, str) and value in ("Infinity", "-Infinity") and key.kind == "field":
        if key.field is not None and key.field.type in ("double", "float"):
            return (0, float(value))
    return (0, value)


def _compare(keys: list[SortKey], a: list[Any], b: list[Any]) -> int:
    for key, x, y in zip(keys, a, b, strict=True):
        cx, cy = _comparable(key, x), _comparable(key, y)
        if cx == cy:
            continue
        less = cx < cy
        return (1 if less else -1) if key.desc else (-1 if less else 1)
    return 0


def _after_values(keys: list[SortKey], after: Any) -> list[Any]:
    if not isinstance(after, list) or len(after) != len(keys):
        raise SearchError(
            400,
            "illegal_argument_exception",
            f"search_after has {len(after) if isinstance(after, list) else 1} value(s) but sort has "
            f"{len(keys)}.",
        )
    out = []
    for key, value in zip(keys, after, strict=True):
        if key.kind == "field" and key.field is not None and value is not None:
            if key.field.type == "date" and isinstance(value, str) and value not in ("Infinity", "-Infinity"):
                value = key.field.read(value)
            elif key.field.type in ("double", "float") and not isinstance(value, str):
                value = float(value)
        out.append(value)
    return out


def filter_source(source: dict[str, Any], spec: Any) -> dict[str, Any] | None:
    """``_source`` after source filtering (None: ``_source: false``)."""
    if spec is None or spec is True:
        return source
    if spec is False:
        return None
    if isinstance(spec, dict):
        includes, excludes = _as_list(spec.get("includes")), _as_list(spec.get("excludes"))
    else:
        includes, excludes = _as_list(spec), []
    return _filter_node(source, "", includes, excludes) or {}


def _filter_node(
    node: dict[str, Any], prefix: str, includes: list[str], excludes: list[str]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in node.items():
        path = prefix + key
        if any(wildcard_match(path, p) for p in excludes):
            continue
        if not includes or any(wildcard_match(path, p) for p in includes):
            out[key] = _drop_excluded(value, path, excludes)
        elif isinstance(value, dict):
            inner = _filter_node(value, path + ".", includes, excludes)
            if inner:
                out[key] = inner
        elif isinstance(value, list) and any(isinstance(v, dict) for v in value):
            items = [_filter_node(v, path + ".", includes, excludes) for v in value if isinstance(v, dict)]
            if any(items):
                out[key] = [i for i in items if i]
    return out


def _drop_excluded(value: Any, path: str, excludes: list[str]) -> Any:
    if not excludes or not isinstance(value, dict):
        return value
    return _filter_node(value, path + ".", [], excludes)


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def search(docs: list[Doc], body: dict[str, Any] | None, pit_id: str | None = None) -> dict[str, Any]:
    """The response to a ``_search`` with ``body`` over ``docs``. Raises SearchError/Unsupported."""
    body = body or {}
    unknown = set(body) - _BODY_KEYS
    if unknown:
        raise Unsupported(f"the search body keys {sorted(unknown)}")
    size, start = int(body.get("size", 10)), int(body.get("from", 0))
    if size < 0 or start < 0:
        raise SearchError(400, "illegal_argument_exception", "[from] and [size] must be non-negative")
    if start + size > MAX_RESULT_WINDOW:
        raise SearchError(
            400,
            "illegal_argument_exception",
            f"Result window is too large, from + size must be less than or equal to: [{MAX_RESULT_WINDOW}] "
            f"but was [{start + size}].",
        )
    keys = _sort_keys(body.get("sort"), docs, pit_id is not None)
    by_score = keys is None or any(k.kind == "_score" for k in keys)
    scores_wanted = (by_score and size > 0) or bool(body.get("track_scores"))
    evaluators: dict[int, Evaluator] = {}
    matched: list[tuple[Doc, float]] = []
    for doc in docs:
        ev = evaluators.setdefault(id(doc.mapping), Evaluator(doc.mapping, scores_wanted))
        score = ev.run(body.get("query"), doc.source)
        if score is not None:
            matched.append((doc, score))
    hits = _hits(matched, keys, body, size, start)
    response: dict[str, Any] = {
        "took": 1,
        "timed_out": False,
        "_shards": {"total": 1, "successful": 1, "skipped": 0, "failed": 0},
        "hits": {**_total(body.get("track_total_hits"), len(matched)), **hits},
    }
    if pit_id is not None:
        response = {"pit_id": pit_id, **response}
    aggs = body.get("aggs", body.get("aggregations"))
    if aggs:
        response["aggregations"] = aggregate(aggs, [d for d, _ in matched])
    return response


def _total(track: Any, n: int) -> dict[str, Any]:
    if track is False:
        return {}
    limit = TOTAL_HITS_DEFAULT if track is None else (2**31 - 1 if track is True else int(track))
    return {"total": {"value": min(n, limit), "relation": "eq" if n <= limit else "gte"}}


def _hits(
    matched: list[tuple[Doc, float]], keys: list[SortKey] | None, body: dict[str, Any], size: int, start: int
) -> dict[str, Any]:
    track_scores = bool(body.get("track_scores"))
    if keys is None:
        if "search_after" in body:
            raise SearchError(400, "illegal_argument_exception", "Sort must contain at least one field.")
        ordered = sorted(matched, key=lambda m: -m[1])  # stable: ties keep index order
        page = ordered[start : start + size]
        return {
            "max_score": max((s for _, s in matched), default=None),
            "hits": [_hit(d, s, body, None) for d, s in page],
        }
    rows = [(d, s, [_sort_value(k, d, s) for k in keys]) for d, s in matched]
    rows.sort(key=functools.cmp_to_key(lambda a, b: _compare(keys, a[2], b[2])))
    if "search_after" in body:
        if start:
            raise SearchError(
                400,
                "illegal_argument_exception",
                "[from] parameter must be set to 0 when [search_after] is used",
            )
        after = _after_values(keys, body["search_after"])
        rows = [r for r in rows if _compare(keys, r[2], after) > 0]
    page = rows[start : start + size]
    scored = track_scores or any(k.kind == "_score" for k in keys)
    return {
        "max_score": max((s for _, s in matched), default=None) if scored else None,
        "hits": [_hit(d, s if scored else None, body, v) for d, s, v in page],
    }


def _hit(doc: Doc, score: float | None, body: dict[str, Any], sort: list[Any] | None) -> dict[str, Any]:
    hit: dict[str, Any] = {"_index": doc.index, "_id": doc.id, "_score": score}
    source = filter_source(doc.source, body.get("_source"))
    if source is not None:
        hit["_source"] = source
    if sort is not None:
        hit["sort"] = sort
    return hit


def count(docs: list[Doc], body: dict[str, Any] | None) -> dict[str, Any]:
    """``_count``: the documents matching ``body["query"]``."""
    query = (body or {}).get("query")
    evaluators: dict[int, Evaluator] = {}
    n = sum(
        evaluators.setdefault(id(d.mapping), Evaluator(d.mapping, False)).run(query, d.source) is not None
        for d in docs
    )
    return {"count": n, "_shards": {"total": 1, "successful": 1, "skipped": 0, "failed": 0}}


def snapshot(docs: Iterable[Doc]) -> list[Doc]:
    """A point in time's copy of ``docs`` (later writes to the indices are not seen)."""
    return [Doc(d.index, d.id, d.source, d.mapping, d.shard_doc) for d in docs]
