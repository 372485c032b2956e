"""Server-sent events as the OpenAI SDK reads them.

One JSON object per ``data:`` line, each event ends with a blank line, ``data: [DONE]`` last on success.
While nothing is ready the stream carries comment lines (``: keep-alive``), which every SSE parser ignores
(never ``event: ping`` or data-less events: the OpenAI SDK fails on those). Errors after the 200 was sent go
in-band as ``data: {"error": {...}}`` and the stream ends without ``[DONE]``.
Headers: ``Cache-Control: no-cache`` and ``X-Accel-Buffering: no`` (nginx: do not buffer), no Content-Length.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

import msgspec
from litestar.response import Stream

from kvscope.engine.server.protocol import ErrorInfo, ErrorResponse

KEEPALIVE_EVENT = b": keep-alive\n\n"
DONE_EVENT = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_encoder = msgspec.json.Encoder()


def data_event(payload: Any) -> bytes:
    """``data: <compact JSON>\\n\\n`` (compact JSON never contains a raw newline)."""
    return b"data: " + _encoder.encode(payload) + b"\n\n"


def error_event(
    message: str, type: str = "server_error", code: str | None = None, param: str | None = None
) -> bytes:
    """An in-band ``data: {"error": {...}}`` event (a stream that fails after its 200)."""
    return data_event(ErrorResponse(ErrorInfo(message=message, type=type, param=param, code=code)))


class SSEResponse(Stream):
    """A ``text/event-stream`` response over an async generator of encoded events.

    When the response ends for any reason (done, client gone, send error), the generator is closed with
    ``aclose()`` so its ``finally`` block runs even if the client left while it was suspended at a ``yield``
    (Litestar's stream cancels only the send loop), and then ``on_close`` runs (idempotent cleanup that also
    covers a generator that never started).
    """

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        on_close: Callable[[], None],
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(events, media_type="text/event-stream", headers={**SSE_HEADERS, **(headers or {})})
        self._events = events
        self._on_close = on_close

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> Any:
        return _Closing(super().to_asgi_response(*args, **kwargs), self._events, self._on_close)


class _Closing:
    def __init__(self, inner: Any, events: AsyncGenerator[bytes, None], on_close: Callable[[], None]) -> None:
        self._inner = inner
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self._inner(scope, receive, send)
        finally:
            try:
                await self._events.aclose()
            finally:
                self._on_close()
