"""Serving case N5, "Clean endings", in the engine server (../shared/cases/serving-cases.md): a client that
leaves in the middle of its request body is logged and counted as 499 (not a 500 feeding the error alerts),
and the server ``kvscope engine`` runs (engine/server/cli.py ``uvicorn_config``) closes a half-sent head or
a stalled body after its read timeout with a JSON 408 (kvscope/common/read_timeouts.py). A real uvicorn in
a thread, the FakeEngine behind it."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from kvscope.engine.server.access_log import ACCESS_LOGGER
from kvscope.engine.server.app import create_app
from kvscope.engine.server.cli import uvicorn_config
from kvscope.engine.server.settings import ServerSettings
from kvscope.engine.server.tracing import Tracing
from kvscope.testing.wait import wait_until
from tests.engine.server.helpers import free_port, metric_samples, sample

READ_TIMEOUT_S = 0.5
BROKEN_RUN_S = 20.0
"""How long a test waits for the server before it calls the run broken (the old server never closed)."""
ROUTE = "/v1/chat/completions"


@contextmanager
def engine_server(fake_engine) -> Iterator[int]:
    """The app under ``kvscope engine``'s own uvicorn config (0.5 s read timeouts), in a thread; yields its
    port."""
    import uvicorn

    settings = ServerSettings(
        port=free_port(),
        sse_keepalive_s=0.05,
        request_head_timeout_s=READ_TIMEOUT_S,
        request_body_timeout_s=READ_TIMEOUT_S,
    )
    app = create_app(
        settings,
        engine=fake_engine,
        tracing=Tracing("test", InMemorySpanExporter(), batch=False),
        registry=CollectorRegistry(),
    )
    server = uvicorn.Server(uvicorn_config(app, settings))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield settings.port
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture
def port(fake_engine) -> Iterator[int]:
    with engine_server(fake_engine) as p:
        yield p


def _access_line(caplog, request_id: str) -> dict:
    """The access line of ``request_id``, once written (the deadline only bounds a broken run)."""

    def found() -> list[dict]:
        lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == ACCESS_LOGGER]
        return [line for line in lines if line["http"]["request"]["id"] == request_id]

    lines = wait_until(found, BROKEN_RUN_S, f"the access line of {request_id}", interval_s=0.01)
    assert len(lines) == 1, lines
    return lines[0]


def _head(request_id: str, length: int = 200) -> bytes:
    return (
        f"POST {ROUTE} HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\nX-Request-Id: {request_id}\r\n\r\n"
    ).encode()


def _until_closed(port: int, data: bytes) -> bytes:
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=BROKEN_RUN_S) as sock:
        sock.sendall(data)
        while chunk := sock.recv(65536):
            received += chunk
    return received


def _http_requests(port: int, status: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sample(metric_samples(text), "kvscope_engine_http_requests_total", route=ROUTE, status=status)


def test_n5_a_client_leaving_mid_body_is_logged_and_counted_as_499(port, caplog) -> None:
    """Serving case N5: the client sends the head and half its body, then closes. The access line and
    ``kvscope_engine_http_requests_total`` say 499 ``client_disconnected`` (as the gateway logs it);
    before, the body reader's "client disconnected prematurely" made them a 500."""
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    with socket.create_connection(("127.0.0.1", port), timeout=BROKEN_RUN_S) as sock:
        sock.sendall(_head("left-mid-body") + b'{"model": "fake-model", "messages": [')
    line = _access_line(caplog, "left-mid-body")
    assert line["http"]["response"]["status_code"] == 499
    assert line["error"] == {
        "type": "client_closed_request",
        "code": "client_disconnected",
        "message": "the client closed the connection while sending the request body",
    }
    assert (line["log"]["level"], line["event"]["outcome"]) == ("warning", "failure")
    assert (_http_requests(port, "499"), _http_requests(port, "500")) == (1, 0)


def test_n5_half_a_request_head_is_answered_408_and_closed(port) -> None:
    """Serving case N5: half a request head, then nothing: a JSON 408 and the close after the head timeout."""
    raw = _until_closed(port, f"POST {ROUTE} HTTP/1.1\r\nHost: engine\r\n".encode())
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower()
    assert json.loads(body) == {
        "error": {
            "message": f"The request head was not received within {READ_TIMEOUT_S:g} s.",
            "type": "timeout_error",
            "param": None,
            "code": "request_timeout",
        }
    }


def test_a_stalled_body_is_answered_408_and_logged_as_408(port, caplog) -> None:
    """A body that stops arriving: a JSON 408, the close, and the access line and counter say 408."""
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    raw = _until_closed(port, _head("stalled-body") + b'{"model": ')
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ")
    assert json.loads(body)["error"]["code"] == "request_timeout"
    line = _access_line(caplog, "stalled-body")
    assert line["http"]["response"]["status_code"] == 408
    assert line["error"]["code"] == "request_timeout"
    assert (_http_requests(port, "408"), _http_requests(port, "500")) == (1, 0)


def test_a_whole_request_is_unaffected_by_the_read_timeouts(port) -> None:
    """A request that arrives at once (and one on the same connection after it) is served as before."""
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=BROKEN_RUN_S) as client:
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert [client.post(ROUTE, json=body).status_code for _ in range(2)] == [200, 200]
