"""Issue 19 through the in-process gateway (same uvicorn config as ``kvscope gateway``): the canonical request
target and admission (the ``#`` reproduction for both key kinds, a generated property test over spellings
of every generation route), the pass-through's refusal of generation routes, and client.ip resolution."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvscope.gateway.auth import hash_key
from kvscope.gateway.errors import NotFound
from kvscope.gateway.forwarded import ClientAddressResolver, forwarded_for, parse_networks, parse_node
from kvscope.gateway.proxy.passthrough import upstream_path
from kvscope.gateway.target import names_generation_api, target_problem
from kvscope.testing.harness import LoopThread, RawResponse, raw_http, records_by_id
from tests.gateway.conftest import KEYS, Stack, build_stack

EDGE_KEYS = {**KEYS, "empty": "sk-empty-bucket", "tpm": "sk-tpm"}
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions")
BODY = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "hi"}],
    "prompt": "hi",
    "max_tokens": 300,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def edge(loop: LoopThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("edge")
    keys = [
        {"name": "alice", "sha256": hash_key(KEYS["alice"])},
        {
            "name": "limited",
            "sha256": hash_key(KEYS["limited"]),
            "models": ["fake-model"],
            "limits": {"max_tokens": 10},
        },
        {"name": "empty", "sha256": hash_key(EDGE_KEYS["empty"]), "limits": {"requests_per_minute": 1}},
        {
            "name": "tpm",
            "sha256": hash_key(EDGE_KEYS["tpm"]),
            "limits": {"max_tokens": 4, "tokens_per_minute": 200},
        },
    ]
    gateway, fakes, exporter = build_stack(loop, tmp, api_keys=keys)
    with gateway:
        yield Stack(gateway, fakes, exporter, tmp / "requests.jsonl")
    for fake in fakes.values():
        loop.run(fake.close())


def post(stack: Stack, target: bytes, key: str, rid: str, body: dict | None = None) -> RawResponse:
    payload = json.dumps(body or BODY).encode()
    head = (
        b"POST "
        + target
        + b" HTTP/1.1\r\nHost: gw\r\nConnection: close\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer "
        + EDGE_KEYS[key].encode()
        + b"\r\nX-Request-Id: "
        + rid.encode()
        + b"\r\nContent-Length: "
        + str(len(payload)).encode()
        + b"\r\n\r\n"
    )
    return raw_http(stack.gateway.port, head + payload)


def generations(stack: Stack) -> int:
    """POSTs any fake upstream received (generation or pass-through)."""
    return sum(1 for fake in stack.fakes.values() for r in fake.records if r.method == "POST")


def test_fragment_reproduction_is_a_400_for_both_key_kinds(edge: Stack) -> None:
    """Issue 19 point 1: ``/v1/chat/completions#x`` with the empty-RPM key and with the max_tokens 4 / 200
    TPM key: 400 before any upstream call, one log record each; the canonical spelling applies the limits."""
    before = generations(edge)
    assert post(edge, b"/v1/chat/completions", "empty", "rpm-first", {**BODY, "max_tokens": 4}).status == 200
    for key in ("empty", "tpm"):
        resp = post(edge, b"/v1/chat/completions#x", key, f"frag-{key}")
        assert resp.status == 400 and resp.headers["content-type"] == "application/json"
        assert resp.json()["error"]["code"] == "invalid_request_target"
        assert "fragment" in resp.json()["error"]["message"]
    limited = post(edge, b"/v1/chat/completions", "empty", "rpm-second")
    assert (limited.status, limited.json()["error"]["code"]) == (429, "rate_limit_exceeded")
    ceiling = post(edge, b"/v1/chat/completions", "tpm", "tpm-300")
    assert (ceiling.status, ceiling.json()["error"]["param"]) == (400, "max_tokens")
    assert generations(edge) == before + 1  # only rpm-first reached an upstream
    ids = ["rpm-first", "frag-empty", "frag-tpm", "rpm-second", "tpm-300"]
    records = records_by_id(edge.log, ids)
    assert [len(records[i]) for i in ids] == [1, 1, 1, 1, 1]
    assert [records[i][0]["http"]["response"]["status_code"] for i in ids] == [200, 400, 400, 429, 400]
    assert records["frag-tpm"][0]["error"]["type"] == "invalid_request_target"
    assert records["frag-tpm"][0]["url"]["path"] == "/v1/chat/completions#x"


def _pct(ch: str, lower: bool) -> str:
    code = f"%{ord(ch):02X}"
    return code.lower() if lower else code


@st.composite
def spellings(draw: st.DrawFn) -> str:
    """Spellings of a generation route: per character kept, case-flipped or percent-encoded (either hex
    case); dot, empty and encoded-dot segments at any slash; prefixes and suffixes from the tricks servers
    disagree on (fragments, ``;params``, trailing slashes, encoded separators, absolute-form, NUL, spaces)."""
    route = draw(st.sampled_from(GENERATION_ROUTES))
    chars = []
    for ch in route:
        how = draw(
            st.sampled_from(["keep"] * 18 + ["case"] * 3 + ["pct", "pct-lower"])
        )  # often still canonical
        chars.append(
            ch.swapcase() if how == "case" else _pct(ch, how == "pct-lower") if how.startswith("pct") else ch
        )
    path = "".join(chars)
    slashes = [i for i, ch in enumerate(path) if ch == "/"]
    for _ in range(draw(st.integers(0, 2)) if slashes else 0):
        at = draw(st.sampled_from(slashes))
        piece = draw(st.sampled_from(["/.", "/x/..", "/", "/%2e", "/%2E%2E", "/v1/..", "/;x"]))
        path = path[:at] + piece + path[at:]
    suffix = draw(
        st.lists(
            st.sampled_from(
                [
                    "/",
                    "/.",
                    "#",
                    "#x",
                    "%23x",
                    "?x=1",
                    "?a#b",
                    ";x",
                    "%3Bx",
                    "%00",
                    "%20",
                    "%09",
                    "/render",
                    ".json",
                    "%2F",
                    "\\",
                    "%5C",
                    "~",
                    "%7E",
                ]
            ),
            max_size=2,
        )
    )
    prefix = draw(st.sampled_from(["", "", "", "http://127.0.0.1", "//", "/./", "/v1/.."]))
    return prefix + path + "".join(suffix)


@settings(max_examples=250, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(target=spellings())
@example(target="/v1/chat/completions")
@example(target="/v1/completions?x=1")
@example(target="/v1/Chat/Completions")
@example(target="/v1/chat/completions;x")
@example(target="/v1/completions%23x")  # found by this test: an encoded '#' once reached the pass-through
def test_no_spelling_of_a_generation_route_skips_admission(edge: Stack, target: str) -> None:
    """Done-when 2: the ``limited`` key may not ask for max_tokens 300 (its ceiling is 10). Whatever the
    spelling, the answer is a 400 from target check or admission, or a 404/405, never an upstream call;
    and the request has exactly one log record."""
    rid = f"spell-{uuid.uuid4().hex}"
    before = generations(edge)
    resp = post(edge, target.encode("ascii"), "limited", rid)
    error = resp.json()["error"]
    outcome = (resp.status, error["code"], error["param"] if error["code"] == "invalid_value" else None)
    assert outcome in {
        (400, "invalid_request_target", None),
        (400, "invalid_value", "max_tokens"),
        (404, "not_found", None),
        (405, "method_not_allowed", None),
    }, (target, outcome)
    assert generations(edge) == before, target
    assert len(records_by_id(edge.log, [rid])[rid]) == 1


def test_admitted_spellings_are_exactly_the_canonical_routes() -> None:
    """The target check accepts a generation route only in its one form (a query is allowed)."""
    assert target_problem(b"/v1/chat/completions", b"x=1", "/v1/chat/completions") is None
    assert target_problem(b"/v1/models/org%2Fm", b"", "/v1/models/org/m") is None  # the openai SDK's encoding
    assert target_problem(b"/v1/models/org%2Fchat-v2", b"", "/v1/models/org/chat-v2") is None
    for raw in (
        b"/v1/chat/completions#x",
        b"/v1/chat/%63ompletions",
        b"/v1//completions",
        b"/v1/completions/",
        b"/v1/./completions",
        b"/v1/%2e%2e/completions",
        b"v1/completions",
        b"/v1/completions%zz",
        b"/v1/completions%00",
        b"/v1/completions%5C",
        b"/v1/completions%23x",
        b"/v1/completions%3Fa=1",
        b"/v1/chat%2Fcompletions",
        b"/v1%2Fchat%2Fcompletions",
        b"/v1%2fcompletions",
    ):
        from urllib.parse import unquote

        assert target_problem(raw, b"", unquote(raw.decode())) is not None, raw


@pytest.mark.parametrize(
    "path",
    [
        "/v1/Chat/Completions",
        "/v1/completions;x",
        "/v1/chat/completions/render",
        "/v1/responses",
        "/v1/messages",
        "/v1/engines/x/completions",
        "/v1/COMPLETIONS",
        "/v1/chat%2Fcompletions",
        "/v1/completions%23x",
        "/v1/completions.json",
        "/v1/x/Completions~",
    ],
)
def test_passthrough_never_forwards_a_generation_route(path: str) -> None:
    assert names_generation_api(path)
    with pytest.raises(NotFound):
        upstream_path(path)


def test_passthrough_still_forwards_other_v1_routes() -> None:
    assert [upstream_path(p) for p in ("/v1/embeddings", "/v1/files/file-1", "/v1/models/a%2Fb")] == [
        "/v1/embeddings",
        "/v1/files/file-1",
        "/v1/models/a%2Fb",
    ]


def test_forwarded_headers_are_ignored_from_untrusted_peers() -> None:
    untrusted = ClientAddressResolver()
    assert untrusted.resolve("127.0.0.1", [(b"x-forwarded-for", b"9.9.9.9")]) == "127.0.0.1"
    assert untrusted.resolve("127.0.0.1", [(b"forwarded", b"for=9.9.9.9")]) == "127.0.0.1"
    other = ClientAddressResolver(parse_networks(["10.0.0.0/8"]))
    assert other.resolve("127.0.0.1", [(b"x-forwarded-for", b"9.9.9.9")]) == "127.0.0.1"


@pytest.mark.parametrize(
    ("headers", "client"),
    [
        ([(b"x-forwarded-for", b"9.9.9.9")], "9.9.9.9"),
        ([(b"x-forwarded-for", b"9.9.9.9, 10.1.2.3")], "9.9.9.9"),  # 10.1.2.3 is a trusted hop
        (
            [(b"x-forwarded-for", b"6.6.6.6, 9.9.9.9")],
            "9.9.9.9",
        ),  # the rightmost untrusted hop, not the spoofable first
        ([(b"x-forwarded-for", b"1.1.1.1"), (b"x-forwarded-for", b"2.2.2.2")], "2.2.2.2"),
        ([(b"x-forwarded-for", b"not-an-ip")], "10.0.0.5"),
        ([(b"x-forwarded-for", b'1.1.1.1\n{"a":1}')], "10.0.0.5"),
        ([(b"x-forwarded-for", b"1" * 10_000)], "10.0.0.5"),
        ([(b"x-forwarded-for", b"9.9.9.9:443")], "9.9.9.9"),
        ([(b"forwarded", b"for=192.0.2.60;proto=http;by=203.0.113.43")], "192.0.2.60"),
        ([(b"forwarded", b'for="[2001:db8:cafe::17]:4711"')], "2001:db8:cafe::17"),
        ([(b"forwarded", b"for=unknown")], "10.0.0.5"),
        ([(b"forwarded", b"for=_hidden, for=10.0.0.9")], "10.0.0.5"),
        ([(b"forwarded", b"for=192.0.2.1"), (b"x-forwarded-for", b"9.9.9.9")], "192.0.2.1"),  # Forwarded wins
        ([], "10.0.0.5"),
    ],
)
def test_forwarded_headers_from_a_trusted_proxy_are_validated(headers: list, client: str) -> None:
    resolver = ClientAddressResolver(parse_networks(["10.0.0.0/8"]))
    assert resolver.resolve("10.0.0.5", headers) == client


def test_forwarded_parsing_helpers() -> None:
    assert forwarded_for('for=a;by=b, by=c, for="[::1]:1";proto=https') == ["a", "", '"[::1]:1"']
    assert [str(parse_node(v)) for v in ("1.2.3.4", "[::1]", "::1", "1.2.3.4:80")] == [
        "1.2.3.4",
        "::1",
        "::1",
        "1.2.3.4",
    ]
    assert [parse_node(v) for v in ("", "1.2.3.4:x", "[::1", "fe80::1%eth0", "999.1.1.1")] == [None] * 5
    with pytest.raises(ValueError, match="'nope' is not an IP"):
        parse_networks(["nope"])


def test_edge_app_uses_the_peer_when_no_proxy_is_trusted(edge: Stack, tmp_path: Path) -> None:
    head = (
        b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nConnection: close\r\nX-Forwarded-For: 9.9.9.9\r\n"
        b"Forwarded: for=8.8.8.8\r\nX-Request-Id: xff-untrusted\r\nAuthorization: Bearer sk-alice\r\n\r\n"
    )
    assert raw_http(edge.gateway.port, head).status == 200
    assert records_by_id(edge.log, ["xff-untrusted"])["xff-untrusted"][0]["client"] == {"ip": "127.0.0.1"}


@pytest.mark.parametrize(
    ("target", "status"), [(b"/metrics", 200), (b"/%6detrics", 400), (b"/healthz#x", 400)]
)
def test_probes_are_unobserved_only_when_spelled_exactly(edge: Stack, target: bytes, status: int) -> None:
    rid = f"probe-{abs(hash(target))}"
    resp = raw_http(
        edge.gateway.port,
        b"GET " + target + b" HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n"
        b"Authorization: Bearer sk-alice\r\nX-Request-Id: " + rid.encode() + b"\r\n\r\n",
    )
    assert resp.status == status
    fence = f"fence-{rid}"
    post(edge, b"/v1/models", "alice", fence)
    records = records_by_id(edge.log, [fence])
    assert len(records.get(rid, [])) == (0 if status == 200 else 1)


def test_ipv4_mapped_addresses_are_their_ipv4_address() -> None:
    """A dual-stack listener (``--host ::``) sees IPv4 peers as ``::ffff:a.b.c.d`` (RFC 4291 §2.5.5.2)."""
    resolver = ClientAddressResolver(parse_networks(["127.0.0.1"]))
    xff = [(b"x-forwarded-for", b"1.2.3.4")]
    assert resolver.resolve("::ffff:127.0.0.1", xff) == "1.2.3.4"  # the mapped peer is the trusted proxy
    assert resolver.resolve("::ffff:8.8.8.8", xff) == "8.8.8.8"  # untrusted: the peer, as IPv4
    assert resolver.resolve("127.0.0.1", [(b"x-forwarded-for", b"::ffff:1.2.3.4")]) == "1.2.3.4"
    assert resolver.resolve("::1", xff) == "::1"


def test_a_long_prompt_is_counted_off_the_event_loop(edge: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """A body up to INLINE_PROMPT_BYTES has its prompt counted on the event loop (the thread hand-off costs
    more than that count); a longer one in a worker thread, where a long prompt cannot stall other streams."""
    import asyncio

    from kvscope.gateway import admission

    on_loop: list[bool] = []
    read_prompt = admission._read_prompt

    def recording(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:  # no running loop: a worker thread
            on_loop.append(False)
        return read_prompt(*args, **kwargs)

    monkeypatch.setattr(admission, "_read_prompt", recording)
    overhead = len(json.dumps({**BODY, "max_tokens": 4}).encode()) - len("hi")
    sizes = (admission.INLINE_PROMPT_BYTES - overhead, admission.INLINE_PROMPT_BYTES - overhead + 1)
    for n, size in enumerate(sizes):
        body = {**BODY, "max_tokens": 4, "messages": [{"role": "user", "content": "x" * size}]}
        assert len(json.dumps(body).encode()) == admission.INLINE_PROMPT_BYTES + n
        assert post(edge, b"/v1/chat/completions", "alice", f"inline-{n}", body).status == 200
    assert on_loop == [True, False]
