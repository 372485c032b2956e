"""``kvscope serve --replicas 2`` end to end: the supervisor starts two real engines (each on its own port,
with its own log, half the usable CPUs as threads) and the gateway in front of both; requests through the
gateway reach both engines; SIGTERM stops every child."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvscope.gateway.logs.jsonl import read_records
from kvscope.testing.harness import free_port
from tests.e2e.test_serve import BANNER, REPO, Serve, children_of, cmdline, gone
from tests.engine.server.e2e_support import CHAT, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]
ENGINE_ARGS = "--max-model-len 512 --kv-cache-memory 32M"  # no --num-threads: serve splits the CPUs


@pytest.fixture
def serve2(tmp_path: Path) -> Iterator[Serve]:
    port, output, log_file = free_port(), tmp_path / "serve.out", tmp_path / "requests.jsonl"
    script = Path(sys.executable).with_name("kvscope")
    head = [str(script)] if script.is_file() else [sys.executable, "-P", "-m", "kvscope.cli"]
    cmd = [*head, "serve", "--replicas", "2", "--port", str(port), "--log-file", str(log_file)]
    with output.open("wb") as out:
        proc = subprocess.Popen(
            [*cmd, "--engine-args", ENGINE_ARGS],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    running = Serve(proc, port, output, log_file, {})
    try:
        deadline = time.monotonic() + 240
        while BANNER not in output.read_text(errors="replace"):
            assert proc.poll() is None, f"kvscope serve exited with {proc.returncode}:\n{output.read_text()}"
            assert time.monotonic() < deadline, f"no banner after 240 s:\n{output.read_text()[-3000:]}"
            time.sleep(0.2)
        running.children = children_of(proc.pid)
        yield running
    finally:
        for pid, start in {**running.children, **children_of(proc.pid)}.items():
            if not gone(pid, start):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_two_engine_replicas_both_serve_through_the_gateway(serve2: Serve) -> None:
    commands = sorted(cmdline(pid)[1:] for pid in serve2.children)
    engines = [c for c in commands if c[3] == "engine"]
    assert len(commands) == 3 and len(engines) == 2 and [c[3] for c in commands].count("gateway") == 1
    threads = str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert [c[c.index("--num-threads") + 1] for c in engines] == [threads, threads]
    ports = sorted(c[c.index("--port") + 1] for c in engines)
    assert len(set(ports)) == 2
    text = serve2.output.read_text()
    assert "2 engine replicas behind the gateway:" in text
    assert all(f"http://127.0.0.1:{p}" in text for p in ports)
    logs = [serve2.log_file.with_name(f"engine-{i}.ndjson") for i in (1, 2)]

    def chat(i: int) -> int:
        body = {
            "model": "smollm2-135m",
            "messages": [{"role": "user", "content": f"{i} hi"}],
            "max_tokens": 16,
        }
        return httpx.post(serve2.url + "/v1/chat/completions", json=body, timeout=120).status_code

    def both_served() -> bool:
        # eight at a time: whatever the routing policy, its load bound spreads requests in flight over both
        # (the chat template's system prompt is one shared prefix, which cache_aware keeps on one replica
        # while that replica is not busier than the bound)
        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(chat, range(8))) == [200] * 8
        return all(any(r["url"]["path"] == CHAT for r in read_records(log)) for log in logs)

    metrics = httpx.get(serve2.url + "/metrics").text
    up = 'kvscope_gateway_upstream_up{{kind="kvscope",upstream="127.0.0.1:{}"}} 1.0'
    assert all(up.format(p) in metrics for p in ports)
    wait_for(both_served, 120, 0.1)
    serve2.proc.send_signal(signal.SIGTERM)
    assert serve2.proc.wait(30) == 0
    assert all(gone(pid, start) for pid, start in serve2.children.items())
