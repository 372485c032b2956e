"""The gateway in front of fake upstreams of each kind (kvscope/testing/fake_upstream.py ``kind``): the log
line's ``kvscope.engine`` / ``kvscope.upstream`` hold what that kind reports per request and what its
``/metrics`` showed, and the client span's children say where their times came from."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvscope.gateway.app import create_app
from kvscope.gateway.settings import load_settings
from kvscope.testing.fake_upstream import FakeUpstream
from kvscope.testing.harness import GatewayThread, LoopThread, records_by_id, start_fake_thread

HI = [{"role": "user", "content": "hi there"}]
KINDS = {"llamacpp": "llama-model", "tgi": "tgi-model", "vllm": "vllm-model"}


@dataclass
class Kinds:
    gateway: GatewayThread
    fakes: dict[str, FakeUpstream]
    exporter: InMemorySpanExporter
    log: Path

    def post(self, model: str, rid: str, **body: object) -> httpx.Response:
        payload = {"model": model, "messages": HI, "max_tokens": 4, **body}
        return httpx.post(
            self.gateway.url + "/v1/chat/completions", json=payload, headers={"x-request-id": rid}, timeout=10
        )

    def record(self, rid: str) -> dict:
        return records_by_id(self.log, [rid])[rid][0]


@pytest.fixture(scope="module")
def kinds(loop: LoopThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kinds]:
    tmp = tmp_path_factory.mktemp("kinds")
    fakes = {
        kind: start_fake_thread(loop, (model,), kind=kind, first_token_delay_s=0.05, token_delay_s=0.01)
        for kind, model in KINDS.items()
    }
    config = {
        "upstreams": [{"url": f.url} for f in fakes.values()],
        "routing": {"health_interval_s": 0.2},
        "upstream_metrics": {"interval_s": 0.2, "idle_interval_s": 0.2, "timeout_s": 0.2},
        "logs": {"file": str(tmp / "requests.jsonl")},
    }
    exporter = InMemorySpanExporter()
    gateway = GatewayThread(create_app(load_settings(None, config, env={}), span_exporter=exporter))
    with gateway:
        deadline = time.monotonic() + 10
        want = {f.url: kind for kind, f in fakes.items()}
        while {r.url: r.kind.value for r in gateway.state.pool.replicas} != want or any(
            r.engine_sample is None for r in gateway.state.pool.replicas
        ):
            assert time.monotonic() < deadline, "kinds and first samples not in within 10 s"
            time.sleep(0.05)
        yield Kinds(gateway, fakes, exporter, tmp / "requests.jsonl")
    for fake in fakes.values():
        loop.run(fake.close())


def _children(exporter: InMemorySpanExporter, trace_id: str) -> dict[str, dict]:
    spans = [
        s
        for s in exporter.get_finished_spans()
        if s.context is not None and f"{s.context.trace_id:032x}" == trace_id
    ]
    return {s.name: dict(s.attributes or {}) for s in spans if s.name in ("queue", "prefill", "decode")}


def test_llamacpp_json_answer_logs_its_timings_ttft_and_samples(kinds: Kinds) -> None:
    answer = kinds.post("llama-model", "k-llama-json")
    assert answer.status_code == 200, answer.text
    timings = answer.json()["timings"]
    record = kinds.record("k-llama-json")
    kv = record["kvscope"]
    engine, upstream = kv["engine"], kv["upstream"]
    assert (upstream["kind"], upstream["kind_source"]) == ("llamacpp", "models")
    assert (engine["prefill_s"], engine["decode_s"]) == (
        timings["prompt_ms"] / 1000,
        timings["predicted_ms"] / 1000,
    )
    assert engine["tpot_s"] == timings["predicted_ms"] / 1000 / (timings["predicted_n"] - 1)
    assert kv["tpot_s"] == engine["tpot_s"]
    assert 0 < kv["ttft_s"] < kv["e2e_s"] - engine["decode_s"]
    assert upstream["sources"]["ttft_s"] == "per_request"
    assert upstream["sources"]["prefill_s"] == upstream["sources"]["decode_s"] == "per_request"
    assert upstream["sources"]["queue_s"] is None
    assert upstream["sampled"]["arrival"] is not None and upstream["sampled"]["finish"] is not None
    assert engine["running_on_arrival"] == upstream["sampled"]["arrival"]["requests_running"]
    # KV usage from its /slots (current llama-servers export none in /metrics)
    assert engine["kv_cache_usage"] == upstream["sampled"]["finish"]["kv_cache_usage"] is not None
    assert upstream["sources"]["kv_cache_usage"] == "sampled"
    assert record["gen_ai"]["response"]["id"] == answer.json()["id"]
    children = _children(kinds.exporter, record["trace"]["id"])
    assert children == {
        "prefill": {"kvscope.timing.source": "per_request"},
        "decode": {"kvscope.timing.source": "per_request"},
    }


def test_llamacpp_stream_keeps_the_measured_ttft(kinds: Kinds) -> None:
    with httpx.stream(
        "POST",
        kinds.gateway.url + "/v1/chat/completions",
        json={"model": "llama-model", "messages": HI, "max_tokens": 4, "stream": True,
              "stream_options": {"include_usage": True}},
        headers={"x-request-id": "k-llama-stream"},
        timeout=10,
    ) as response:  # fmt: skip
        events = [line for line in response.iter_lines() if line.startswith("data: {")]
    timings = json.loads(events[-1][6:])["timings"]
    kv = kinds.record("k-llama-stream")["kvscope"]
    assert kv["upstream"]["sources"]["ttft_s"] == "gateway"
    assert (kv["engine"]["prefill_s"], kv["engine"]["decode_s"]) == (
        timings["prompt_ms"] / 1000,
        timings["predicted_ms"] / 1000,
    )


def test_tgi_json_answer_logs_its_queue_time_only(kinds: Kinds) -> None:
    answer = kinds.post("tgi-model", "k-tgi-json")
    assert answer.status_code == 200, answer.text
    kv = kinds.record("k-tgi-json")["kvscope"]
    finished = kinds.fakes["tgi"].engine.finished[-1]
    assert kv["engine"]["queue_s"] == int(finished.queue_s * 1e3) / 1000
    assert (kv["engine"]["prefill_s"], kv["engine"]["decode_s"], kv["ttft_s"]) == (None, None, None)
    assert kv["upstream"]["kind"] == "tgi"
    assert kv["upstream"]["sources"]["queue_s"] == "per_request"
    assert kv["upstream"]["sources"]["batch_size"] == "sampled"


def test_vllm_stream_logs_cached_tokens_and_sampled_state(kinds: Kinds) -> None:
    with httpx.stream(
        "POST",
        kinds.gateway.url + "/v1/chat/completions",
        json={
            "model": "vllm-model",
            "messages": HI,
            "max_tokens": 4,
            "stream": True,
            "fake": {"cached_tokens": 2},
        },
        headers={"x-request-id": "k-vllm-stream"},
        timeout=10,
    ) as response:
        assert response.status_code == 200
        response.read()
    record = kinds.record("k-vllm-stream")
    kv = record["kvscope"]
    assert (kv["upstream"]["kind"], kv["upstream"]["kind_source"]) == ("vllm", "models")
    assert kv["engine"]["cached_tokens"] == record["gen_ai"]["usage"]["cache_read"]["input_tokens"] == 2
    assert kv["upstream"]["sources"] == {
        "ttft_s": "gateway",
        "tpot_s": "gateway",
        "queue_s": None,
        "prefill_s": None,
        "decode_s": None,
        "cached_tokens": "per_request",
        "batch_size": "sampled",
        "kv_cache_usage": "sampled",
        "queue_ahead": "sampled",
    }
    children = _children(kinds.exporter, record["trace"]["id"])
    assert children == {
        "prefill": {"kvscope.timing.source": "gateway"},
        "decode": {"kvscope.timing.source": "gateway"},
    }


def test_llamacpp_context_error_is_relayed_and_logged_by_its_type(kinds: Kinds) -> None:
    """llama.cpp's 400 carries ``code: 400`` (a number) and the error's name in ``type``: the log's
    ``error.type`` was the integer 400 before, where the name says what went wrong."""
    words = " ".join(["w"] * 2049)  # the fake's context: 2048 words
    answer = kinds.post("llama-model", "k-llama-ctx", messages=[{"role": "user", "content": words}])
    assert answer.status_code == 400
    assert answer.json() == {
        "error": {
            "code": 400,
            "message": "request (2049 tokens) exceeds the available context size (2048 tokens), "
            "try increasing it",
            "type": "exceed_context_size_error",
            "n_prompt_tokens": 2049,
            "n_ctx": 2048,
        }
    }
    record = kinds.record("k-llama-ctx")
    assert record["error"] == {
        "type": "exceed_context_size_error",
        "message": answer.json()["error"]["message"],
    }
    assert record["kvscope"]["upstream"]["kind"] == "llamacpp"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_every_llamacpp_line_has_what_issue_38_asks(loop: LoopThread, tmp_path: Path, stream: bool) -> None:
    """Issue 38's "Done when" on the llama.cpp fake (its answers, ``/metrics`` and ``/slots`` as the recorded
    llama-server writes them), JSON and streamed: the line has TTFT, prefill and decode, cached tokens, and
    batch size and KV usage with their samples' ages, each value the one the upstream reported or showed.
    One request straight to the fake first leaves its slot's cache, as llama-server's idle slot keeps it;
    the gateway scrapes once, at its start (60 s intervals), so both stamps are that one sample."""
    fake = start_fake_thread(
        loop, ("llama-model",), kind="llamacpp", slots=1, first_token_delay_s=0.02, token_delay_s=0.005
    )
    primed = httpx.post(
        fake.url + "/v1/chat/completions", json={"model": "llama-model", "messages": HI, "max_tokens": 4}
    )
    assert primed.status_code == 200, primed.text
    (slot,) = httpx.get(fake.url + "/slots").json()
    assert (slot["is_processing"], slot["n_ctx"]) == (False, 2048)
    kv_usage = slot["n_prompt_tokens"] / 2048  # the idle slot's kept cache: what /slots says is in use
    assert kv_usage > 0
    config = {
        "upstreams": [{"url": fake.url}],
        "routing": {"health_interval_s": 60},
        "upstream_metrics": {"interval_s": 60, "idle_interval_s": 60, "timeout_s": 1},
        "logs": {"file": str(tmp_path / "requests.jsonl")},
    }
    words = [{"role": "user", "content": "name three colours of the rainbow please"}]  # 7 prompt tokens
    body: dict = {"model": "llama-model", "messages": words, "max_tokens": 4, "stream": stream}
    if stream:  # the client sees the usage chunk (and its timings) only when it asks
        body["stream_options"] = {"include_usage": True}
    try:
        with GatewayThread(create_app(load_settings(None, config, env={}))) as gateway:
            body["fake"] = {"cached_tokens": 3}
            headers = {"x-request-id": "asked"}
            if stream:
                with httpx.stream(
                    "POST", gateway.url + "/v1/chat/completions", json=body, headers=headers, timeout=10
                ) as response:
                    assert response.status_code == 200
                    chunks = [json.loads(x[6:]) for x in response.iter_lines() if x.startswith("data: {")]
                timings = chunks[-1]["timings"]
            else:
                answer = httpx.post(
                    gateway.url + "/v1/chat/completions", json=body, headers=headers, timeout=10
                )
                assert answer.status_code == 200, answer.text
                timings = answer.json()["timings"]
            record = records_by_id(tmp_path / "requests.jsonl", ["asked"])["asked"][0]
    finally:
        loop.run(fake.close())
    kv = record["kvscope"]
    assert (timings["cache_n"], timings["prompt_n"], timings["predicted_n"]) == (3, 4, 4)
    assert kv["engine"] == {
        "queue_s": None,  # llama.cpp does not time the wait for a slot
        "ttft_s": None,  # nor its arrival: the TTFT is the gateway's (kvscope.ttft_s)
        "prefill_s": timings["prompt_ms"] / 1000,
        "decode_s": timings["predicted_ms"] / 1000,
        "tpot_s": timings["predicted_ms"] / 1000 / 3,
        "prompt_tokens": 7,
        "cached_tokens": 3,
        "batch_size_mean": 0.0,
        "batch_size_max": 0,
        "kv_cache_usage": kv_usage,
        "queue_ahead": 0,
        "running_on_arrival": 0,
    }
    assert record["gen_ai"]["usage"]["cache_read"]["input_tokens"] == 3
    assert isinstance(kv["ttft_s"], float) and 0 < kv["ttft_s"] < kv["e2e_s"]
    upstream = kv["upstream"]
    assert upstream["sources"] == {
        "ttft_s": "gateway" if stream else "per_request",
        "tpot_s": "gateway" if stream else "per_request",
        "queue_s": None,
        "prefill_s": "per_request",
        "decode_s": "per_request",
        "cached_tokens": "per_request",
        "batch_size": "sampled",
        "kv_cache_usage": "sampled",
        "queue_ahead": "sampled",
    }
    arrival, finish = upstream["sampled"]["arrival"], upstream["sampled"]["finish"]
    state = {"requests_running": 0, "requests_waiting": 0, "kv_cache_usage": kv_usage}
    assert {k: v for k, v in arrival.items() if k != "age_s"} == state
    assert {k: v for k, v in finish.items() if k != "age_s"} == state
    # the one start-up sample, stamped at the attempt's start and end: older at its end
    assert 0 < arrival["age_s"] < finish["age_s"]
