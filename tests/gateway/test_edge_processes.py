"""Issue 19 against a real ``python -m kvscope.gateway`` process, over raw sockets: every request the
gateway answers (405s for unusual methods, non-GET on /v1/models/{id}, the HTTP parser's own 400s) has
exactly one log line and an OpenAI-shaped JSON error, and client.ip trusts forwarding headers only from
``trusted_proxies`` (uvicorn's own proxy_headers handling, which trusts any loopback peer, is off)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvscope.gateway.auth import hash_key
from kvscope.testing.harness import (
    Proc,
    raw_http,
    read_log,
    records_by_id,
    spawn_fake,
    spawn_gateway,
    wait_http,
)

pytestmark = pytest.mark.e2e
KEY = "sk-edge"
AUTH = b"Authorization: Bearer " + KEY.encode() + b"\r\n"
TRUSTED_PROXY = "127.0.0.2"


@dataclass
class Edge:
    gateway: Proc
    fake: Proc
    log: Path


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    yield from _edge_stack(tmp_path_factory.mktemp("edge-procs"), trusted_proxies=[TRUSTED_PROXY])


def _edge_stack(tmp: Path, **config: object) -> Iterator[Edge]:
    """A fake upstream and a keyed gateway in front of it (``config`` adds gateway settings), stopped
    after."""
    fake = spawn_fake(tmp, "fake")
    procs = [fake]
    try:
        wait_http(fake.url + "/health", proc=fake.popen)
        config = {
            "upstreams": [{"url": fake.url}],
            "api_keys": [{"name": "edge", "sha256": hash_key(KEY)}],
            "routing": {"health_interval_s": 60},
            "logs": {"file": str(tmp / "requests.jsonl")},
            **config,
        }
        gateway = spawn_gateway(tmp, "gateway", config)
        procs.append(gateway)
        wait_http(gateway.url + "/readyz", proc=gateway.popen)
        yield Edge(gateway, fake, tmp / "requests.jsonl")
    finally:
        for proc in procs:
            proc.stop()


def _request(method: bytes, target: bytes, extra: bytes = b"") -> bytes:
    return method + b" " + target + b" HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n" + AUTH + extra + b"\r\n"


ODD_METHODS = [
    (m, r)
    for m in (b"TRACE", b"CONNECT", b"PROPFIND", b"MKCOL", b"LOCK", b"COPY")
    for r in (b"/v1/chat/completions", b"/v1/completions", b"/v1/models", b"/v1/embeddings")
]
MODEL_METHODS = [(m, b"/v1/models/fake-model") for m in (b"POST", b"PUT", b"PATCH", b"DELETE")]
PARSER_ERRORS = {  # name: (raw request, method and path the log can still name)
    "header-without-colon": (b"GET /v1/models HTTP/1.1\r\nHost gw\r\n\r\n", ("GET", "/v1/models")),
    "missing-host": (b"GET /v1/models HTTP/1.1\r\nConnection: close\r\n\r\n", ("GET", "/v1/models")),
    "space-before-colon": (b"GET /v1/models HTTP/1.1\r\nHost : gw\r\n\r\n", ("GET", "/v1/models")),
    "two-lengths": (
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        ("POST", "/v1/completions"),
    ),
    "bad-content-length": (
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: abc\r\n\r\n",
        ("POST", "/v1/completions"),
    ),
    "non-ascii-target": (b"GET /v1/mod\xc3\xa9ls HTTP/1.1\r\nHost: gw\r\n\r\n", ("GET", "")),
    "bad-header-name": (b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nX(A): b\r\n\r\n", ("GET", "/v1/models")),
    "no-version": (b"GET /v1/models\r\nHost: gw\r\n\r\n", ("GET", "/v1/models")),
    "nul-in-header": (b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nX-A: a\x00b\r\n\r\n", ("GET", "/v1/models")),
    "unfinished-head-over-16k": (
        b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nX-A: " + b"a" * 20_000,
        ("GET", "/v1/models"),
    ),  # h11's max_incomplete_event_size
    "garbage-line": (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", ("_OTHER", "")),  # a TLS hello
    "length-and-chunked": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n" + AUTH + b"Content-Length: 4\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\nGET /healthz HTTP/1.1\r\n"
        b"Host: gw\r\n\r\n",
        ("POST", "/v1/chat/completions"),
    ),  # smuggling: RFC 9112 §6.1
    "complete-head-over-16k": (
        b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nX-A: " + b"a" * 17_000 + b"\r\n\r\n",
        ("GET", "/v1/models"),
    ),  # one write: h11 bounds only an incomplete head
    "bad-chunk-size": (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
        + AUTH
        + b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n",
        ("POST", "/v1/chat/completions"),
    ),
}


def _one_new_record(edge: Edge, data: bytes, fence: str, source: str | None = None) -> tuple[object, dict]:
    """Send ``data``, then a fence request; returns (response, the one record logged in between)."""
    before = len(read_log(edge.log, 0, 0))
    resp = raw_http(edge.gateway.port, data, source=source)
    assert (
        raw_http(
            edge.gateway.port, _request(b"GET", b"/v1/models", b"X-Request-Id: " + fence.encode() + b"\r\n")
        ).status
        == 200
    )
    records_by_id(edge.log, [fence], timeout=20)
    new = read_log(edge.log, 0, 0)[before:]
    fences = [r for r in new if r["http"]["request"]["id"] == fence]
    others = [r for r in new if r["http"]["request"]["id"] != fence]
    assert len(fences) == 1 and len(others) == 1, [r["message"] for r in new]
    return resp, others[0]


def _assert_openai_error(resp, status: int, code: str) -> None:
    assert (resp.status, resp.headers["content-type"]) == (status, "application/json")
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("invalid_request_error", code)


@pytest.mark.parametrize(("method", "route"), ODD_METHODS + MODEL_METHODS)
def test_unusual_methods_get_one_record_and_a_json_405(edge: Edge, method: bytes, route: bytes) -> None:
    rid = f"m-{method.decode()}-{route.decode().replace('/', '_')}"
    resp, record = _one_new_record(
        edge,
        _request(method, route, b"Content-Length: 0\r\nX-Request-Id: " + rid.encode() + b"\r\n"),
        rid + "-fence",
    )
    _assert_openai_error(resp, 405, "method_not_allowed")
    assert record["http"]["request"]["id"] == rid
    assert (record["http"]["request"]["method"], record["url"]["path"]) == (method.decode(), route.decode())
    assert (record["http"]["response"]["status_code"], record["error"]["type"]) == (405, "method_not_allowed")


@pytest.mark.parametrize("name", list(PARSER_ERRORS))
def test_parser_errors_get_one_record_and_a_json_400(edge: Edge, name: str) -> None:
    data, (method, path) = PARSER_ERRORS[name]
    resp, record = _one_new_record(edge, data, f"p-{name}-fence")
    _assert_openai_error(resp, 400, "invalid_http_request")
    assert (record["http"]["response"]["status_code"], record["error"]["type"]) == (
        400,
        "invalid_http_request",
    )
    assert (record["http"]["request"]["method"], record["url"]["path"]) == (method, path)
    assert record["client"]["ip"] == "127.0.0.1" and record["event"]["outcome"] == "failure"


@pytest.mark.parametrize(
    ("source", "headers", "client"),
    [
        ("127.0.0.1", b"X-Forwarded-For: 9.9.9.9\r\n", "127.0.0.1"),  # loopback but not a trusted proxy
        ("127.0.0.1", b"Forwarded: for=9.9.9.9\r\n", "127.0.0.1"),
        (TRUSTED_PROXY, b"X-Forwarded-For: 9.9.9.9\r\n", "9.9.9.9"),
        (TRUSTED_PROXY, b'Forwarded: for="[2001:db8::17]:4711";proto=https\r\n', "2001:db8::17"),
        (TRUSTED_PROXY, b"X-Forwarded-For: not-an-ip\r\n", TRUSTED_PROXY),
        (TRUSTED_PROXY, b"X-Forwarded-For: " + b"7" * 10_000 + b"\r\n", TRUSTED_PROXY),
        (TRUSTED_PROXY, b'X-Forwarded-For: 1.1.1.1\\n{"a":1}\r\n', TRUSTED_PROXY),
    ],
)
def test_client_ip_trusts_only_configured_proxies(
    edge: Edge, source: str, headers: bytes, client: str
) -> None:
    rid = f"ip-{abs(hash((source, headers)))}"
    resp, record = _one_new_record(
        edge,
        _request(b"GET", b"/v1/models", headers + b"X-Request-Id: " + rid.encode() + b"\r\n"),
        rid + "-fence",
        source=source,
    )
    assert resp.status == 200
    assert record["client"]["ip"] == client


def test_a_malformed_request_after_a_good_one_on_a_keep_alive_connection_gets_its_400(edge: Edge) -> None:
    import h11

    before = len(read_log(edge.log, 0, 0))
    good = b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n" + AUTH + b"X-Request-Id: ka-good\r\n\r\n"
    conn = h11.Connection(h11.CLIENT)
    responses: list[tuple[int, bytes]] = []
    with socket.create_connection(("127.0.0.1", edge.gateway.port), timeout=20) as sock:
        sock.sendall(good + b"BROKEN\r\n\r\n")  # pipelined: the second request is not HTTP at all
        for _ in range(2):
            conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
            conn.send(h11.EndOfMessage())
            status, body = 0, b""
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(sock.recv(65536))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    break
            responses.append((status, body))
            if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                conn.start_next_cycle()
    assert [s for s, _ in responses] == [200, 400]
    assert json.loads(responses[1][1])["error"]["code"] == "invalid_http_request"
    records_by_id(edge.log, ["ka-good"], timeout=20)
    deadline = time.monotonic() + 20
    while len(new := read_log(edge.log, 0, 0)[before:]) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted((r["http"]["response"]["status_code"], r["error"]["type"]) for r in new) == [
        (200, None),
        (400, "invalid_http_request"),
    ]


# --- read timeouts (serving case N5; kvscope/common/read_timeouts.py)
# ---------------------------------------------
READ_TIMEOUT_S = 0.5
"""``timeouts.request_head_s`` and ``request_body_s`` of the :func:`slow_clients` gateway."""
BROKEN_RUN_S = 20.0
"""How long a test waits for the server to close before it calls the run broken (the old code never
closed)."""


@pytest.fixture(scope="module")
def slow_clients(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    """A gateway process with 0.5 s request head and body timeouts."""
    yield from _edge_stack(
        tmp_path_factory.mktemp("read-timeouts"),
        timeouts={"request_head_s": READ_TIMEOUT_S, "request_body_s": READ_TIMEOUT_S},
    )


def _until_closed(port: int, data: bytes) -> bytes:
    """Send ``data`` on a new connection, then read until the server closes it; everything it sent."""
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=BROKEN_RUN_S) as sock:
        if data:
            sock.sendall(data)
        while chunk := sock.recv(65536):
            received += chunk
    return received


def _records_meanwhile(edge: Edge, action, fence: str) -> tuple[object, list[dict]]:
    """(what ``action()`` returned, the records other than a fence request's logged while and after it
    ran)."""
    before = len(read_log(edge.log, 0, 0))
    result = action()
    assert (
        raw_http(
            edge.gateway.port, _request(b"GET", b"/v1/models", b"X-Request-Id: " + fence.encode() + b"\r\n")
        ).status
        == 200
    )
    records_by_id(edge.log, [fence], timeout=20)
    return result, [r for r in read_log(edge.log, 0, 0)[before:] if r["http"]["request"]["id"] != fence]


def _timeout_answer(raw: bytes) -> dict:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("timeout_error", "request_timeout")
    return error


def test_n5_half_a_request_head_is_closed_after_the_head_timeout(slow_clients: Edge) -> None:
    """Serving case N5: a connection that sends half a request head and waits gets a JSON 408 and is closed
    after ``request_head_s``, with one log record naming what could be read (method, path). Before, uvicorn
    kept it open for as long as the client liked (2,000 such connections stayed 40 s in the probe)."""
    half = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n" + AUTH
    raw, others = _records_meanwhile(
        slow_clients, lambda: _until_closed(slow_clients.gateway.port, half), "head-fence"
    )
    error = _timeout_answer(raw)
    assert error["message"] == f"The request head was not received within {READ_TIMEOUT_S:g} s."
    [record] = others
    assert (record["http"]["response"]["status_code"], record["error"]["type"]) == (408, "request_timeout")
    assert (record["http"]["request"]["method"], record["url"]["path"]) == ("POST", "/v1/chat/completions")


def test_an_idle_connection_is_closed_without_an_answer_or_a_record(slow_clients: Edge) -> None:
    """A connection that sends nothing is closed after the head timeout, silently (as uvicorn's keep-alive
    timeout closes an idle keep-alive connection): there was no request to answer or log."""
    raw, others = _records_meanwhile(
        slow_clients, lambda: _until_closed(slow_clients.gateway.port, b""), "idle-fence"
    )
    assert (raw, others) == (b"", [])


def test_n5_a_stalled_body_is_answered_408_and_logged_once(slow_clients: Edge) -> None:
    """A body that stops arriving for ``request_body_s`` gets a JSON 408 and the close; the request's one log
    record (the app held it, waiting for the body) says 408 ``request_timeout``, not a disconnect."""
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n" + AUTH + b"Content-Type: application/json\r\n"
        b'Content-Length: 100\r\nX-Request-Id: stalled-body\r\n\r\n{"model": '
    )
    raw, others = _records_meanwhile(
        slow_clients, lambda: _until_closed(slow_clients.gateway.port, head), "body-fence"
    )
    error = _timeout_answer(raw)
    assert error["message"] == f"The request body stalled: nothing of it arrived for {READ_TIMEOUT_S:g} s."
    [record] = others
    assert record["http"]["request"]["id"] == "stalled-body"
    assert (record["http"]["response"]["status_code"], record["error"]["type"]) == (408, "request_timeout")
    assert record["kvscope"]["client_disconnected"] is False
