"""The test suite's local OTLP receivers: decode the protobuf export requests they are sent (metrics and
traces), keeping them in memory. ``with OtlpReceiver() as rx: rx.url`` → ``http://127.0.0.1:PORT``
(OTLP/HTTP: any path naming ``metrics`` or ``traces``, recorded in ``rx.paths``, with its content type in
``rx.content_types``; any other path is answered 404, as a collector without that signal's receiver does);
``OtlpReceiver().start()`` / ``.close()`` for a fixture that outlives a ``with``. ``GrpcOtlpReceiver`` is the
same over gRPC (the collector's TraceService and MetricsService). The e2e engine and gateway tests use these
too (one receiver for the whole suite)."""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class _Received:
    """What a receiver was sent, and the views the tests read."""

    def __init__(self) -> None:
        self.metrics: list[ExportMetricsServiceRequest] = []
        self.traces: list[ExportTraceServiceRequest] = []
        self.paths: list[str] = []
        self.content_types: list[str] = []
        """The ``Content-Type`` of each OTLP/HTTP export (``application/x-protobuf``)."""
        self.lock = threading.Lock()

    def add(
        self,
        message: ExportMetricsServiceRequest | ExportTraceServiceRequest,
        path: str,
        content_type: str | None = None,
    ) -> None:
        with self.lock:
            (self.metrics if isinstance(message, ExportMetricsServiceRequest) else self.traces).append(
                message
            )
            self.paths.append(path)
            if content_type is not None:
                self.content_types.append(content_type)

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
        """The resource attributes of every metrics export."""
        with self.lock:
            return [
                {a.key: _value(a.value) for a in rm.resource.attributes}
                for request in self.metrics
                for rm in request.resource_metrics
            ]

    def span_messages(self) -> list[Any]:
        """Every span received, as its protobuf ``Span`` (ids, parent, attributes, events), in arrival
        order."""
        with self.lock:
            requests = list(self.traces)
        return [
            span
            for request in requests
            for rs in request.resource_spans
            for ss in rs.scope_spans
            for span in ss.spans
        ]

    def spans(self) -> list[tuple[dict[str, Any], str]]:
        """(resource attributes, span name) of every span received."""
        with self.lock:
            requests = list(self.traces)
        return [
            ({a.key: _value(a.value) for a in rs.resource.attributes}, span.name)
            for request in requests
            for rs in request.resource_spans
            for ss in rs.scope_spans
            for span in ss.spans
        ]


class OtlpReceiver(_Received):
    def __init__(self) -> None:
        super().__init__()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server API
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                kind = (
                    ExportMetricsServiceRequest
                    if "metrics" in self.path
                    else ExportTraceServiceRequest
                    if "traces" in self.path
                    else None
                )
                if kind is None:
                    self.send_response(404)
                    self.send_header("content-length", "0")
                    self.end_headers()
                    return
                receiver.add(kind.FromString(body), self.path, self.headers.get("content-type"))
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

    def start(self) -> OtlpReceiver:
        """Serve in a thread (returns self)."""
        self.thread.start()
        return self

    def close(self) -> None:
        """Stop serving and free the port."""
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class GrpcOtlpReceiver(_Received):
    """An OTLP/gRPC receiver on a free port: ``rx.url`` → ``http://127.0.0.1:PORT`` (plaintext)."""

    def __init__(self) -> None:
        super().__init__()
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        receiver = self

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC API
                receiver.add(request, "grpc:traces")
                return trace_service_pb2.ExportTraceServiceResponse()

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC API
                receiver.add(request, "grpc:metrics")
                return metrics_service_pb2.ExportMetricsServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> GrpcOtlpReceiver:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(grace=None)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None
