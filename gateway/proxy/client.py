"""The client's half of a proxied exchange: the ASGI ``send`` of its one response, and how far it got."""

from __future__ import annotations

from litestar.types import Send


class ClientResponse:
    """Writes the response to the client; the call and the relay both write through it."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.committed = False
        """The response has started: no retry, errors go in-band."""
        self.finished = False
        """The last body message was sent (or the call is over): a disconnect from here is the normal end."""

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Send the status line and headers (``http.response.start``)."""
        self.committed = True
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def body(self, data: bytes, final: bool = False) -> None:
        """Send body bytes; ``final`` ends the response."""
        if final:
            self.finished = True  # from here a disconnect message is the normal end, not the client leaving
        await self._send({"type": "http.response.body", "body": data, "more_body": not final})
