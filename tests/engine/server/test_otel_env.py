"""The OpenTelemetry SDK environment, honoured by the engine server process (issue 39): OTEL_SERVICE_NAME,
OTEL_EXPORTER_OTLP_{TRACES_,METRICS_,}ENDPOINT, OTEL_EXPORTER_OTLP_PROTOCOL (http/protobuf and grpc),
OTEL_METRIC_EXPORT_INTERVAL and OTEL_SDK_DISABLED, each set on a real process. One engine with the model
(the OTLP/HTTP case); the gRPC and disabled cases run the same server code around the tests' FakeEngine
(tests/engine/server/fake_engine_server.py), which starts in a second."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.engine.server.helpers import REPO, free_port, start_engine
from tests.otlp_receiver import GrpcOtlpReceiver, OtlpReceiver

CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2, "temperature": 0}
PUSH_WITHIN_S = 8.0
"""OTEL_METRIC_EXPORT_INTERVAL=2000 must bring the first gen_ai push within this (the default is 15 s)."""
ENGINE_METRICS = {
    "gen_ai.server.request.duration",
    "gen_ai.server.time_to_first_token",
    "gen_ai.server.time_per_output_token",
}


def wait_for_metrics(rx: OtlpReceiver | GrpcOtlpReceiver, since: float) -> float:
    """Seconds from ``since`` until every engine gen_ai metric arrived; raises AssertionError after 8 s."""
    while time.monotonic() - since < PUSH_WITHIN_S:
        if ENGINE_METRICS <= set(rx.metric_points()):
            return time.monotonic() - since
        time.sleep(0.1)
    raise AssertionError(f"no gen_ai push within {PUSH_WITHIN_S} s: {sorted(rx.metric_points())}")


def start_fake_engine(tmp: Path, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = (tmp / "fake-engine.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.engine.server.fake_engine_server", "--port", str(port)],
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), **env},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp / "fake-engine.log").read_text()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("the fake engine server did not start")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(20)


def test_engine_exports_to_the_otel_environment_over_http(tmp_path: Path) -> None:
    with OtlpReceiver() as rx:
        env = {
            "OTEL_SERVICE_NAME": "engine-from-env",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": rx.url + "/collector/traces",
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": rx.url + "/vendor/api/metrics",
            "OTEL_METRIC_EXPORT_INTERVAL": "2000",
        }
        engine = start_engine(tmp_path, "--max-model-len", "512", env=env)
        try:
            sent = time.monotonic()
            assert httpx.post(engine.url + "/v1/chat/completions", json=CHAT, timeout=60).status_code == 200
            wait_for_metrics(rx, sent)
        finally:
            engine.stop()  # flushes the spans
        # both signal URLs used as given (nothing appended, the metrics URL not derived from the traces one)
        assert set(rx.paths) == {"/collector/traces", "/vendor/api/metrics"}
        assert {r["service.name"] for r in rx.resources()} == {"engine-from-env"}
        spans = rx.spans()
    assert {name for _, name in spans} >= {"llm_request", "queue", "prefill", "decode"}
    assert {r["service.name"] for r, _ in spans} == {"engine-from-env"}


def test_engine_exports_over_grpc_to_the_generic_endpoint(tmp_path: Path) -> None:
    with GrpcOtlpReceiver() as rx:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": rx.url,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_METRIC_EXPORT_INTERVAL": "2000",
        }
        proc, url = start_fake_engine(tmp_path, env)
        try:
            sent = time.monotonic()
            assert (
                httpx.post(url + "/v1/chat/completions", json={"model": "fake-model", **CHAT}).status_code
                == 200
            )
            wait_for_metrics(rx, sent)
        finally:
            stop(proc)
        assert set(rx.paths) == {"grpc:traces", "grpc:metrics"}
        assert {r["service.name"] for r in rx.resources()} == {"kvscope-engine"}
        assert "llm_request" in {name for _, name in rx.spans()}


def test_sdk_disabled_exports_nothing(tmp_path: Path) -> None:
    with OtlpReceiver() as rx:
        env = {
            "OTEL_SDK_DISABLED": "true",
            "OTEL_EXPORTER_OTLP_ENDPOINT": rx.url,
            "OTEL_METRIC_EXPORT_INTERVAL": "200",
        }
        proc, url = start_fake_engine(tmp_path, env)
        try:
            response = httpx.post(url + "/v1/chat/completions", json={"model": "fake-model", **CHAT})
            assert response.status_code == 200
            metrics = httpx.get(url + "/metrics").text
        finally:
            stop(proc)  # a shutdown would push the last metrics and flush the spans
        assert (rx.paths, rx.metrics, rx.traces) == ([], [], [])
    assert 'kvscope_engine_http_requests_total{route="/v1/chat/completions",status="200"} 1.0' in metrics


def test_an_unsupported_protocol_stops_the_process_with_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tests.engine.server.fake_engine_server"],
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (result.returncode, result.stderr) == (
        2,
        "fake engine server: OTEL_EXPORTER_OTLP_PROTOCOL must be one "
        "of http/protobuf, grpc, got 'http/json'\n",
    )
