"""Connection settings and the ``AsyncElasticsearch`` client factory shared by the sink, setup and analytics.

Compatibility mode: the 9.x Python client sends ``Accept``/``Content-Type:
application/vnd.elasticsearch+json; compatible-with=9`` on every request. Elasticsearch 9 accepts that,
Elasticsearch 8 rejects it (400 ``media_type_header_exception``). REST API compatibility lets a server
answer requests written for the previous major, so ``compatible-with=8`` is understood by both 8.x and 9.x
servers. We therefore default to ``compat_major=8`` (works with ES ≥ 8.0 and 9.x) and rewrite the header in
a transport subclass; set ``compat_major=9`` to use the client's native mode against a 9.x-only cluster.
Every API we call (``_bulk``, index/component templates, ILM, ``_search`` aggregations) has the same
request and response shape in both majors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec
from elastic_transport import AsyncTransport, HttpHeaders, SerializationError
from elasticsearch import AsyncElasticsearch
from elasticsearch.serializer import JsonSerializer

_COMPAT_RE = re.compile(r"compatible-with=\d+")


@dataclass(frozen=True, slots=True)
class EsConnectionConfig:
    hosts: tuple[str, ...] = ("http://localhost:9200",)
    """Elasticsearch URLs (``https://…`` for TLS)."""
    api_key: str | None = None
    """Encoded API key (base64 of ``id:api_key``, as Kibana and the create-API-key call return it)."""
    basic_auth: tuple[str, str] | None = None
    """(user, password); ignored when ``api_key`` is set."""
    ca_certs: str | None = None
    """Path to a PEM CA bundle that signed the cluster's certificate (ES 8 security auto-config's
    http_ca.crt)."""
    verify_certs: bool = True
    """Verify TLS certificates (only switch off on a throwaway test cluster)."""
    request_timeout_s: float = 10.0
    """Per-request timeout; a bulk that times out is retried (idempotently) later."""
    compat_major: int = 8
    """REST compatibility version sent in Accept/Content-Type: 8 (ES 8.x and 9.x) or 9 (ES 9.x only)."""
    node_class: str = "httpxasync"
    """elastic-transport HTTP node: ``httpxasync`` (httpx, a gateway dependency) or ``aiohttp`` (needs
    aiohttp)."""

    def __post_init__(self) -> None:
        if not self.hosts:
            raise ValueError("at least one Elasticsearch host is required")
        if self.compat_major not in (8, 9):
            raise ValueError(f"compat_major must be 8 or 9, got {self.compat_major}")
        if self.request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be > 0")


class Compat8Transport(AsyncTransport):
    """Transport that asks for REST API compatibility with 8.x (understood by ES 8 and ES 9 servers)."""

    compat_major = 8

    async def perform_request(self, method: str, target: str, **kwargs: Any) -> Any:
        headers = kwargs.get("headers")
        if headers:
            rewritten = HttpHeaders(headers)
            for name in ("accept", "content-type"):
                value = rewritten.get(name)
                if value:
                    rewritten[name] = _COMPAT_RE.sub(f"compatible-with={self.compat_major}", value)
            kwargs["headers"] = rewritten
        return await super().perform_request(method, target, **kwargs)


class MsgspecJsonSerializer(JsonSerializer):
    """The client's JSON (de)serializer on msgspec instead of the stdlib ``json`` it uses by default: a bulk
    body is encoded on the event loop, so its cost per record is the gateway's (docs/benchmarks.md "The
    gateway's CPU per relayed token")."""

    def __init__(self) -> None:
        self._encoder = msgspec.json.Encoder(decimal_format="number")
        self._decoder = msgspec.json.Decoder()

    def dumps(self, data: Any) -> bytes:
        if isinstance(data, str):
            return data.encode("utf-8", "surrogatepass")
        if isinstance(data, bytes):
            return data
        try:
            return self._encoder.encode(data)
        except (TypeError, ValueError, msgspec.EncodeError) as exc:
            raise SerializationError(f"Unable to serialize to JSON: {exc}", errors=(exc,)) from exc

    def loads(self, data: bytes) -> Any:
        try:
            return self._decoder.decode(data)
        except msgspec.DecodeError as exc:
            raise SerializationError(f"Unable to deserialize as JSON: {data[:200]!r}", errors=(exc,)) from exc


def make_client(config: EsConnectionConfig, *, max_retries: int = 0) -> AsyncElasticsearch:
    """Build an ``AsyncElasticsearch`` for ``config``.

    ``max_retries`` is the transport's own retry count on connection errors and 502/503/504 (the sink
    passes 0 and retries per item itself; the CLI uses the client default of 3). Raises ``ValueError``
    for inconsistent TLS options (from elastic-transport).
    """
    kwargs: dict[str, Any] = {
        "request_timeout": config.request_timeout_s,
        "max_retries": max_retries,
        "retry_on_timeout": False,
        "node_class": config.node_class,
        "verify_certs": config.verify_certs,
        "serializer": MsgspecJsonSerializer(),
    }
    if config.api_key:
        kwargs["api_key"] = config.api_key
    elif config.basic_auth:
        kwargs["basic_auth"] = config.basic_auth
    if config.ca_certs:
        kwargs["ca_certs"] = config.ca_certs
    if config.compat_major == 8:
        kwargs["transport_class"] = Compat8Transport
    return AsyncElasticsearch(list(config.hosts), **kwargs)


def is_es_url(source: str) -> bool:
    """True when a ``--source`` names an Elasticsearch endpoint rather than a file path."""
    return source.startswith(("http://", "https://"))
