"""Case K2 (preemption is invisible) against a real engine server whose KV cache holds about two requests,
then S3's shutdown variant (SIGTERM fails running streams in-band) on the same server.

Scaled for a 2-core CPU: 8 concurrent greedy completions of 64 tokens (not 512) with 10 KV blocks of 16
tokens (each request needs 5: a 12-token prompt + 64 tokens), so the scheduler must preempt by recompute. The
reference is the 4 prompts two at a time, which fit without preemption (float32 greedy text does not depend on
the batch; tests/engine/test_llm_parity.py); the 8 concurrent requests are those prompts twice each.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.engine.server.e2e_support import (
    CHAT,
    COMPLETIONS,
    BackgroundStream,
    chat,
    completion,
    delta,
    line_by_http_id,
    log_line,
    wait_for,
)
from tests.engine.server.helpers import sample, start_engine

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(400)]
M = {"model": "smollm2-135m"}
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    process = start_engine(
        tmp_path_factory.mktemp("engine"),
        "--max-model-len",
        "128",
        "--num-blocks",
        "10",
        "--block-size",
        "16",
    )
    yield process
    process.stop()


def _body(i: int) -> dict:
    return completion(
        f"Request {i}: list the numbers from 1 upward:", max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0
    )


def test_k2_preemption_is_invisible(engine):
    """Eight concurrent requests on four prompts (each twice: a twin's recompute may also reuse the other's
    cached blocks) against the four prompts run two at a time."""
    with httpx.Client(base_url=engine.url, timeout=300) as client:
        with ThreadPoolExecutor(8) as pool:
            unpreempted = [
                r
                for k in (0, 2)
                for r in pool.map(lambda i: client.post(COMPLETIONS, json=_body(i)).json(), (k, k + 1))
            ]
            assert [r["kvscope"]["num_preemptions"] for r in unpreempted] == [0] * 4
            before = engine.metrics()
            together = list(pool.map(lambda i: client.post(COMPLETIONS, json=_body(i % 4)).json(), range(8)))
        after = wait_for(
            lambda: (
                (m := engine.metrics())
                and sample(m, "kvscope_engine_kv_cache_blocks", state="used", **M) == 0
                and m
            )
        )
        for reference, batched in zip(unpreempted * 2, together, strict=True):
            choice = batched["choices"][0]
            assert (choice["finish_reason"], batched["usage"]["completion_tokens"]) == ("length", MAX_TOKENS)
            assert choice["text"] == reference["choices"][0]["text"]
        preemptions = delta(before, after, "kvscope_engine_preemptions_total", **M)
        assert preemptions > 0
        lines = [log_line(engine, r["id"]) for r in together]
        assert sum(line["kvscope"]["num_preemptions"] for line in lines) == preemptions
        assert all(
            r["kvscope"]["num_preemptions"] == line["kvscope"]["num_preemptions"]
            for r, line in zip(together, lines, strict=True)
        )
        assert sample(after, "kvscope_engine_kv_cache_usage_ratio", **M) == 0.0
        assert client.post(CHAT, json=chat("hi", max_tokens=4)).status_code == 200


def test_shutdown_fails_running_streams_in_band(engine):
    """SIGTERM while a stream runs: the client gets ``data: {"error": …}`` (engine shutting down), no
    [DONE]."""
    run = BackgroundStream(
        engine.url, CHAT, chat("Tell me a long story.", max_tokens=60, ignore_eos=True), "shutdown-stream"
    )
    wait_for(lambda: run.data_events >= 3, 60)
    engine.proc.terminate()
    run.join(30)
    assert run.last_data is not None and run.last_data != "data: [DONE]"
    error = json.loads(run.last_data[len("data: ") :])["error"]
    assert "engine shutting down" in error["message"] and error["code"] == "engine_shutdown"
    assert engine.proc.wait(30) in (0, -15)  # uvicorn re-raises the captured SIGTERM after a clean shutdown
    line = line_by_http_id(engine, "shutdown-stream")
    assert (line["kvscope"]["outcome"], line["event"]["outcome"]) == ("error", "failure")
