"""Per-request reports (gateway/engines/reports.py) from each server's literal answer (payloads.py)."""

from __future__ import annotations

import httpx
import msgspec

from kvscope.gateway.engines.kinds import UpstreamKind
from kvscope.gateway.engines.reports import (
    UpstreamReport,
    report_from_body,
    report_from_headers,
    upstream_report,
)
from kvscope.gateway.proxy.relay import completion_outcome
from kvscope.gateway.sse import StreamState
from tests.gateway.engines.payloads import (
    LLAMACPP_CHAT,
    LLAMACPP_FINISH_CHUNK,
    LLAMACPP_LAST_CHUNK,
    LLAMACPP_TIMINGS,
    LLAMACPP_USAGE,
    SGLANG_USAGE,
    TGI_HEADERS,
    TGI_USAGE,
    VLLM_USAGE,
    VLLM_USAGE_NO_DETAILS,
)

K = UpstreamKind
USAGE_FIELDS = (
    "usage.prompt_tokens",
    "usage.completion_tokens",
    "usage.prompt_tokens_details.cached_tokens",
)
LLAMACPP = UpstreamReport(
    prefill_s=52.125 / 1000,
    decode_s=30.75 / 1000,
    tpot_s=30.75 / 1000 / 3,  # predicted_ms spans the 4 tokens' 3 intervals
    prompt_tokens=25,
    cached_tokens=9,
    output_tokens=4,
    source_fields=(
        "timings.prompt_ms",
        "timings.predicted_ms",
        "timings.predicted_n",
        "timings.cache_n",
        "timings.prompt_n",
        *USAGE_FIELDS,
    ),
)


def test_llamacpp_timings_of_a_json_answer() -> None:
    assert report_from_body(K.LLAMACPP, LLAMACPP_CHAT) == LLAMACPP
    # the gateway's JSON path keeps the timings object for it
    outcome = completion_outcome(msgspec.json.encode(LLAMACPP_CHAT), keep_text=False)
    assert outcome is not None and outcome.timings == LLAMACPP_TIMINGS


def test_llamacpp_timings_of_a_stream_come_with_its_usage_chunk() -> None:
    state = StreamState()
    for chunk in (LLAMACPP_FINISH_CHUNK, LLAMACPP_LAST_CHUNK):
        state.observe(chunk, client_wants_usage=False)
    assert (state.timings, state.usage) == (LLAMACPP_TIMINGS, LLAMACPP_USAGE)
    body = {"usage": state.usage, "kvscope": state.engine, "timings": state.timings}
    assert report_from_body(K.LLAMACPP, body) == LLAMACPP


def test_llamacpp_without_cache_n_or_usage() -> None:
    """Older servers send no ``cache_n``: the cached tokens come from usage, the prompt from usage only."""
    old = {k: v for k, v in LLAMACPP_TIMINGS.items() if k != "cache_n"}
    report = report_from_body(K.LLAMACPP, {"timings": old, "usage": LLAMACPP_USAGE})
    assert report is not None
    assert (report.prefill_s, report.cached_tokens, report.prompt_tokens) == (52.125 / 1000, 9, 25)
    alone = report_from_body(K.LLAMACPP, {"timings": {**LLAMACPP_TIMINGS, "predicted_n": 1}})
    assert alone is not None
    assert (alone.tpot_s, alone.output_tokens, alone.prompt_tokens) == (
        None,
        1,
        25,
    )  # 16 processed + 9 cached


def test_timings_name_their_server_whatever_the_kind() -> None:
    """A replica not detected yet (``openai`` until its first health check) still logs llama.cpp's timings;
    a ``timings`` object of another shape is not llama.cpp's."""
    assert report_from_body(UpstreamKind.OPENAI, LLAMACPP_CHAT) == LLAMACPP
    assert report_from_body(None, LLAMACPP_CHAT) == LLAMACPP
    other = {"timings": {"total_ms": 12.5}, "usage": {"prompt_tokens": 3}}
    assert report_from_body(UpstreamKind.VLLM, other) == UpstreamReport(
        prompt_tokens=3, source_fields=("usage.prompt_tokens",)
    )


def test_vllm_sglang_openai_cached_tokens() -> None:
    for kind, usage, cached in (
        (K.VLLM, VLLM_USAGE, 512),
        (K.SGLANG, SGLANG_USAGE, 32),
        (K.OPENAI, VLLM_USAGE, 512),
    ):
        report = report_from_body(kind, {"usage": usage})
        assert report == UpstreamReport(
            prompt_tokens=usage["prompt_tokens"],
            cached_tokens=cached,
            output_tokens=usage["completion_tokens"],
            source_fields=USAGE_FIELDS,
        )
    # vLLM without --enable-prompt-tokens-details: not reported, never 0
    report = report_from_body(K.VLLM, {"usage": VLLM_USAGE_NO_DETAILS})
    assert report is not None and report.cached_tokens is None
    assert report_from_body(K.VLLM, {"usage": None}) is None
    assert report_from_body(K.VLLM, {}) is None


def test_kvscope_object_is_read_whatever_the_kind() -> None:
    obj = {
        "queue_s": 0.25,
        "ttft_s": 0.5,
        "prefill_s": 0.25,
        "decode_s": 1.5,
        "tpot_s": 0.05,
        "prompt_tokens": 100,
        "cached_tokens": 64,
        "batch_size_mean": 3.5,
    }
    usage = {"prompt_tokens": 100, "completion_tokens": 31, "total_tokens": 131}
    expected = UpstreamReport(
        queue_s=0.25,
        ttft_s=0.5,
        prefill_s=0.25,
        decode_s=1.5,
        tpot_s=0.05,
        prompt_tokens=100,
        cached_tokens=64,
        output_tokens=31,
        source_fields=(
            "kvscope.queue_s",
            "kvscope.ttft_s",
            "kvscope.prefill_s",
            "kvscope.decode_s",
            "kvscope.tpot_s",
            "kvscope.prompt_tokens",
            "kvscope.cached_tokens",
            "usage.prompt_tokens",
            "usage.completion_tokens",
        ),
    )
    for kind in (K.KVSCOPE, K.OPENAI, None):
        assert report_from_body(kind, {"kvscope": obj, "usage": usage}) == expected


def test_tgi_headers_give_the_queue_and_the_token_counts_only() -> None:
    expected = UpstreamReport(
        queue_s=310 / 1000,
        prompt_tokens=18,
        output_tokens=40,
        source_fields=("x-queue-time", "x-prompt-tokens", "x-generated-tokens"),
    )
    assert report_from_headers(K.TGI, httpx.Headers(TGI_HEADERS)) == expected
    assert report_from_headers(K.TGI, TGI_HEADERS) == expected
    assert report_from_headers(K.VLLM, TGI_HEADERS) is None
    # a TGI stream's headers carry no timing (generate_stream_internal)
    assert (
        report_from_headers(K.TGI, {"x-compute-type": "gpu+optimized", "x-compute-characters": "54"}) is None
    )
    assert report_from_headers(K.TGI, {"x-queue-time": "soon", "x-prompt-tokens": "-1"}) is None
    combined = upstream_report(K.TGI, {"usage": TGI_USAGE}, httpx.Headers(TGI_HEADERS))
    assert combined == UpstreamReport(
        queue_s=310 / 1000,
        prompt_tokens=18,
        output_tokens=40,
        source_fields=("usage.prompt_tokens", "usage.completion_tokens", *expected.source_fields),
    )
    assert upstream_report(K.TGI, {}, TGI_HEADERS) == expected
    assert upstream_report(K.OPENAI, {}, TGI_HEADERS) is None


def test_odd_values_are_not_reported() -> None:
    timings = {"prompt_ms": -1, "predicted_ms": True, "predicted_n": 2.5, "cache_n": "9"}
    assert report_from_body(K.LLAMACPP, {"timings": timings}) is None
    assert report_from_body(K.LLAMACPP, {"usage": {"prompt_tokens": 12.0}}) == UpstreamReport(
        prompt_tokens=12, source_fields=("usage.prompt_tokens",)
    )
