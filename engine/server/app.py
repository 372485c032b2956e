"""``create_app``: the engine's OpenAI-compatible Litestar app.

Start-up (lifespan): load the model (AsyncEngine) in a worker thread unless the caller passed a loaded one
(``kvscope engine`` does: engine/server/cli.py ``load_engine``), start the step loop, warm up with one
short generation, then attach the metrics/tracing step listener (and, on CUDA, start the GPU telemetry
sampler: engine/server/gpu_telemetry.py) and serve. Uvicorn only accepts connections
after that, so a reachable ``/health`` means warmed up. Shutdown fails in-flight requests ("engine shutting
down": streams get an in-band error), stops the loop and flushes spans.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from litestar import Litestar
from litestar.datastructures import State
from litestar.middleware import DefineMiddleware
from litestar.openapi import OpenAPIConfig
from opentelemetry.sdk.metrics.export import MetricReader
from prometheus_client import CollectorRegistry, ProcessCollector

from kvscope.common.otel_genai import GenAiServerMetrics, build_meter_provider
from kvscope.common.version import kvscope_version
from kvscope.engine.config import EngineConfig
from kvscope.engine.engine_core import StepResult
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.server.access_log import AccessLogMiddleware, AccessRecord
from kvscope.engine.server.auth import api_key_guard
from kvscope.engine.server.engine_client import EngineClient
from kvscope.engine.server.errors import exception_handlers
from kvscope.engine.server.gpu_telemetry import GpuTelemetry, sample_every
from kvscope.engine.server.routes import ROUTES
from kvscope.engine.server.settings import ServerSettings
from kvscope.engine.server.stat_logger import ServerMetrics, host_memory_bytes
from kvscope.engine.server.state import ServerState
from kvscope.engine.server.tracing import Tracing
from kvscope.engine.structured.params import CompileLimits

logger = logging.getLogger(__name__)
WARMUP_PROMPT = "Hello"


class AppContext:
    """Builds the ServerState at start-up and hands it to the middleware and hooks created before it."""

    def __init__(
        self,
        settings: ServerSettings,
        engine_config: EngineConfig | None,
        engine: EngineClient | None,
        tracing: Tracing | None,
        registry: CollectorRegistry | None,
        metric_readers: Sequence[MetricReader] = (),
    ) -> None:
        if engine_config is None and engine is None:
            raise ValueError("create_app needs an engine_config or an engine")
        self.settings = settings
        self._engine_config = engine_config
        self._engine = engine
        self._tracing = tracing
        self._registry = registry
        self._metric_readers = tuple(metric_readers)
        self.state: ServerState | None = None
        self._gpu: GpuTelemetry | None = None
        self._gpu_task: asyncio.Task | None = None

    @asynccontextmanager
    async def lifespan(self, app: Litestar) -> AsyncIterator[None]:
        state = await self._start()
        app.state.server = state
        try:
            yield
        finally:
            await self.drain()
            await self._stop_gpu_telemetry()
            state.tracing.shutdown()
            if state.metrics.genai is not None:
                state.metrics.genai.provider.shutdown()  # the last OTLP metrics push

    async def _start(self) -> ServerState:
        engine = self._engine
        if engine is None:
            from kvscope.engine.async_engine import AsyncEngine

            assert self._engine_config is not None  # __init__ refuses neither an engine nor its config
            engine = await asyncio.to_thread(AsyncEngine, self._engine_config)
        if self.settings.warmup:  # oneDNN shapes of every prefill size (before the step loop)
            await asyncio.to_thread(engine.warm_up_prefill)
        engine.start()
        if self.settings.warmup:
            await warm_up(engine)
        tracing = self._tracing or Tracing.otlp(self.settings.service_name, self.settings.otlp_endpoint)
        meters = build_meter_provider(
            {"service.name": self.settings.service_name, "service.version": kvscope_version()},
            self.settings.otlp_endpoint,
            self._metric_readers,
        )
        registry = self._registry or CollectorRegistry()
        ProcessCollector(
            registry=registry
        )  # process_resident_memory_bytes & co. (the prometheus_client standard)
        speculative = engine.speculative  # the per-position series and length buckets follow k
        metrics = ServerMetrics(
            registry,
            engine.info.name,
            engine.device,
            self.settings.buckets,
            genai=GenAiServerMetrics(meters, kvscope_version()),
            num_speculative_tokens=speculative.num_speculative_tokens if speculative else 0,
        )
        self.state = ServerState(engine, self.settings, metrics, tracing)
        _observe_mask_time(self.state)
        _set_device_memory(self.state)
        self._start_gpu_telemetry(engine, metrics)
        self.state.on_step(StepResult())
        engine.set_step_listener(self.state.on_step)
        logger.info(  # the format and sizes: the engine's own lines ("weights format", "engine ready")
            "serving %s (the OpenAI API under /v1, Prometheus metrics at /metrics)", engine.info.name
        )
        return self.state

    def _start_gpu_telemetry(self, engine: EngineClient, metrics: ServerMetrics) -> None:
        """On CUDA: sample NVML and the torch allocator now and every ``gpu_telemetry_interval_s``
        (engine/server/gpu_telemetry.py); on CPU nothing (the GPU series stay absent)."""
        self._gpu = GpuTelemetry.for_engine(metrics.engine, engine.device, engine.gpu_memory_utilization())
        if self._gpu is not None:
            self._gpu.sample()  # the series exist from the first scrape
            self._gpu_task = asyncio.create_task(
                sample_every(self._gpu, self.settings.gpu_telemetry_interval_s)
            )

    async def _stop_gpu_telemetry(self) -> None:
        if self._gpu_task is not None:
            self._gpu_task.cancel()
            await asyncio.gather(self._gpu_task, return_exceptions=True)
        if self._gpu is not None:
            self._gpu.close()

    async def drain(self) -> None:
        """Refuse new work and fail in-flight requests (their clients get an error, not a hang)."""
        if self.state is None or self.state.draining:
            return
        self.state.draining = True
        await asyncio.to_thread(self.state.engine.stop)

    def on_access_start(self, scope: dict[str, Any]) -> Any:
        """The request's HTTP SERVER span (None before start-up ends, and for probes and scrapes)."""
        return self.state.tracing.start_server_span(scope) if self.state is not None else None

    def on_access_done(self, record: AccessRecord, route: str) -> None:
        if self.state is not None:
            self.state.on_access_done(record, route)
            if record.server_span is not None:
                error = record.error["type"] if record.error else None
                self.state.tracing.end_server_span(
                    record.server_span, record.method, record.final_status, route, error
                )

    def on_unrouted(self, request: Any, error: Any) -> None:
        if self.state is not None:
            self.state.on_unrouted(request, error)


async def warm_up(engine: EngineClient) -> None:
    """One greedy 2-token generation: first-call costs (allocations, kernels) are paid before traffic."""
    prompt = engine.tokenizer.encode(WARMUP_PROMPT) or [0]
    request = engine.process_inputs(prompt, SamplingParams(max_tokens=2, temperature=0.0))
    async for _ in engine.generate("warmup", request):
        pass


def _observe_mask_time(state: ServerState) -> None:
    """Feed the structured-output mask time of each step (engine thread) into its histogram, and give the
    grammar compiler the server's limits (``--structured-output-max-grammar-size``,
    ``--structured-output-max-pending-compiles``)."""
    structured = state.engine.structured
    settings = state.settings
    structured.set_limits(
        CompileLimits(
            max_grammar_size=settings.structured_output_max_grammar_size,
            max_pending=settings.structured_output_max_pending_compiles,
        )
    )
    structured.mask_observer = state.metrics.engine.structured_output_mask_time.labels(
        model=state.metrics.model
    ).observe


def _set_device_memory(state: ServerState) -> None:
    """CPU: KV cache + weights bytes of host memory (``kvscope_engine_device_memory_*``, docs/metrics.md;
    fixed once loaded). CUDA: left to the GPU telemetry, which refreshes the device's used/total memory."""
    device = state.engine.device
    info = state.engine.info
    state.metrics.set_weights(info.dtype, info.quantization, info.weights_bytes)
    state.metrics.set_row_kernels(info.row_kernels)
    if not device.startswith("cuda"):
        used = info.kv_cache_bytes + info.weights_bytes
        state.metrics.set_device_memory(device, used, host_memory_bytes())


def create_app(
    settings: ServerSettings | None = None,
    engine_config: EngineConfig | None = None,
    *,
    engine: EngineClient | None = None,
    tracing: Tracing | None = None,
    registry: CollectorRegistry | None = None,
    metric_readers: Sequence[MetricReader] = (),
) -> Litestar:
    """The engine server app. Give ``engine_config`` (the app builds an AsyncEngine at start-up) or an
    ``engine`` (an :class:`~kvscope.engine.server.engine_client.EngineClient`, e.g. the tests' FakeEngine).
    ``tracing`` overrides the exporter chosen by settings (e.g. an in-memory exporter); ``registry`` the
    Prometheus registry; ``metric_readers`` also read the OTel ``gen_ai.server.*`` metrics (pushed over OTLP
    when ``otlp_endpoint`` is set). Raises ValueError without an engine.
    """
    settings = settings or ServerSettings()
    context = AppContext(settings, engine_config, engine, tracing, registry, metric_readers)
    return Litestar(
        route_handlers=ROUTES,
        lifespan=[context.lifespan],
        exception_handlers=exception_handlers(),
        middleware=[
            DefineMiddleware(
                AccessLogMiddleware, on_done=context.on_access_done, on_start=context.on_access_start
            )
        ],
        openapi_config=OpenAPIConfig(
            title="kvscope engine",
            version="0.1.0",
            description="OpenAI-compatible API of the kvscope engine.",
        ),
        state=State({"unrouted_hook": context.on_unrouted, "context": context}),
        guards=[api_key_guard(settings.api_key)] if settings.api_key else [],
        logging_config=None,
    )
