"""Read timeouts for request heads and bodies, for the uvicorn h11 servers of the gateway and the engine.

uvicorn (0.55) bounds only the silence between requests on a keep-alive connection (``timeout_keep_alive``,
5 s): a connection that sends half a request head, or a head and then part of its body, stays open for as long
as the client likes (a slow-loris client holds a socket, and in the body case an app task, per connection).
:class:`ReadTimeoutProtocol`, uvicorn's ``H11Protocol`` with two
timers, closes them:

- **head** (``head_s``, default :data:`HEAD_TIMEOUT_S`): a request head must be complete within ``head_s`` of
  the connection opening or of the previous response ending (nginx ``client_header_timeout``: the whole head,
  however slowly it trickles). A connection that sent nothing of a new request is then closed silently (as
  uvicorn's keep-alive timeout closes an idle one); one that sent part of a head gets a JSON 408
  ``request_timeout`` and is closed.
- **body** (``body_s``, default :data:`BODY_TIMEOUT_S`): while a request body is being received, at most
  ``body_s`` without a byte of it (nginx ``client_body_timeout``: the time between two reads, not the whole
  body). Then the connection gets a JSON 408 when no response has started (else it is only closed) and is
  closed; the app reading the body sees the client leave (``http.disconnect``), and
  ``scope["state"][READ_TIMEOUT_KEY]`` says the server answered 408, for the app's request log. While the
  server itself paused reading (the app has not taken what arrived) the clock does not run.

A leaf module (uvicorn and h11 only): the gateway (gateway/server.py) and the engine server
(engine/server/cli.py) both serve through it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import h11
import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvscope.common.openai_errors import error_body, error_type

HEAD_TIMEOUT_S = 10.0
"""Default seconds for a whole request head (a few hundred bytes from any real client; Go servers commonly
set ``ReadHeaderTimeout`` to 10 s)."""
BODY_TIMEOUT_S = 30.0
"""Default longest silence while a request body is being received (half of nginx's 60 s default: an API client
sends its JSON body at once)."""
READ_TIMEOUT_KEY = "kvscope_read_timeout"
"""``scope["state"]`` key set to 408 when the server answered a request whose body stalled."""
REQUEST_TIMEOUT = 408


@dataclass(frozen=True, slots=True)
class ReadTimeouts:
    """The two read timeouts, seconds (module docstring)."""

    head_s: float = HEAD_TIMEOUT_S
    body_s: float = BODY_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("head_s", "body_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"read timeout {name} must be > 0, got {getattr(self, name)}")


def timeout_message(stage: str, seconds: float) -> str:
    """The 408's message: ``stage`` is ``head`` or ``body``."""
    if stage == "head":
        return f"The request head was not received within {seconds:g} s."
    return f"The request body stalled: nothing of it arrived for {seconds:g} s."


def timeout_body(message: str) -> bytes:
    """The JSON body of a 408 (the OpenAI error shape both servers speak; code ``request_timeout``)."""
    return msgspec.json.encode(error_body(message, error_type(REQUEST_TIMEOUT), None, "request_timeout"))


class ReadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with the head and body read timeouts of the module docstring. Subclasses may
    override :meth:`read_timed_out` (the gateway logs the 408 as a request)."""

    def __init__(self, *args: Any, read_timeouts: ReadTimeouts | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read_timeouts = read_timeouts or ReadTimeouts()
        self._read_timer: asyncio.TimerHandle | None = None
        self._read_stage: str | None = None
        """``head`` or ``body``: what the armed timer waits for (None: nothing)."""

    # --- the protocol's events ------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._follow_reads()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_reads(read=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_reads()

    # --- the timers
    # -------------------------------------------------------------------------------------------
    def _follow_reads(self, read: bool = False) -> None:
        """Arm the timer the connection's state calls for: the head timer while a request head is awaited
        (armed once: the whole head counts), the body timer while a body is being received (re-armed by
        each ``read``), none otherwise (the app holds a whole request, or the connection is closing)."""
        if self.transport is None or self.transport.is_closing():
            self._disarm()
            return
        state = self.conn.their_state
        if state is h11.IDLE and self.conn.our_state is h11.IDLE:
            if self._read_stage != "head":
                self._arm("head", self.read_timeouts.head_s)
        elif state is h11.SEND_BODY:
            if read or self._read_stage != "body":
                self._arm("body", self.read_timeouts.body_s)
        else:
            self._disarm()

    def _arm(self, stage: str, seconds: float) -> None:
        self._disarm()
        self._read_stage = stage
        self._read_timer = self.loop.call_later(seconds, self._expired, stage)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer, self._read_stage = None, None

    def _expired(self, stage: str) -> None:
        self._read_timer, self._read_stage = None, None
        if self.transport.is_closing():
            return
        if stage == "body" and self.flow.read_paused:  # the server stopped reading, not the client sending
            self._arm("body", self.read_timeouts.body_s)
            return
        state = self.conn.their_state
        if (stage == "head" and state is not h11.IDLE) or (stage == "body" and state is not h11.SEND_BODY):
            self._follow_reads()
            return
        if stage == "head" and not self.conn.trailing_data[0]:
            self._close()  # nothing of a request arrived: an idle connection, closed like a keep-alive one
            return
        seconds = self.read_timeouts.head_s if stage == "head" else self.read_timeouts.body_s
        self.read_timed_out(stage, timeout_message(stage, seconds))

    # --- answering ------------------------------------------------------------------------------------------
    def read_timed_out(self, stage: str, message: str) -> None:
        """Answer a timed-out read: 408 (JSON) and close when no response has started on the connection, else
        close; a request the app holds learns it through ``http.disconnect`` and ``READ_TIMEOUT_KEY``."""
        cycle = self.cycle if stage == "body" else None
        if cycle is not None:
            cycle.scope.setdefault("state", {})[READ_TIMEOUT_KEY] = REQUEST_TIMEOUT
        if cycle is None or not cycle.response_started:
            self.write_timeout_response(message)
        self._close()

    def write_timeout_response(self, message: str) -> int:
        """Write the 408 with ``Connection: close`` (h11 framing); returns the body's length. The caller
        closes."""
        body = timeout_body(message)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        try:
            for event in (
                h11.Response(status_code=REQUEST_TIMEOUT, headers=headers, reason=b"Request Timeout"),
                h11.Data(data=body),
                h11.EndOfMessage(),
            ):
                self.transport.write(self.conn.send(event) or b"")
        except h11.LocalProtocolError:  # h11 cannot answer in its state: the close alone says it
            pass
        return len(body)

    def _close(self) -> None:
        """Close the connection; a request in progress sees ``http.disconnect`` (uvicorn's
        connection_lost)."""
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        if self.conn.our_state is not h11.ERROR:
            try:
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:
                pass
        self.transport.close()
