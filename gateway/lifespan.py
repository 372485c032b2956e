"""Building and running the gateway's long-lived parts (:class:`kvscope.gateway.state.GatewayState`):
startup/shutdown.

:func:`build_state` wires objects without I/O (tokenizers are loaded here so a bad path fails at startup);
:func:`gateway_lifespan` opens the upstream HTTP client, starts the log sinks, probes every upstream once,
runs a first discovery round (DNS names, gateway/proxy/discovery.py) and a first scrape of the upstreams'
``/metrics`` (gateway/engines/scraper.py: their kinds and KV capacity before the first request), then keeps
health-checking, scraping and re-reading the replicas' sources in the background; at shutdown it stops all of
it and flushes the sinks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import http.cookiejar
import logging
import os
import threading
from collections.abc import AsyncIterator, Sequence

import httpx
from litestar import Litestar
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.trace.export import SpanExporter
from prometheus_client import CollectorRegistry, ProcessCollector

from kvscope.common.otel_genai import build_client_metrics
from kvscope.common.version import kvscope_version
from kvscope.gateway.auth import Authenticator
from kvscope.gateway.engines.scraper import EngineScraper
from kvscope.gateway.forwarded import ClientAddressResolver, parse_networks
from kvscope.gateway.logs.record import RecordBuilder, ServiceInfo
from kvscope.gateway.logs.sink import LogSink
from kvscope.gateway.logs.sinks import JsonlFileSink, StdoutSink
from kvscope.gateway.metrics import GatewayMetrics, LogSinkMetrics
from kvscope.gateway.proxy.discovery import Discovery
from kvscope.gateway.proxy.network import upstream_transport
from kvscope.gateway.proxy.upstreams import UpstreamPool
from kvscope.gateway.ratelimit import InMemoryRateLimiter, RateLimiter, RedisRateLimiter
from kvscope.gateway.settings import GatewaySettings, SettingsSource, multiprocess_dir
from kvscope.gateway.state import GatewayState, WorkerSlot
from kvscope.gateway.tokenize import PromptCounter
from kvscope.gateway.tracing import build_tracer

_log = logging.getLogger("kvscope.gateway")


def build_state(
    settings: GatewaySettings,
    registry: CollectorRegistry | None = None,
    span_exporter: SpanExporter | None = None,
    sinks: Sequence[LogSink] = (),
    metric_readers: Sequence[MetricReader] = (),
    source: SettingsSource | None = None,
    worker: WorkerSlot | None = None,
) -> GatewayState:
    """Wire the gateway's parts from ``settings``. ``registry`` defaults to a new one (not the global);
    ``span_exporter`` receives spans synchronously (tests); ``sinks`` are added to the configured ones;
    ``metric_readers`` read the OTel GenAI metrics besides the OTLP exporter (tests); ``source``: where
    ``settings`` came from, for the config reload; ``worker``: which of ``--workers N`` this process is
    (gateway/workers.py): the log file is then shared, the Elasticsearch spool and the OTel
    ``service.instance.id`` are the worker's own."""
    registry = registry or CollectorRegistry()
    shared_metrics = multiprocess_dir()
    if shared_metrics is None:  # (multiprocess: gateway/metrics_workers.py adds up every worker's)
        ProcessCollector(registry=registry)  # process_cpu_seconds_total, process_resident_memory_bytes & co.
    metrics = GatewayMetrics(registry, settings.metrics, shared_metrics)
    configured = configured_sinks(settings, metrics, worker)
    metrics.initialize(tuple(u.label for u in settings.upstreams), tuple(s.name for s in configured))
    version = kvscope_version()
    tracer = build_tracer(settings.tracing, settings.service_name, version, settings.node, span_exporter)
    limiter: RateLimiter = (
        RedisRateLimiter(settings.redis_url, settings.timeouts.total_s + 60)
        if settings.redis_url
        else InMemoryRateLimiter()
    )
    genai = build_client_metrics(
        {
            "service.name": settings.service_name,
            "service.version": version,
            # one per process: two workers pushing cumulative sums under one identity would clash
            "service.instance.id": settings.node if worker is None else f"{settings.node}/{worker.index}",
        },
        version,
        settings.tracing.otlp_endpoint,
        metric_readers,
        settings.tracing.metrics_export_interval_s,
    )
    return GatewayState(
        settings=settings,
        metrics=metrics,
        tracer=tracer,
        genai=genai,
        pool=UpstreamPool(settings.upstreams, settings.models, settings.routing, metrics),
        auth=Authenticator(settings.api_keys, settings.default_limits),
        limiter=limiter,
        counter=PromptCounter.from_config(settings.models),
        record_builder=RecordBuilder(
            ServiceInfo(settings.service_name, version, settings.node, os.getpid()), settings.logs.log_content
        ),
        sinks=[*configured, *sinks],
        client_address=ClientAddressResolver(parse_networks(settings.trusted_proxies)),
        settings_source=source,
        worker=worker,
    )


def configured_sinks(
    settings: GatewaySettings, metrics: GatewayMetrics, worker: WorkerSlot | None = None
) -> list[LogSink]:
    """The request-log sinks of ``settings.logs``. In a worker of ``--workers N`` (``worker``) the JSONL file
    is shared with the other workers (appends and rotation under a file lock, gateway/logs/sinks.py) and the
    Elasticsearch spool is ``<spool_dir>/worker-<index>`` (a spool has one writer; a restarted worker keeps
    its index and replays its own)."""
    logs = settings.logs
    sinks: list[LogSink] = []
    if logs.file:
        sinks.append(
            JsonlFileSink(
                metrics,
                logs.file,
                logs.max_bytes,
                logs.backup_count,
                logs.queue_size,
                shared=worker is not None,
            )
        )
    if logs.stdout:
        sinks.append(StdoutSink(metrics, logs.queue_size))
    if logs.elasticsearch is not None:
        from kvscope.gateway.logs.elasticsearch import ElasticsearchSink

        sink_config = logs.elasticsearch_settings().sink_config()
        if worker is not None:
            spool = dataclasses.replace(
                sink_config.spool, directory=sink_config.spool.directory / f"worker-{worker.index}"
            )
            sink_config = dataclasses.replace(sink_config, spool=spool)
        sinks.append(ElasticsearchSink(sink_config, LogSinkMetrics(metrics, ElasticsearchSink.name)))
    return sinks


class _NoCookies(http.cookiejar.DefaultCookiePolicy):
    """Stores no cookie an upstream sets, so the client's jar stays empty and no request carries one on: the
    upstream client is shared by every user of the gateway (the gateway passes no cookies of its own)."""

    def set_ok(self, cookie: http.cookiejar.Cookie, request: object) -> bool:
        return False


def new_scrape_client(settings: GatewaySettings) -> httpx.AsyncClient:
    """The client of the upstream metrics scraper (gateway/engines/scraper.py), apart from the requests'
    client: a scrape never takes, holds (a hanging ``/metrics``) or opens a connection of the request path's
    pool. Its connections stay pooled across an idle interval (``idle_interval_s`` + 1 s), so an idle
    gateway keeps one connection per upstream instead of opening one per scrape; the scraper retries once a
    pooled connection the upstream had closed (as the health probe does). No cookies, as
    :func:`new_http_client`; deadlines come from the scraper (``timeout_s``)."""
    m = settings.upstream_metrics
    limits = httpx.Limits(
        max_connections=None, max_keepalive_connections=64, keepalive_expiry=m.idle_interval_s + 1
    )
    return httpx.AsyncClient(
        timeout=httpx.Timeout(m.timeout_s),
        limits=limits,
        transport=upstream_transport(limits),
        headers={"accept-encoding": "identity"},
        trust_env=False,
        cookies=http.cookiejar.CookieJar(policy=_NoCookies()),
    )


def new_http_client(settings: GatewaySettings) -> httpx.AsyncClient:
    """The upstream client: connect/pool timeouts from settings; read deadlines are enforced per request; the
    connections on kvscope's asyncio network backend (gateway/proxy/network.py). Its cookie jar keeps nothing:
    httpx's default jar would store an upstream's ``Set-Cookie`` and send it with every later request of every
    user (one client's session cookie on another's request)."""
    t = settings.timeouts
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=t.connect_s, read=None, write=t.connect_s, pool=t.connect_s),
        limits=limits,
        transport=upstream_transport(limits),
        headers={"accept-encoding": "identity"},
        trust_env=False,
        cookies=http.cookiejar.CookieJar(policy=_NoCookies()),
    )


@contextlib.asynccontextmanager
async def gateway_lifespan(app: Litestar) -> AsyncIterator[None]:
    """Litestar lifespan: start client, sinks, first health round and the health loop; stop them after."""
    gw: GatewayState = app.state.gateway
    gw.client = new_http_client(gw.settings)
    for sink in gw.sinks:
        await sink.start()
    await gw.pool.check_all(gw.client)
    discovery = Discovery(gw.settings, gw.pool, gw.metrics, gw.settings_source)
    if discovery.active:
        await discovery.run_once(gw.client)  # DNS replicas before the first request
        gw.discovery_task = asyncio.create_task(discovery.run(gw.client), name="kvscope-discovery")
    for model in gw.pool.served_models():  # zero series for the models found by the first health round
        gw.metrics.initialize_model(model)
    gw.health_task = asyncio.create_task(gw.pool.run_health_checks(gw.client), name="kvscope-health")
    scraper = EngineScraper(gw.settings.upstream_metrics, lambda: gw.pool.replicas)
    scrape_client = new_scrape_client(gw.settings)
    await scraper.scrape_due(scrape_client)  # kinds and KV capacities before the first request
    scrape_task = asyncio.create_task(scraper.run(scrape_client), name="kvscope-engine-scraper")
    frozen = threading.current_thread() is threading.main_thread()  # the process is the gateway's
    if frozen:
        # what start-up built lives as long as the app: kept out of the cyclic GC's passes, a full pass
        # scans the ~50,000 objects requests leave behind instead of ~150,000 (GC time per request 0.7 ->
        # 0.4 ms at 200 streams on a 2-vCPU AMD EPYC, gc.callbacks; docs/benchmarks.md "The gateway's CPU
        # per request"); given back at shutdown, so that a program running apps one after another frees them
        gc.freeze()
    try:
        yield
    finally:
        if frozen:
            gc.unfreeze()
        for task in (gw.discovery_task, gw.health_task, scrape_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await scrape_client.aclose()
        await gw.client.aclose()
        await gw.limiter.aclose()
        for sink in gw.sinks:
            await sink.aclose()
        gw.tracer.shutdown()
        gw.genai.provider.shutdown()  # the last OTLP metrics push
