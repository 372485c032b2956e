"""Decoding an HTTP/1.1 chunked body as its bytes arrive (RFC 9112 §7.1), for the gateway's stream tap
(gateway/proxy/network.py ``AsyncioStream.tap_body``): no I/O here, only the framing."""

from __future__ import annotations

from collections.abc import Callable

import httpx

TERMINAL_CHUNK = b"0\r\n\r\n"
"""The last chunk of a chunked body, with no trailers (RFC 9112 §7.1)."""
MAX_CHUNK_LINE = 4096
"""Longest chunk-size line (with extensions) or trailer line a tap accepts."""


class ChunkedBodyTap:
    """Decodes an HTTP/1.1 chunked body (RFC 9112 §7.1: size line with optional extensions, data, CRLF; a
    zero chunk, optional trailer lines and a blank line end it) from the connection's reads as they come,
    and hands the payload of each read to ``deliver`` in one piece (chunk boundaries carry no meaning). At
    the body's end ``deliver(None)``; on a broken body the httpx error httpx would have raised for it:
    ``RemoteProtocolError`` for bad framing or a connection closed before the end, ``ReadError`` for a
    connection reset. ``deliver`` returns whether it takes more (False: the protocol pauses reading until
    told, backpressure)."""

    def __init__(self, deliver: Callable[[bytes | Exception | None], bool]) -> None:
        self._deliver = deliver
        self._pending = b""  # an incomplete size line, trailer line or chunk-ending CRLF
        self._left = 0  # data bytes left in the current chunk
        self._state = "size"  # size → data → crlf → size …; "trailer" after the zero chunk
        self.accepting = True
        self.done = False
        self.broken = False

    def feed(self, data: bytes) -> bytes | None:
        """Consume ``data``; None while the body goes on, else the bytes after its end (normally ``b""``; also
        after bad framing, with :attr:`broken` set)."""
        if self.done:
            return data
        if self._state == "size" and not self._pending and data[-2:] == b"\r\n":
            # the common read: exactly one whole chunk (a streamed token); the same checks as the loop below
            line_end = data.find(b"\r\n")
            size = data[:line_end].split(b";", 1)[0].strip(b" \t")
            if (
                0 < len(size) <= 16
                and not size.strip(b"0123456789abcdefABCDEF")
                and line_end + 4 + int(size, 16) == len(data)
                and line_end + 2 < len(data) - 2
            ):
                self.accepting = self._deliver(data[line_end + 2 : -2])
                return None
        buf = self._pending + data if self._pending else data
        self._pending = b""
        payload: list[bytes] = []
        pos, end = 0, len(buf)
        while pos < end:
            if self._state == "data":
                take = min(self._left, end - pos)
                payload.append(buf[pos : pos + take])
                pos += take
                self._left -= take
                if self._left == 0:
                    self._state = "crlf"
                continue
            if self._state == "crlf":
                if end - pos < 2:
                    self._pending = buf[pos:]
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    return self._broken(payload, "chunk data not followed by CRLF")
                pos += 2
                self._state = "size"
                continue
            line_end = buf.find(b"\r\n", pos)
            if line_end < 0:
                if end - pos > MAX_CHUNK_LINE:
                    return self._broken(payload, "chunk-size or trailer line too long")
                self._pending = buf[pos:]
                break
            line = buf[pos:line_end]
            pos = line_end + 2
            if self._state == "trailer":
                if not line:  # the blank line after the zero chunk (and any trailers): the body is over
                    self.done = True
                    self._flush(payload)
                    self.accepting = self._deliver(None)
                    return buf[pos:]
                continue  # a trailer field: not forwarded (the relay never forwards upstream trailers)
            size = line.split(b";", 1)[0].strip(b" \t")
            if not size or len(size) > 16 or size.strip(b"0123456789abcdefABCDEF"):
                return self._broken(payload, f"bad chunk-size line {line[:40]!r}")
            self._left = int(size, 16)
            self._state = "data" if self._left else "trailer"
        self._flush(payload)
        return None

    def connection_ended(self, exc: Exception | None) -> None:
        """The connection closed (``exc`` None: the upstream's EOF) before the body's end."""
        if self.done:
            return
        self.done = True
        if exc is None:
            self._deliver(
                httpx.RemoteProtocolError(
                    "peer closed connection without sending complete message body: incomplete chunked read"
                )
            )
        else:
            self._deliver(httpx.ReadError(str(exc) or type(exc).__name__))

    def _flush(self, payload: list[bytes]) -> None:
        if payload:
            self.accepting = self._deliver(payload[0] if len(payload) == 1 else b"".join(payload))

    def _broken(self, payload: list[bytes], why: str) -> bytes:
        self._flush(payload)
        self.done = self.broken = True
        self._deliver(httpx.RemoteProtocolError(f"malformed chunked body from the upstream: {why}"))
        return b""  # the connection is not reused: httpcore's parser never finishes this response
