"""`kvscope serve` refuses to start when a port it needs is taken, before loading a model or starting a child
(otherwise another server on the gateway's port answers the readiness probe and the banner points at it)."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import pytest

from kvscope.cli.supervisor import ServeOptions, Supervisor


def _listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def _free() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("taken", ["gateway", "engine"])
def test_a_taken_port_fails_before_any_child_starts(
    taken: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # keep pytest's own SIGINT/SIGTERM handlers
    with _listening() as other:
        busy = other.getsockname()[1]
        port, engine_port = (busy, _free()) if taken == "gateway" else (_free(), busy)
        options = ServeOptions(
            model="smollm2-135m",
            host="127.0.0.1",
            port=port,
            engine_port=engine_port,
            log_file=tmp_path / "requests.jsonl",
            engine_args=(),
            gateway_args=(),
        )
        supervisor = Supervisor(options)
        assert supervisor.run() == 1
    assert supervisor.children == []
    flag = "--port" if taken == "gateway" else "--engine-port"
    err = capsys.readouterr().err
    assert err.startswith(f"kvscope serve: cannot listen on 127.0.0.1:{busy} (Address already in use)")
    assert f"pass {flag} with a free port" in err


@pytest.mark.parametrize("how", ["flag", "flag=", "env"])
def test_an_engine_api_key_is_refused_before_anything_starts(
    how: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    monkeypatch.delenv("KVSCOPE_ENGINE_API_KEY", raising=False)
    engine_args: tuple[str, ...] = {
        "flag": ("--api-key", "s3cret"),
        "flag=": ("--api-key=s3cret",),
        "env": (),
    }[how]
    if how == "env":
        monkeypatch.setenv("KVSCOPE_ENGINE_API_KEY", "s3cret")
    options = ServeOptions(
        model="smollm2-135m",
        host="127.0.0.1",
        port=_free(),
        engine_port=_free(),
        log_file=tmp_path / "requests.jsonl",
        engine_args=engine_args,
        gateway_args=(),
    )
    supervisor = Supervisor(options)
    assert supervisor.run() == 1 and supervisor.children == []
    assert capsys.readouterr().err.startswith(
        "kvscope serve: an engine API key (--api-key or "
        "$KVSCOPE_ENGINE_API_KEY) is not supported by kvscope serve"
    )
