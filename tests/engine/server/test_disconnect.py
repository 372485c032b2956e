"""Client disconnect aborts the engine request in every phase, streaming or not (cases L1, L2), through a real
uvicorn server in a thread (the FakeEngine runs on its loop)."""

from __future__ import annotations

import http.client
import json
import logging
from urllib.parse import urlsplit

import httpx
import pytest

from kvscope.engine.core.request import RequestStatus
from kvscope.engine.server.access_log import ACCESS_LOGGER
from kvscope.testing.wait import wait_until
from tests.engine.server.conftest import chat_body
from tests.engine.server.helpers import metric_samples, sample, serve_in_thread


@pytest.fixture
def live(app):
    with serve_in_thread(app) as url:
        yield url


def _wait(predicate, what: str, timeout_s: float = 30.0):
    """Poll ``predicate`` until truthy; the deadline only bounds a broken run."""
    return wait_until(predicate, timeout_s, what, interval_s=0.005)


def _wait_aborted(fake_engine, request_id: str) -> None:
    _wait(
        lambda: (request_id, "abort") in fake_engine.aborted, f"{request_id} aborted: {fake_engine.aborted}"
    )


def _wait_phase(fake_engine, started_before: int, phase: str) -> str:
    """The id of the next request once it is in ``phase`` (queued: waiting; prefill: running, no token yet;
    decode: a token out)."""

    def reached():
        if len(fake_engine.started) <= started_before:
            return None
        rid = fake_engine.started[started_before]
        req = fake_engine.core.scheduler.requests.get(rid)
        if req is None:
            return None
        now = {RequestStatus.WAITING: "queued", RequestStatus.RUNNING: "prefill"}.get(req.status)
        if now == "prefill" and req.num_output_tokens:
            now = "decode"
        return rid if now == phase else None

    return _wait(lambda: reached(), f"a request in {phase}")


def _access_lines(caplog) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == ACCESS_LOGGER]


@pytest.mark.parametrize(("phase", "queue_s", "prefill_s", "chunks_before_close"), [
    ("queued", 60.0, 0.0, 0), ("prefill", 0.0, 60.0, 0), ("decode", 0.0, 0.0, 5)])  # fmt: skip
def test_stream_disconnect_aborts_in_every_phase(
    live, fake_engine, caplog, phase, queue_s, prefill_s, chunks_before_close
):
    """The client closes once the request is in ``phase`` (a 60 s queue or prefill, or 100 tokens 0.2 s apart
    that would take 20 s), so only the disconnect can end it: an abort, not a finish."""
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    fake_engine.queue_s, fake_engine.prefill_s, fake_engine.token_s = queue_s, prefill_s, 0.2
    fake_engine.reply = b"x" * 100
    started_before = len(fake_engine.started)
    with httpx.Client(base_url=live, timeout=30) as client:
        with client.stream("POST", "/v1/chat/completions", json=chat_body(max_tokens=100, stream=True)) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            received = 0
            while received < chunks_before_close:
                if next(lines).startswith("data: "):
                    received += 1
            request_id = _wait_phase(fake_engine, started_before, phase)
        _wait_aborted(fake_engine, request_id)
        assert fake_engine.core.scheduler.requests == {}
        samples = metric_samples(client.get("/metrics").text)
        assert sample(samples, "kvscope_engine_requests_running", model="fake-model") == 0
        assert (
            sample(samples, "kvscope_engine_request_success_total", model="fake-model", finish_reason="abort")
            == 1
        )
        fake_engine.queue_s = fake_engine.prefill_s = 0.0
        assert client.post("/v1/chat/completions", json=chat_body(max_tokens=2)).status_code == 200
    lines = [line for line in _access_lines(caplog) if line["gen_ai"]["response"]["id"] == request_id]
    assert len(lines) == 1
    assert lines[0]["kvscope"]["client_disconnected"] is True
    assert lines[0]["kvscope"]["phase"] == phase
    assert lines[0]["event"]["outcome"] == "failure"
    assert lines[0]["http"]["response"]["status_code"] == 200
    assert (
        lines[0]["gen_ai"]["usage"]["output_tokens"] >= chunks_before_close - 1
    )  # role chunk is one of them


@pytest.mark.parametrize(("phase", "queue_s", "prefill_s"), [
    ("queued", 60.0, 0.0), ("prefill", 0.0, 60.0), ("decode", 0.0, 0.0)])  # fmt: skip
def test_non_streaming_disconnect_aborts(live, fake_engine, caplog, phase, queue_s, prefill_s):
    """The client sends the request and closes its socket once the request is in ``phase``; the access line
    is read after a later request's line (so a duplicate would already be there)."""
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    fake_engine.queue_s, fake_engine.prefill_s, fake_engine.token_s = queue_s, prefill_s, 0.2
    fake_engine.reply = b"x" * 100
    started_before = len(fake_engine.started)
    url = urlsplit(live)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request(
        "POST",
        "/v1/chat/completions",
        body=json.dumps(chat_body(max_tokens=100)),
        headers={"content-type": "application/json"},
    )
    request_id = _wait_phase(fake_engine, started_before, phase)
    conn.close()
    _wait_aborted(fake_engine, request_id)
    assert fake_engine.core.scheduler.requests == {}
    fake_engine.queue_s = fake_engine.prefill_s = 0.0
    with httpx.Client(base_url=live, timeout=30) as client:
        samples = metric_samples(client.get("/metrics").text)
        later = client.post("/v1/chat/completions", json=chat_body(max_tokens=2)).json()["id"]
        _wait(
            lambda: any(line["gen_ai"]["response"]["id"] == later for line in _access_lines(caplog)),
            "the later request's access line",
        )
    lines = [line for line in _access_lines(caplog) if line["gen_ai"]["response"]["id"] == request_id]
    assert len(lines) == 1
    assert lines[0]["http"]["response"]["status_code"] == 499
    assert (lines[0]["kvscope"]["phase"], lines[0]["kvscope"]["outcome"]) == (phase, "client_disconnected")
    prompt_tokens = sample(samples, "kvscope_engine_prompt_tokens_total", model="fake-model")
    assert prompt_tokens == (20 if phase == "decode" else 0)  # an abandoned prefill counts no prompt tokens
