"""OTel GenAI client metrics exported over OTLP/HTTP by the gateway, decoded from a local receiver (issue 15,
Build: semconv names, units, attributes and bucket boundaries)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from kvscope.common.otel_genai import (
    CHUNK_BUCKETS,
    OPERATION_DURATION_BUCKETS,
    TOKEN_USAGE_BUCKETS,
    build_client_metrics,
)
from kvscope.testing.harness import LoopThread
from tests.gateway.conftest import KEYS, build_stack
from tests.otlp_receiver import OtlpReceiver

HI = [{"role": "user", "content": "hello world"}]
TOKEN_DELAY_S = 0.05
"""The fake upstream's pause before each token (s)."""


def test_gen_ai_client_metrics_reach_an_otlp_receiver(tmp_path: Path) -> None:
    loop = LoopThread()
    with OtlpReceiver() as rx:
        gateway, fakes, _ = build_stack(
            loop, tmp_path, tracing={"otlp_endpoint": rx.url, "metrics_export_interval_s": 3600}
        )
        headers = {"authorization": f"Bearer {KEYS['alice']}"}
        with gateway:
            for stream in (False, True):
                started = time.perf_counter()
                resp = httpx.post(
                    gateway.url + "/v1/chat/completions",
                    headers=headers,
                    timeout=10,
                    json={
                        "model": "fake-model",
                        "messages": HI,
                        "max_tokens": 3,
                        "stream": stream,
                        "fake": {"token_delay_s": TOKEN_DELAY_S},
                    },
                )
                stream_s = time.perf_counter() - started
                assert resp.status_code == 200
        # leaving the gateway shut its MeterProvider down: the final push has arrived
        points = rx.metric_points()
        resources = rx.resources()
    for fake in fakes.values():
        loop.run(fake.close())
    loop.stop()

    assert {
        "gen_ai.client.operation.duration",
        "gen_ai.client.token.usage",
        "gen_ai.client.operation.time_to_first_chunk",
        "gen_ai.client.operation.time_per_output_chunk",
    } <= set(points)
    base = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "kvscope",
        "gen_ai.request.model": "fake-model",
        "gen_ai.response.model": "fake-model",
        "server.address": "127.0.0.1",
        "server.port": fakes["main"].port,
    }
    ((attrs, duration),) = points["gen_ai.client.operation.duration"]
    assert attrs == base and duration.count == 2
    assert list(duration.explicit_bounds) == list(OPERATION_DURATION_BUCKETS)
    usage = {a["gen_ai.token.type"]: p for a, p in points["gen_ai.client.token.usage"]}
    assert (usage["input"].count, usage["input"].sum) == (2, 4)  # "hello world" twice (fake: words)
    assert (usage["output"].count, usage["output"].sum) == (2, 6)
    assert list(usage["input"].explicit_bounds) == [float(b) for b in TOKEN_USAGE_BUCKETS]
    ((attrs, ttfc),) = points["gen_ai.client.operation.time_to_first_chunk"]
    assert attrs == base and ttfc.count == 1  # the stream only
    assert list(ttfc.explicit_bounds) == list(CHUNK_BUCKETS) == [0.01 * 2**i for i in range(14)]  # semconv
    ((attrs, tpoc),) = points["gen_ai.client.operation.time_per_output_chunk"]
    # one observation per chunk after the first (semconv): the stream's 3 token chunks give 2 gaps, which add
    # up to the time from its first to its last chunk: at least the upstream's 2 token delays less one (the
    # first chunk may arrive late, never early), at most the whole stream as the client saw it
    assert attrs == base and tpoc.count == 2
    assert TOKEN_DELAY_S <= tpoc.sum <= stream_s
    assert list(tpoc.explicit_bounds) == list(CHUNK_BUCKETS)
    assert {"service.name": "kvscope-gateway"}.items() <= resources[-1].items()


ATTRS = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "kvscope", "gen_ai.request.model": "m"}


def test_client_metrics_record_only_what_a_reader_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no reader (no OTLP endpoint, none passed) the instruments record nothing (each measurement would
    be built for no one: one per streamed token); with a reader every chunk gap is one observation; with only
    the OTLP environment set the OTLP push is a reader."""
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    unread = build_client_metrics({"service.name": "t"}, "1")
    assert unread.read is False

    def built(*_: object, **__: object) -> None:
        raise AssertionError("a measurement was recorded with no reader")

    for instrument in ("duration", "token_usage", "time_to_first_chunk", "time_per_output_chunk"):
        monkeypatch.setattr(getattr(unread, instrument), "record", built)
    unread.record(ATTRS, 1.0, 5, 3, 0.1, [0.01, 0.02])

    reader = InMemoryMetricReader()
    read = build_client_metrics({"service.name": "t"}, "1", readers=[reader])
    read.record(ATTRS, 1.0, 5, 3, 0.1, [0.01, 0.02])
    data = reader.get_metrics_data()
    assert data is not None
    (gaps,) = [
        m
        for sm in data.resource_metrics[0].scope_metrics
        for m in sm.metrics
        if m.name == "gen_ai.client.operation.time_per_output_chunk"
    ]
    (point,) = gaps.data.data_points
    assert (read.read, point.count, point.sum, point.min, point.max) == (True, 2, 0.03, 0.01, 0.02)

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "http://127.0.0.1:9/v1/metrics")
    pushed = build_client_metrics({"service.name": "t"}, "1")
    assert pushed.read is True
    pushed.provider.shutdown(timeout_millis=1)
