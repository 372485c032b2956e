"""gateway/server.py ``write_body_chunk``: a streamed event written straight to the client's transport is one
chunk of the chunked body h11 started (a client's h11 reads back exactly the bytes), and everything else —
empty data, a response not started or complete, a client gone or not reading, a body h11 frames otherwise
(HTTP/1.0, HEAD, Content-Length) — is refused with nothing written, for ASGI ``send`` to do."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import h11
import pytest
from uvicorn.server import ServerState

from kvscope.gateway.app import create_app
from kvscope.gateway.proxy.client import BODY_CHUNK_EXTENSION
from kvscope.gateway.server import uvicorn_config, write_body_chunk
from kvscope.gateway.settings import load_settings


@dataclass
class Transport:
    written: list[bytes] = field(default_factory=list)

    def write(self, data: bytes) -> None:
        self.written.append(data)


@dataclass
class Flow:
    write_paused: bool = False


@dataclass
class Cycle:
    """The fields of uvicorn's RequestResponseCycle that write_body_chunk reads."""

    conn: h11.Connection
    transport: Transport = field(default_factory=Transport)
    flow: Flow = field(default_factory=Flow)
    disconnected: bool = False
    response_started: bool = False
    response_complete: bool = False


def started(
    method: bytes = b"POST",
    version: bytes = b"1.1",
    headers: tuple[tuple[bytes, bytes], ...] = ((b"content-type", b"text/event-stream"),),
) -> Cycle:
    """A server connection that received a request and sent its response head (as uvicorn does)."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(
        b"%s /v1/chat/completions HTTP/%s\r\nhost: x\r\ncontent-length: 0\r\n\r\n" % (method, version)
    )
    assert isinstance(conn.next_event(), h11.Request)
    cycle = Cycle(conn)
    cycle.transport.write(conn.send(h11.Response(status_code=200, headers=list(headers))))
    cycle.response_started = True
    return cycle


def test_events_are_chunks_of_the_body_h11_started() -> None:
    cycle = started()
    events = [b'data: {"a": 1}\n\n', b": keep-alive\n\n", b"x" * 70000]
    assert all(write_body_chunk(cycle, e) for e in events)  # type: ignore[arg-type]
    cycle.transport.write(cycle.conn.send(h11.EndOfMessage()))  # the end goes through h11 (ASGI send)
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="POST", target="/", headers=[("host", "x"), ("content-length", "0")]))
    client.send(h11.EndOfMessage())
    client.receive_data(b"".join(cycle.transport.written))
    body, event = b"", client.next_event()
    assert isinstance(event, h11.Response) and (b"transfer-encoding", b"chunked") in event.headers
    while not isinstance(event := client.next_event(), h11.EndOfMessage):
        body += event.data
    assert body == b"".join(events)


@pytest.mark.parametrize(
    "case",
    ["empty", "not started", "complete", "disconnected", "paused", "http/1.0", "head", "content-length"],
)
def test_refused_where_send_must_write(case: str) -> None:
    cycle = {
        "http/1.0": lambda: started(version=b"1.0"),
        "head": lambda: started(method=b"HEAD"),
        "content-length": lambda: started(headers=((b"content-length", b"5"),)),
    }.get(case, started)()
    if case == "not started":
        cycle.response_started = False
    cycle.response_complete = case == "complete"
    cycle.disconnected = case == "disconnected"
    cycle.flow.write_paused = case == "paused"
    before = list(cycle.transport.written)
    assert write_body_chunk(cycle, b"" if case == "empty" else b"data: 1\n\n") is False  # type: ignore[arg-type]
    assert cycle.transport.written == before


class _Transport(Transport):
    """What uvicorn's h11 protocol asks of its transport."""

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"sockname": ("127.0.0.1", 4123), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass


async def test_the_gateways_server_gives_each_request_the_writer() -> None:
    """The protocol the gateway's uvicorn runs (gateway/server.py ``uvicorn_config``) puts the direct writer
    into each parsed request's scope, bound to that request's cycle. (A regression once put it into a dict
    no scope held — ``setdefault("extensions", {}) or {}``: the new dict is empty, so falsy — and every token
    went through the ASGI send chain again, at nearly twice the gateway's CPU per relayed token.)"""
    config = uvicorn_config(
        create_app(load_settings(None, {"upstreams": [{"url": "http://127.0.0.1:9"}]})), "127.0.0.1", 4123
    )
    config.load()
    protocol: Any = config.http_protocol_class(config=config, server_state=ServerState(), app_state={})
    protocol.connection_made(_Transport())
    protocol.data_received(b"POST /v1/models HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
    cycle = protocol.cycle
    writer = cycle.scope["extensions"][BODY_CHUNK_EXTENSION]
    assert (writer.func, writer.args) == (write_body_chunk, (cycle,))
    for task in list(protocol.tasks):  # the app's task, never run
        task.cancel()
