"""How the gateway runs under uvicorn: one :func:`uvicorn_config` for the CLI and the tests.

- ``http``: :class:`GatewayH11Protocol`, uvicorn's h11 protocol with the read timeouts of
  kvscope/common/read_timeouts.py (``timeouts.request_head_s``: a request head not complete in time gets a
  JSON 408 and its connection closed, an idle one is closed; ``timeouts.request_body_s``: a body that stalls
  that long gets a 408 and a close), each 408 with its log record like the parser's 400s, and one more change:
  a request the HTTP parser refuses (bad request line or header, missing Host, conflicting framing, a head
  over 16 KiB …) is answered with an OpenAI-shaped JSON 400 and gets its one log record, metrics and span
  (:func:`kvscope.gateway.observe.record_refused`), instead of uvicorn's plain-text 400 that no app sees. Two
  checks h11 leaves to the server are added (:func:`head_problem`): a request with both ``Content-Length`` and
  ``Transfer-Encoding`` is refused and its connection closed (RFC 9112 §6.1 allows refusing it and requires
  the close: a proxy in front that reads the other header would see a different request, "request smuggling"),
  and the 16 KiB head limit holds for a head that arrives in one piece too (h11 bounds only an incomplete
  head).
- ``proxy_headers=False``: uvicorn would otherwise rewrite the client address from ``X-Forwarded-For`` for
  any loopback peer; the gateway trusts only ``trusted_proxies`` (gateway/forwarded.py).
- ``loop``: uvloop unless the settings' ``event_loop`` says ``asyncio`` (kvscope/common/event_loop.py).
- ``ws="none"``: no WebSocket routes, so an ``Upgrade`` request is a plain HTTP request for the app.
- no access log, no ``Server`` header (the gateway writes its own request log).
- ``scope["extensions"]["kvscope.body_chunk"]``: :func:`write_body_chunk` for the request, the relay's way to
write
  a streamed event to the client without the ASGI send chain.
"""

from __future__ import annotations

import asyncio
import functools
import re
from typing import TYPE_CHECKING, Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import RequestResponseCycle

try:  # h11's writer of chunked bodies: the body-chunk fast path writes only where h11 chose it
    from h11._writers import ChunkedWriter
except ImportError:  # pragma: no cover - another h11 layout: the fast path stays off, ASGI send does it all
    ChunkedWriter = None

from kvscope.common.event_loop import resolve_event_loop
from kvscope.common.read_timeouts import READ_TIMEOUT_KEY, ReadTimeoutProtocol, ReadTimeouts
from kvscope.gateway.errors import GatewayError, InvalidRequest, error_json
from kvscope.gateway.proxy.client import BODY_CHUNK_EXTENSION

if TYPE_CHECKING:
    from kvscope.gateway.app import GatewayApp
    from kvscope.gateway.state import GatewayState

_METHOD = re.compile(rb"[A-Z]{1,20}")
MAX_LOGGED_TARGET = 2048
MAX_HEAD_BYTES = 16 * 1024
"""Largest request head (request line + header lines): uvicorn's default ``h11_max_incomplete_event_size``."""


class InvalidHttpRequest(InvalidRequest):
    """The HTTP parser's 400 (h11 ``RemoteProtocolError``)."""

    code = "invalid_http_request"


class RequestTimedOut(GatewayError):
    """The server's 408: a request head or body that did not arrive in time
    (kvscope/common/read_timeouts.py)."""

    status, code = 408, "request_timeout"


def request_line(head: bytes) -> tuple[str, str]:
    """(method, path) from the start of a refused request, for its log record: the method when it is 1-20
    capital letters, else ``_OTHER`` (OpenTelemetry's value for an unknown method); the target's path when
    it is origin-form ASCII (at most 2048 characters), else ``""``."""
    parts = head.split(b"\r\n", 1)[0].split(b"\n", 1)[0].split(b" ")
    method = parts[0].decode("ascii") if _METHOD.fullmatch(parts[0]) else "_OTHER"
    target = parts[1].split(b"?", 1)[0] if len(parts) > 1 else b""
    printable = target.startswith(b"/") and all(0x21 <= c <= 0x7E for c in target)
    return method, target[:MAX_LOGGED_TARGET].decode("ascii") if printable else ""


def head_problem(request: h11.Request, max_head_bytes: int = MAX_HEAD_BYTES) -> str | None:
    """Why a parsed request head must be refused, or None: both ``Content-Length`` and ``Transfer-Encoding``
    (RFC 9112 §6.1), or a head longer than ``max_head_bytes`` (request line and header lines with their CRLFs,
    as sent)."""
    names = {name for name, _ in request.headers}  # h11 lower-cases header names
    if b"content-length" in names and b"transfer-encoding" in names:
        return "Both Content-Length and Transfer-Encoding are present."
    size = (
        len(request.method) + len(request.target) + 12 + sum(len(n) + len(v) + 4 for n, v in request.headers)
    )
    if size > max_head_bytes:
        return f"The request head is over {max_head_bytes} bytes."
    return None


class GatewayH11Protocol(ReadTimeoutProtocol):
    """uvicorn's h11 protocol with read timeouts; parser errors become JSON 400s and read timeouts JSON 408s,
    each with a log record (module docstring)."""

    def __init__(self, *args: Any, gateway: GatewayState, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._gateway = gateway
        self._head = b""
        """The start of the request head being received (h11 consumes the lines of a head it refuses)."""
        self._problem: str | None = None
        """Why :meth:`_next_event` refused the head being answered (None: h11 itself refused it)."""
        self._parse_next_event = self.conn.next_event
        self.conn.next_event = (
            self._next_event
        )  # uvicorn's handle_events turns its RemoteProtocolError into a 400

    def _next_event(self) -> Any:
        """h11's next event, with :func:`head_problem`'s refusals raised as h11's own parser errors."""
        event = self._parse_next_event()
        if isinstance(event, h11.Request) and (problem := head_problem(event)) is not None:
            self._problem = problem
            raise h11.RemoteProtocolError(problem, 400)
        return event

    def handle_events(self) -> None:
        super().handle_events()
        cycle = self.cycle  # the request just parsed (its task has not run yet) gets the body-chunk extension
        if cycle is not None:
            # Any: the value of our extension is a function, not the dict the ASGI types declare for one
            # (not ``setdefault(...) or {}``: the new empty dict is falsy, and the extension would go into a
            # dict no one reads)
            extensions: dict[str, Any] | None = cycle.scope.get("extensions")
            if extensions is None:
                extensions = cycle.scope["extensions"] = {}
            if BODY_CHUNK_EXTENSION not in extensions:
                extensions[BODY_CHUNK_EXTENSION] = functools.partial(write_body_chunk, cycle)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            self._head = (self._head + data)[: MAX_LOGGED_TARGET + 64]
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE and self.conn.their_state is not h11.ERROR:
            self._head = b""

    def send_400_response(self, msg: str) -> None:
        in_progress = self.cycle is not None and not self.cycle.response_complete
        if in_progress and self.cycle.response_started:
            self.transport.close()  # the framing broke after the app answered: nothing more can be sent
            return
        # (a finished cycle is the previous request of a keep-alive connection: this one gets its 400)
        problem, self._problem = self._problem, None
        self._refuse(
            InvalidHttpRequest(
                f"{msg} {problem + ' ' if problem else ''}The request is not valid HTTP/1.1 (RFC 9112)."
            ),
            in_progress,
        )

    def read_timed_out(self, stage: str, message: str) -> None:
        """A head or body that did not arrive in time (kvscope/common/read_timeouts.py): a JSON 408 and the
        close, and its log record: the app's own when it holds the request (a stalled body), else a record
        of its own (a partial head, as for the parser's 400s)."""
        in_progress = stage == "body" and self.cycle is not None and not self.cycle.response_complete
        if in_progress:
            self.cycle.scope.setdefault("state", {})[READ_TIMEOUT_KEY] = 408
            if self.cycle.response_started:  # the app answered while the body came: only the close is left
                self._close()
                return
        self._refuse(RequestTimedOut(message), in_progress)

    def _refuse(self, err: GatewayError, in_progress: bool) -> None:
        """Answer ``err`` (400 or 408) as JSON with ``Connection: close``, close, and see that the request
        gets its one log record: through the app when it holds (or will hold) the request, ``in_progress``,
        else
        :func:`kvscope.gateway.observe.record_refused` with the method and path read so far."""
        from kvscope.gateway.observe import CTX_KEY, REFUSED_KEY, record_refused

        body = error_json(err)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        reason = b"Bad Request" if err.status == 400 else b"Request Timeout"
        for event in (
            h11.Response(status_code=err.status, headers=headers, reason=reason),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event) or b"")
        self.transport.close()
        if in_progress:  # the app holds (or will) this request
            self.cycle.disconnected = True  # its answer has been sent here: uvicorn drops the app's own
            state = self.cycle.scope.setdefault("state", {})
            state[REFUSED_KEY] = (err, len(body))  # picked up by observe() if the app has not started yet
            if (owner := state.get(CTX_KEY)) is not None:
                owner.outcome.refused_by_parser(err, len(body))  # the app's own record reports this 400
            return
        method, path = request_line(self._head or self.conn.trailing_data[0])
        self._head = b""
        client = self.client[0] if self.client else None
        task = asyncio.get_running_loop().create_task(
            record_refused(self._gateway, method, path, client, err, len(body))
        )
        self.tasks.add(task)  # uvicorn waits for these at shutdown
        task.add_done_callback(self.tasks.discard)


def write_body_chunk(cycle: RequestResponseCycle, data: bytes) -> bool:
    """Write ``data`` as one chunk of the started response body straight to the client's transport, in the
    chunked framing h11 chose for it (RFC 9112 §7.1), and return True; False, having written nothing, where
    the caller must use ASGI ``send`` instead: empty data (an empty chunk would end the body), a response not
    started or complete, a client gone or not reading (``send`` waits for its drain), or a body that h11
    frames otherwise (HTTP/1.0 clients, HEAD, a Content-Length).

    Why: a streamed token went through Litestar's send wrappers, uvicorn's ``send`` and h11's state machine
    before its one ``transport.write``; the relay writes each SSE event here instead
    (gateway/proxy/client.py; docs/gateway.md "CPU per relayed token"). The start, the end and every other
    message keep the ASGI path."""
    if (
        not data
        or ChunkedWriter is None
        or cycle.disconnected
        or not cycle.response_started
        or cycle.response_complete
        or cycle.flow.write_paused
        or not isinstance(getattr(cycle.conn, "_writer", None), ChunkedWriter)
    ):
        return False
    cycle.transport.write(b"%x\r\n%s\r\n" % (len(data), data))
    return True


def uvicorn_config(
    app: GatewayApp, host: str, port: int, log_level: str = "info", **extra: Any
) -> uvicorn.Config:
    """The uvicorn settings the gateway runs under (module docstring); ``extra`` adds uvicorn options. The
    event loop is the settings' ``event_loop`` resolved (kvscope/common/event_loop.py: uvloop where
    installed); the read timeouts are the settings' ``timeouts.request_head_s`` and
    ``timeouts.request_body_s``."""
    settings = app.state.gateway.settings
    protocol = functools.partial(
        GatewayH11Protocol,
        gateway=app.state.gateway,
        read_timeouts=ReadTimeouts(settings.timeouts.request_head_s, settings.timeouts.request_body_s),
    )
    extra.setdefault("loop", resolve_event_loop(app.state.gateway.settings.event_loop))
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        server_header=False,
        lifespan="on",
        # uvicorn calls `http` with its keyword arguments, so a factory works; its annotation names a class
        http=protocol,  # pyright: ignore[reportArgumentType]
        ws="none",
        proxy_headers=False,
        **extra,
    )
