"""The client's half of a proxied exchange: the ASGI ``send`` of its one response, and how far it got."""

from __future__ import annotations

from collections.abc import Callable

from litestar.types import Send

BODY_CHUNK_EXTENSION = "kvscope.body_chunk"
"""ASGI scope extension (``scope["extensions"]``) the server sets per request (gateway/server.py
``write_body_chunk``): write one chunk of the started response body to the client, or say it cannot
(False)."""


class ClientResponse:
    """Writes the response to the client; the call and the relay both write through it.

    ``body_chunk``: the server's direct writer of one body chunk (gateway/server.py ``write_body_chunk``,
    the ``kvscope.body_chunk`` scope extension), used for body bytes that do not end the response; it
    returns False where ASGI ``send`` must write them instead. ``count``: told the size of each body
    written that way (the request log's response bytes, which ASGI ``send`` counts otherwise)."""

    def __init__(
        self,
        send: Send,
        body_chunk: Callable[[bytes], bool] | None = None,
        count: Callable[[int], None] | None = None,
    ) -> None:
        self._send = send
        self._body_chunk = body_chunk
        self._count = count
        self.committed = False
        """The response has started: no retry, errors go in-band."""
        self.finished = False
        """The last body message was sent (or the call is over): a disconnect from here is the normal end."""

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Send the status line and headers (``http.response.start``)."""
        self.committed = True
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    @property
    def direct(self) -> bool:
        """The server gave a direct body writer (``write_now`` can succeed)."""
        return self._body_chunk is not None

    def write_now(self, data: bytes) -> bool:
        """Write ``data`` (body bytes that do not end the response) through the server's direct writer,
        without waiting; False, having written nothing, where :meth:`body` must (no direct writer, the
        client not reading, not started …)."""
        if self._body_chunk is None or not self._body_chunk(data):
            return False
        if self._count is not None:
            self._count(len(data))
        return True

    async def body(self, data: bytes, final: bool = False) -> None:
        """Send body bytes; ``final`` ends the response."""
        if final:
            self.finished = True  # from here a disconnect message is the normal end, not the client leaving
        elif self.write_now(data):
            return
        await self._send({"type": "http.response.body", "body": data, "more_body": not final})
