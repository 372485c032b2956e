"""A local OTLP/HTTP receiver for tests: decodes the protobuf export requests it is sent (metrics and
traces), keeping them in memory. ``with OtlpReceiver() as rx: rx.url`` → ``http://127.0.0.1:PORT``."""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class OtlpReceiver:
    def __init__(self) -> None:
        self.metrics: list[ExportMetricsServiceRequest] = []
        self.traces: list[ExportTraceServiceRequest] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server API
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                kind = {"/v1/metrics": ExportMetricsServiceRequest, "/v1/traces": ExportTraceServiceRequest}.get(
                    self.path)
                if kind is None:
                    self.send_response(404)
                    self.end_headers()
                    return
                message = kind.FromString(body)
                with receiver.lock:
                    (receiver.metrics if kind is ExportMetricsServiceRequest else receiver.traces).append(message)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> OtlpReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def metric_points(self) -> dict[str, list[tuple[dict[str, Any], Any]]]:
        """Metric name → [(attributes, data point)] over every export received."""
        out: dict[str, list[tuple[dict[str, Any], Any]]] = {}
        with self.lock:
            requests = list(self.metrics)
        for request in requests:
            for rm in request.resource_metrics:
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        points = metric.histogram.data_points if metric.HasField("histogram") else []
                        for point in points:
                            attrs = {a.key: _value(a.value) for a in point.attributes}
                            out.setdefault(metric.name, []).append((attrs, point))
        return out

    def resources(self) -> list[dict[str, Any]]:
        with self.lock:
            return [{a.key: _value(a.value) for a in rm.resource.attributes}
                    for request in self.metrics for rm in request.resource_metrics]


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None
