"""Admission's 503 through the gateway (issue 42): our engine's refusal (``ttft_slo_exceeded``, Retry-After,
the prediction in the message and a ``kvscope`` object beside ``error``) reaches the client unchanged,
logged with the prediction; a refusing replica is overloaded, not broken (never ejected) and the next replica
is tried; and the gateway tells the engine the key's tier and how long it will wait."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvscope.common.deadline_header import TIMEOUT_HEADER
from kvscope.gateway.app import create_app
from kvscope.gateway.auth import SERVICE_TIER_HEADER, hash_key
from kvscope.gateway.logs.why import explain
from kvscope.gateway.settings import load_settings
from kvscope.testing.harness import GatewayThread, LoopThread, records_by_id, start_fake_thread
from tests.gateway.conftest import KEYS, Stack, build_stack

MESSAGE = "predicted time to first token 7.8 s exceeds the 2 s objective of tier default; 41 requests ahead"
PREDICTION = {"predicted_ttft_s": 7.8, "service_tier": "default", "queue_ahead": 41}
SHED = {
    "status": 503,
    "error_code": "ttft_slo_exceeded",
    "error_message": MESSAGE,
    "error_headers": "Retry-After: 6",
    "error_kvscope": json.dumps(PREDICTION),
}
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_the_refusal_reaches_the_client_unchanged_and_is_logged(own_stack: Stack, stream: bool) -> None:
    with own_stack.client() as c:
        for i in range(5):  # more than failure_threshold (3): a refusal never ejects the replica
            resp = c.post(
                "/v1/chat/completions",
                json={**CHAT, "stream": stream, "fake": SHED},
                headers={"x-request-id": f"shed-{i}"},
            )
            assert resp.status_code == 503
            assert resp.headers.get_list("retry-after") == ["6"]
            assert resp.json() == {
                "error": {
                    "message": MESSAGE,
                    "type": "server_error",
                    "param": None,
                    "code": "ttft_slo_exceeded",
                },
                "kvscope": PREDICTION,
            }
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200  # still routed to
    [record] = records_by_id(own_stack.log, ["shed-4"])["shed-4"]
    assert record["http"]["response"]["status_code"] == 503
    assert record["error"]["message"] == MESSAGE
    assert record["error"]["type"] == "ttft_slo_exceeded"
    assert {k: v for k, v in record["kvscope"]["engine"].items() if v is not None} == PREDICTION
    why = explain(record)  # kvscope logs why on the gateway's own line
    assert why.verdict == "admission refusal" and why.text.splitlines()[0].endswith(MESSAGE)
    main = own_stack.fakes["main"]
    assert sum(1 for r in main.records if r.path == "/v1/chat/completions") == 6  # one attempt each


@pytest.fixture
def two_replicas(loop: LoopThread, tmp_path: Path) -> Iterator[Stack]:
    """fake-model on two replicas: ``main`` serves, ``busy`` refuses everything as an overloaded engine."""
    fakes = {
        "main": start_fake_thread(loop, ("fake-model",)),
        "busy": start_fake_thread(loop, ("fake-model",), **SHED),
    }
    config = {
        "upstreams": [{"url": f.url} for f in fakes.values()],
        "api_keys": [{"name": "alice", "sha256": hash_key(KEYS["alice"])}],
        "routing": {"health_interval_s": 60, "max_attempts": 2, "policy": "round_robin"},
        "logs": {"file": str(tmp_path / "requests.jsonl")},
    }
    exporter = InMemorySpanExporter()
    gateway = GatewayThread(create_app(load_settings(None, config, env={}), span_exporter=exporter))
    with gateway:
        yield Stack(gateway, fakes, exporter, tmp_path / "requests.jsonl")
    for fake in fakes.values():
        loop.run(fake.close())


def test_a_refusal_is_retried_on_the_next_replica(two_replicas: Stack) -> None:
    with two_replicas.client() as c:
        statuses = [c.post("/v1/chat/completions", json=CHAT).status_code for _ in range(6)]
    assert statuses == [200] * 6  # a refusal on busy went on to main: refused only where every replica is
    refused = sum(1 for r in two_replicas.fakes["busy"].records if r.path == "/v1/chat/completions")
    served = sum(1 for r in two_replicas.fakes["main"].records if r.path == "/v1/chat/completions")
    assert served == 6 and refused >= 3  # more than failure_threshold refusals …
    metrics = two_replicas.metrics()
    busy = two_replicas.fakes["busy"].url.removeprefix("http://")
    assert f'kvscope_gateway_upstream_up{{kind="kvscope",upstream="{busy}"}} 1.0' in metrics  # … no ejection


@pytest.fixture
def tiered(loop: LoopThread, tmp_path: Path) -> Iterator[Stack]:
    """alice's key is a batch (flex) key; limited has no tier."""
    keys = [
        {"name": "alice", "sha256": hash_key(KEYS["alice"]), "service_tier": "flex"},
        {"name": "limited", "sha256": hash_key(KEYS["limited"])},
    ]
    gateway, fakes, exporter = build_stack(loop, tmp_path, api_keys=keys, timeouts={"total_s": 120.0})
    with gateway:
        yield Stack(gateway, fakes, exporter, tmp_path / "requests.jsonl")
    for fake in fakes.values():
        loop.run(fake.close())


def test_the_keys_tier_and_the_time_left_go_to_the_engine(tiered: Stack) -> None:
    def sent() -> dict[str, str]:
        return next(
            r for r in reversed(tiered.fakes["main"].records) if r.path == "/v1/chat/completions"
        ).headers

    with tiered.client("alice") as c:
        assert (
            c.post("/v1/chat/completions", json=CHAT, headers={SERVICE_TIER_HEADER: "priority"}).status_code
            == 200
        )
    headers = sent()
    assert headers[SERVICE_TIER_HEADER] == "flex"  # the key's, never the client's own
    assert 0.0 < float(headers[TIMEOUT_HEADER]) <= 120.0  # what is left of the total timeout
    with tiered.client("limited") as c:
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert SERVICE_TIER_HEADER not in sent()


def test_a_clients_own_shorter_deadline_is_the_requests(tiered: Stack) -> None:
    """A client's ``x-kvscope-timeout`` shorter than the gateway's total timeout is the request's deadline:
    the engine gets what is left of it, and the gateway gives up then (504), not at its own 120 s; a longer
    one changes nothing; anything but a positive number is a 400 naming the header."""

    def sent() -> dict[str, str]:
        return next(
            r for r in reversed(tiered.fakes["main"].records) if r.path == "/v1/chat/completions"
        ).headers

    with tiered.client("limited") as c:
        assert c.post("/v1/chat/completions", json=CHAT, headers={TIMEOUT_HEADER: "5"}).status_code == 200
        assert 0.0 < float(sent()[TIMEOUT_HEADER]) <= 5.0
        assert c.post("/v1/chat/completions", json=CHAT, headers={TIMEOUT_HEADER: "500"}).status_code == 200
        assert 5.0 < float(sent()[TIMEOUT_HEADER]) <= 120.0
        held = c.post(
            "/v1/chat/completions", json={**CHAT, "fake": {"hold": "never"}}, headers={TIMEOUT_HEADER: "0.3"}
        )
        assert (held.status_code, held.json()["error"]["code"]) == (504, "upstream_timeout")
        for bad in ("abc", "0", "-1", "inf", "nan", ""):
            response = c.post("/v1/chat/completions", json=CHAT, headers={TIMEOUT_HEADER: bad})
            assert response.status_code == 400, bad
            assert response.json()["error"] == {
                "message": "x-kvscope-timeout must be a positive number of seconds.",
                "type": "invalid_request_error",
                "param": "x-kvscope-timeout",
                "code": "invalid_value",
            }


def _shed(retry_after: int | str) -> dict[str, object]:
    return {**SHED, "error_headers": f"Retry-After: {retry_after}"}


@pytest.fixture
def refusing(loop: LoopThread, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Stack]:
    """fake-model on replicas named by the parameter: name → None (serves) or the Retry-After it refuses
    with; max_attempts 2, round robin."""
    fakes = {
        name: start_fake_thread(loop, ("fake-model",), **({} if after is None else _shed(after)))
        for name, after in request.param.items()
    }
    config = {
        "upstreams": [{"url": f.url, "name": name} for name, f in fakes.items()],
        "routing": {"health_interval_s": 60, "max_attempts": 2, "policy": "round_robin"},
        "logs": {"file": str(tmp_path / "requests.jsonl")},
    }
    gateway = GatewayThread(
        create_app(load_settings(None, config, env={}), span_exporter=InMemorySpanExporter())
    )
    with gateway:
        yield Stack(gateway, fakes, InMemorySpanExporter(), tmp_path / "requests.jsonl")
    for fake in fakes.values():
        loop.run(fake.close())


def _chats(fake) -> int:
    return sum(1 for r in fake.records if r.path == "/v1/chat/completions")


@pytest.mark.parametrize("refusing", [{"a": 5, "b": 6, "c": 7, "d": None}], indirect=True)
def test_refusals_cost_no_attempt_every_replica_is_asked(refusing: Stack) -> None:
    ids = [f"rr-{i}" for i in range(8)]
    with refusing.client() as c:
        statuses = [
            c.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": i}).status_code for i in ids
        ]
    assert statuses == [200] * 8  # up to three refusals and max_attempts 2: the fourth replica still serves
    assert _chats(refusing.fakes["d"]) == 8
    records = [record for [record] in records_by_id(refusing.log, ids).values()]
    assert {r["kvscope"]["routing"]["replica"] for r in records} == {"d"}
    attempts = [r["kvscope"]["attempts"] for r in records]
    assert max(attempts) == 4  # a request that met a, b and c first (round robin) still got d
    assert sum(_chats(refusing.fakes[name]) for name in "abc") == sum(a - 1 for a in attempts)


@pytest.mark.parametrize("refusing", [{"a": 9, "b": 2, "c": 6}], indirect=True)
def test_when_every_replica_refuses_the_soonest_retry_reaches_the_client(refusing: Stack) -> None:
    with refusing.client() as c:
        for i in range(3):
            resp = c.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": f"all-{i}"})
            assert resp.status_code == 503 and resp.headers.get_list("retry-after") == ["2"]
            assert resp.json()["error"]["code"] == "ttft_slo_exceeded"
    assert [_chats(refusing.fakes[name]) for name in "abc"] == [3, 3, 3]
    records = records_by_id(refusing.log, ["all-0", "all-1", "all-2"])
    for [record] in records.values():
        assert record["kvscope"]["attempts"] == 3
        assert record["kvscope"]["routing"]["replica"] == "b"  # the refusal relayed is b's
        assert record["error"]["type"] == "ttft_slo_exceeded"


@pytest.mark.parametrize(
    "refusing", [{"a": "nan", "b": "-4", "c": 3, "d": "soon", "e": "inf"}], indirect=True
)
def test_a_malformed_retry_after_never_wins_over_a_valid_one(refusing: Stack) -> None:
    """Retry-After is a non-negative number of seconds (RFC 9110 §10.2.3): a replica refusing with ``nan``,
    a negative number, a word or ``inf`` counts as "no retry time" and never outbids a replica's real one,
    whichever replica round robin asks first."""
    with refusing.client() as c:
        got = [c.post("/v1/chat/completions", json=CHAT).headers.get_list("retry-after") for _ in range(5)]
    assert got == [["3"]] * 5
