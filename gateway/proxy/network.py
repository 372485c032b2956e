"""The upstream connections' socket layer: an asyncio-native network backend for httpcore.

httpx reaches the upstreams through httpcore, whose only asyncio backend goes through anyio. Per read of a
streamed answer that backend costs, on Python 3.11: a cancel scope (``anyio.fail_after``, which asks
``asyncio.current_task`` and so ``getpid()`` twice), ``pause_reading``/``resume_reading`` of the transport (an
``epoll_ctl`` each: anyio's socket stream stops reading whenever nobody waits), and for every
``get_extra_info("is_readable")`` of the pool's expiry checks a ``getpeername()`` plus a ``select()``.
Relaying a token costs one read, so at 32 streams these syscalls were a fifth of the gateway's CPU (py-spy,
2-vCPU Xeon; docs/benchmarks.md "The gateway's CPU per relayed token").

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
import time
from collections.abc import Callable, Iterable
from typing import Any, cast

import httpcore
import httpx

from kvscope.gateway.proxy.chunked import TERMINAL_CHUNK, ChunkedBodyTap

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
        self.head_pending = False
        """A request went out and its response head has not been handed to httpcore yet (reads stop at its
        end)."""
        self.head_tail = b""
        """The last bytes handed over while the head was pending (its blank line can straddle two reads)."""
        self.clean_head = False
        """httpcore was handed exactly the response head, nothing after it: the body is all still here."""
        self.tap: ChunkedBodyTap | None = None
        self.tap_paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        if self.tap is not None:
            after = self.tap.feed(data)
            if after is None:  # still in the body
                if not self.tap.accepting and not self.tap_paused and self.transport is not None:
                    self.tap_paused = True
                    self.transport.pause_reading()
                return
            broken = self.tap.broken
            self.end_tap()
            if broken:  # httpcore's parser never finishes this response: the connection is not reused
                return
            data = TERMINAL_CHUNK + after  # httpcore finishes the response on a body of no chunks
            if not data:
                return
        self.chunks.append(data)
        self.buffered += len(data)
        if self.buffered > HIGH_WATER and not self.read_paused and self.transport is not None:
            self.read_paused = True
            self.transport.pause_reading()
        self._wake_reader()

    def eof_received(self) -> bool:
        self.eof = True
        self._fail_tap(None)
        self._wake_reader()
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.error = exc
        self._fail_tap(exc)
        self._wake_reader()
        if self.drainer is not None and not self.drainer.done():
            self.drainer.set_result(None)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.drainer is not None and not self.drainer.done():
            self.drainer.set_result(None)

    def end_tap(self) -> None:
        """Back to buffering for httpcore (the tap's body ended, or its reader left)."""
        self.tap = None
        if self.tap_paused:
            self.tap_paused = False
            if self.transport is not None:
                self.transport.resume_reading()

    def resume_tap(self) -> None:
        """The tap's reader has room again: read on (until its next delivery says it is full)."""
        if self.tap is not None:
            self.tap.accepting = True
        if self.tap_paused and self.tap is not None:
            self.tap_paused = False
            if self.transport is not None:
                self.transport.resume_reading()

    def _fail_tap(self, exc: Exception | None) -> None:
        if self.tap is not None:
            tap, self.tap = self.tap, None
            tap.connection_ended(exc)

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


async def wait_future(
    waiter: asyncio.Future[None], timeout: float | None, on_timeout: BaseException | type[BaseException]
) -> None:
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
            data = p.take(max_bytes)
            p.clean_head = False
            if p.head_pending:
                data = self._head_only(data)
            return data
        if p.error is not None:
            raise httpcore.ReadError(str(p.error) or type(p.error).__name__) from p.error
        return b""

    def _head_only(self, data: bytes) -> bytes:
        """``data`` up to the end of the response head (its blank line) when it holds one; the rest goes back
        to the buffer, so that httpcore's parser holds none of the body (:meth:`tap_body`)."""
        p = self._protocol
        seen = p.head_tail + data
        end = seen.find(b"\r\n\r\n")
        if end < 0:
            p.head_tail = seen[-3:]
            return data
        cut = end + 4 - len(p.head_tail)
        if cut < len(data):
            rest = data[cut:]
            p.chunks.appendleft(rest)
            p.buffered += len(rest)
        p.head_pending, p.head_tail, p.clean_head = False, b"", True
        return data[:cut]

    def tap_body(self, deliver: Callable[[bytes | Exception | None], bool]) -> bool:
        """Take the response body being received off httpcore's hands: decode its chunked framing as it
        arrives (:class:`ChunkedBodyTap`) and hand each read's payload to ``deliver`` (then None at the end,
        or the httpx error that a broken body raises from httpx). False, and nothing changes, when the body is
        not all still here (httpcore read past the head: an interim 1xx answer or a read after the head).

        At the body's end the connection gets a zero-chunk body for httpcore to read
        (:meth:`StreamRelay.drain`), so it goes back to the pool as after any complete answer; a body left
        before its end keeps httpcore's parser short of it, and the connection is closed. Why: per relayed
        token, httpx's response iterator over httpcore over h11 cost the gateway more CPU than all the rest of
        the relay (docs/gateway.md "CPU per relayed token")."""
        p = self._protocol
        if not p.clean_head or p.tap is not None or p.eof:
            return False
        p.clean_head = False
        p.tap = ChunkedBodyTap(deliver)
        buffered = b"".join(p.chunks)
        p.chunks.clear()
        p.buffered = 0
        if p.read_paused and p.transport is not None:
            p.read_paused = False
            p.transport.resume_reading()
        if buffered:
            p.data_received(buffered)
        return True

    def untap(self) -> None:
        """Stop delivering (the reader left); the body's remainder is dropped with the connection."""
        if self._protocol.tap is not None:
            self._protocol.end_tap()

    def tap_room(self) -> None:
        """The tap's reader took items: resume reading if the tap paused it."""
        self._protocol.resume_tap()

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        """Queue ``buffer`` on the transport; waits (up to ``timeout``) while the socket's buffer is full."""
        if not buffer:
            return
        p = self._protocol
        p.head_pending, p.head_tail, p.clean_head = True, b"", False  # a request is going out
        if self._transport.is_closing() or p.eof and p.error is not None:
            raise httpcore.WriteError("the upstream connection is closed")
        self._transport.write(buffer)
        if p.write_paused:
            p.drainer = p.loop.create_future()
            try:
                await wait_future(
                    p.drainer, timeout, httpcore.WriteTimeout("timed out writing to the upstream")
                )
            finally:
                p.drainer = None
            if p.write_paused or p.error is not None:
                raise httpcore.WriteError(str(p.error or "the upstream connection is closed"))

    async def aclose(self) -> None:
        """Close the connection now (the upstream sees EOF: a cancelled request stops its generation)."""
        self._transport.close()
        if self._transport.get_write_buffer_size():
            self._transport.abort()

    async def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.AsyncNetworkStream:
        """TLS over this connection (``https://`` upstreams); ConnectTimeout/ConnectError on failure."""
        p = self._protocol
        try:
            new = await p.loop.start_tls(
                self._transport,
                p,
                ssl_context,
                server_hostname=server_hostname,
                ssl_handshake_timeout=timeout,
            )
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
        key = {
            "ssl_object": "ssl_object",
            "client_addr": "sockname",
            "server_addr": "peername",
            "socket": "socket",
        }.get(info)
        return self._transport.get_extra_info(key) if key else None


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    """httpcore network backend on the running asyncio loop (module docstring)."""

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        """A TCP connection (TCP_NODELAY, as asyncio sets it); ConnectTimeout/ConnectError on failure."""
        loop = asyncio.get_running_loop()
        local = (local_address, 0) if local_address else None
        return await self._connect(
            loop.create_connection(lambda: _BufferedProtocol(loop), host, port, local_addr=local),
            timeout,
            socket_options,
        )

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.AsyncNetworkStream:
        """A Unix-socket connection; ConnectTimeout/ConnectError on failure."""
        loop = asyncio.get_running_loop()
        return await self._connect(
            loop.create_unix_connection(lambda: _BufferedProtocol(loop), path), timeout, socket_options
        )

    @staticmethod
    async def _connect(
        opening: Any, timeout: float | None, socket_options: Iterable[Any] | None
    ) -> httpcore.AsyncNetworkStream:
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


class LinearPool(httpcore.AsyncConnectionPool):
    """httpcore 1.0's connection pool with its clean-up pass made linear and mostly skipped. httpcore 1.0.9
    runs the pass on every request queued and every response closed and evaluates ``len([c.is_idle() for c in
    connections])`` once for every idle connection, O(n²) each time: with the 32 keep-alive connections of 32
    streams that was a third of the gateway's httpx time per request (py-spy, docs/gateway.md "CPU per
    relayed token"; encode/httpcore#1035). Here the pass keeps its count as it goes (an idle check runs only
    where it can matter) and runs at most every :attr:`sweep_interval_s`, or at once while the pool holds
    more connections than ``max_keepalive_connections`` or its ``max_connections``: with 200 streams in
    flight even the linear pass asked 600 questions of the connections twice a request. Its decisions are
    httpcore's (closed and expired connections are removed, surplus idle ones closed), at most that much
    later; the connection a request is given is asked whether it expired (keep-alive expiry, or an idle
    connection the upstream closed) at that moment, as httpcore's pass would have, so no request is sent on a
    connection the upstream closed. The assignment of queued requests is httpcore's, stopping at the first
    available connection (httpcore builds the list of all of them and takes the first)."""

    sweep_interval_s = 0.25
    """Seconds between two clean-up passes while the pool is within its limits."""
    _next_sweep = 0.0

    def _assign_requests_to_connections(self) -> list[httpcore.AsyncConnectionInterface]:
        closing: list[httpcore.AsyncConnectionInterface] = []
        count = len(self._connections)
        now = time.monotonic()
        if (
            now >= self._next_sweep
            or count > self._max_keepalive_connections
            or count >= self._max_connections
        ):
            self._next_sweep = now + self.sweep_interval_s
            for connection in list(self._connections):
                if connection.is_closed():
                    self._connections.remove(connection)
                    count -= 1
                elif connection.has_expired() or (
                    count > self._max_keepalive_connections and connection.is_idle()
                ):
                    self._connections.remove(connection)
                    count -= 1
                    closing.append(connection)
        for pool_request in [request for request in self._requests if request.is_queued()]:
            origin = pool_request.request.url.origin
            available = self._available(origin, closing)
            if available is not None:
                pool_request.assign_to_connection(available)
                continue
            if len(self._connections) >= self._max_connections:
                idle = next((c for c in self._connections if c.is_idle()), None)
                if idle is None:
                    continue  # wait for a connection to come free
                self._connections.remove(idle)
                closing.append(idle)
            connection = self.create_connection(origin)
            self._connections.append(connection)
            pool_request.assign_to_connection(connection)
        return closing

    def _available(
        self, origin: httpcore.Origin, closing: list[httpcore.AsyncConnectionInterface]
    ) -> httpcore.AsyncConnectionInterface | None:
        """The first connection that can take a request to ``origin`` now; expired ones met on the way are
        removed from the pool and added to ``closing``."""
        expired = []
        found = None
        for connection in self._connections:
            if connection.is_available() and connection.can_handle_request(origin):
                if not connection.has_expired():
                    found = connection
                    break
                expired.append(connection)
        for connection in expired:
            self._connections.remove(connection)
            closing.append(connection)
        return found


def upstream_transport(limits: httpx.Limits) -> httpx.AsyncHTTPTransport:
    """httpx's HTTP/1.1 transport (certificates verified, no proxy from the environment) whose connection
    pool uses :class:`AsyncioBackend` (and is a :class:`LinearPool` on httpcore 1.0, whose clean-up pass it
    was written against)."""
    transport = httpx.AsyncHTTPTransport(limits=limits, trust_env=False)
    pool_class = LinearPool if httpcore.__version__.startswith("1.0.") else httpcore.AsyncConnectionPool
    transport._pool = pool_class(
        ssl_context=httpx.create_ssl_context(trust_env=False),
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry,
        http1=True,
        http2=False,
        network_backend=AsyncioBackend(),
    )
    return transport
