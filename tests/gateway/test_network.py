"""gateway/proxy/network.py: the asyncio network backend under the gateway's upstream client, against real
loopback servers: exact bytes in order, EOF and a reset after data, read/connect timeouts and errors in
httpcore's (and so httpx's) exception types, backpressure above the high-water mark, an idle connection the
server closed is not reused, keep-alive reuse, and a closed stream reaching the server as EOF."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpcore
import httpx
import pytest

from kvscope.gateway.lifespan import new_http_client
from kvscope.gateway.proxy.chunked import MAX_CHUNK_LINE, ChunkedBodyTap
from kvscope.gateway.proxy.network import (
    HIGH_WATER,
    LOW_WATER,
    AsyncioBackend,
    AsyncioStream,
    _BufferedProtocol,
    upstream_transport,
)
from kvscope.gateway.settings import load_settings
from kvscope.testing.wait import async_wait_until

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[int]:
    srv = await asyncio.start_server(handler, "127.0.0.1", 0)
    try:
        yield srv.sockets[0].getsockname()[1]
    finally:
        srv.close()


async def connect(port: int, timeout: float | None = 5.0) -> AsyncioStream:
    stream = await AsyncioBackend().connect_tcp("127.0.0.1", port, timeout=timeout)
    assert isinstance(stream, AsyncioStream)
    return stream


async def read_all(stream: AsyncioStream, max_bytes: int = 65536) -> bytes:
    out = b""
    while data := await stream.read(max_bytes, timeout=5):
        out += data
    return out


async def test_bytes_arrive_exactly_then_eof() -> None:
    payload = bytes(range(256)) * 1000

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await reader.readexactly(5)
        for i in range(0, len(payload), 1000):
            writer.write(payload[i : i + 1000])
            await writer.drain()
        writer.write(request)
        writer.close()

    async with server(handler) as port:
        stream = await connect(port)
        await stream.write(b"hello", timeout=5)
        assert await read_all(stream, max_bytes=777) == payload + b"hello"
        assert await stream.read(10, timeout=5) == b""  # EOF stays EOF
        assert stream.get_extra_info("is_readable") is True
        await stream.aclose()


class DuckTransport:
    """A transport with asyncio's methods that does not subclass ``asyncio.Transport``, as uvloop's do
    (uvicorn runs the gateway on uvloop whenever it is installed)."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default


async def test_a_transport_that_does_not_subclass_asyncio_transport_works() -> None:
    protocol = _BufferedProtocol(asyncio.get_running_loop())
    transport = DuckTransport()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    stream = AsyncioStream(protocol.transport, protocol)  # type: ignore[arg-type]
    await stream.write(b"GET / HTTP/1.1\r\n\r\n", timeout=1)
    protocol.data_received(b"HTTP/1.1 200 OK\r\n")
    assert await stream.read(100, timeout=1) == b"HTTP/1.1 200 OK\r\n"
    assert transport.written == [b"GET / HTTP/1.1\r\n\r\n"] and stream.get_extra_info("is_readable") is False
    await stream.aclose()
    assert transport.closed


async def test_read_timeout_and_reset_after_data() -> None:
    done = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(1)  # "r": send data, then reset the connection
        writer.write(b"partial")
        await writer.drain()
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await done.wait()
        writer.transport.abort()  # SO_LINGER 0: an RST, not a FIN

    async with server(handler) as port:
        stream = await connect(port)
        with pytest.raises(httpcore.ReadTimeout):
            await stream.read(100, timeout=0.05)
        assert stream.get_extra_info("is_readable") is False  # idle and open
        await stream.write(b"r", timeout=5)
        assert await stream.read(100, timeout=5) == b"partial"
        done.set()
        with pytest.raises(httpcore.ReadError):
            await stream.read(100, timeout=5)
        await stream.aclose()


async def test_backpressure_pauses_reading_above_the_high_water_mark() -> None:
    total = (
        4 * HIGH_WATER
    )  # an asyncio read takes at most 256 KiB: paused, at most 2 x HIGH_WATER is buffered

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"x" * total)
        await writer.drain()
        writer.close()

    async with server(handler) as port:
        stream = await connect(port)
        protocol = stream._protocol
        for _ in range(200):  # the client does not read: the buffer fills to the mark and stops there
            await asyncio.sleep(0.01)
            if protocol.read_paused:
                break
        assert protocol.read_paused and HIGH_WATER < protocol.buffered <= 2 * HIGH_WATER
        received = await read_all(stream)
        assert received == b"x" * total and protocol.buffered == 0 and not protocol.read_paused
        assert LOW_WATER < HIGH_WATER


async def test_connect_errors_are_httpcore_errors() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(httpcore.ConnectError):
            await connect(port)
    with pytest.raises(httpcore.ConnectTimeout):
        await AsyncioBackend().connect_tcp("127.0.0.1", 9, timeout=0)


async def test_a_closed_stream_reaches_the_server_as_eof() -> None:
    seen_eof = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)  # returns b"" at EOF
        seen_eof.set()

    async with server(handler) as port:
        stream = await connect(port)
        await stream.aclose()
        await asyncio.wait_for(seen_eof.wait(), 5)


def _chunked(pieces: list[bytes]) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    return b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n" + body


def _closing_upstream(
    connections: list[int], close_after_next: asyncio.Event, closed: asyncio.Event
) -> Handler:
    """A keep-alive upstream: each connection appends its index to ``connections``; every request is answered
    chunked (``/stream``: 20 SSE events, else ``ok``); once ``close_after_next`` is set, the connection is
    closed after its next answer and ``closed`` set."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(len(connections))
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            pieces = [b"data: %d\n\n" % i for i in range(20)] if b"/stream" in head else [b"ok"]
            writer.write(_chunked(pieces))
            await writer.drain()
            if close_after_next.is_set():
                writer.close()
                await writer.wait_closed()
                closed.set()
                return

    return handler


async def test_httpx_streams_reuses_and_drops_a_closed_idle_connection() -> None:
    """Through httpx: a chunked SSE answer arrives piece by piece; the next request reuses the connection;
    after the server closes the idle connection, the next request opens a new one instead of failing."""
    connections: list[int] = []
    close_after_next = asyncio.Event()
    closed = asyncio.Event()

    async with (
        server(_closing_upstream(connections, close_after_next, closed)) as port,
        httpx.AsyncClient(transport=upstream_transport(httpx.Limits())) as client,
    ):
        base = f"http://127.0.0.1:{port}"
        async with client.stream("GET", base + "/stream") as resp:
            body = b"".join([chunk async for chunk in resp.aiter_raw()])
        assert body == b"".join(b"data: %d\n\n" % i for i in range(20))
        assert (await client.get(base + "/json")).content == b"ok"
        assert len(connections) == 1  # kept alive, reused
        close_after_next.set()
        assert (await client.get(base + "/json")).content == b"ok"
        await asyncio.wait_for(closed.wait(), 5)  # the server's FIN is on its way to the idle connection
        assert (await client.get(base + "/json")).content == b"ok"
        assert len(connections) == 2


async def test_httpx_read_timeout_is_httpx_read_timeout() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(5)

    async with (
        server(handler) as port,
        httpx.AsyncClient(transport=upstream_transport(httpx.Limits())) as client,
    ):
        with pytest.raises(httpx.ReadTimeout):
            await client.get(f"http://127.0.0.1:{port}/", timeout=httpx.Timeout(5, read=0.1))


async def test_the_gateway_client_uses_the_backend() -> None:
    """Guards the wiring into httpx (it has no public switch for httpcore's network backend)."""
    client = new_http_client(load_settings(None, {"upstreams": [{"url": "http://127.0.0.1:1"}]}, env={}))
    try:
        pool = client._transport._pool  # type: ignore[attr-defined]
        assert isinstance(pool, httpcore.AsyncConnectionPool)
        assert isinstance(pool._network_backend, AsyncioBackend)
        assert pool._max_keepalive_connections == 256 and not pool._http2
    finally:
        await client.aclose()


async def test_the_gateway_client_keeps_no_upstream_cookie() -> None:
    """An upstream's Set-Cookie (a load balancer's sticky session, say) is not stored and not sent with the
    next request: the client is shared by every user of the gateway (httpx's default jar would send it on)."""
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                seen.append(await reader.readuntil(b"\r\n\r\n"))
                writer.write(
                    b"HTTP/1.1 200 OK\r\nset-cookie: session=alice; Path=/\r\n"
                    b"set-cookie: lb=node1\r\ncontent-length: 2\r\n\r\n{}"
                )
                await writer.drain()

    async with server(handler) as port:
        client = new_http_client(
            load_settings(None, {"upstreams": [{"url": f"http://127.0.0.1:{port}"}]}, env={})
        )
        try:
            for _ in range(2):
                response = await client.get(f"http://127.0.0.1:{port}/v1/models")
                assert response.headers.get_list("set-cookie") == ["session=alice; Path=/", "lb=node1"]
            assert len(client.cookies) == 0
        finally:
            await client.aclose()
    assert len(seen) == 2 and all(b"cookie" not in head.lower() for head in seen)


async def test_a_health_check_on_a_connection_the_upstream_just_closed_is_not_a_failure() -> None:
    """The upstream answers the first request of each connection and drops the connection at the second
    (what an idle keep-alive timeout does when it fires as the pool reuses the connection): the replica
    stays healthy, because the probe is retried once on a new connection (break-it finding: one such race
    marked it down)."""
    from prometheus_client import CollectorRegistry

    from kvscope.gateway.metrics import GatewayMetrics
    from kvscope.gateway.proxy.upstreams import UpstreamPool

    body = b'{"object": "list", "data": [{"id": "m", "object": "model"}]}'
    connections: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(len(connections))
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (len(body), body)
        )
        await writer.drain()
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            await reader.readuntil(b"\r\n\r\n")  # the second request on this connection: no answer
        writer.transport.abort()

    async with server(handler) as port:
        settings = load_settings(None, {"upstreams": [{"url": f"http://127.0.0.1:{port}"}]}, env={})
        pool = UpstreamPool(
            settings.upstreams, settings.models, settings.routing, GatewayMetrics(CollectorRegistry())
        )
        client = new_http_client(settings)
        try:
            replica = pool.replicas[0]
            for _ in range(3):
                assert await pool.check(replica, client) and replica.healthy and set(replica.cards) == {"m"}
        finally:
            await client.aclose()
    assert len(connections) == 3  # each reused connection was found closed and replaced once


async def test_health_probes_without_an_answer_eject_only_at_the_threshold() -> None:
    """A replica that accepts the probe's connection but answers late (an engine in a long step) stays in
    rotation through failure_threshold - 1 unanswered probes in a row, leaves at the failure_threshold-th,
    returns at the next answer; an answer in between resets the count; a refused connection and an error
    status eject at once (break-it finding: one 1-s probe timeout on a 2-core host turned every request
    into a 503 for a second)."""
    from prometheus_client import CollectorRegistry

    from kvscope.gateway.metrics import GatewayMetrics
    from kvscope.gateway.proxy.upstreams import UpstreamPool

    body = b'{"object": "list", "data": [{"id": "m", "object": "model"}]}'
    script: list[str] = []  # per probe: "ok", "late" (never answers) or "500"

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                await reader.readuntil(b"\r\n\r\n")
                action = script.pop(0)
                if action == "late":
                    await reader.read()  # until the client gives up and closes
                    return
                status, payload = (
                    (b"200 OK", body) if action == "ok" else (b"500 Internal Server Error", b"{}")
                )
                writer.write(
                    b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                    % (status, len(payload), payload)
                )
                await writer.drain()

    async with server(handler) as port:
        settings = load_settings(
            None,
            {
                "upstreams": [{"url": f"http://127.0.0.1:{port}"}],
                "routing": {"health_timeout_s": 0.2, "failure_threshold": 3},
            },
            env={},
        )
        pool = UpstreamPool(
            settings.upstreams, settings.models, settings.routing, GatewayMetrics(CollectorRegistry())
        )
        client = new_http_client(settings)
        replica = pool.replicas[0]

        async def probe(action: str) -> tuple[bool, bool, int]:
            script.append(action)
            kept = await pool.check(replica, client)
            assert script == []
            return kept, replica.healthy, replica.probe_timeouts

        try:
            assert await probe("late") == (
                False,
                False,
                1,
            )  # not yet healthy: a late first answer does not admit it
            assert await probe("ok") == (True, True, 0)
            assert [await probe("late") for _ in range(2)] == [(True, True, 1), (True, True, 2)]
            assert await probe("ok") == (True, True, 0)  # an answer resets the count
            assert [await probe("late") for _ in range(3)] == [
                (True, True, 1),
                (True, True, 2),
                (False, False, 3),
            ]
            assert await probe("late") == (False, False, 4)  # an ejected replica stays out while silent
            assert await probe("ok") == (True, True, 0)
            assert await probe("500") == (False, False, 0)  # an error status ejects at once
            assert await probe("ok") == (True, True, 0)
        finally:
            await client.aclose()
    async with new_http_client(settings) as client:  # healthy until now; the server is gone: refused, at once
        assert (await pool.check(replica, client), replica.healthy) == (False, False)


CHUNKED_BODY = (
    b"5\r\nhello\r\n"
    b"1a;name=value\r\n" + b'data: {"a": 1}\n\n' + b"0123456789"[: 26 - 16] + b"\r\n"
    b"3 \r\n\n\n\n\r\n"
    b"0\r\nx-trailer: 1\r\n\r\n"
)
CHUNKED_PAYLOAD = b"hello" + b'data: {"a": 1}\n\n' + b"0123456789"[: 26 - 16] + b"\n\n\n"


def _tap_collect() -> tuple[ChunkedBodyTap, list[object]]:
    got: list[object] = []
    return ChunkedBodyTap(lambda item: got.append(item) or True), got


def _payload(got: list[object]) -> bytes:
    return b"".join(x for x in got if isinstance(x, bytes))


def test_the_tap_decodes_chunked_framing_split_anywhere() -> None:
    """Extensions, a size with trailing whitespace, trailers; every split point of the body into two reads
    (and one byte at a time) gives the same payload, then the end, then the bytes after it."""
    for cut in range(len(CHUNKED_BODY) + 1):
        tap, got = _tap_collect()
        assert tap.feed(CHUNKED_BODY[:cut]) is None or cut == len(CHUNKED_BODY)
        after = tap.feed(CHUNKED_BODY[cut:] + b"NEXT") if cut < len(CHUNKED_BODY) else tap.feed(b"NEXT")
        assert _payload(got) == CHUNKED_PAYLOAD and got[-1] is None and after == b"NEXT", cut
        assert tap.done and not tap.broken
    tap, got = _tap_collect()
    ends = [tap.feed(CHUNKED_BODY[i : i + 1]) for i in range(len(CHUNKED_BODY))]
    assert ends[:-1] == [None] * (len(CHUNKED_BODY) - 1) and ends[-1] == b""
    assert _payload(got) == CHUNKED_PAYLOAD and got[-1] is None


@pytest.mark.parametrize(
    "read",
    [
        b"5\r\nhello\r\n",
        b"A;ext=1\r\n0123456789\r\n",
        b"a \t\r\n0123456789\r\n",  # one whole chunk: the shortcut
        b"3\r\nhello\r\n",  # shorter than its data: broken
        b"9\r\nhello\r\n",  # longer: the rest comes in the next read
        b"0x5\r\nhello\r\n",
        b"+5\r\nhello\r\n",
        b"5_\r\nhello\r\n",  # what int(s, 16) takes, RFC 9112 does not
        b"0\r\n\r\n",
        b"2\r\nok\r\n0\r\n\r\n",
    ],
)
def test_a_read_of_one_whole_chunk_decodes_as_byte_by_byte_reads_do(read: bytes) -> None:
    """A read holding exactly one chunk (a streamed token) takes a shortcut (gateway/proxy/chunked.py); every
    read gives the payload, end, errors and state that one byte at a time gives."""
    whole, got_whole = _tap_collect()
    bytewise, got_bytewise = _tap_collect()
    after_whole = whole.feed(read)
    after_bytewise = [bytewise.feed(read[i : i + 1]) for i in range(len(read))]
    assert after_whole == next((a for a in after_bytewise if a is not None), None)
    assert _payload(got_whole) == _payload(got_bytewise)
    assert [type(x) for x in got_whole if not isinstance(x, bytes)] == [
        type(x) for x in got_bytewise if not isinstance(x, bytes)
    ]
    assert (whole.done, whole.broken, whole._state, whole._left) == (
        bytewise.done,
        bytewise.broken,
        bytewise._state,
        bytewise._left,
    )


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"zz\r\nhello\r\n", "bad chunk-size line"),
        (b"\r\n", "bad chunk-size line"),
        (b"-5\r\nhello\r\n", "bad chunk-size line"),
        (b"5\r\nhelloXX", "not followed by CRLF"),
        (b"1" * (MAX_CHUNK_LINE + 1), "too long"),
    ],
)
def test_bad_chunked_framing_is_a_remote_protocol_error(body: bytes, why: str) -> None:
    tap, got = _tap_collect()
    assert tap.feed(b"2\r\nok\r\n" + body) == b""
    assert (
        _payload(got).startswith(b"ok")
        and isinstance(got[-1], httpx.RemoteProtocolError)
        and why in str(got[-1])
    )
    assert tap.done and tap.broken


def test_a_connection_that_ends_mid_body_is_an_httpx_error() -> None:
    tap, got = _tap_collect()
    tap.feed(b"5\r\nhel")
    tap.connection_ended(None)
    assert (
        got[0] == b"hel"
        and isinstance(got[1], httpx.RemoteProtocolError)
        and "incomplete chunked read" in str(got[1])
    )
    tap, got = _tap_collect()
    tap.connection_ended(ConnectionResetError("reset by peer"))
    assert isinstance(got[0], httpx.ReadError) and "reset by peer" in str(got[0])
    tap.connection_ended(None)  # once only
    assert len(got) == 1


async def _tapped_stream(
    client: httpx.AsyncClient, url: str
) -> tuple[httpx.Response, list[object], asyncio.Event, AsyncioStream, bool]:
    response = await client.send(client.build_request("GET", url), stream=True)
    stream = response.extensions["network_stream"]
    assert isinstance(stream, AsyncioStream)
    got: list[object] = []
    ended = asyncio.Event()

    def deliver(item: object) -> bool:
        got.append(item)
        if not isinstance(item, bytes):
            ended.set()
        return True

    return response, got, ended, stream, stream.tap_body(deliver)


async def test_a_tapped_body_arrives_whole_and_its_connection_is_reused() -> None:
    """Head and first chunk in one packet, the rest piece by piece: the tap gets the whole payload (httpcore's
    parser was handed the head only), and after httpcore reads the end the tap left, the next request reuses
    the connection."""
    connections: list[int] = []
    pieces = [b"data: %d\n\n" % i for i in range(20)]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(len(connections))
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            if b"/json" in head:
                writer.write(_chunked([b"ok"]))
                continue
            raw = _chunked(pieces)
            first = raw.index(b"\r\n\r\n") + 4 + len(b"%x\r\n%s\r\n" % (len(pieces[0]), pieces[0]))
            writer.write(raw[:first])  # the head and the first chunk together
            for i in range(first, len(raw), 7):
                await writer.drain()
                await asyncio.sleep(0.001)
                writer.write(raw[i : i + 7])

    async with (
        server(handler) as port,
        httpx.AsyncClient(transport=upstream_transport(httpx.Limits())) as client,
    ):
        base = f"http://127.0.0.1:{port}"
        response, got, ended, _, tapped = await _tapped_stream(client, base + "/stream")
        assert tapped
        await asyncio.wait_for(ended.wait(), 5)
        assert _payload(got) == b"".join(pieces) and got[-1] is None
        assert [chunk async for chunk in response.aiter_raw()] == []  # the end the tap left: no chunks
        await response.aclose()
        assert (await client.get(base + "/json")).content == b"ok"
        assert len(connections) == 1


async def test_a_body_left_before_its_end_closes_the_connection() -> None:
    seen_eof = asyncio.Event()
    connections: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(len(connections))
        head = await reader.readuntil(b"\r\n\r\n")
        if b"/json" in head:
            writer.write(_chunked([b"ok"]))
            await reader.read(1)
            return
        writer.write(_chunked([b"data: 1\n\n"])[:-5])  # no zero chunk: the body goes on
        await writer.drain()
        await reader.read(1)  # b"" at EOF
        seen_eof.set()

    async with (
        server(handler) as port,
        httpx.AsyncClient(transport=upstream_transport(httpx.Limits())) as client,
    ):
        base = f"http://127.0.0.1:{port}"
        response, got, _, stream, tapped = await _tapped_stream(client, base + "/stream")
        assert tapped
        while _payload(got) != b"data: 1\n\n":
            await asyncio.sleep(0.01)
        stream.untap()
        await response.aclose()
        await asyncio.wait_for(seen_eof.wait(), 5)  # the upstream sees the client go (the engine aborts)
        assert (await client.get(base + "/json")).content == b"ok" and len(connections) == 2


async def test_no_tap_after_an_interim_answer_and_the_normal_path_still_works() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n" + _chunked([b"data: 1\n\n"]))
        await writer.drain()
        await reader.read(1)

    async with (
        server(handler) as port,
        httpx.AsyncClient(transport=upstream_transport(httpx.Limits())) as client,
    ):
        response, got, _, _, tapped = await _tapped_stream(client, f"http://127.0.0.1:{port}/stream")
        assert not tapped and got == []
        assert b"".join([chunk async for chunk in response.aiter_raw()]) == b"data: 1\n\n"
        await response.aclose()


async def test_a_tap_whose_reader_is_full_pauses_reading_until_there_is_room() -> None:
    """The relay's queue (gateway/proxy/chunk_queue.py ChunkQueue, 4 items here) fills while its reader
    does not read: the connection stops reading; once the reader takes items again it reads on, and the
    whole body arrives (a resume that waited for the next delivery's answer never came: the stream hung)."""
    from kvscope.gateway.proxy.chunk_queue import ChunkQueue

    total = 4000  # 4 MB: more than one read, so reading pauses with the rest still in the socket

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(_chunked([b"x" * 1000] * total))
        await writer.drain()
        await reader.read(1)

    async with (
        server(handler) as port,
        httpx.AsyncClient(transport=upstream_transport(httpx.Limits())) as client,
    ):
        response = await client.send(client.build_request("GET", f"http://127.0.0.1:{port}/s"), stream=True)
        stream = response.extensions["network_stream"]
        queue = ChunkQueue(maxsize=4)
        queue.on_room = stream.tap_room
        assert stream.tap_body(lambda item: queue.offer(item))
        protocol = stream._protocol
        # full, and reading stopped short of the end
        await async_wait_until(
            lambda: protocol.tap_paused and len(queue) >= 4, 10, "the tap paused, queue full"
        )
        body = b""
        while (item := await queue.get(5)) is not None:
            assert isinstance(item, bytes)
            body += item
            if len(queue) == 0:
                await asyncio.sleep(0)  # a slow reader: the connection refills the queue meanwhile
        assert body == b"x" * 1000 * total and not protocol.tap_paused
        await response.aclose()


async def test_the_pool_cleanup_pass_is_linear_and_decides_as_httpcores() -> None:
    """gateway/proxy/network.py LinearPool: with n idle keep-alive connections a pass asks each connection
    once whether it is idle (httpcore 1.0.9 asks n² times), and the pool keeps, reuses and evicts the same
    connections as httpcore's own pool (max_keepalive_connections: the surplus idle ones are closed)."""
    from kvscope.gateway.proxy.network import LinearPool

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                await reader.readuntil(b"\r\n\r\n")
                await asyncio.sleep(0.05)  # every request is in flight at once: one connection each
                writer.write(_chunked([b"ok"]))

    async with server(handler) as port:
        results = {}
        for cls in (LinearPool, httpcore.AsyncConnectionPool):
            async with cls(max_keepalive_connections=5, network_backend=AsyncioBackend()) as pool:
                url = f"http://127.0.0.1:{port}/"
                await asyncio.gather(*(pool.request("GET", url) for _ in range(8)))
                kept = len(pool.connections)
                calls = 0
                for connection in pool.connections:
                    original = connection.is_idle

                    def counted(original=original) -> bool:
                        nonlocal calls
                        calls += 1
                        return original()

                    connection.is_idle = counted
                await pool.request("GET", url)  # one pass when queued, one when closed
                results[cls.__name__] = (kept, len(pool.connections), calls)
        assert results["LinearPool"][:2] == results["AsyncConnectionPool"][:2] == (5, 5)
        assert results["LinearPool"][2] <= 3 * 5 < results["AsyncConnectionPool"][2]


async def test_the_pool_skips_its_cleanup_pass_within_limits_and_never_sends_on_a_closed_connection() -> None:
    """gateway/proxy/network.py LinearPool between two clean-up passes (sweep_interval_s): no connection is
    asked whether it closed or expired, except the one a request is given, so a keep-alive connection the
    upstream closed meanwhile is still never used: the request goes on a new connection and succeeds."""
    from kvscope.gateway.proxy.network import LinearPool

    connections: list[int] = []
    close_after_next = asyncio.Event()
    closed = asyncio.Event()

    async with (
        server(_closing_upstream(connections, close_after_next, closed)) as port,
        LinearPool(max_keepalive_connections=5, network_backend=AsyncioBackend()) as pool,
    ):
        url = f"http://127.0.0.1:{port}/"
        assert (await pool.request("GET", url)).content == b"ok"  # the first pass runs at once
        pool.sweep_interval_s = 3600.0
        pool._next_sweep = time.monotonic() + 3600.0
        close_after_next.set()
        assert (await pool.request("GET", url)).content == b"ok"
        await asyncio.wait_for(closed.wait(), 5)
        asked: list[str] = []
        for connection in pool.connections:
            for name in ("is_closed", "has_expired"):
                original = getattr(connection, name)

                def counted(original=original, name=name) -> bool:
                    asked.append(name)
                    return original()

                setattr(connection, name, counted)
        assert (await pool.request("GET", url)).content == b"ok"
        assert connections == [0, 1]  # the closed keep-alive connection was not sent on
        assert asked == ["has_expired"]  # only the connection offered to the request: no pass
        assert len(pool.connections) == 1  # the closed one left the pool when it was found expired
