"""Test helpers shared by the server unit tests and the e2e engine tests: SSE parsing, metric reading,
an in-thread uvicorn server, and the engine server as a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvscope.gateway.logs.jsonl import read_records
from kvscope.testing.ports import free_port as free_port  # re-exported for the server tests
from kvscope.testing.sse import SSEStream as SSEStream  # re-exported: the one SSE reader
from kvscope.testing.sse import parse_sse as parse_sse
from kvscope.testing.wait import wait_until

REPO = Path(__file__).resolve().parents[3]


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text → {(sample name, sorted labels): value}."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def sample(samples: dict, name: str, **labels: str) -> float:
    """One sample's value (0.0 when absent)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    """Run an ASGI app under a real uvicorn server in a thread; yields its base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()

    def started() -> bool:
        if not thread.is_alive():
            raise RuntimeError("uvicorn exited before it started")
        return server.started

    wait_until(started, 10, "uvicorn started", interval_s=0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@dataclass
class EngineProcess:
    """``python -m kvscope.engine.server`` as a subprocess; stdout (the JSON request log) goes to
    ``log_path``."""

    url: str
    proc: subprocess.Popen
    log_path: Path
    err_path: Path

    def log_records(self) -> list[dict]:
        return read_records(self.log_path)  # the line the engine is still writing is not a record yet

    def records_for(self, response_id: str) -> list[dict]:
        return [
            r for r in self.log_records() if r.get("gen_ai", {}).get("response", {}).get("id") == response_id
        ]

    def metrics(self) -> dict:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            return metric_samples(response.read().decode())

    def await_log_sentinel(self, timeout_s: float = 30.0) -> None:
        """Send a request the engine answers 404 and logs (an unrouted path: counted under
        ``route="unmatched"``, no generation metric moves) and wait until its line is in the log. The engine
        writes its lines in the order it finishes the requests (one handler, whole lines), so every line of
        a request that ended before this one is in the file then: how a test shows that nothing more was
        logged for a request, instead of sleeping. An engine that has exited wrote its last line before it
        exited: nothing to wait for (and nobody to answer the sentinel)."""
        if self.proc.poll() is not None:
            return
        path = f"/kvscope-log-sentinel-{uuid.uuid4().hex}"
        try:
            urllib.request.urlopen(self.url + path, timeout=10).close()
        except urllib.error.HTTPError as exc:
            assert exc.code == 404, exc
        wait_until(
            lambda: any(r.get("url", {}).get("path") == path for r in self.log_records()),
            timeout_s,
            f"the engine's log line of GET {path}",
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_engine(
    tmp_dir: Path,
    *args: str,
    env: dict[str, str] | None = None,
    timeout_s: float = 240,
    pin_float32: bool = True,
) -> EngineProcess:
    """Start the engine server on a free port with ``args`` and wait until /health answers 200.
    ``pin_float32``: pass ``--dtype float32`` (exact, batch-independent greedy text as the tests expect)
    unless ``args`` name a ``--dtype``/``--quantization``; False serves the server's default format (auto)."""
    port = free_port()
    log_path, err_path = tmp_dir / "engine.jsonl", tmp_dir / "engine.err"
    pinned = pin_float32 and not any(a.split("=")[0] in ("--dtype", "--quantization") for a in args)
    command = [
        sys.executable,
        "-P",
        "-m",
        "kvscope.engine.server",
        "--port",
        str(port),
        *(("--dtype", "float32") if pinned else ()),
        *args,
    ]
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=log_path.open("w"),
        stderr=err_path.open("w"),
        env={**os.environ, **(env or {})},
    )
    engine = EngineProcess(f"http://127.0.0.1:{port}", proc, log_path, err_path)

    def healthy() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited with {proc.returncode}:\n{err_path.read_text()[-3000:]}")
        with urllib.request.urlopen(f"{engine.url}/health", timeout=2) as response:
            return response.status == 200

    try:
        wait_until(
            healthy, timeout_s, f"{engine.url}/health answering 200", interval_s=0.1, retry_on=(OSError,)
        )
    except AssertionError as exc:
        engine.stop()
        raise RuntimeError(
            f"engine not healthy after {timeout_s} s:\n{err_path.read_text()[-3000:]}"
        ) from exc
    return engine
