"""The server's shared state: engine, metrics, tracing, settings (one instance per app, in ``app.state``)."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvscope.engine.engine_core import StepResult
from kvscope.engine.server.access_log import ACCESS_LOGGER, AccessRecord, emit
from kvscope.engine.server.engine_client import EngineClient
from kvscope.engine.server.errors import OpenAIError
from kvscope.engine.server.settings import ServerSettings
from kvscope.engine.server.stat_logger import ServerMetrics
from kvscope.engine.server.tracing import Tracing, observe_step
from kvscope.engine.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ServerState:
    engine: EngineClient
    """An AsyncEngine (or the server tests' FakeEngine)."""
    settings: ServerSettings
    metrics: ServerMetrics
    tracing: Tracing
    created: int = field(default_factory=lambda: int(time.time()))
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """New at every start: a gateway that sees it change knows this server's prefix cache is empty."""
    in_flight: int = 0
    """Generation requests being served now."""
    draining: bool = False
    """Shutdown began: new generation requests get 503."""
    access_logger: logging.Logger = field(default_factory=lambda: logging.getLogger(ACCESS_LOGGER))

    @property
    def model_name(self) -> str:
        return self.engine.info.name

    @property
    def max_model_len(self) -> int:
        return self.engine.info.max_model_len

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def on_step(self, result: StepResult) -> None:
        """The engine's step listener (engine thread): metrics gauges/histograms and request timelines."""
        self.metrics.on_step(
            result, result.stats if result.stats is not None else self.engine.scheduler_stats()
        )
        if not result.scheduled_only:  # timelines advance on completed steps only
            observe_step(self.engine.unfinished_requests())

    def on_access_done(self, record: AccessRecord, route: str) -> None:
        self.metrics.on_http_request(route, record.final_status)
        emit(self.access_logger, record, route, self.settings.service_name)

    def on_unrouted(self, request: Any, error: OpenAIError) -> None:
        """404/405 for paths that matched no route: count under ``unmatched`` and log."""
        record = AccessRecord(request.method, request.url.path, request.headers.get("x-request-id") or "-")
        record.status = error.status
        record.set_error(error.type, error.message, error.code)
        self.on_access_done(record, "unmatched")
