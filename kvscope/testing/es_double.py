"""An in-process HTTP server that answers like Elasticsearch for what kvscope uses, with fault injection.

Speaks HTTP/1.1 with keep-alive on asyncio streams, so the real ``elasticsearch`` client (and its
transport, product check and compatibility headers) is what the tests exercise. Behaviour copied from
Elasticsearch 8.x/9.x (REST API docs and real responses):

- every response carries ``X-Elastic-Product: Elasticsearch`` (the client refuses a 2xx without it);
- ``compatible-with=N`` in Accept/Content-Type must be the server major or the one before, and the same in
  both headers when the request has a body, else 400 ``media_type_header_exception``; the response's
  Content-Type echoes the compatible media type;
- ILM policies, component templates and index templates are stored and acknowledged; an index template
  naming a missing component template is refused (400 ``invalid_index_template_exception``);
- ``_bulk`` auto-creates a data stream from a matching ``data_stream`` index template, allows only
  ``create`` on it, needs ``@timestamp``, enforces ``dynamic: strict`` and field types, answers 409
  ``version_conflict_engine_exception`` for an ``_id`` already in the write index, and reports every item
  with its own status plus the top-level ``errors`` flag; ``_rollover`` starts a new backing index;
  ``PUT _data_stream/<name>`` creates one empty (from its matching template);
- ``_search`` evaluates the query DSL, sort, ``search_after``, points in time and the aggregations kvscope
  sends, with Elasticsearch's documented semantics (kvscope/testing/es_double_search.py and the modules it
  names); what it does not model is refused with 400 ``es_double_unsupported``, never answered wrongly.
  ``_count`` and ``_refresh`` answer too. (There is no way to make it answer a canned body: a test ships
  records and the double computes the answer.)

Faults: :meth:`go_down`/:meth:`come_up` (the port stops listening: connection refused), ``delay_s``
(answer late, after applying the request), ``item_429_rate``/``item_503_rate`` (per-item
``es_rejected_execution_exception``/``unavailable_shards_exception``), ``bulk_statuses`` (whole ``_bulk``
requests refused with 429/503).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote

from kvscope.testing.es_double_docs import DataStream, validate_doc
from kvscope.testing.es_double_fields import SearchError, Unsupported
from kvscope.testing.es_double_search import PointsInTime, count, resolve, search, snapshot

JsonBody = dict[str, Any] | list[Any] | None
Answer = tuple[int, JsonBody]


def es_error(status: int, type_: str, reason: str, **extra: Any) -> Answer:
    """An Elasticsearch error body: ``{"error": {"root_cause": [...], "type", "reason"}, "status"}``."""
    cause = {"type": type_, "reason": reason, **extra}
    return status, {"error": {"root_cause": [cause], **cause}, "status": status}


ACK: Answer = (200, {"acknowledged": True})


@dataclass(slots=True)
class Request:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


@dataclass(slots=True)
class Faults:
    delay_s: float = 0.0
    item_429_rate: float = 0.0
    item_503_rate: float = 0.0
    bulk_statuses: list[int] = field(default_factory=list)
    """Statuses for the next whole ``_bulk`` requests (popped front first)."""


class EsDouble:
    """Elasticsearch stand-in; ``async with EsDouble() as es: es.url``."""

    def __init__(self, *, major: int = 9, seed: int = 0, product_header: bool = True) -> None:
        self.major = major
        self.product_header = product_header
        self.faults = Faults()
        self.rng = random.Random(seed)
        self.requests: list[Request] = []
        self.ilm_policies: dict[str, Any] = {}
        self.component_templates: dict[str, Any] = {}
        self.index_templates: dict[str, Any] = {}
        self.data_streams: dict[str, DataStream] = {}
        self.created: Counter[str] = Counter()
        """Successful creates per ``_id`` (every one should be exactly 1)."""
        self.item_statuses: Counter[int] = Counter()
        """Every ``_bulk`` item status answered."""
        self.pits = PointsInTime()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    async def __aenter__(self) -> EsDouble:
        await self.come_up()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.go_down()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def come_up(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def go_down(self) -> None:
        """Stop listening and cut every open connection (clients then see connection refused)."""
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()
            await self._server.wait_closed()
            self._server = None

    def docs(self, stream: str = "kvscope-requests") -> dict[str, Any]:
        """All documents of ``stream`` by ``_id`` (over every backing index)."""
        ds = self.data_streams.get(stream)
        return {} if ds is None else {k: v for index in ds.indices for k, v in index.docs.items()}

    # ---- HTTP --------------------------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while (request := await _read_request(reader)) is not None:
                self.requests.append(request)
                status, body, compat = self._answer(request)
                if self.faults.delay_s:
                    await asyncio.sleep(self.faults.delay_s)
                writer.write(
                    _response(
                        status, body, compat, head=request.method == "HEAD", product=self.product_header
                    )
                )
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        except asyncio.CancelledError:
            pass  # loop shutdown; swallowed because Python 3.11's stream callback mis-reports cancelled tasks
        finally:
            self._writers.discard(writer)
            writer.close()

    def _answer(self, request: Request) -> tuple[int, JsonBody, int | None]:
        compat, error = self._compat(request)
        if error is not None:
            return (*error, None)
        try:
            status, body = self._route(request)
        except json.JSONDecodeError as exc:
            status, body = es_error(400, "x_content_parse_exception", f"[1:1] {exc}")
        return status, body, compat

    def _compat(self, request: Request) -> tuple[int | None, Answer | None]:
        accept = request.headers.get("accept", "")
        ctype = request.headers.get("content-type", "")
        found = {h: re.search(r"compatible-with=(\d+)", v) for h, v in (("accept", accept), ("ctype", ctype))}
        versions = {int(m.group(1)) for m in found.values() if m}
        if not versions:
            return None, None
        both = found["accept"] is not None and found["ctype"] is not None
        if len(versions) > 1 or not versions <= {self.major, self.major - 1} or (request.body and not both):
            return None, es_error(
                400,
                "media_type_header_exception",
                "Invalid media-type value on headers [Content-Type, Accept]",
                caused_by={
                    "type": "status_exception",
                    "reason": "A compatible version is required on both "
                    f"Content-Type and Accept headers if either one has requested a compatible version. "
                    f"Accept={accept or None}, Content-Type={ctype or None}",
                },
            )
        return versions.pop(), None

    # ---- routing -----------------------------------------------------------------------------------
    def _route(self, r: Request) -> Answer:
        parts = [unquote(p) for p in r.path.split("/") if p]
        if r.method in ("GET", "HEAD") and not parts:
            return 200, self._info()
        if parts and parts[-1] == "_bulk" and r.method in ("POST", "PUT"):
            return self._bulk(r, parts[0] if len(parts) == 2 else None)
        if parts and parts[-1] in ("_search", "_count", "_pit", "_refresh") and len(parts) <= 2:
            return self._search_api(r, parts[-1], parts[0] if len(parts) == 2 else None)
        if len(parts) == 2 and parts[1] == "_rollover" and r.method == "POST":
            return self._rollover(parts[0])
        if len(parts) == 3 and parts[:2] == ["_ilm", "policy"]:
            return self._store(r, self.ilm_policies, parts[2], "policy")
        if len(parts) == 2 and parts[0] in ("_component_template", "_index_template"):
            store = self.component_templates if parts[0] == "_component_template" else self.index_templates
            return self._store(r, store, parts[1], "template" if store is self.component_templates else None)
        if len(parts) == 2 and parts[0] == "_data_stream" and r.method == "GET":
            return self._get_data_stream(parts[1])
        if len(parts) == 2 and parts[0] == "_data_stream" and r.method == "PUT":
            return self._create_data_stream(parts[1])
        return 400, {"error": f"no handler found for uri [{r.path}] and method [{r.method}]"}

    def _info(self) -> dict[str, Any]:
        return {
            "name": "es-double",
            "cluster_name": "kvscope-test",
            "cluster_uuid": "dOuBlE",
            "version": {
                "number": f"{self.major}.1.0",
                "build_flavor": "default",
                "minimum_wire_compatibility_version": f"{self.major - 1}.19.0",
                "minimum_index_compatibility_version": f"{self.major - 1}.0.0",
            },
            "tagline": "You Know, for Search",
        }

    def _store(self, r: Request, store: dict[str, Any], name: str, required: str | None) -> Answer:
        if r.method == "GET":
            return self._get_stored(store, name)
        if r.method != "PUT":
            return 405, {"error": f"Incorrect HTTP method for uri [{r.path}] and method [{r.method}]"}
        body = r.json()
        if not isinstance(body, dict) or (required and required not in body):
            return es_error(400, "x_content_parse_exception", f"[1:1] required field [{required}] is missing")
        if store is self.index_templates:
            missing = [c for c in body.get("composed_of", []) if c not in self.component_templates]
            if missing or not body.get("index_patterns"):
                return es_error(
                    400,
                    "invalid_index_template_exception",
                    f"index_template [{name}] invalid, cause [index template [{name}] specifies "
                    f"component templates {missing} that do not exist]",
                )
            if "data_stream" in body and not self._timestamp_ok(body):
                return es_error(
                    400,
                    "illegal_argument_exception",
                    "data stream timestamp field [@timestamp] "
                    "has disallowed [ignore_malformed] attribute specified",
                )
        store[name] = body
        return ACK

    def _timestamp_ok(self, template: dict[str, Any]) -> bool:
        """ES 8.x before 8.11: ``@timestamp`` must not inherit ``index.mapping.ignore_malformed: true``."""
        parts = [self.component_templates[c]["template"] for c in template.get("composed_of", [])]
        ds = DataStream.create("check", "check", [*parts, template.get("template", {})])
        ts = ds.mappings.get("properties", {}).get("@timestamp", {})
        inherited = bool(ds.settings.get("index.mapping.ignore_malformed", False))
        return ts.get("ignore_malformed", inherited) is False

    def _get_stored(self, store: dict[str, Any], name: str) -> Answer:
        if name not in store:
            return es_error(404, "resource_not_found_exception", f"[{name}] not found")
        if store is self.ilm_policies:
            return 200, {name: {"version": 1, "modified_date": "2025-01-01T00:00:00.000Z", **store[name]}}
        kind = "component_template" if store is self.component_templates else "index_template"
        return 200, {f"{kind}s": [{"name": name, kind: store[name]}]}

    def _get_data_stream(self, name: str) -> Answer:
        ds = self.data_streams.get(name)
        if ds is None:
            return es_error(404, "index_not_found_exception", f"no such index [{name}]", index=name)
        return 200, {"data_streams": [ds.describe()]}

    def _create_data_stream(self, name: str) -> Answer:
        """``PUT _data_stream/<name>``: the data stream of the matching ``data_stream`` index template."""
        if name in self.data_streams:
            return es_error(400, "resource_already_exists_exception", f"data_stream [{name}] already exists")
        if self._data_stream_for(name) is None:
            return es_error(
                400,
                "illegal_argument_exception",
                f"no matching index template found for data stream [{name}]",
            )
        return ACK

    def _rollover(self, name: str) -> Answer:
        ds = self.data_streams.get(name)
        if ds is None:
            return es_error(400, "illegal_argument_exception", f"rollover target [{name}] does not exist")
        old = ds.write_index.name
        ds.roll_over()
        return 200, {
            "acknowledged": True,
            "shards_acknowledged": True,
            "old_index": old,
            "new_index": ds.write_index.name,
            "rolled_over": True,
            "dry_run": False,
            "conditions": {},
        }

    def _search_api(self, r: Request, api: str, target: str | None) -> Answer:
        """``_search``, ``_count``, ``_pit`` and ``_refresh`` (kvscope/testing/es_double_search.py)."""
        try:
            if api == "_pit" and target is None and r.method == "DELETE":
                pit_id = str((r.json() or {}).get("id"))
                freed = self.pits.open.pop(pit_id, None) is not None
                return (200 if freed else 404), {"succeeded": True, "num_freed": int(freed)}
            if api == "_search" and (r.method not in ("GET", "POST")):
                return 405, {"error": f"Incorrect HTTP method for uri [{r.path}] and method [{r.method}]"}
            if api == "_search":
                body = r.json()
                if unsupported := set(parse_qs(r.query)) - {"typed_keys", "rest_total_hits_as_int"}:
                    raise Unsupported(f"the _search URL parameters {sorted(unsupported)}")
                pit = (body or {}).get("pit")
                if pit is None:
                    return 200, search(resolve(self.data_streams, target or "*"), body)
                if target is not None:
                    raise SearchError(
                        400,
                        "action_request_validation_exception",
                        "Validation Failed: 1: [indices] cannot be used with point in time. Do not specify "
                        "any index with point in time;",
                    )
                docs = self.pits.open.get(pit.get("id"))
                if docs is None:
                    raise SearchError(
                        404, "search_context_missing_exception", "No search context found for id"
                    )
                return 200, search(docs, {k: v for k, v in body.items() if k != "pit"}, pit["id"])
            if api == "_pit" and r.method == "POST" and target is not None:
                if "keep_alive" not in parse_qs(r.query):
                    raise SearchError(
                        400,
                        "action_request_validation_exception",
                        "Validation Failed: 1: [keep_alive] is not set;",
                    )
                pit_id = self.pits.create(snapshot(resolve(self.data_streams, target)))
                return 200, {
                    "id": pit_id,
                    "_shards": {"total": 1, "successful": 1, "skipped": 0, "failed": 0},
                }
            if api == "_count" and target is not None and r.method in ("GET", "POST"):
                return 200, count(resolve(self.data_streams, target), r.json())
            if api == "_refresh" and target is not None and r.method in ("GET", "POST"):
                resolve(self.data_streams, target)  # 404 for an unknown index; writes are visible at once
                return 200, {"_shards": {"total": 1, "successful": 1, "failed": 0}}
        except SearchError as exc:
            return es_error(exc.status, exc.type_, exc.reason)
        return 400, {"error": f"no handler found for uri [{r.path}] and method [{r.method}]"}

    # ---- _bulk -------------------------------------------------------------------------------------
    def _bulk(self, r: Request, default_index: str | None) -> Answer:
        if self.faults.bulk_statuses:
            status = self.faults.bulk_statuses.pop(0)
            if status == 429:
                return es_error(
                    429,
                    "es_rejected_execution_exception",
                    "rejected execution of coordinating operation [coordinating_and_primary_bytes="
                    "104857600, replica_bytes=0, all_bytes=104857600, coordinating_operation_bytes="
                    "1024, max_coordinating_and_primary_bytes=104857600]",
                )
            return es_error(
                status, "unavailable_shards_exception", "[.ds-kvscope][0] primary shard is not active"
            )
        if not r.body.endswith(b"\n"):
            return es_error(
                400, "illegal_argument_exception", "The bulk request must be terminated by a newline [\\n]"
            )
        started = time.perf_counter()
        lines = r.body.decode().split("\n")[:-1]
        items: list[dict[str, Any]] = []
        i = 0
        while i < len(lines):
            action = json.loads(lines[i])
            op, meta = next(iter(action.items()))
            source = json.loads(lines[i + 1]) if op != "delete" else None
            i += 2 if op != "delete" else 1
            item = self._bulk_item(op, meta, source, default_index)
            self.item_statuses[item["status"]] += 1
            items.append({op: item})
        errors = any("error" in next(iter(item.values())) for item in items)
        return 200, {"errors": errors, "took": int((time.perf_counter() - started) * 1000), "items": items}

    def _bulk_item(
        self, op: str, meta: dict[str, Any], source: Any, default_index: str | None
    ) -> dict[str, Any]:
        target = meta.get("_index", default_index)
        doc_id = meta.get("_id") or f"auto-{self.rng.getrandbits(64):016x}"
        roll = self.rng.random()
        if roll < self.faults.item_429_rate:
            return {
                "_index": target,
                "_id": doc_id,
                "status": 429,
                "error": {
                    "type": "es_rejected_execution_exception",
                    "reason": "rejected execution of primary operation [shard_detail=[.ds-kvscope][0]]",
                },
            }
        if roll < self.faults.item_429_rate + self.faults.item_503_rate:
            return {
                "_index": target,
                "_id": doc_id,
                "status": 503,
                "error": {"type": "unavailable_shards_exception", "reason": "primary shard is not active"},
            }
        ds = self._data_stream_for(target)
        if ds is None:
            return {
                "_index": target,
                "_id": doc_id,
                "status": 404,
                "error": {"type": "index_not_found_exception", "reason": f"no such index [{target}]"},
            }
        if op != "create":
            return {
                "_index": target,
                "_id": doc_id,
                "status": 400,
                "error": {
                    "type": "illegal_argument_exception",
                    "reason": "only write ops with an op_type of create are allowed in data streams",
                },
            }
        index = ds.write_index
        problem = validate_doc(source, ds.mappings, ds.settings)
        if problem is not None:
            return {"_index": index.name, "_id": doc_id, "status": 400, "error": problem}
        if doc_id in index.docs:
            return {
                "_index": index.name,
                "_id": doc_id,
                "status": 409,
                "error": {
                    "type": "version_conflict_engine_exception",
                    "reason": f"[{doc_id}]: version conflict, document already exists (current version [1])",
                    "index_uuid": index.uuid,
                    "shard": "0",
                    "index": index.name,
                },
            }
        index.docs[doc_id] = source
        self.created[doc_id] += 1
        return {
            "_index": index.name,
            "_id": doc_id,
            "_version": 1,
            "result": "created",
            "_shards": {"total": 2, "successful": 1, "failed": 0},
            "_seq_no": len(index.docs) - 1,
            "_primary_term": 1,
            "status": 201,
        }

    def _data_stream_for(self, name: str) -> DataStream | None:
        if name in self.data_streams:
            return self.data_streams[name]
        matches = [
            (t.get("priority", 0), n, t)
            for n, t in self.index_templates.items()
            if "data_stream" in t
            and any(re.fullmatch(p.replace("*", ".*"), name) for p in t["index_patterns"])
        ]
        if not matches:
            return None
        _, template_name, template = max(matches, key=lambda m: m[0])
        parts = [self.component_templates[c]["template"] for c in template.get("composed_of", [])]
        parts.append(template.get("template", {}))
        self.data_streams[name] = DataStream.create(name, template_name, parts)
        return self.data_streams[name]


async def _read_request(reader: asyncio.StreamReader) -> Request | None:
    line = await reader.readline()
    if not line:
        return None
    method, target, _ = line.decode("latin-1").split(" ", 2)
    headers: dict[str, str] = {}
    while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = h.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    path, _, query = target.partition("?")
    return Request(method, path, query, headers, body)


def _response(status: int, body: JsonBody, compat: int | None, *, head: bool, product: bool = True) -> bytes:
    payload = b"" if body is None else json.dumps(body).encode()
    ctype = f"application/vnd.elasticsearch+json;compatible-with={compat}" if compat else "application/json"
    head_lines = [
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}",
        *(["X-Elastic-Product: Elasticsearch"] if product else []),
        f"content-type: {ctype}",
        f"content-length: {len(payload)}",
        "",
        "",
    ]
    return "\r\n".join(head_lines).encode() + (b"" if head else payload)


_REASONS = {
    200: "OK",
    201: "Created",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    429: "Too Many Requests",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


async def _serve_forever(port: int) -> None:
    double = EsDouble()
    double.port = port
    await double.come_up()
    print(double.url, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":  # python -m kvscope.testing.es_double PORT (used by bench/es_sink.py)
    import sys

    asyncio.run(_serve_forever(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
