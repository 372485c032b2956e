"""GatewayState: the gateway's long-lived parts, one per app (``app.state.gateway``); built and started by
gateway/lifespan.py, read by every route. It imports only the parts it holds, never the request path.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import httpx
from litestar.connection import ASGIConnection

from kvscope.common.otel_genai import GenAiClientMetrics
from kvscope.gateway.auth import Authenticator
from kvscope.gateway.forwarded import ClientAddressResolver
from kvscope.gateway.logs.record import RecordBuilder
from kvscope.gateway.logs.sink import LogSink
from kvscope.gateway.metrics import GatewayMetrics
from kvscope.gateway.proxy.upstreams import UpstreamPool
from kvscope.gateway.ratelimit import RateLimiter
from kvscope.gateway.settings import GatewaySettings, SettingsSource
from kvscope.gateway.tokenize import PromptCounter
from kvscope.gateway.tracing import GatewayTracer


@dataclass(frozen=True, slots=True)
class WorkerSlot:
    """Which of the ``kvscope gateway --workers N`` processes this one is (gateway/workers.py)."""

    index: int
    """0 … count − 1; a worker restarted by the supervisor keeps its index (and its Elasticsearch spool)."""
    count: int


@dataclass(slots=True)
class GatewayState:
    """Everything a request needs; one per app (``app.state.gateway``)."""

    settings: GatewaySettings
    metrics: GatewayMetrics
    tracer: GatewayTracer
    genai: GenAiClientMetrics
    """OTel ``gen_ai.client.*`` metrics (OTLP), beside the Prometheus collectors."""
    pool: UpstreamPool
    auth: Authenticator
    limiter: RateLimiter
    counter: PromptCounter
    record_builder: RecordBuilder
    sinks: list[LogSink] = field(default_factory=list)
    client_address: ClientAddressResolver = field(default_factory=ClientAddressResolver)
    """``client.ip`` from the peer and trusted forwarding headers (gateway/forwarded.py)."""
    worker: WorkerSlot | None = None
    """Set in a worker of ``--workers N`` (N > 1); None: the only process."""
    settings_source: SettingsSource | None = None
    """Where ``settings`` came from (the config file discovery re-reads); None: built in code."""
    client: httpx.AsyncClient | None = None
    health_task: asyncio.Task | None = None
    discovery_task: asyncio.Task | None = None
    """DNS re-resolution and config reload (gateway/proxy/discovery.py); None when there is nothing to
    re-read."""

    @property
    def http(self) -> httpx.AsyncClient:
        if self.client is None:
            raise RuntimeError("the gateway lifespan has not started")
        return self.client


def state_of(connection: ASGIConnection) -> GatewayState:
    """The app's GatewayState, from a request or any connection."""
    return connection.app.state.gateway
