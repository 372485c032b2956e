"""Client disconnect aborts the engine request in every phase, streaming or not (cases L1, L2), through a real
uvicorn server in a thread (the FakeEngine runs on its loop)."""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest

from engine.server.access_log import ACCESS_LOGGER
from tests.engine.server.conftest import chat_body
from tests.engine.server.helpers import metric_samples, sample, serve_in_thread


@pytest.fixture
def live(app):
    with serve_in_thread(app) as url:
        yield url


def _wait_aborted(fake_engine, request_id: str, timeout_s: float = 1.0) -> float:
    start = time.monotonic()
    while (request_id, "abort") not in fake_engine.aborted:
        assert time.monotonic() - start < timeout_s, f"{request_id} not aborted: {fake_engine.aborted}"
        time.sleep(0.005)
    return time.monotonic() - start


def _access_lines(caplog) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == ACCESS_LOGGER]


@pytest.mark.parametrize(("phase", "queue_s", "prefill_s", "chunks_before_close"), [
    ("queued", 5.0, 0.0, 0), ("prefill", 0.0, 5.0, 0), ("decode", 0.0, 0.0, 5)])  # fmt: skip
def test_stream_disconnect_aborts_in_every_phase(live, fake_engine, caplog, phase, queue_s, prefill_s,
                                                  chunks_before_close):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    fake_engine.queue_s, fake_engine.prefill_s, fake_engine.token_s = queue_s, prefill_s, 0.05
    fake_engine.reply = b"x" * 100
    with httpx.Client(base_url=live, timeout=10) as client:
        with client.stream("POST", "/v1/chat/completions", json=chat_body(max_tokens=100, stream=True)) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            received = 0
            while received < chunks_before_close:
                if next(lines).startswith("data: "):
                    received += 1
            time.sleep(0.1)
        request_id = fake_engine.started[-1]
        assert _wait_aborted(fake_engine, request_id) < 1.0
        assert fake_engine.core.scheduler.requests == {}
        samples = metric_samples(client.get("/metrics").text)
        assert sample(samples, "kvscope_engine_requests_running", model="fake-model") == 0
        assert sample(samples, "kvscope_engine_request_success_total", model="fake-model", finish_reason="abort") == 1
        fake_engine.queue_s = fake_engine.prefill_s = 0.0
        assert client.post("/v1/chat/completions", json=chat_body(max_tokens=2)).status_code == 200
    lines = [line for line in _access_lines(caplog) if line["gen_ai"]["response"]["id"] == request_id]
    assert len(lines) == 1
    assert lines[0]["kvscope"]["client_disconnected"] is True
    assert lines[0]["kvscope"]["phase"] == phase
    assert lines[0]["event"]["outcome"] == "failure"
    assert lines[0]["http"]["response"]["status_code"] == 200
    assert lines[0]["gen_ai"]["usage"]["output_tokens"] >= chunks_before_close - 1  # role chunk is one of them


@pytest.mark.parametrize(("phase", "queue_s", "prefill_s"), [
    ("queued", 5.0, 0.0), ("prefill", 0.0, 5.0), ("decode", 0.0, 0.0)])  # fmt: skip
def test_non_streaming_disconnect_aborts(live, fake_engine, caplog, phase, queue_s, prefill_s):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    fake_engine.queue_s, fake_engine.prefill_s, fake_engine.token_s = queue_s, prefill_s, 0.05
    fake_engine.reply = b"x" * 100
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=live, timeout=0.4) as client:
        client.post("/v1/chat/completions", json=chat_body(max_tokens=100))
    request_id = fake_engine.started[-1]
    assert _wait_aborted(fake_engine, request_id) < 1.0
    assert fake_engine.core.scheduler.requests == {}
    time.sleep(0.05)
    lines = [line for line in _access_lines(caplog) if line["gen_ai"]["response"]["id"] == request_id]
    assert len(lines) == 1
    assert lines[0]["http"]["response"]["status_code"] == 499
    assert (lines[0]["kvscope"]["phase"], lines[0]["kvscope"]["outcome"]) == (phase, "client_disconnected")
    with httpx.Client(base_url=live, timeout=10) as client:
        samples = metric_samples(client.get("/metrics").text)
    prompt_tokens = sample(samples, "kvscope_engine_prompt_tokens_total", model="fake-model")
    assert prompt_tokens == (20 if phase == "decode" else 0)  # an abandoned prefill counts no prompt tokens
