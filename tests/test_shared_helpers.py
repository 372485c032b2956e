"""The suite's shared helpers (kvscope/testing/): race-free test ports, the one polling helper, the SSE
reader."""

from __future__ import annotations

import ast
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.testing.ports import NAME_PREFIX, ephemeral_start, free_port
from kvscope.testing.sse import parse_sse, sse_events
from kvscope.testing.wait import wait_until

ROOT = Path(__file__).resolve().parents[1]
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


def _port_helpers(path: Path, root: Path) -> list[str]:
    """Functions in ``path`` that hand out a port the kernel picked (bind port 0, return
    ``getsockname()[1]``): the race ``free_port`` replaces (the port is free only until the socket closes,
    and another xdist worker's kernel-picked port may be the same)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        binds_zero = any(
            isinstance(sub, ast.Call)
            and isinstance(sub.func, ast.Attribute)
            and sub.func.attr == "bind"
            and sub.args
            and isinstance(sub.args[0], ast.Tuple)
            and isinstance(port := sub.args[0].elts[-1], ast.Constant)
            and port.value == 0
            for sub in ast.walk(node)
        )
        returns_port = any(
            isinstance(sub, ast.Return)
            and sub.value is not None
            and "getsockname()[1]" in ast.unparse(sub.value)
            for sub in ast.walk(node)
        )
        if binds_zero and returns_port:
            found.append(f"{path.relative_to(root).as_posix()}::{node.name}")
    return found


def test_no_test_file_keeps_its_own_port_picker(tmp_path: Path) -> None:
    """One port helper (kvscope.testing.ports.free_port): a test module that picks ports itself is found."""
    assert [hit for path in sorted((ROOT / "tests").rglob("*.py")) for hit in _port_helpers(path, ROOT)] == []
    sample = tmp_path / "tests" / "test_sample.py"
    sample.parent.mkdir()
    sample.write_text(
        "import socket\n"
        "def pick() -> int:\n"
        "    with socket.socket() as s:\n"
        "        s.bind(('127.0.0.1', 0))\n"
        "        return s.getsockname()[1]\n"
        "def listening():\n"
        "    s = socket.socket()\n"
        "    s.bind(('127.0.0.1', 0))\n"
        "    return s\n"
    )
    assert _port_helpers(sample, tmp_path) == ["tests/test_sample.py::pick"]


CLOCK_CALLS = frozenset({"monotonic", "perf_counter", "time"})
HAND_WRITTEN_WAITS: dict[str, str] = {
    # loops that also watch a process and fail at once when it exits (wait_until can: its predicate may
    # assert), in fixtures that start kvscope serve, the engine or a browser stack: to convert with them
    "tests/e2e/test_console_browser.py::stack": "watches the stack's processes too (issue 40's file)",
    "tests/e2e/test_serve.py::serve": "watches kvscope serve's process and prints its output on exit",
    "tests/e2e/test_serve_replicas.py::serve2": "as test_serve.py's serve",
    "tests/engine/server/test_otel_env.py::start_fake_engine": "watches the fake engine's process too",
    "tests/engine/server/test_read_timeouts.py::engine_server": "watches the uvicorn thread too",
    # timing checks written as loops: the loop's bound is what the test asserts
    "tests/engine/server/test_otel_env.py::wait_for_metrics": (
        "asserts the first push within PUSH_WITHIN_S of the request (OTEL_METRIC_EXPORT_INTERVAL applied: "
        "the default 15 s would miss it); an upper bound only a slow machine could miss"
    ),
    "tests/gateway/test_otel_env.py::wait_for_metrics": "as the engine's test_otel_env.py wait_for_metrics",
    # not waits: a measurement, a scripted delay, a gate inside a patched engine step
    "tests/gateway/engines/test_scraper.py::ticker": "measures the loop's tick gaps (the subject)",
    "tests/engine/test_async_engine_thread.py::step": (
        "holds the engine's first step on its own thread until all six requests are in (a gate, not a wait "
        "for an outcome)"
    ),
    # plain waits left in files other sessions were editing: to convert to wait_until
    "tests/gateway/console/test_console_app.py::_until": "a copy of wait_until (issue 40's file)",
    "tests/gateway/engines/test_gateway_kinds.py::kinds": "waits for kinds and samples (issue 38's file)",
    "tests/gateway/test_app_stream.py::_spans": "returns what it has at 30 s for the caller's assert",
    "tests/gateway/test_edge_processes.py::"
    "test_a_malformed_request_after_a_good_one_on_a_keep_alive_connection_gets_its_400": (
        "waits for two log lines, then asserts them"
    ),
    "tests/gateway/test_latency_phases.py::phased": "waits for both replicas healthy before yielding",
    "tests/testing/test_fake_upstream_kinds.py::wait_for": "a copy of wait_until (H7's file)",
}
"""``path::function`` → why its polling loop is not :func:`kvscope.testing.wait.wait_until` (yet)."""


def _clock_call(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in CLOCK_CALLS
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id in ("time", "loop")
    )


def _own_nodes(node: ast.AST) -> list[ast.AST]:
    """``node``'s body without the functions defined inside it (each is scanned on its own)."""
    out: list[ast.AST] = []
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            out += [child, *_own_nodes(child)]
    return out


def _polling_loops(path: Path, root: Path) -> list[str]:
    """``path::function`` for each function in ``path`` with a hand-written polling loop: a ``while`` that
    sleeps and reads a clock (directly, or through a name the function set from one, as a deadline)."""
    found = []
    for function in ast.walk(ast.parse(path.read_text())):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        own = _own_nodes(function)
        deadlines = {
            target.id
            for node in own
            if isinstance(node, ast.Assign) and any(_clock_call(sub) for sub in ast.walk(node.value))
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        for loop in (node for node in own if isinstance(node, ast.While)):
            inside = list(ast.walk(loop))
            sleeps = any(
                isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr == "sleep"
                for sub in inside
            )
            clock = any(
                _clock_call(sub) or (isinstance(sub, ast.Name) and sub.id in deadlines) for sub in inside
            )
            if sleeps and clock:
                found.append(f"{path.relative_to(root).as_posix()}::{function.name}")
                break
    return found


def test_polling_goes_through_wait_until_except_the_listed_loops(tmp_path: Path) -> None:
    """One polling helper: every hand-written deadline loop left in tests/ is listed with why, and a new
    one (here in a sample file) is found."""
    found = [hit for path in sorted((ROOT / "tests").rglob("*.py")) for hit in _polling_loops(path, ROOT)]
    assert sorted(set(found) - set(HAND_WRITTEN_WAITS)) == [], "use kvscope.testing.wait.wait_until"
    assert sorted(set(HAND_WRITTEN_WAITS) - set(found)) == [], "a listed loop is gone: drop it"
    sample = tmp_path / "tests" / "test_sample.py"
    sample.parent.mkdir()
    sample.write_text(
        "import asyncio, time\n"
        "def wait_log(path):\n"
        "    deadline = time.monotonic() + 10\n"
        "    while not path.exists():\n"
        "        assert time.monotonic() < deadline\n"
        "        time.sleep(0.05)\n"
        "async def fixture():\n"
        "    async def inner():\n"
        "        while loop.time() < 5:\n"
        "            await asyncio.sleep(0.1)\n"
        "    while True:\n"
        "        await asyncio.sleep(1)\n"
        "def retries(items):\n"
        "    while items:\n"
        "        items.pop()\n"
    )
    assert _polling_loops(sample, tmp_path) == [
        "tests/test_sample.py::wait_log",
        "tests/test_sample.py::inner",
    ]
