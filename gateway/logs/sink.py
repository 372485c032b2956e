"""The request-log sink interface: every sink (JSONL file, stdout, Elasticsearch) implements it.

A record is one request's log line as a nested JSON-able dict (ECS style; fields in docs/gateway.md, "Request
log"). The request path only calls :meth:`LogSink.emit`, which must never block and never raise; sinks do
their I/O off the request path and account for every record in
``kvscope_gateway_log_records_total{sink,outcome}``.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

LogRecord = dict[str, Any]


@runtime_checkable
class LogSink(Protocol):
    name: str
    """Metric label value: ``file``, ``stdout``, ``elasticsearch``."""

    async def start(self) -> None:
        """Open files/connections and start background work (called once by the gateway lifespan)."""

    def emit(self, record: LogRecord) -> None:
        """Hand one record to the sink. Non-blocking, never raises (failures are counted, not thrown)."""

    async def aclose(self) -> None:
        """Flush what can be flushed (spool the rest) and stop background work."""
