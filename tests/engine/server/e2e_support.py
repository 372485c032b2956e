"""Helpers for the e2e engine tests (tests/e2e/test_engine_*.py): timed SSE reading, log polling, metric
deltas and a local OTLP/HTTP receiver."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from tests.engine.server.helpers import EngineProcess, parse_sse, sample

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@dataclass
class TimedStream:
    status: int
    headers: httpx.Headers
    text: str
    events: list[tuple[float, str]] = field(default_factory=list)
    """(seconds since the request was sent, raw event text) per event."""

    @property
    def parsed(self):
        return parse_sse(self.text)

    def data_times(self) -> list[float]:
        return [t for t, event in self.events if event.startswith("data: ")]


def stream(
    client: httpx.Client,
    path: str,
    body: dict,
    headers: dict | None = None,
    stop_after_data: int | None = None,
    until: Callable[[str], bool] | None = None,
) -> TimedStream:
    """POST with ``stream: true`` and read events with arrival times; close (a client disconnect) after
    ``stop_after_data`` data events, or as soon as ``until(event)`` is true, when given."""
    start = time.monotonic()
    with client.stream("POST", path, json={**body, "stream": True}, headers=headers or {}) as response:
        result = TimedStream(response.status_code, response.headers, "")
        if response.status_code != 200:
            result.text = response.read().decode()
            return result
        buffer, count = "", 0
        for text in response.iter_text():
            buffer += text
            while "\n\n" in buffer:
                event, buffer = buffer.split("\n\n", 1)
                result.events.append((time.monotonic() - start, event))
                result.text += event + "\n\n"
                count += event.startswith("data: ")
                if stop_after_data is not None and count >= stop_after_data:
                    return result
                if until is not None and until(event):
                    return result
    return result


def wait_for(predicate: Callable[[], Any], timeout_s: float = 30.0, interval_s: float = 0.05) -> Any:
    """Poll until ``predicate()`` is truthy; returns its value or raises AssertionError after the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(interval_s)


def line_by_http_id(engine: EngineProcess, http_id: str, timeout_s: float = 30.0) -> dict:
    """The single log line whose ``http.request.id`` is ``http_id``."""

    def find() -> list[dict]:
        return [r for r in engine.log_records() if r["http"]["request"]["id"] == http_id]

    wait_for(find, timeout_s)
    time.sleep(0.05)
    records = find()
    assert len(records) == 1, records
    return records[0]


def log_line(engine: EngineProcess, response_id: str, timeout_s: float = 30.0) -> dict:
    """The single log line of ``response_id`` (waits until it is written; fails if there are several)."""
    records = wait_for(lambda: engine.records_for(response_id), timeout_s)
    time.sleep(0.05)
    records = engine.records_for(response_id)
    assert len(records) == 1, records
    return records[0]


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    return sample(after, name, **labels) - sample(before, name, **labels)


class OTLPReceiver:
    """A local OTLP/HTTP receiver: keeps every decoded ExportTraceServiceRequest (POST /v1/traces) and
    ExportMetricsServiceRequest (POST /v1/metrics); any other path is answered 404, as a collector without
    that signal's receiver does."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.requests: list[Any] = []
        self.metric_requests: list[Any] = []
        self.content_types: list[str] = []
        receiver = self
        signals = {
            "/v1/traces": (ExportTraceServiceRequest, self.requests),
            "/v1/metrics": (ExportMetricsServiceRequest, self.metric_requests),
        }

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server API
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path not in signals:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                message_type, kept = signals[self.path]
                message = message_type()
                message.ParseFromString(body)
                kept.append(message)
                receiver.content_types.append(self.headers["Content-Type"])
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def spans(self) -> list[Any]:
        return [
            span
            for request in self.requests
            for rs in request.resource_spans
            for ss in rs.scope_spans
            for span in ss.spans
        ]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def chat(content: str, **extra: Any) -> dict:
    return {"model": "smollm2-135m", "messages": [{"role": "user", "content": content}], **extra}


def completion(prompt: Any, **extra: Any) -> dict:
    return {"model": "smollm2-135m", "prompt": prompt, **extra}


class BackgroundStream:
    """A streaming request read by a thread until :meth:`close` (a client disconnect) or its end."""

    def __init__(self, base_url: str, path: str, body: dict, http_id: str) -> None:
        self.http_id = http_id
        """Sent as ``x-request-id``: the log line's ``http.request.id`` (the response id is unknown while
        the request is queued)."""
        self.data_events = 0
        self.last_data: str | None = None
        self.first_chunk: dict | None = None
        self.finish_times: list[float] = []
        """``time.monotonic()`` when each choice's final chunk (a non-null ``finish_reason``) arrived."""
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(base_url, path, body), daemon=True)
        self.lines = 0
        self._thread.start()

    def _run(self, base_url: str, path: str, body: dict) -> None:
        with (
            httpx.Client(base_url=base_url, timeout=300) as client,
            client.stream(
                "POST", path, json={**body, "stream": True}, headers={"x-request-id": self.http_id}
            ) as response,
        ):
            for line in response.iter_lines():
                self.lines += 1
                if line.startswith("data: {") and self.first_chunk is None:
                    self.first_chunk = json.loads(line[len("data: ") :])
                if line.startswith("data: "):
                    self.data_events += 1
                    self.last_data = line
                    if '"finish_reason":"' in line:
                        self.finish_times.append(time.monotonic())
                if self._closing.is_set():
                    return
        self._closing.set()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    @property
    def request_id(self) -> str | None:
        return self.first_chunk["id"] if self.first_chunk else None

    def close(self) -> None:
        """Disconnect (takes effect at the next line the server sends: a token or a keep-alive comment)."""
        self._closing.set()
        self._thread.join(30)
