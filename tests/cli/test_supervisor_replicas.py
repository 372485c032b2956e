"""`kvscope serve --replicas N`: the commands the supervisor builds (N engines on their own ports and logs,
the CPUs split between them, one gateway --upstream per engine), the banner, and the flag's validation. One
engine builds exactly today's commands. The processes themselves: tests/e2e/test_serve.py."""

from __future__ import annotations

import signal
import sys
from dataclasses import replace as dataclass_replace
from pathlib import Path
from typing import Any

import pytest

from kvscope.cli import supervisor
from kvscope.cli.supervisor import ServeOptions, Supervisor, engine_threads, serve_main


def _options(tmp_path: Path, replicas: int, engine_args: tuple[str, ...] = ()) -> ServeOptions:
    return ServeOptions(
        model="smollm2-135m",
        host="127.0.0.1",
        port=4100,
        engine_port=8100,
        log_file=tmp_path / "requests.jsonl",
        engine_args=engine_args,
        gateway_args=(),
        replicas=replicas,
    )


class _Child:
    def __init__(self, pid: int) -> None:
        self.pid = pid

    def poll(self) -> None:
        return None


def _started(
    sup: Supervisor, monkeypatch: pytest.MonkeyPatch, card: dict[str, Any] | None = None
) -> list[tuple[list[str], str | None]]:
    """Run the supervisor's start-up with the children's launch replaced: (command, stdout file name).
    ``card``: what every engine's /v1/models answers."""
    launched: list[tuple[list[str], str | None]] = []

    def spawn(cmd: list[str], stdout: Any = None) -> _Child:
        launched.append((cmd, Path(stdout.name).name if stdout is not None else None))
        return _Child(1000 + len(launched))

    monkeypatch.setattr(sup, "_spawn", spawn)
    monkeypatch.setattr(sup, "_wait_ready", lambda *args: None)
    monkeypatch.setattr(supervisor, "_model_card", lambda url: card)
    monkeypatch.setattr(supervisor, "usable_cpus", lambda: 7)
    monkeypatch.setattr(supervisor, "_tokenizer_path", lambda model: None)
    sup._start_engines()
    sup._start_gateway()
    sup._print_banner()
    return launched


HEAD = [sys.executable, "-P", "-m", "kvscope.cli"]


def test_two_replicas_get_their_own_ports_threads_and_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    sup = Supervisor(_options(tmp_path, 2, ("--max-model-len", "512")))
    second = sup.engine_ports[1]
    assert sup.engine_ports[0] == 8100 and second not in (8100, 4100)
    engine = [*HEAD, "engine", "--model", "smollm2-135m", "--host", "127.0.0.1", "--port"]
    log = str(tmp_path / "requests.jsonl")
    assert _started(sup, monkeypatch) == [
        ([*engine, "8100", "--num-threads", "3", "--max-model-len", "512"], "engine-1.ndjson"),
        ([*engine, str(second), "--num-threads", "3", "--max-model-len", "512"], "engine-2.ndjson"),
        (
            [
                *HEAD,
                *("gateway", "--host", "127.0.0.1", "--port", "4100"),
                *("--upstream", "http://127.0.0.1:8100", "--upstream", f"http://127.0.0.1:{second}"),
                *("--log-file", log),
            ],
            None,
        ),
    ]
    out = capsys.readouterr().out
    assert "engine 1 (port 8100): engine weight format: unknown" in out
    assert f"engine 2 (port {second}): engine weight format" in out
    assert (
        "kvscope is serving smollm2-135m at http://127.0.0.1:4100/v1  "
        f"(metrics: http://127.0.0.1:4100/metrics, request log: {log})\n"
        "2 engine replicas behind the gateway:\n"
        f"  http://127.0.0.1:8100  (log {tmp_path / 'engine-1.ndjson'})\n"
        f"  http://127.0.0.1:{second}  (log {tmp_path / 'engine-2.ndjson'})\n\n  curl "
    ) in out


def test_one_replica_builds_todays_commands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    sup = Supervisor(_options(tmp_path, 1))
    assert sup.engine_ports == [8100]
    log = str(tmp_path / "requests.jsonl")
    assert _started(sup, monkeypatch) == [
        (
            [*HEAD, "engine", "--model", "smollm2-135m", "--host", "127.0.0.1", "--port", "8100"],
            "engine.ndjson",
        ),
        (
            [*HEAD, "gateway", "--host", "127.0.0.1", "--port", "4100", "--upstream", "http://127.0.0.1:8100"]
            + ["--log-file", log],
            None,
        ),
    ]
    out = capsys.readouterr().out
    assert "\nengine weight format: unknown" in out and "engine 1:" not in out
    assert (
        f"(metrics: http://127.0.0.1:4100/metrics, request log: {log})\n\n  curl http://127.0.0.1:4100/v1/chat"
    ) in out


def test_a_given_thread_count_is_left_alone(tmp_path: Path) -> None:
    sup = Supervisor(_options(tmp_path, 3, ("--num-threads=2",)))
    assert len(set(sup.engine_ports)) == 3
    assert [sup.engine_command(i)[-3:] for i in range(3)] == [
        ["--port", str(port), "--num-threads=2"] for port in sup.engine_ports
    ]


@pytest.mark.parametrize(
    ("replicas", "cpus", "threads"), [(1, 8, None), (2, 8, 4), (3, 8, 2), (4, 2, 1), (2, 1, 1)]
)
def test_threads_split_the_usable_cpus(replicas: int, cpus: int, threads: int | None) -> None:
    assert engine_threads(replicas, cpus) == threads


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("0", "argument --replicas: must be >= 1 (engines to start), got 0"),
        ("-2", "argument --replicas: must be >= 1 (engines to start), got -2"),
        ("two", "argument --replicas: must be an integer >= 1, got 'two'"),
    ],
)
def test_replicas_below_one_are_refused_before_anything_starts(
    value: str, error: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    with pytest.raises(SystemExit) as exit_info:
        serve_main(["--replicas", value])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.endswith(f"kvscope serve: error: {error}\n")


def test_the_other_replicas_serve_the_first_ones_weight_format(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each engine's start-up probe could pick another format under the others' load: the first one's pick
    (its card) is passed to the rest, unless --engine-args names a format."""
    fmt = {"dtype": "bfloat16", "quantization": "gguf", "weights_bytes": 1 << 20, "rss_bytes": 1 << 20}
    card = {"id": "smollm2-135m", "kvscope": {**fmt, "reason": "probe"}}
    sup = Supervisor(_options(tmp_path, 3))
    commands = [cmd for cmd, _ in _started(sup, monkeypatch, card)][:3]
    pinned = ["--dtype", "bfloat16", "--quantization", "gguf"]
    assert [cmd[-4:] == pinned for cmd in commands] == [False, True, True]
    assert sup.names == {
        1001: "engine 1 (port 8100)",
        1002: f"engine 2 (port {sup.engine_ports[1]})",
        1003: f"engine 3 (port {sup.engine_ports[2]})",
        1004: "gateway",
    }
    own = Supervisor(_options(tmp_path, 2, ("--dtype", "float32")))
    assert [cmd[-2:] for cmd, _ in _started(own, monkeypatch, card)][:2] == [["--dtype", "float32"]] * 2


def test_gateway_workers_reach_the_gateway_and_turn_off_the_console_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    sup = Supervisor(dataclass_replace(_options(tmp_path, 1), gateway_workers=3))
    gateway = _started(sup, monkeypatch)[-1][0]
    assert gateway[-2:] == ["--workers", "3"]
    out = capsys.readouterr().out
    assert "/console" not in out and "kvscope is serving smollm2-135m at http://127.0.0.1:4100/v1" in out
    sup = Supervisor(_options(tmp_path, 1))
    assert "--workers" not in _started(sup, monkeypatch)[-1][0]
    assert "console (live charts" in capsys.readouterr().out


def test_gateway_workers_below_one_are_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    with pytest.raises(SystemExit) as exit_info:
        serve_main(["--gateway-workers", "0"])
    assert exit_info.value.code == 2
    error = "argument --gateway-workers: must be >= 1 (gateway processes), got 0"
    assert capsys.readouterr().err.endswith(f"kvscope serve: error: {error}\n")
