"""The suite's shared helpers (kvscope/testing/): race-free test ports, the one polling helper, the SSE
reader."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.testing.ports import NAME_PREFIX, ephemeral_start, free_port
from kvscope.testing.sse import parse_sse, sse_events
from kvscope.testing.wait import wait_until

PORTS_SCRIPT = """
from kvscope.testing.ports import free_port
import sys
ports = [free_port() for _ in range(200)]
print(" ".join(map(str, ports)), flush=True)
sys.stdin.read()  # hold the reservations until the test has read both processes' ports
"""


def test_two_processes_asking_at_once_never_get_the_same_port() -> None:
    """As two xdist workers do: each reserves 200 ports while the other one holds its own."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-P", "-c", PORTS_SCRIPT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        got = [set(map(int, p.stdout.readline().split())) for p in procs]  # type: ignore[union-attr]
    finally:
        for p in procs:
            p.communicate("", timeout=30)
    assert [len(ports) for ports in got] == [200, 200]
    assert got[0] & got[1] == set()
    assert all(10_000 <= port < ephemeral_start() for ports in got for port in ports)


def test_a_port_is_handed_out_once_per_process_and_a_listening_one_never() -> None:
    """Every port of a range below the ephemeral one is handed out once, then the range is exhausted; the
    ports it skipped are exactly the listening one and those another process holds or uses meanwhile (the
    other xdist worker's servers: below the ephemeral range no kernel-chosen port lands)."""
    taken = free_port(high=ephemeral_start() - 101)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", taken))
        listener.listen()
        ports: list[int] = []
        with pytest.raises(
            RuntimeError, match=rf"^every port in \[{taken}, {taken + 101}\) is reserved or in use$"
        ):
            for _ in range(101):
                ports.append(free_port(low=taken, high=taken + 101))
        assert taken not in ports and len(set(ports)) == len(ports)
        assert all(taken < port < taken + 101 for port in ports)
        skipped = set(range(taken + 1, taken + 101)) - set(ports)
        assert all(_held_elsewhere(port) for port in skipped), sorted(skipped)


def _held_elsewhere(port: int) -> bool:
    """Whether ``port`` is reserved by another process of the scheme or not bindable now."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as name:
        try:
            name.bind(f"\0{NAME_PREFIX}{port}")
        except OSError:
            return True
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def test_the_ephemeral_start_is_read_from_the_kernel_setting(tmp_path: Path) -> None:
    setting = tmp_path / "ip_local_port_range"
    setting.write_text("40000\t60999\n")
    assert ephemeral_start(setting) == 40000
    assert ephemeral_start(tmp_path / "missing") == 32768


def test_wait_until_returns_the_value_or_says_what_it_waited_for() -> None:
    calls = iter([0, None, [], "ready"])
    assert wait_until(lambda: next(calls), 5, "ready", interval_s=0) == "ready"
    with pytest.raises(AssertionError, match=r"^the log line: not within 0\.05 s \(last seen: \[\]\)$"):
        wait_until(list, 0.05, "the log line")
    attempts = iter([OSError("refused"), OSError("refused"), True])

    def connect() -> bool:
        outcome = next(attempts)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert wait_until(connect, 5, "up", interval_s=0, retry_on=(OSError,)) is True
    with pytest.raises(ValueError, match="not retried"):
        wait_until(lambda: int("not retried"), 5, "x", retry_on=(OSError,))


def test_the_sse_reader_follows_the_spec_framing() -> None:
    body = (
        b": keep-alive\r\n\r\n"
        b'data: {"a": 1}\n\n'
        b"data:no-space\rdata:  two spaces\r\r"
        b"event: x\nid: 7\ndata: [DONE]\n\n"
        b'data: {"cut": true}'
    )
    parsed = parse_sse(body)
    assert parsed.payloads == ['{"a": 1}', "no-space\n two spaces", "[DONE]", '{"cut": true}']
    assert parsed.comments == [": keep-alive"]
    assert parsed.other == ["event: x", "id: 7"]
    assert sse_events(body) == parsed.payloads
    with pytest.raises(ValueError):
        _ = parsed.data  # "no-space\n two spaces" is no JSON
    assert parse_sse('data: {"a": 1}\n\ndata: [DONE]\n\n').chunks == [{"a": 1}]
