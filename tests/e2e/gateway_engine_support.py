"""The stack for the gateway-over-engine e2e tests (tests/e2e/test_gateway_engine_*.py): one real engine
subprocess (SmolLM2 on CPU) and one real gateway subprocess in front of it, both exporting spans over
OTLP/HTTP to one local receiver; the gateway writes its JSONL request log into the test's tmp folder.

Reuses the engine e2e helpers (tests/engine/server/e2e_support.py: timed SSE, log lines), the OTLP receiver
(tests/otlp_receiver.py) and the gateway harness (kvscope/testing/harness.py: process spawning,
Prometheus/JSONL parsing). Both sides log one line per request under the same ``x-request-id`` (the gateway
forwards it), so a test finds the gateway's and the engine's view of one request by that id.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvscope.testing.harness import Proc, metric_samples, read_log, records_by_id, spawn_gateway, wait_http
from kvscope.testing.wait import wait_until
from tests.engine.server.e2e_support import (
    CHAT,
    COMPLETIONS,
    TimedStream,
    line_by_http_id,
    wait_for,
)
from tests.engine.server.helpers import EngineProcess, start_engine
from tests.otlp_receiver import OtlpReceiver

MODEL = "smollm2-135m"
M = {"model": MODEL}
GENERATION_ROUTES = (CHAT, COMPLETIONS)
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}
"""Batch span processors of both processes export every 100 ms (default 5 s)."""
ENGINE_BASE_ARGS = ("--max-model-len", "1024", "--num-threads", "1")
"""Small settings for a shared 2-core CPU (one intra-op thread leaves a core to gateway and client)."""
GATEWAY_KEEPALIVE_S = 0.5


@dataclass
class Stack:
    """A running engine + gateway pair and what observes them."""

    engine: EngineProcess
    gateway: Proc
    receiver: OtlpReceiver
    log: Path
    """The gateway's JSONL request log."""

    @property
    def url(self) -> str:
        """The gateway's base URL (what clients use)."""
        return self.gateway.url

    def client(self, timeout_s: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout_s)

    def gateway_metrics(self) -> dict:
        """``{(sample name, sorted labels): value}`` of the gateway's /metrics."""
        return metric_samples(httpx.get(self.url + "/metrics", timeout=10).text)

    def engine_metrics(self) -> dict:
        return self.engine.metrics()

    def gateway_line(self, request_id: str, timeout_s: float = 30.0) -> dict:
        """The single gateway log record of ``request_id`` (fails when there is none or several)."""
        records_by_id(self.log, [request_id], timeout_s)
        self.await_log_sentinel(timeout_s)  # a duplicate would be written before the sentinel's line
        lines = records_by_id(self.log, [], 0).get(request_id, [])
        assert len(lines) == 1, lines
        return lines[0]

    def await_log_sentinel(self, timeout_s: float = 30.0) -> None:
        """Send the gateway a request it answers 404 itself and logs (an unknown path outside /v1, so the
        engine never sees it; counted under ``route="other"``) and wait until its line is in the log. The
        gateway's log writer keeps the order in which requests ended, so every line of a request that ended
        before this one is in the file then."""
        path = f"/kvscope-log-sentinel-{uuid.uuid4().hex}"
        assert httpx.get(self.url + path, timeout=10).status_code == 404
        wait_until(
            lambda: any(r["url"]["path"] == path for r in read_log(self.log, 0, 0)),
            timeout_s,
            f"the gateway's log line of GET {path}",
        )

    def engine_line(self, request_id: str, timeout_s: float = 30.0) -> dict:
        """The single engine log record of the request the gateway sent with ``x-request-id: request_id``."""
        return line_by_http_id(self.engine, request_id, timeout_s)

    def stop(self) -> None:
        self.gateway.stop()
        self.engine.stop()
        self.receiver.close()


def start_stack(tmp: Path, *engine_args: str, gateway_config: dict[str, Any] | None = None) -> Stack:
    """Engine (``ENGINE_BASE_ARGS`` + ``engine_args``) then the gateway in front of it, with the model's
    tokenizer for prompt limits at the edge, keep-alives every ``GATEWAY_KEEPALIVE_S``, a JSONL log in ``tmp``
    and both exporting OTLP to a fresh receiver; returns once the gateway is ready (/readyz 200)."""
    from kvscope.common.models.cache import hf_dir

    receiver = OtlpReceiver().start()
    engine = start_engine(
        tmp, *ENGINE_BASE_ARGS, *engine_args, "--otlp-endpoint", receiver.url, env=FAST_EXPORT
    )
    log = tmp / "gateway.jsonl"
    config = {
        "upstreams": [{"url": engine.url}],
        "models": [{"name": MODEL, "tokenizer": str(hf_dir(MODEL))}],  # converted by the engine's start
        "timeouts": {"keepalive_s": GATEWAY_KEEPALIVE_S},
        "routing": {"health_interval_s": 2},
        "logs": {"file": str(log)},
        "tracing": {"otlp_endpoint": receiver.url},
        **(gateway_config or {}),
    }
    gateway = spawn_gateway(tmp, "gateway", config, env=FAST_EXPORT)
    try:
        wait_http(gateway.url + "/readyz", timeout=60, proc=gateway.popen)
    except Exception:
        gateway.stop()
        engine.stop()
        receiver.close()
        raise RuntimeError(f"gateway not ready:\n{gateway.log.read_text()[-3000:]}") from None
    return Stack(engine, gateway, receiver, log)


# --- reading the two sides --------------------------------------------------------------------------------
def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of every sample named ``name`` whose labels include ``labels`` (other labels summed over)."""
    wanted = set(labels.items())
    return sum(v for (n, lbls), v in samples.items() if n == name and wanted <= set(lbls))


def engine_generation_requests(samples: dict) -> float:
    """Generation requests the engine's HTTP server answered (any status): the gateway's health checks
    (GET /v1/models) are not counted."""
    return sum(total(samples, "kvscope_engine_http_requests_total", route=r) for r in GENERATION_ROUTES)


def engine_gauges(samples: dict) -> tuple[float, float, float]:
    """(running requests, waiting requests, KV-cache usage ratio) of the engine."""
    running, waiting, usage = (
        total(samples, f"kvscope_engine_{name}", **M)
        for name in ("requests_running", "requests_waiting", "kv_cache_usage_ratio")
    )
    return running, waiting, usage


def engine_back_to(stack: Stack, idle: tuple, timeout_s: float = 30.0) -> dict:
    """Poll the engine until its gauges equal ``idle``; returns those metrics."""
    return wait_for(lambda: (m := stack.engine_metrics()) and engine_gauges(m) == idle and m, timeout_s)


def token_times(result: TimedStream) -> list[float]:
    """Arrival times (s after sending) of the data events that carried output text."""
    out = []
    for t, event in result.events:
        if not event.startswith("data: {"):
            continue
        chunk = json.loads(event[len("data: ") :])
        choices = chunk.get("choices") or []
        if any((c.get("delta") or {}).get("content") or c.get("text") for c in choices):
            out.append(t)
    return out


def plain_chat(client: httpx.Client, max_tokens: int = 4) -> httpx.Response:
    """The cases' liveness probe: a plain chat request that must answer 200."""
    return client.post(
        CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    )
