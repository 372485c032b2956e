"""An upstream the gateway has never reached: a model it may serve is a 503 with Retry-After (clients retry
that), not a 404 model_not_found (clients never retry that); once every replica has said what it serves, an
unknown model is a 404 again (break-it finding F3)."""

from __future__ import annotations

import logging

import httpx
import pytest

from kvscope.gateway.app import create_app
from kvscope.gateway.auth import hash_key
from kvscope.gateway.settings import load_settings
from kvscope.testing.harness import GatewayThread, free_port

BODY = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _post(upstreams: list[dict], tmp_path) -> httpx.Response:
    config = {
        "upstreams": upstreams,
        "api_keys": [{"name": "a", "sha256": hash_key("sk-a")}],
        "routing": {"health_interval_s": 60},
        "logs": {"file": str(tmp_path / "requests.jsonl")},
    }
    with GatewayThread(create_app(load_settings(None, config, env={}))) as gateway:
        return httpx.post(
            gateway.url + "/v1/chat/completions",
            json=BODY,
            timeout=30,
            headers={"authorization": "Bearer sk-a"},
        )


def test_a_model_of_an_upstream_never_reached_is_a_503_with_retry_after(tmp_path, caplog) -> None:
    port = free_port()
    caplog.set_level(logging.WARNING, logger="kvscope.gateway")
    response = _post([{"url": f"http://127.0.0.1:{port}"}], tmp_path)
    error = response.json()["error"]
    assert (response.status_code, error["type"], error["code"], error["param"]) == (
        503,
        "server_error",
        "upstream_unavailable",
        None,
    )
    assert response.headers["retry-after"] == "60"
    assert error["message"] == (
        "No upstream has answered yet to say whether it serves model 'smollm2-135m'; retry shortly. "
        f"(health checks so far: 127.0.0.1:{port}: connection refused)"
    )
    assert [r.getMessage() for r in caplog.records if "health check" in r.getMessage()] == [
        f"upstream 127.0.0.1:{port} failed its health check (GET http://127.0.0.1:{port}/v1/models): "
        "connection refused; no requests go to it until it answers"
    ]


def test_a_model_no_configured_upstream_lists_is_still_a_404(tmp_path) -> None:
    response = _post([{"url": f"http://127.0.0.1:{free_port()}", "models": ["other-model"]}], tmp_path)
    assert (response.status_code, response.json()["error"]["code"]) == (404, "model_not_found")


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1/"])
def test_an_upstream_url_ending_in_v1_is_a_config_error_naming_the_base(url: str) -> None:
    with pytest.raises(ValueError, match=r"ends in /v1: give the server's base URL, 'http://127.0.0.1:8000'"):
        load_settings(None, {"upstreams": [{"url": url}]}, env={})
