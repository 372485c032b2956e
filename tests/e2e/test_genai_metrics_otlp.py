"""The OTel GenAI metrics leave the real processes while they run: an engine (SmolLM2 on CPU) and a gateway in
front of it, each configured only by the standard environment (``OTEL_EXPORTER_OTLP_ENDPOINT`` at a local
OTLP/HTTP receiver, ``OTEL_METRIC_EXPORT_INTERVAL=500`` ms), push their histograms every half second; the test
reads each push as it arrives, after one batch of requests and again after a second, with both processes
still up (not the shutdown flush).

What each process exports, per OpenTelemetry semantic conventions 1.41, "Semantic conventions for generative
AI metrics" (open-telemetry/semantic-conventions v1.41.0, docs/gen-ai/gen-ai-metrics.md; built in
kvscope/common/otel_genai.py):

- the gateway (a GenAI client of its upstream): ``gen_ai.client.operation.duration`` (s),
  ``gen_ai.client.token.usage`` ({token}, ``gen_ai.token.type`` input/output, one observation of each per
  call), ``gen_ai.client.operation.time_to_first_chunk`` (s, streams) and
  ``gen_ai.client.operation.time_per_output_chunk`` (s, one per chunk after a stream's first);
- the engine (a GenAI model server): ``gen_ai.server.request.duration``,
  ``gen_ai.server.time_to_first_token`` and ``gen_ai.server.time_per_output_token`` (s, one observation per
  request; the last two for successful ones).

Attributes are the semconv's metric attributes only (operation, provider, request and response model, server
address and port on the client side; no ids, token counts or parameters). Counts are exact for the requests
sent: ``ignore_eos`` fixes each answer's length, so every request has a first token and a TPOT.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvscope.common.otel_genai import (
    CHUNK_BUCKETS,
    OPERATION_DURATION_BUCKETS,
    TIME_PER_OUTPUT_TOKEN_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    TOKEN_USAGE_BUCKETS,
)
from kvscope.testing.harness import spawn_gateway, wait_http
from kvscope.testing.wait import wait_until
from tests.engine.server.helpers import start_engine
from tests.otlp_receiver import OtlpReceiver

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]
MODEL = "smollm2-135m"
EXPORT_ENV = {"OTEL_METRIC_EXPORT_INTERVAL": "500", "OTEL_TRACES_EXPORTER": "none"}
CUMULATIVE = 2  # AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE, the OTLP exporter's default
GATEWAY = {
    "gen_ai.client.operation.duration": ("s", OPERATION_DURATION_BUCKETS),
    "gen_ai.client.token.usage": ("{token}", TOKEN_USAGE_BUCKETS),
    "gen_ai.client.operation.time_to_first_chunk": ("s", CHUNK_BUCKETS),
    "gen_ai.client.operation.time_per_output_chunk": ("s", CHUNK_BUCKETS),
}
ENGINE = {
    "gen_ai.server.request.duration": ("s", OPERATION_DURATION_BUCKETS),
    "gen_ai.server.time_to_first_token": ("s", TIME_TO_FIRST_TOKEN_BUCKETS),
    "gen_ai.server.time_per_output_token": ("s", TIME_PER_OUTPUT_TOKEN_BUCKETS),
}


def latest_export(rx: OtlpReceiver, service: str) -> dict[str, tuple[str, int, list[tuple[dict, Any]]]]:
    """The last metrics push of ``service``: metric name → (unit, temporality, [(attributes, histogram
    point)]). Cumulative temporality: each push holds the totals since the process started."""
    with rx.lock:
        pushes = list(rx.metrics)
    for push in reversed(pushes):
        for rm in push.resource_metrics:
            attrs = {a.key: a.value.string_value for a in rm.resource.attributes}
            if attrs.get("service.name") != service:
                continue
            out = {}
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    assert metric.HasField("histogram"), metric.name
                    points = [
                        ({a.key: _value(a.value) for a in p.attributes}, p)
                        for p in metric.histogram.data_points
                    ]
                    out[metric.name] = (metric.unit, metric.histogram.aggregation_temporality, points)
            return out
    return {}


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def counts(export: dict, name: str, *keys: str) -> Counter:
    """Observations of ``name`` by the values of attribute ``keys``."""
    out: Counter = Counter()
    for attrs, point in export.get(name, ("", 0, []))[2]:
        out[tuple(attrs.get(k) for k in keys)] += point.count
    return out


def sums(export: dict, name: str, *keys: str) -> Counter:
    out: Counter = Counter()
    for attrs, point in export.get(name, ("", 0, []))[2]:
        out[tuple(attrs.get(k) for k in keys)] += point.sum
    return out


class Sent:
    """What the requests sent so far must have produced (by operation)."""

    def __init__(self) -> None:
        self.requests: Counter = Counter()
        self.streams: Counter = Counter()
        self.chunk_gaps: Counter = Counter()
        self.tokens: Counter = Counter()

    def add(self, operation: str, usage: dict[str, int], content_chunks: int | None) -> None:
        self.requests[(operation,)] += 1
        self.tokens[(operation, "input")] += usage["prompt_tokens"]
        self.tokens[(operation, "output")] += usage["completion_tokens"]
        if content_chunks is not None:
            self.streams[(operation,)] += 1
            self.chunk_gaps[(operation,)] += content_chunks - 1


def send(client: httpx.Client, sent: Sent, route: str, max_tokens: int, stream: bool) -> None:
    """One request through the gateway; records what it must add to the metrics."""
    operation = "chat" if route.endswith("chat/completions") else "text_completion"
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    body |= {"messages": [{"role": "user", "content": "Count"}]} if operation == "chat" else {"prompt": "One"}
    if not stream:
        response = client.post(route, json=body)
        assert response.status_code == 200, response.text
        sent.add(operation, response.json()["usage"], None)
        return
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    usage, chunks = None, 0
    with client.stream("POST", route, json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: ") :])
            usage = event.get("usage") or usage
            choices = event.get("choices") or []
            chunks += any((c.get("delta") or {}).get("content") or c.get("text") for c in choices)
    assert usage is not None and usage["completion_tokens"] == max_tokens
    sent.add(operation, usage, chunks)


def check(rx: OtlpReceiver, sent: Sent, engine_port: int) -> None:
    """Wait for the pushes that hold exactly what ``sent`` produced, then check names, units, attributes."""

    def arrived() -> tuple[dict, dict] | None:
        gateway, engine = latest_export(rx, "kvscope-gateway"), latest_export(rx, "kvscope-engine")
        op = "gen_ai.operation.name"
        done = (
            counts(gateway, "gen_ai.client.operation.duration", op) == sent.requests
            and counts(engine, "gen_ai.server.request.duration", op) == sent.requests
        )
        return (gateway, engine) if done else None

    gateway, engine = wait_until(arrived, 60, "a push of each process counting every request sent")
    assert {n: (u, t) for n, (u, t, _) in gateway.items()} == {
        n: (u, CUMULATIVE) for n, (u, _) in GATEWAY.items()
    }
    assert {n: (u, t) for n, (u, t, _) in engine.items()} == {
        n: (u, CUMULATIVE) for n, (u, _) in ENGINE.items()
    }
    for name, (_, bounds) in (GATEWAY | ENGINE).items():
        for _, point in (gateway | engine)[name][2]:
            assert tuple(point.explicit_bounds) == tuple(float(b) for b in bounds), name
    client_attrs = {
        "gen_ai.provider.name": "kvscope",
        "gen_ai.request.model": MODEL,
        "gen_ai.response.model": MODEL,
        "server.address": "127.0.0.1",
        "server.port": engine_port,
    }
    for name, (_, _, points) in gateway.items():
        for attrs, _ in points:
            extra = {"gen_ai.token.type"} if name == "gen_ai.client.token.usage" else set()
            assert set(attrs) == {"gen_ai.operation.name", *client_attrs, *extra}, (name, attrs)
            assert {k: attrs[k] for k in client_attrs} == client_attrs, name
    server_attrs = {
        "gen_ai.provider.name": "kvscope",
        "gen_ai.request.model": MODEL,
        "gen_ai.response.model": MODEL,
    }
    for name, (_, _, points) in engine.items():
        for attrs, _ in points:
            assert attrs == {"gen_ai.operation.name": attrs["gen_ai.operation.name"], **server_attrs}, name
    op, kind = "gen_ai.operation.name", "gen_ai.token.type"
    per_call = Counter({key: sent.requests[key[:1]] for key in sent.tokens})  # one input, one output each
    assert counts(gateway, "gen_ai.client.token.usage", op, kind) == per_call
    assert sums(gateway, "gen_ai.client.token.usage", op, kind) == sent.tokens
    assert counts(gateway, "gen_ai.client.operation.time_to_first_chunk", op) == sent.streams
    assert counts(gateway, "gen_ai.client.operation.time_per_output_chunk", op) == sent.chunk_gaps
    assert counts(engine, "gen_ai.server.time_to_first_token", op) == sent.requests
    assert counts(engine, "gen_ai.server.time_per_output_token", op) == sent.requests


def test_genai_metrics_are_pushed_while_the_processes_run(tmp_path: Path):
    with OtlpReceiver() as rx:
        env = {**EXPORT_ENV, "OTEL_EXPORTER_OTLP_ENDPOINT": rx.url}
        engine = start_engine(tmp_path, "--max-model-len", "512", "--num-threads", "1", env=env)
        try:
            config = {"upstreams": [{"url": engine.url}], "routing": {"health_interval_s": 2}}
            gateway = spawn_gateway(tmp_path, "gateway", config, env=env)
            try:
                wait_http(gateway.url + "/readyz", timeout=60, proc=gateway.popen)
                engine_port = int(engine.url.rsplit(":", 1)[1])
                sent = Sent()
                with httpx.Client(base_url=gateway.url, timeout=120) as client:
                    send(client, sent, "/v1/chat/completions", 4, stream=True)
                    send(client, sent, "/v1/chat/completions", 3, stream=False)
                    send(client, sent, "/v1/completions", 3, stream=False)
                    check(rx, sent, engine_port)
                    assert gateway.popen.poll() is None and engine.proc.poll() is None  # pushed while running
                    send(client, sent, "/v1/completions", 4, stream=True)
                    send(client, sent, "/v1/chat/completions", 2, stream=True)
                    check(rx, sent, engine_port)
                    assert gateway.popen.poll() is None and engine.proc.poll() is None
            finally:
                gateway.stop()
        finally:
            engine.stop()
