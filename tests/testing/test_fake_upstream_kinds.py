"""The fake upstream's ``kind`` knob (kvscope/testing/fake_upstream.py, upstream_kinds.py): each kind answers
what that server answers (cards, Prometheus text, llama.cpp's /props, /slots and ``timings`` with exactly the
keys the real llama-server sent, TGI's /info and timing headers, vLLM's /version), with values from the fake's
own running/waiting requests and delays."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvscope.dashboards.engine_names import ENGINE_EQUIVALENTS
from kvscope.gateway.engines.samples import EngineSample, sample_from_slots
from kvscope.testing.fake_upstream import FakeUpstream
from kvscope.testing.harness import LoopThread, metric_samples, sample, sse_events, start_fake_thread
from kvscope.testing.upstream_kinds import KINDS, tgi_duration_buckets

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "upstreams"
CHAT = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "hello there world"}],
    "max_tokens": 5,
}


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    loop = LoopThread()
    yield loop
    loop.stop()


def fake(loop: LoopThread, kind: str, **kw: Any) -> FakeUpstream:
    return start_fake_thread(loop, kind=kind, **kw)


def families(text: str) -> dict[str, str]:
    """Family name -> type, parsed by prometheus_client."""
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def test_every_kind_names_itself_in_its_model_card_as_that_server_does(loop: LoopThread) -> None:
    cards = {}
    for kind in KINDS:
        up = fake(loop, kind)
        cards[kind] = httpx.get(up.url + "/v1/models").json()["data"][0]
        loop.run(up.close())
    assert {kind: card["owned_by"] for kind, card in cards.items()} == {
        "kvscope": "kvscope",
        "vllm": "vllm",
        "sglang": "sglang",
        "llamacpp": "llamacpp",
        "tgi": "fake-model",  # TGI writes the model id there
        "openai": "system",
    }
    assert cards["kvscope"] == {
        "id": "fake-model",
        "object": "model",
        "created": 0,
        "owned_by": "kvscope",
        "max_model_len": 2048,
    }
    created = cards["vllm"]["created"]
    assert cards["vllm"] == {
        "id": "fake-model",
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": "fake-model",
        "parent": None,
        "max_model_len": 2048,
        "permission": [
            {
                "id": f"modelperm-{created:x}",
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }
    assert sorted(cards["sglang"]) == ["created", "id", "max_model_len", "object", "owned_by", "root"]
    assert cards["tgi"] == {"id": "fake-model", "object": "model", "created": 0, "owned_by": "fake-model"}


def test_each_kind_answers_only_its_own_extra_paths(loop: LoopThread) -> None:
    statuses = {}
    for kind in KINDS:
        up = fake(loop, kind)
        statuses[kind] = {
            path: httpx.get(up.url + path).status_code
            for path in ("/metrics", "/version", "/info", "/props", "/slots")
        }
        loop.run(up.close())
    ok = {
        "kvscope": {"/metrics"},
        "vllm": {"/metrics", "/version"},
        "sglang": {"/metrics"},
        "llamacpp": {"/metrics", "/props", "/slots"},
        "tgi": {"/metrics", "/info"},
        "openai": set(),
    }
    assert statuses == {
        kind: {path: 200 if path in ok[kind] else 404 for path in statuses[kind]} for kind in KINDS
    }


def test_vllm_version_and_tgi_info(loop: LoopThread) -> None:
    vllm, tgi = fake(loop, "vllm"), fake(loop, "tgi", slots=4)
    try:
        assert httpx.get(vllm.url + "/version").json() == {"version": "0.11.0"}
        assert httpx.get(tgi.url + "/info").json() == {
            "model_id": "fake-model",
            "model_sha": None,
            "model_pipeline_tag": "text-generation",
            "max_concurrent_requests": 4,
            "max_best_of": 2,
            "max_stop_sequences": 4,
            "max_input_tokens": 2047,
            "max_total_tokens": 2048,
            "validation_workers": 2,
            "max_client_batch_size": 4,
            "router": "text-generation-router",
            "version": "3.3.6-dev0",
            "sha": None,
            "docker_label": None,
        }
    finally:
        loop.run(vllm.close())
        loop.run(tgi.close())


def test_a_plain_openai_server_has_no_metrics(loop: LoopThread) -> None:
    up = fake(loop, "openai")
    try:
        resp = httpx.get(up.url + "/metrics")
        assert (resp.status_code, resp.json()["error"]["code"]) == (404, "not_found")
    finally:
        loop.run(up.close())


def held_pair(loop: LoopThread, up: FakeUpstream, gate: str) -> list[threading.Thread]:
    """Two requests to a one-slot fake: the first holds the slot (its token 0 waits for ``{gate}/0``), the
    second waits for it. Returns their threads, started; the fake's state is then 1 running, 1 waiting."""
    body = {**CHAT, "fake": {"hold": gate}}
    threads = [
        threading.Thread(target=lambda: httpx.post(up.url + "/v1/chat/completions", json=body, timeout=30))
    ]
    threads[0].start()
    wait_for(lambda: len(up.engine.running) == 1)
    threads.append(
        threading.Thread(target=lambda: httpx.post(up.url + "/v1/chat/completions", json=body, timeout=30))
    )
    threads[1].start()
    wait_for(lambda: up.engine.waiting == 1)
    return threads


def wait_for(condition: Any, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.005)


def release_pair(up: FakeUpstream, gate: str, threads: list[threading.Thread]) -> None:
    up.release(f"{gate}/0")  # both requests pass the same gate: the first, then the second in its slot
    for thread in threads:
        thread.join(30)


@pytest.mark.parametrize(
    ("kind", "running", "waiting", "usage"),
    [
        ("vllm", "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"),
        ("sglang", "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"),
        ("kvscope", "kvscope_engine_requests_running", "kvscope_engine_requests_waiting",
         "kvscope_engine_kv_cache_usage_ratio"),
        ("tgi", "tgi_batch_current_size", "tgi_queue_size", None),
    ],
)  # fmt: skip
def test_metrics_show_the_fakes_running_and_waiting_requests(
    loop: LoopThread, kind: str, running: str, waiting: str, usage: str | None
) -> None:
    up = fake(loop, kind, slots=1)
    try:
        threads = held_pair(loop, up, f"{kind}-busy")
        busy = httpx.get(up.url + "/metrics").text
        release_pair(up, f"{kind}-busy", threads)
        idle = httpx.get(up.url + "/metrics").text
    finally:
        loop.run(up.close())

    def values(text: str) -> list[float]:
        samples = {name: value for (name, _), value in metric_samples(text).items()}
        return [samples[name] for name in (running, waiting, *([usage] if usage else []))]

    # "hello there world": 3 prompt tokens, no output yet: 1 of 64 blocks
    assert values(busy) == [1.0, 1.0, *([1 / 64] if usage else [])]
    assert values(idle) == [0.0, 0.0, *([0.0] if usage else [])]


def test_vllm_and_sglang_metrics_have_every_series_the_mapping_names(loop: LoopThread) -> None:
    """Every vLLM series docs/metrics.md maps to ours (dashboards/engine_names.py ENGINE_EQUIVALENTS) is in
    the vLLM-kind fake's /metrics, so the vLLM engine dashboard shows every panel over it; the SGLang ones
    too but for those SGLang writes only with options the fake does not model."""
    texts = {}
    for kind in ("vllm", "sglang"):
        up = fake(loop, kind)
        httpx.post(up.url + "/v1/chat/completions", json={**CHAT, "fake": {"token_delay_s": 0.001}})
        texts[kind] = httpx.get(up.url + "/metrics").text
        loop.run(up.close())
    for kind, missing in (("vllm", set()), ("sglang", SGLANG_NOT_MODELLED)):
        mapped = {s for e in ENGINE_EQUIVALENTS.values() if kind in e and (s := e[kind].series) is not None}
        text = texts[kind]
        exported = {s.name for f in text_string_to_metric_families(text) for s in f.samples} | set(
            families(text)
        )
        assert mapped and mapped - exported == missing, (kind, sorted(mapped - exported))


SGLANG_NOT_MODELLED = {
    "sglang:num_retracted_requests_total",  # retractions: the fake never runs out of KV blocks
    "sglang:num_so_requests_total",  # structured output: the fake has no grammars
    "sglang:grammar_compilation_time_seconds",
    "sglang:prompt_tokens_histogram",  # these two only with --collect-tokens-histogram
    "sglang:generation_tokens_histogram",
}


def test_vllm_histograms_hold_the_finished_requests_phases(loop: LoopThread) -> None:
    up = fake(loop, "vllm", slots=1)
    try:
        threads = held_pair(loop, up, "phases")
        release_pair(up, "phases", threads)
        knobs = {"first_token_delay_s": 0.02, "token_delay_s": 0.01, "cached_tokens": 2}
        httpx.post(up.url + "/v1/chat/completions", json={**CHAT, "fake": knobs})
        s = metric_samples(httpx.get(up.url + "/metrics").text)
    finally:
        loop.run(up.close())
    lab = {"model_name": "fake-model", "engine": "0"}
    assert sample(s, "vllm:request_success_total", **lab, finished_reason="length") == 3
    assert sample(s, "vllm:prompt_tokens_total", **lab) == 9
    assert sample(s, "vllm:generation_tokens_total", **lab) == 15
    assert sample(s, "vllm:prefix_cache_hits_total", **lab) == 2
    assert sample(s, "vllm:request_prefill_time_seconds_sum", **lab) == pytest.approx(0.02)
    assert sample(s, "vllm:request_decode_time_seconds_sum", **lab) == pytest.approx(0.04)
    assert sample(s, "vllm:inter_token_latency_seconds_count", **lab) == 12  # 4 gaps x 3 requests
    assert sample(s, "vllm:request_time_per_output_token_seconds_sum", **lab) == pytest.approx(0.01)
    # the second request waited for the first one's slot: one queue time above 0
    queued = sample(s, "vllm:request_queue_time_seconds_sum", **lab)
    assert queued > 0 and sample(s, "vllm:request_queue_time_seconds_count", **lab) == 3


def test_sglang_and_tgi_metric_texts_parse_with_their_types(loop: LoopThread) -> None:
    texts = {}
    for kind in ("sglang", "tgi"):
        up = fake(loop, kind)
        httpx.post(up.url + "/v1/chat/completions", json=CHAT)
        texts[kind] = httpx.get(up.url + "/metrics").text
        loop.run(up.close())
    assert families(texts["sglang"]) == {
        "sglang:num_running_reqs": "gauge",
        "sglang:num_used_tokens": "gauge",
        "sglang:token_usage": "gauge",
        "sglang:gen_throughput": "gauge",
        "sglang:num_queue_reqs": "gauge",
        "sglang:cache_hit_rate": "gauge",
        "sglang:max_total_num_tokens": "gauge",
        "sglang:queue_time_seconds": "histogram",
        "sglang:prompt_tokens": "counter",
        "sglang:generation_tokens": "counter",
        "sglang:cached_tokens": "counter",
        "sglang:num_requests": "counter",
        "sglang:num_aborted_requests": "counter",
        "sglang:time_to_first_token_seconds": "histogram",
        "sglang:inter_token_latency_seconds": "histogram",
        "sglang:e2e_request_latency_seconds": "histogram",
    }
    tgi = families(texts["tgi"])
    assert tgi["tgi_queue_size"] == tgi["tgi_batch_current_size"] == "gauge"
    assert tgi["tgi_request_success"] == "counter" and tgi["tgi_request_queue_duration"] == "histogram"
    s = metric_samples(texts["tgi"])
    assert sample(s, "tgi_request_success_total") == 1 and sample(s, "tgi_batch_max_total_tokens") == 1024
    assert len([k for k in s if k[0] == "tgi_request_duration_bucket"]) == 36  # 35 bounds and +Inf
    assert tgi_duration_buckets()[0] == pytest.approx(0.00015)


def test_tgi_sets_timing_headers_on_non_streamed_answers_only(loop: LoopThread) -> None:
    up = fake(loop, "tgi")
    knobs = {"first_token_delay_s": 0.05, "token_delay_s": 0.01}
    try:
        plain = httpx.post(up.url + "/v1/chat/completions", json={**CHAT, "fake": knobs})
        completion = httpx.post(
            up.url + "/v1/completions",
            json={"model": "fake-model", "prompt": "one two", "max_tokens": 3, "fake": knobs},
        )
        with httpx.stream("POST", up.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as stream:
            stream_headers = dict(stream.headers)
            stream.read()
    finally:
        loop.run(up.close())
    timing = {k: v for k, v in plain.headers.items() if k.startswith("x-")}
    compute_time = float(timing.pop("x-compute-time"))
    assert 0.09 <= compute_time < 0.2  # queue (measured, about 0) + inference
    assert timing == {
        "x-compute-type": "gpu+optimized",
        "x-compute-characters": "17",
        "x-total-time": timing["x-total-time"],
        "x-validation-time": "0",
        "x-queue-time": "0",
        "x-inference-time": "90",  # prefill 50 ms + 4 gaps of 10 ms
        "x-time-per-token": "18",  # inference / 5 generated tokens
        "x-prompt-tokens": "3",
        "x-generated-tokens": "5",
    }
    assert int(timing["x-total-time"]) in (90, 91)
    assert "x-compute-time" not in completion.headers  # /v1/completions sums its prompts' headers
    assert (completion.headers["x-inference-time"], completion.headers["x-time-per-token"]) == ("70", "23")
    assert {k: v for k, v in stream_headers.items() if k.startswith("x-")} == {
        "x-compute-type": "gpu+optimized",
        "x-compute-characters": "17",
        "x-accel-buffering": "no",
    }
    assert "prompt_tokens_details" not in plain.json()["usage"]


def test_tgi_queue_time_header_measures_the_wait_for_a_slot(loop: LoopThread) -> None:
    up = fake(loop, "tgi", slots=1)
    answers: list[httpx.Response] = []
    body = {**CHAT, "fake": {"hold": "q"}}
    try:
        first = threading.Thread(
            target=lambda: answers.append(httpx.post(up.url + "/v1/chat/completions", json=body))
        )
        first.start()
        wait_for(lambda: len(up.engine.running) == 1)
        second = threading.Thread(
            target=lambda: answers.append(httpx.post(up.url + "/v1/chat/completions", json=body))
        )
        second.start()
        wait_for(lambda: up.engine.waiting == 1)
        threading.Event().wait(0.05)
        up.release("q/0")
        first.join(10)
        second.join(10)
    finally:
        loop.run(up.close())
    queued = sorted(int(a.headers["x-queue-time"]) for a in answers)
    assert queued[0] == 0 and queued[1] >= 50


def test_the_default_kind_answers_as_before(loop: LoopThread) -> None:
    up = start_fake_thread(loop)
    try:
        assert httpx.get(up.url + "/health").json() == {}
        body = httpx.post(up.url + "/v1/chat/completions", json=CHAT).json()
    finally:
        loop.run(up.close())
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 5,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "t0 t1 t2 t3 t4 "}


# --- llama.cpp: the fake against the recording (tests/fixtures/upstreams/llamacpp/) -------------------------
LLAMA = FIXTURES / "llamacpp"


def paths(obj: Any, prefix: str = "") -> set[str]:
    """Every key path of a JSON value: ``a.b``, list items as ``a[].b`` (the union over the items)."""
    if isinstance(obj, dict):
        out = set()
        for key, value in obj.items():
            out |= {f"{prefix}{key}"} | paths(value, f"{prefix}{key}.")
        return out
    if isinstance(obj, list):
        return set().union(*(paths(item, prefix.rstrip(".") + "[].") for item in obj)) if obj else set()
    return set()


def recorded(name: str) -> Any:
    return json.loads((LLAMA / name).read_text())


def recorded_events(name: str) -> list[dict[str, Any]]:
    return [json.loads(e) for e in sse_events((LLAMA / name).read_bytes()) if e != "[DONE]"]


def stream_events(up: FakeUpstream, path: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], Any]:
    with httpx.stream("POST", up.url + path, json={**body, "stream": True}) as resp:
        raw = resp.read()
        headers = resp.headers
    return [json.loads(e) for e in sse_events(raw) if e != "[DONE]"], headers


@pytest.fixture(scope="module")
def llama(loop: LoopThread) -> Iterator[FakeUpstream]:
    up = fake(loop, "llamacpp", slots=2)
    yield up
    loop.run(up.close())


PROMPT = {"model": "fake-model", "prompt": "one two", "max_tokens": 3}


def test_llamacpp_non_streamed_answers_have_exactly_the_recorded_keys_in_order(llama: FakeUpstream) -> None:
    chat = httpx.post(llama.url + "/v1/chat/completions", json=CHAT)
    text = httpx.post(llama.url + "/v1/completions", json=PROMPT).json()
    for answer, name in ((chat.json(), "chat.json"), (text, "completions.json")):
        assert list(answer) == list(recorded(name))
        assert paths(answer) == paths(recorded(name))
    assert chat.headers["content-type"] == "application/json; charset=utf-8"
    assert chat.headers["server"] == "llama.cpp"
    assert chat.json()["system_fingerprint"] == recorded("chat.json")["system_fingerprint"] == "b1-0c1e570"


def test_llamacpp_streams_have_the_recorded_events(llama: FakeUpstream) -> None:
    """Chat: the role with the first token, one chunk per token, the finish chunk with ``timings``; with
    ``include_usage`` a usage chunk after it carries ``timings`` instead. Text: the last chunk carries
    usage (always) and ``timings``."""
    cases = [
        ("/v1/chat/completions", CHAT, "chat_stream.sse"),
        (
            "/v1/chat/completions",
            {**CHAT, "stream_options": {"include_usage": True}},
            "chat_stream_usage.sse",
        ),
        ("/v1/completions", PROMPT, "completions_stream.sse"),
    ]
    for path, body, name in cases:
        events, headers = stream_events(llama, path, body)
        want = recorded_events(name)
        # role (chat), tokens, then the final event(s): the same sequence of key sets as recorded
        kinds_of = [(list(e), sorted(paths(e))) for e in events]
        recorded_kinds = [(list(e), sorted(paths(e))) for e in want]
        assert kinds_of[0] == recorded_kinds[0] and kinds_of[-1] == recorded_kinds[-1], name
        assert {str(k) for k in kinds_of} == {str(k) for k in recorded_kinds}, name
        assert ["timings" in e for e in events].count(True) == 1 and "timings" in events[-1]
        assert headers["x-accel-buffering"] == "no"


def test_llamacpp_timings_come_from_the_fakes_delays(llama: FakeUpstream) -> None:
    """prompt_ms = the prefill delay; predicted_ms = first to last token (4 gaps of 10 ms), per token over
    the 4 decode steps; a cached prefix of 2 of the 3 prompt tokens leaves 1 to evaluate."""
    knobs = {"first_token_delay_s": 0.05, "token_delay_s": 0.01, "cached_tokens": 2}
    body = httpx.post(llama.url + "/v1/chat/completions", json={**CHAT, "fake": knobs}).json()
    events, _ = stream_events(llama, "/v1/chat/completions", {**CHAT, "fake": knobs})
    want = {
        "cache_n": 2,
        "prompt_n": 1,
        "prompt_ms": 50.0,
        "prompt_per_token_ms": 50.0,
        "prompt_per_second": 20.0,
        "predicted_n": 5,
        "predicted_ms": 40.0,
        "predicted_per_token_ms": 10.0,
        "predicted_per_second": 100.0,
    }
    assert body["timings"] == events[-1]["timings"] == want
    assert body["usage"] == {
        "completion_tokens": 5,
        "prompt_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    full_hit = httpx.post(llama.url + "/v1/chat/completions", json={**CHAT, "fake": {"cached_tokens": 3}})
    assert (full_hit.json()["timings"]["cache_n"], full_hit.json()["timings"]["prompt_n"]) == (2, 1)


def test_llamacpp_props_models_health_and_metrics_have_the_recorded_shapes(llama: FakeUpstream) -> None:
    props = httpx.get(llama.url + "/props").json()
    assert list(props) == list(recorded("props.json")) and paths(props) == paths(recorded("props.json"))
    assert (props["total_slots"], props["default_generation_settings"]["n_ctx"]) == (2, 2048)
    models = httpx.get(llama.url + "/v1/models").json()
    assert paths(models) == paths(recorded("models.json"))
    assert models["data"][0]["owned_by"] == "llamacpp" and models["data"][0]["meta"]["n_ctx"] == 2048
    assert httpx.get(llama.url + "/health").json() == recorded("health.json") == {"status": "ok"}
    metrics = httpx.get(llama.url + "/metrics")
    assert families(metrics.text) == families((LLAMA / "metrics.txt").read_text())
    assert metrics.headers["content-type"] == "text/plain; version=0.0.4"


def test_llamacpp_slots_and_metrics_show_a_busy_slot_and_a_deferred_request(loop: LoopThread) -> None:
    up = fake(loop, "llamacpp", slots=1)
    try:
        threads = held_pair(loop, up, "llama-busy")
        slots = httpx.get(up.url + "/slots").json()
        busy = metric_samples(httpx.get(up.url + "/metrics").text)
        release_pair(up, "llama-busy", threads)
        idle_slots = httpx.get(up.url + "/slots").json()
        done = metric_samples(httpx.get(up.url + "/metrics").text)
    finally:
        loop.run(up.close())
    recorded_busy = next(s for s in recorded("slots_busy.json") if s["is_processing"])
    assert paths(slots[0]) == paths(recorded_busy)
    assert {k: slots[0][k] for k in ("is_processing", "n_prompt_tokens", "n_prompt_tokens_processed")} == {
        "is_processing": True,
        "n_prompt_tokens": 3,
        "n_prompt_tokens_processed": 3,
    }
    assert slots[0]["next_token"] == [
        {"has_next_token": True, "has_new_line": False, "n_remain": 5, "n_decoded": 0}
    ]
    # idle again, the slot shows its last task as the server's reset() leaves it, with the cache it keeps:
    # the prompt and the generated tokens but the last (3 + 5 - 1)
    recorded_idle = next(s for s in recorded("slots_busy.json") if not s["is_processing"])
    assert list(idle_slots[0]) == list(recorded_idle) and paths(idle_slots[0]) == paths(recorded_idle)
    assert {k: v for k, v in idle_slots[0].items() if k != "params"} == {
        "id": 0,
        "n_ctx": 2048,
        "speculative": False,
        "is_processing": False,
        "id_task": 1,
        "n_prompt_tokens": 7,
        "n_prompt_tokens_processed": 0,
        "n_prompt_tokens_cache": 0,
        "next_token": [{"has_next_token": False, "has_new_line": False, "n_remain": -1, "n_decoded": 0}],
    }
    # what the gateway reads from them (gateway/engines/samples.py): busy slots, KV usage, capacity
    assert sample_from_slots(slots, at=0.0) == EngineSample(0.0, 1.0, None, 3 / 2048, 2048)
    assert sample_from_slots(idle_slots, at=0.0) == EngineSample(0.0, 0.0, None, 7 / 2048, 2048)
    assert (sample(busy, "llamacpp:requests_processing"), sample(busy, "llamacpp:requests_deferred")) == (
        1,
        1,
    )
    assert sample(done, "llamacpp:tokens_predicted_total") == 10  # 5 tokens x 2 requests
    assert sample(done, "llamacpp:prompt_tokens_total") == 6
    assert sample(done, "llamacpp:n_decode_total") == 10
    assert (sample(done, "llamacpp:requests_processing"), sample(done, "llamacpp:requests_deferred")) == (
        0,
        0,
    )


def test_a_slot_never_used_shows_no_task(loop: LoopThread) -> None:
    up = fake(loop, "llamacpp", slots=2)
    try:
        slots = httpx.get(up.url + "/slots").json()
    finally:
        loop.run(up.close())
    assert slots == [{"id": i, "n_ctx": 2048, "speculative": False, "is_processing": False} for i in range(2)]
    assert list(slots[0]) == list(recorded("slots.json")[0])


def test_scrapes_are_counted_apart_from_the_records(loop: LoopThread) -> None:
    """What a gateway samples in the background never shows among the requests a test counts."""
    up = fake(loop, "llamacpp")
    try:
        for path in ("/metrics", "/slots", "/slots", "/props", "/version", "/info"):
            httpx.get(up.url + path)
        httpx.get(up.url + "/v1/models")
        counted = dict(httpx.get(up.url + "/_fake/scrapes").json())
        recorded_paths = [r["path"] for r in httpx.get(up.url + "/_fake/requests").json()]
    finally:
        loop.run(up.close())
    expected = {"/metrics": 1, "/slots": 2, "/props": 1, "/version": 1, "/info": 1}
    assert counted == dict(up.scrapes) == expected
    assert recorded_paths == [r.path for r in up.records] == ["/v1/models"]
