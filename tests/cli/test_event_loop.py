"""The event loop the engine's and the gateway's uvicorn servers run on (kvscope/common/event_loop.py):
uvloop by default, asyncio on request, a clear error for uvloop where it is missing; and a gateway process
really runs the loop it was given (its memory map holds uvloop's extension only when it does)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvscope.common import event_loop
from kvscope.common.event_loop import resolve_event_loop
from kvscope.engine.server.cli import uvicorn_config as engine_uvicorn_config
from kvscope.engine.server.settings import ServerSettings
from kvscope.gateway.app import create_app
from kvscope.gateway.server import uvicorn_config as gateway_uvicorn_config
from kvscope.gateway.settings import load_settings
from kvscope.testing.harness import spawn_fake, spawn_gateway, wait_http

UPSTREAM = {"upstreams": [{"url": "http://127.0.0.1:9"}]}


@pytest.fixture
def no_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(event_loop, "uvloop_available", lambda: False)


def test_auto_is_uvloop_where_installed_and_asyncio_on_request() -> None:
    assert event_loop.uvloop_available()  # a dependency of both extras (pyproject.toml)
    assert resolve_event_loop("auto") == "uvloop"
    assert resolve_event_loop("uvloop") == "uvloop"
    assert resolve_event_loop("asyncio") == "asyncio"


@pytest.mark.usefixtures("no_uvloop")
def test_without_uvloop_auto_falls_back_and_a_forced_uvloop_is_a_config_error() -> None:
    assert resolve_event_loop("auto") == "asyncio"
    with pytest.raises(ValueError, match="uvloop is not installed"):
        resolve_event_loop("uvloop")
    with pytest.raises(ValueError, match="uvloop is not installed"):
        ServerSettings(event_loop="uvloop")
    with pytest.raises(ValueError, match="uvloop is not installed"):
        load_settings(None, {**UPSTREAM, "event_loop": "uvloop"})
    assert ServerSettings().event_loop == "auto"


def test_unknown_loop_is_refused() -> None:
    with pytest.raises(ValueError, match="event loop must be one of auto, uvloop, asyncio, got 'trio'"):
        resolve_event_loop("trio")


@pytest.mark.parametrize(
    ("choice", "loop"), [("auto", "uvloop"), ("asyncio", "asyncio"), ("uvloop", "uvloop")]
)
def test_the_servers_are_configured_with_the_resolved_loop(choice: str, loop: str) -> None:
    engine = engine_uvicorn_config(object(), ServerSettings(event_loop=choice, port=8123))
    assert (engine.loop, engine.port, engine.access_log, engine.timeout_graceful_shutdown) == (
        loop,
        8123,
        False,
        5,
    )
    gateway = gateway_uvicorn_config(
        create_app(load_settings(None, {**UPSTREAM, "event_loop": choice})), "127.0.0.1", 4123
    )
    assert (gateway.loop, gateway.port) == (loop, 4123)


def _uvloop_mapped(pid: int) -> bool:
    """Whether process ``pid`` has uvloop's compiled loop module mapped (uvicorn imports it only to run
    it)."""
    return bool(re.search(r"uvloop/loop\.cpython", Path(f"/proc/{pid}/maps").read_text()))


@pytest.mark.e2e
@pytest.mark.parametrize(("env", "uvloop"), [({}, True), ({"KVSCOPE_GATEWAY_EVENT_LOOP": "asyncio"}, False)])
def test_a_gateway_process_runs_the_chosen_loop_and_relays_a_stream(
    tmp_path: Path, env: dict[str, str], uvloop: bool
) -> None:
    import httpx

    fake = spawn_fake(tmp_path, "stub")
    gateway = None
    try:
        wait_http(fake.url + "/health", proc=fake.popen)
        gateway = spawn_gateway(tmp_path, "gateway", {"upstreams": [{"url": fake.url}]}, env=env)
        wait_http(gateway.url + "/readyz", proc=gateway.popen)
        body = {
            "model": "fake-model",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "stream": True,
        }
        with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, timeout=30) as resp:
            text = b"".join(resp.iter_raw()).decode()
        assert resp.status_code == 200
        assert text.count('"content":"t') == 5 and text.endswith("data: [DONE]\n\n")
        assert _uvloop_mapped(gateway.popen.pid) is uvloop
    finally:
        for proc in (gateway, fake):
            if proc is not None:
                proc.stop()
