"""The upstream connections' socket layer: an asyncio-native network backend for httpcore.

httpx reaches the upstreams through httpcore, whose only asyncio backend goes through anyio. Per read of a
streamed answer that backend costs, on Python 3.11: a cancel scope (``anyio.fail_after``, which asks
``asyncio.current_task`` and so ``getpid()`` twice), ``pause_reading``/``resume_reading`` of the transport (an
``epoll_ctl`` each: anyio's socket stream stops reading whenever nobody waits), and for every
``get_extra_info("is_readable")`` of the pool's expiry checks a ``getpeername()`` plus a ``select()``. Relaying
a token costs one read, so at 32 streams these syscalls were a fifth of the gateway's CPU (py-spy, 2-vCPU Xeon;
docs/benchmarks.md "The gateway's CPU per relayed token").

:class:`AsyncioBackend` is the same contract (httpcore's ``AsyncNetworkBackend``: ``read``/``write`` with
timeouts, ``start_tls``, ``get_extra_info``, the same httpcore exceptions) over an :class:`asyncio.Protocol`
that keeps reading into a buffer: a read that finds data returns it without suspending, a read that waits
has one future and one timer, and the buffer only pauses reading above :data:`HIGH_WATER` bytes (the
backpressure of a client that does not read). ``is_readable`` (httpcore: "an idle connection that is
readable was closed by the server") is answered from what the protocol already saw: buffered bytes, EOF or
a lost connection.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import ssl
from collections.abc import Iterable
from typing import Any, cast

import httpcore
import httpx

HIGH_WATER = 256 * 1024
"""Buffered bytes above which the transport stops reading (resumed below :data:`LOW_WATER`)."""
LOW_WATER = 64 * 1024


class _BufferedProtocol(asyncio.Protocol):
    """Reads into a queue of chunks and wakes the one waiting reader; tracks write flow control."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.eof = False
        self.error: BaseException | None = None
        self.read_paused = False
        self.reader: asyncio.Future[None] | None = None
        self.write_paused = False
        self.drainer: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        self.chunks.append(data)
        self.buffered += len(data)
        if self.buffered > HIGH_WATER and not self.read_paused and self.transport is not None:
            self.read_paused = True
            self.transport.pause_reading()
        self._wake_reader()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake_reader()
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.error = exc
        self._wake_reader()
        if self.drainer is not None and not self.drainer.done():
            self.drainer.set_result(None)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.drainer is not None and not self.drainer.done():
            self.drainer.set_result(None)

    def _wake_reader(self) -> None:
        if self.reader is not None and not self.reader.done():
            self.reader.set_result(None)

    def take(self, max_bytes: int) -> bytes:
        """Up to ``max_bytes`` buffered bytes (at least one chunk's worth when any are buffered)."""
        first = self.chunks.popleft()
        if len(first) > max_bytes:
            self.chunks.appendleft(first[max_bytes:])
            first = first[:max_bytes]
        elif self.chunks and len(first) < max_bytes:
            parts = [first]
            size = len(first)
            while self.chunks and size + len(self.chunks[0]) <= max_bytes:
                nxt = self.chunks.popleft()
                parts.append(nxt)
                size += len(nxt)
            first = b"".join(parts)
        self.buffered -= len(first)
        if self.read_paused and self.buffered < LOW_WATER and self.transport is not None:
            self.read_paused = False
            self.transport.resume_reading()
        return first


def _expire(waiter: asyncio.Future[None], exc: BaseException | type[BaseException]) -> None:
    if not waiter.done():
        waiter.set_exception(exc)


async def wait_future(waiter: asyncio.Future[None], timeout: float | None,
                      on_timeout: BaseException | type[BaseException]) -> None:
    """Await ``waiter`` at most ``timeout`` seconds (None: no limit; ≤ 0: expired, unless it is already done),
    then raise ``on_timeout``. One timer on the future's loop: ``asyncio.timeout`` would ask the running loop
    and the current task, a ``getpid()`` each on Python 3.11, per wait."""
    loop = waiter.get_loop()
    timer = loop.call_later(max(0.0, timeout), _expire, waiter, on_timeout) if timeout is not None else None
    try:
        await waiter
    finally:
        if timer is not None:
            timer.cancel()


class AsyncioStream(httpcore.AsyncNetworkStream):
    """One upstream connection (see the module docstring); raises httpcore's ``ReadTimeout``,
    ``ReadError``, ``WriteTimeout``, ``WriteError``, ``ConnectTimeout`` and ``ConnectError``."""

    def __init__(self, transport: asyncio.Transport, protocol: _BufferedProtocol) -> None:
        self._transport, self._protocol = transport, protocol

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        """Buffered bytes (at most ``max_bytes``), waiting up to ``timeout`` seconds for some; ``b""`` at
        EOF; ReadError when the connection broke (after the bytes that came before it)."""
        p = self._protocol
        if not p.chunks and not p.eof:
            p.reader = p.loop.create_future()
            try:
                await wait_future(p.reader, timeout, httpcore.ReadTimeout("timed out reading the upstream"))
            finally:
                p.reader = None
        if p.chunks:
            return p.take(max_bytes)
        if p.error is not None:
            raise httpcore.ReadError(str(p.error) or type(p.error).__name__) from p.error
        return b""

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        """Queue ``buffer`` on the transport; waits (up to ``timeout``) while the socket's buffer is full."""
        if not buffer:
            return
        p = self._protocol
        if self._transport.is_closing() or p.eof and p.error is not None:
            raise httpcore.WriteError("the upstream connection is closed")
        self._transport.write(buffer)
        if p.write_paused:
            p.drainer = p.loop.create_future()
            try:
                await wait_future(p.drainer, timeout, httpcore.WriteTimeout("timed out writing to the upstream"))
            finally:
                p.drainer = None
            if p.write_paused or p.error is not None:
                raise httpcore.WriteError(str(p.error or "the upstream connection is closed"))

    async def aclose(self) -> None:
        """Close the connection now (the upstream sees EOF: a cancelled request stops its generation)."""
        self._transport.close()
        if self._transport.get_write_buffer_size():
            self._transport.abort()

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        """TLS over this connection (``https://`` upstreams); ConnectTimeout/ConnectError on failure."""
        p = self._protocol
        try:
            new = await p.loop.start_tls(self._transport, p, ssl_context, server_hostname=server_hostname,
                                         ssl_handshake_timeout=timeout)
        except TimeoutError as exc:
            self._transport.abort()
            raise httpcore.ConnectTimeout(str(exc)) from exc
        except (OSError, ssl.SSLError, ConnectionError) as exc:
            self._transport.abort()
            raise httpcore.ConnectError(str(exc)) from exc
        p.transport = cast(asyncio.Transport, new)
        return AsyncioStream(p.transport, p)

    def get_extra_info(self, info: str) -> Any:
        """httpcore's keys: ``ssl_object``, ``client_addr``, ``server_addr``, ``socket``, ``is_readable``."""
        if info == "is_readable":
            p = self._protocol
            return bool(p.chunks) or p.eof or self._transport.is_closing()
        key = {"ssl_object": "ssl_object", "client_addr": "sockname", "server_addr": "peername",
               "socket": "socket"}.get(info)
        return self._transport.get_extra_info(key) if key else None


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    """httpcore network backend on the running asyncio loop (module docstring)."""

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        """A TCP connection (TCP_NODELAY, as asyncio sets it); ConnectTimeout/ConnectError on failure."""
        loop = asyncio.get_running_loop()
        local = (local_address, 0) if local_address else None
        return await self._connect(loop.create_connection(lambda: _BufferedProtocol(loop), host, port,
                                                          local_addr=local), timeout, socket_options)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        """A Unix-socket connection; ConnectTimeout/ConnectError on failure."""
        loop = asyncio.get_running_loop()
        return await self._connect(loop.create_unix_connection(lambda: _BufferedProtocol(loop), path),
                                   timeout, socket_options)

    @staticmethod
    async def _connect(opening: Any, timeout: float | None,
                       socket_options: Iterable[Any] | None) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                transport, protocol = await opening
        except TimeoutError as exc:
            raise httpcore.ConnectTimeout(str(exc) or "timed out connecting to the upstream") from exc
        except OSError as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        sock: socket.socket | None = transport.get_extra_info("socket")
        for option in socket_options or ():
            if sock is not None:
                sock.setsockopt(*option)
        return AsyncioStream(transport, protocol)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def upstream_transport(limits: httpx.Limits) -> httpx.AsyncHTTPTransport:
    """httpx's HTTP/1.1 transport (certificates verified, no proxy from the environment) whose connection
    pool uses :class:`AsyncioBackend`."""
    transport = httpx.AsyncHTTPTransport(limits=limits, trust_env=False)
    transport._pool = httpcore.AsyncConnectionPool(
        ssl_context=httpx.create_ssl_context(trust_env=False), max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections, keepalive_expiry=limits.keepalive_expiry,
        http1=True, http2=False, network_backend=AsyncioBackend())
    return transport
