"""The engine's optional ``--api-key`` (every route but /health) and the warning on a non-loopback bind
without one (issue 19 point 5)."""

from __future__ import annotations

import hashlib
import logging

import pytest
from litestar.testing import TestClient
from prometheus_client import CollectorRegistry

from kvscope.engine.server import cli
from kvscope.engine.server.app import create_app
from kvscope.engine.server.auth import key_matches
from kvscope.engine.server.settings import ServerSettings, api_key_from
from kvscope.engine.server.tracing import Tracing
from tests.engine.server.conftest import chat_body
from tests.engine.server.fakes import FakeEngine

KEY = "engine-secret"


@pytest.fixture
def keyed(spans) -> TestClient:
    app = create_app(
        ServerSettings(api_key=KEY),
        engine=FakeEngine(),
        tracing=Tracing("test", spans, batch=False),
        registry=CollectorRegistry(),
    )
    with TestClient(app) as client:
        yield client


ROUTES = [
    ("POST", "/v1/chat/completions", chat_body()),
    ("POST", "/v1/completions", {"model": "fake-model", "prompt": "hi"}),
    ("GET", "/v1/models", None),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [1]}),
    ("GET", "/metrics", None),
    ("GET", "/schema/openapi.json", None),
]


@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {KEY}", "Bearer ", KEY])
def test_every_route_but_health_needs_the_key(
    keyed: TestClient, method: str, path: str, body: dict | None, authorization: str | None
) -> None:
    headers = {"authorization": authorization} if authorization is not None else {}
    resp = keyed.request(method, path, json=body, headers=headers)
    assert resp.status_code == 401 and resp.headers["content-type"].startswith("application/json")
    assert resp.json()["error"] | {"message": ""} == {
        "message": "",
        "type": "authentication_error",
        "param": None,
        "code": "invalid_api_key",
    }


@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
def test_the_key_opens_every_route(keyed: TestClient, method: str, path: str, body: dict | None) -> None:
    resp = keyed.request(method, path, json=body, headers={"authorization": f"Bearer {KEY}"})
    assert resp.status_code == 200, resp.text


def test_health_is_open_and_a_bad_body_is_401_before_400(keyed: TestClient) -> None:
    assert keyed.get("/health").status_code == 200
    assert keyed.post("/v1/chat/completions", content=b"{not json").status_code == 401


def test_key_comparison_hashes_both_sides() -> None:
    digest = hashlib.sha256(KEY.encode()).digest()
    assert key_matches(f"Bearer {KEY}", digest) and key_matches(f"bearer  {KEY} ", digest)
    assert not any(key_matches(h, digest) for h in (None, "", KEY, f"Bearer {KEY}x", f"Bearer {KEY[:-1]}"))


def test_api_key_from_flag_or_env() -> None:
    assert api_key_from("a", {"KVSCOPE_ENGINE_API_KEY": "b"}) == "a"
    assert api_key_from(None, {"KVSCOPE_ENGINE_API_KEY": "b"}) == "b"
    assert api_key_from(None, {}) is None
    with pytest.raises(ValueError, match="api_key must not be empty"):
        ServerSettings(api_key=" ")


@pytest.mark.parametrize(
    ("argv", "warned"),
    [
        (["--host", "0.0.0.0"], True),
        (["--host", "10.1.2.3"], True),
        (["--host", "::"], True),
        (["--host", "0.0.0.0", "--api-key", KEY], False),
        (["--host", "127.0.0.1"], False),
        (["--host", "localhost"], False),
        (["--host", "::1"], False),
    ],
)
def test_non_loopback_bind_without_key_warns_loudly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, argv: list[str], warned: bool
) -> None:
    served = []
    monkeypatch.delenv("KVSCOPE_ENGINE_API_KEY", raising=False)
    monkeypatch.setattr(cli, "configure_logging", lambda level: None)
    monkeypatch.setattr(cli, "_serve", lambda settings, config: served.append(settings) or 0)
    with caplog.at_level(logging.WARNING, logger="kvscope.engine"):
        assert cli.engine_main(["--model", "smollm2-135m", *argv]) == 0
    warnings = [
        r.getMessage() for r in caplog.records if r.name == "kvscope.engine" and r.levelno == logging.WARNING
    ]
    assert len(warnings) == (1 if warned else 0)
    if warned:
        assert "WITHOUT an API key" in warnings[0] and "bypassing the gateway's API keys" in warnings[0]
    assert served[0].api_key == (KEY if "--api-key" in argv else None)
