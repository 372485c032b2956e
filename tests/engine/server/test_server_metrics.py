"""After a known workload the kvscope_engine_* counters and histogram counts equal what it implies."""

from __future__ import annotations

from litestar.testing import TestClient
from prometheus_client import CollectorRegistry, generate_latest

from kvscope.engine.core.stats import SchedulerStats
from kvscope.engine.engine_core import StepResult
from kvscope.engine.server.app import create_app
from kvscope.engine.server.metrics import MetricBuckets
from kvscope.engine.server.settings import ServerSettings
from kvscope.engine.server.stat_logger import ServerMetrics
from tests.engine.server.conftest import chat_body
from tests.engine.server.fakes import FakeEngine
from tests.engine.server.helpers import metric_samples, sample

M = {"model": "fake-model"}


def test_counters_and_histograms_match_the_workload(client):
    for _ in range(3):
        assert client.post("/v1/chat/completions", json=chat_body(max_tokens=4)).status_code == 200
    body = {"model": "fake-model", "prompt": "hi", "max_tokens": 3, "n": 2, "stream": True}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert client.post("/v1/chat/completions", json=chat_body(max_tokens=0)).status_code == 400
    s = metric_samples(client.get("/metrics").text)
    assert sample(s, "kvscope_engine_prompt_tokens_total", **M) == 3 * 20 + 2  # n=2 counts its prompt once
    assert sample(s, "kvscope_engine_generation_tokens_total", **M) == 3 * 4 + 2 * 3
    assert sample(s, "kvscope_engine_request_success_total", finish_reason="length", **M) == 5
    assert sample(s, "kvscope_engine_request_success_total", finish_reason="stop", **M) == 0
    for name in (
        "time_to_first_token",
        "e2e_request_latency",
        "time_per_output_token",
        "queue_time",
        "prefill_time",
        "decode_time",
    ):
        assert sample(s, f"kvscope_engine_{name}_seconds_count", **M) == 5, name
    assert sample(s, "kvscope_engine_inter_token_latency_seconds_count", **M) == 3 * 3 + 2 * 2
    assert sample(s, "kvscope_engine_request_generation_tokens_sum", **M) == 18
    assert sample(s, "kvscope_engine_request_prompt_tokens_count", **M) == 4
    assert sample(s, "kvscope_engine_request_prompt_tokens_sum", **M) == 62
    assert sample(s, "kvscope_engine_requests_running", **M) == 0
    assert sample(s, "kvscope_engine_http_requests_total", route="/v1/chat/completions", status="200") == 3
    assert sample(s, "kvscope_engine_http_requests_total", route="/v1/completions", status="200") == 1
    assert sample(s, "kvscope_engine_http_requests_total", route="/v1/chat/completions", status="400") == 1
    assert ("kvscope_engine_http_requests_total", (("route", "/v1/completions"), ("status", "500"))) in s
    assert sample(s, "kvscope_engine_http_requests_total", route="/v1/completions", status="500") == 0
    # vLLM's request_inference_time / request_params_*: one observation per sequence / per request
    assert sample(s, "kvscope_engine_request_inference_time_seconds_count", **M) == 5
    assert sample(s, "kvscope_engine_request_params_n_count", **M) == 4
    assert sample(s, "kvscope_engine_request_params_n_sum", **M) == 3 * 1 + 2
    assert sample(s, "kvscope_engine_request_params_max_tokens_sum", **M) == 3 * 4 + 3
    assert sample(s, "kvscope_engine_device_memory_used_bytes", device="cpu") == 3000


def test_histogram_sum_equals_reported_ttft(client):
    body = client.post("/v1/chat/completions", json=chat_body(max_tokens=2)).json()
    s = metric_samples(client.get("/metrics").text)
    assert sample(s, "kvscope_engine_time_to_first_token_seconds_sum", **M) == body["kvscope"]["ttft_s"]
    assert sample(s, "kvscope_engine_decode_time_seconds_sum", **M) == body["kvscope"]["decode_s"]


def test_buckets_are_configurable():
    settings = ServerSettings(buckets=MetricBuckets(ttft_s=(0.5, 1.0, 2.0)))
    app = create_app(settings, engine=FakeEngine(), registry=CollectorRegistry())
    with TestClient(app) as client:
        text = client.get("/metrics").text
    les = [
        line.split('le="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith("kvscope_engine_time_to_first_token_seconds_bucket")
    ]
    assert les == ["0.5", "1.0", "2.0", "+Inf"]


def test_step_listener_sets_gauges_and_counts_deltas():
    registry = CollectorRegistry()
    metrics = ServerMetrics(registry, "m")
    stats = SchedulerStats(
        num_running=3,
        num_waiting=2,
        kv_cache_usage=0.25,
        num_used_blocks=5,
        num_cached_blocks=2,
        num_free_blocks=13,
        num_preemptions_total=1,
        prefix_cache_queries=100,
        prefix_cache_hits=32,
    )
    metrics.on_step(
        StepResult(
            num_running=3,
            num_waiting=2,
            kv_cache_usage=0.25,
            batch_size=3,
            num_scheduled_tokens=40,
            num_preemptions=1,
        ),
        stats,
    )
    later = SchedulerStats(
        num_running=0,
        num_waiting=0,
        kv_cache_usage=0.0,
        num_used_blocks=0,
        num_cached_blocks=7,
        num_free_blocks=13,
        num_preemptions_total=1,
        prefix_cache_queries=150,
        prefix_cache_hits=48,
    )
    metrics.on_step(StepResult(), later)  # an abort notification: gauges only
    s = metric_samples(generate_latest(registry).decode())
    assert sample(s, "kvscope_engine_requests_running", model="m") == 0
    assert sample(s, "kvscope_engine_kv_cache_usage_ratio", model="m") == 0.0
    assert [
        sample(s, "kvscope_engine_kv_cache_blocks", model="m", state=x) for x in ("used", "cached", "free")
    ] == [0, 7, 13]
    assert sample(s, "kvscope_engine_prefix_cache_queries_total", model="m") == 150
    assert sample(s, "kvscope_engine_prefix_cache_hits_total", model="m") == 48
    assert sample(s, "kvscope_engine_preemptions_total", model="m") == 1
    assert sample(s, "kvscope_engine_batch_size_count", model="m") == 1
    assert sample(s, "kvscope_engine_step_tokens_sum", model="m") == 40


def test_metrics_content_types_name_the_charset_once(client) -> None:
    plain = client.get("/metrics")
    assert plain.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    scraped = client.get("/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
    assert scraped.headers["content-type"] == (
        "application/openmetrics-text; version=1.0.0; charset=utf-8; escaping=underscores"
    )
    assert scraped.text.rstrip().endswith("# EOF")
