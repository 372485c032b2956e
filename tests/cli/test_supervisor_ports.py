"""`kvscope serve` refuses to start when a port it needs is taken, before loading a model or starting a child
(otherwise another server on the gateway's port answers the readiness probe and the banner points at it)."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import pytest

from kvscope.cli.supervisor import ServeOptions, Supervisor
from kvscope.testing.ports import free_port


def _options(tmp_path: Path, **given: object) -> ServeOptions:
    """kvscope serve's options for the default model on free loopback ports, with ``given`` instead."""
    fields: dict[str, object] = {
        "model": "smollm2-135m",
        "host": "127.0.0.1",
        "port": free_port(),
        "engine_port": free_port(),
        "log_file": tmp_path / "requests.jsonl",
        "engine_args": (),
        "gateway_args": (),
    }
    return ServeOptions(**{**fields, **given})  # type: ignore[arg-type]


def _listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


@pytest.mark.parametrize("taken", ["gateway", "engine"])
def test_a_taken_port_fails_before_any_child_starts(
    taken: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # keep pytest's own SIGINT/SIGTERM handlers
    with _listening() as other:
        busy = other.getsockname()[1]
        port, engine_port = (busy, free_port()) if taken == "gateway" else (free_port(), busy)
        options = _options(tmp_path, port=port, engine_port=engine_port)
        supervisor = Supervisor(options)
        assert supervisor.run() == 1
    assert supervisor.children == []
    advice = {
        "gateway": f"Stop it, or serve on another port, e.g. `kvscope serve --port {busy + 1}` (with make: "
        f"`make run PORT={busy + 1}`)",
        "engine": "Stop it, or pass --engine-port with a free port (or leave it out: kvscope serve picks a "
        "free one)",
    }[taken]
    assert capsys.readouterr().err == (
        f"kvscope serve: cannot listen on 127.0.0.1:{busy} (Address already in use); is another kvscope "
        f"serve running? {advice}\n"
    )


def test_make_run_passes_port_to_kvscope_serve() -> None:
    """The port advice names ``make run PORT=…``: the Makefile turns it into ``--port`` (``make -n``
    prints the command without running it); without PORT, kvscope serve's own default."""
    import shutil
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    make = shutil.which("make")
    assert make is not None

    def dry_run(*args: str) -> list[str]:
        done = subprocess.run(
            [make, "-n", "-C", str(repo), "run", "VENV=.venv", "TORCH_INDEX_URL=", *args],
            capture_output=True,
            text=True,
            check=True,
            env={k: v for k, v in os.environ.items() if k not in ("PORT", "MAKEFLAGS")},
        )
        return [line for line in done.stdout.splitlines() if "kvscope serve" in line]

    assert dry_run("PORT=4001") == [".venv/bin/kvscope serve --port 4001"]
    assert dry_run() == [".venv/bin/kvscope serve "]


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
    options = _options(tmp_path, engine_args=engine_args)
    supervisor = Supervisor(options)
    assert supervisor.run() == 1 and supervisor.children == []
    assert capsys.readouterr().err.startswith(
        "kvscope serve: an engine API key (--api-key or "
        "$KVSCOPE_ENGINE_API_KEY) is not supported by kvscope serve"
    )


@pytest.mark.parametrize(
    ("gateway_args", "config", "message"),
    [
        (("--routing", "foo"), None, "kvscope serve: gateway: the gateway options were refused (exit 2)\n"),
        (
            (),
            "routing:\n  cache_aware:\n    load_slack: -1\n",
            "Expected `int` >= 0 - at `$.routing.cache_aware.load_slack`",
        ),
    ],
)
def test_gateway_options_the_gateway_would_refuse_fail_before_any_engine_starts(
    gateway_args: tuple[str, ...],
    config: str | None,
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bad ``--gateway-args`` flag or a bad value in the config file they name: the gateway's own message,
    before the engines' minute of start-up (a new user waited for two engines to learn of a typo)."""
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    if config is not None:
        (tmp_path / "gateway.yaml").write_text(config)
        gateway_args = ("--config", str(tmp_path / "gateway.yaml"))
    options = _options(tmp_path, gateway_args=gateway_args)
    supervisor = Supervisor(options)
    assert supervisor.run() == 1
    assert supervisor.children == []
    err = capsys.readouterr().err
    assert message in err
    if config is None:  # argparse's own line names the flag and the choices
        assert "argument --routing: invalid choice: 'foo'" in err
    else:
        assert err.startswith("kvscope serve: gateway: ")
