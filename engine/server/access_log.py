"""One JSON log line per API request, and the ``kvscope_engine_http_requests_total{route,status}`` counter.

The middleware puts an :class:`AccessRecord` into the ASGI scope (``scope["kvscope.access"]``); exception
handlers add the error type, the serving code adds the gen_ai / kvscope fields (docs/engine-server.md,
"Request log"), and the line is written when the response is over (after the last SSE event, or when the
client left). Field names follow ECS (``http.response.status_code``, ``event.outcome`` …); never the body,
never prompt or output text.

A client that leaves before its request body ended is logged (and counted) as 499 ``client_disconnected``,
nginx's "client closed request" as the gateway logs it, not as the 500 Litestar's body reader raises for it (a
client's departure must not feed the server-error alerts); a body the server stopped waiting for
(kvscope/common/read_timeouts.py) as the 408 the server answered.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, BinaryIO

from litestar.types import ASGIApp, Message, Receive, Scope, Send

from kvscope.common.openai_errors import CLIENT_CLOSED_REQUEST, default_code, error_type
from kvscope.common.read_timeouts import READ_TIMEOUT_KEY

ACCESS_LOGGER = "kvscope.engine.access"
QUIET_ROUTES = ("/health", "/metrics", "/schema", "/v1/models")
"""Route prefixes counted but not logged when they succeed (probes, scrapes, the gateway's model-list health
check and docs would drown the log)."""


"""Status logged for a client that left before its request body ended (nginx's convention, the gateway's
too)."""
ECS_VERSION = "9.1.0"
"""ECS 9.1 is the first with the ``gen_ai.*`` field set these records use (same as the gateway's record)."""


def _level(status: int, outcome: str) -> str:
    """``log.level`` in the vocabulary the gateway uses too (Python level names): ``error`` for 5xx,
    ``warning`` for any other failure, ``info`` for a success."""
    if status >= 500:
        return "error"
    return "info" if outcome == "success" else "warning"


class AccessRecord:
    """What the log line of one request says."""

    def __init__(self, method: str, path: str, request_id: str) -> None:
        self.method = method
        self.path = path
        self.request_id = request_id
        self.start_ns = time.time_ns()
        self._start = time.monotonic()
        self.status: int | None = None
        self.status_override: int | None = None
        """Status to log instead of the one sent (499 when the client left before a non-streamed answer)."""
        self.error: dict[str, Any] | None = None
        self.details: dict[str, Any] = {}
        self.server_span: Any = None
        """The request's HTTP SERVER span (engine/server/tracing.py), None for probes and scrapes."""

    @property
    def received(self) -> float:
        """``time.monotonic()`` when the server received the request (its ``x-kvscope-timeout`` deadline
        counts from here)."""
        return self._start

    def set_error(self, type: str, message: str, code: str | int | None = None) -> None:
        self.error = {"type": type, "message": message, **({"code": code} if code is not None else {})}

    def set_request_details(self, details: dict[str, Any]) -> None:
        self.details.update(details)

    @property
    def final_status(self) -> int:
        return self.status_override or self.status or 500

    def to_json(self, service_name: str) -> str:
        status = self.final_status
        end_ns = time.time_ns()
        kvscope = self.details.get("kvscope", {})
        outcome = "success" if status < 400 and kvscope.get("outcome", "success") == "success" else "failure"
        record: dict[str, Any] = {
            "@timestamp": _iso(end_ns),
            "ecs": {"version": ECS_VERSION},
            "log": {"level": _level(status, outcome), "logger": ACCESS_LOGGER},
            "message": self._message(status, kvscope),
            "event": {
                "kind": "event",
                "category": ["web"],
                "type": ["access"],
                "outcome": outcome,
                "duration": int((time.monotonic() - self._start) * 1e9),
                "start": _iso(self.start_ns),
                "end": _iso(end_ns),
            },
            "http": {
                "request": {"id": self.request_id, "method": self.method},
                "response": {"status_code": status},
            },
            "url": {"path": self.path},
            "service": {"name": service_name},
        }
        if self.error is not None:
            record["error"] = self.error
        record.update({k: v for k, v in self.details.items() if k not in record})
        return json.dumps(record, separators=(",", ":"), default=str)

    def _message(self, status: int, kvscope: dict[str, Any]) -> str:
        parts = [f"{self.method} {self.path} {status}"]
        if kvscope:
            reasons = self.details["gen_ai"]["response"]["finish_reasons"]
            parts.append(f"{kvscope['outcome']} finish_reasons={','.join(reasons)}")
            if kvscope.get("phase"):
                parts.append(f"phase={kvscope['phase']}")
        if self.error is not None:
            parts.append(f"{self.error['type']}: {self.error['message']}")
        return " ".join(parts)


def _iso(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class AccessLogMiddleware:
    """ASGI middleware for every routed request: count it, and log it unless it is a quiet success."""

    def __init__(
        self,
        app: ASGIApp,
        on_done: Callable[[AccessRecord, str], None],
        on_start: Callable[[dict[str, Any]], Any] | None = None,
    ) -> None:
        """``on_start(scope)`` returns the request's HTTP SERVER span (kept on the record), ``on_done(record,
        route)`` runs when the response ended."""
        self.app = app
        self.on_done = on_done
        self.on_start = on_start

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _header(scope, b"x-request-id") or uuid.uuid4().hex
        record = AccessRecord(scope["method"], scope["path"], request_id)
        scope["kvscope.access"] = record
        if self.on_start is not None:
            record.server_span = self.on_start(scope)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (b"x-request-id", request_id.encode("latin-1"))],
                }
            await send(message)

        body = _BodyWatch(receive)
        try:
            await self.app(scope, body.receive, send_with_id)
        finally:
            _body_outcome(record, body, scope)
            self.on_done(record, scope.get("path_template") or scope["path"])


class _BodyWatch:
    """Wraps an ASGI ``receive``: whether the client left (``http.disconnect``) before its body's last
    ``http.request`` message."""

    def __init__(self, receive: Callable) -> None:
        self._receive = receive
        self.body_done = False
        self.left_mid_body = False

    async def receive(self) -> dict[str, Any]:
        message = await self._receive()
        if message["type"] == "http.request" and not message.get("more_body", False):
            self.body_done = True
        elif message["type"] == "http.disconnect" and not self.body_done:
            self.left_mid_body = True
        return message


def _body_outcome(record: AccessRecord, body: _BodyWatch, scope: dict[str, Any]) -> None:
    """A request whose body never ended: 408 when the server timed its body out (``READ_TIMEOUT_KEY``),
    else 499 ``client_disconnected`` (module docstring), replacing the 500 the body reader's error was
    answered with."""
    if not body.left_mid_body:
        return
    if (scope.get("state") or {}).get(READ_TIMEOUT_KEY) is not None:
        record.status_override = 408
        record.set_error(
            "timeout_error", "the request body stalled; the server closed the connection", "request_timeout"
        )
        return
    record.status_override = CLIENT_CLOSED_REQUEST
    record.set_error(
        error_type(CLIENT_CLOSED_REQUEST),
        "the client closed the connection while sending the request body",
        default_code(CLIENT_CLOSED_REQUEST),
    )


class JsonLineHandler(logging.Handler):
    """Writes each record's message plus ``\n`` to a binary stream as ONE write of the whole line, then
    flushes: a tailing reader (gateway/logs/jsonl.py, Filebeat, ``tail -f``) never sees half a record, and
    lines from several threads never interleave (``logging.Handler.handle`` holds the handler lock around
    :meth:`emit`). ``logging.StreamHandler`` on a text stream gives neither guarantee: the text layer may
    hand a long line to the file in several writes, and only flushes when asked."""

    terminator = b"\n"

    def __init__(self, stream: BinaryIO) -> None:
        super().__init__()
        self.stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record).encode("utf-8", "backslashreplace") + self.terminator
            self.stream.write(line)
            self.stream.flush()
        except Exception:  # noqa: BLE001 - logging must never raise into the request path
            self.handleError(record)


def emit(logger: logging.Logger, record: AccessRecord, route: str, service_name: str) -> None:
    """Write the record's line (quiet routes only when they failed)."""
    if route.startswith(QUIET_ROUTES) and record.final_status < 400:
        return
    logger.info(record.to_json(service_name))
