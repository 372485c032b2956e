"""The log record's ``kvscope.engine`` and ``kvscope.upstream`` (gateway/engines/section.py) for each kind."""

from __future__ import annotations

from kvscope.gateway.engines.kinds import UpstreamKind
from kvscope.gateway.engines.reports import report_from_body, upstream_report
from kvscope.gateway.engines.samples import EngineSample
from kvscope.gateway.engines.section import ENGINE_KEYS, SampleStamp, engine_section, stamp
from tests.gateway.engines.payloads import LLAMACPP_CHAT, TGI_HEADERS, TGI_USAGE, VLLM_USAGE

ARRIVAL = SampleStamp(
    EngineSample(at=100.0, requests_running=3.0, requests_waiting=1.0, kv_cache_usage=0.25), 0.4
)
FINISH = SampleStamp(
    EngineSample(at=101.5, requests_running=6.0, requests_waiting=0.0, kv_cache_usage=0.5), 0.125
)
NO_SAMPLES = {"arrival": None, "finish": None}
SAMPLED = {
    "arrival": {"requests_running": 3, "requests_waiting": 1, "kv_cache_usage": 0.25, "age_s": 0.4},
    "finish": {"requests_running": 6, "requests_waiting": 0, "kv_cache_usage": 0.5, "age_s": 0.125},
}


def sources(**given: str | None) -> dict[str, str | None]:
    keys = ("ttft_s", "tpot_s", "queue_s", "prefill_s", "decode_s", "cached_tokens", "batch_size")
    return {k: given.get(k) for k in (*keys, "kv_cache_usage", "queue_ahead")}


def test_llamacpp_per_request_timings_and_sampled_state() -> None:
    report = report_from_body(UpstreamKind.LLAMACPP, LLAMACPP_CHAT)
    engine, upstream = engine_section(
        "llamacpp", "models", report, None, ARRIVAL, FINISH, "per_request", "per_request"
    )
    assert engine == {
        "queue_s": None,
        "ttft_s": None,
        "prefill_s": 52.125 / 1000,
        "decode_s": 30.75 / 1000,
        "tpot_s": 30.75 / 1000 / 3,
        "prompt_tokens": 25,
        "cached_tokens": 9,
        "batch_size_mean": 4.5,
        "batch_size_max": 6,
        "kv_cache_usage": 0.5,
        "queue_ahead": 1,
        "running_on_arrival": 3,
    }
    assert engine is not None and list(engine) == list(ENGINE_KEYS)
    assert upstream == {
        "kind": "llamacpp",
        "kind_source": "models",
        "sources": sources(
            ttft_s="per_request",
            tpot_s="per_request",
            prefill_s="per_request",
            decode_s="per_request",
            cached_tokens="per_request",
            batch_size="sampled",
            kv_cache_usage="sampled",
            queue_ahead="sampled",
        ),
        "sampled": SAMPLED,
    }


def test_tgi_queue_only_and_a_stream_ttft() -> None:
    report = upstream_report(UpstreamKind.TGI, {"usage": TGI_USAGE}, TGI_HEADERS)
    engine, upstream = engine_section("tgi", "info", report, None, None, None, "gateway")
    assert engine == dict.fromkeys(ENGINE_KEYS) | {"queue_s": 0.31, "prompt_tokens": 18}
    assert upstream["sources"] == sources(ttft_s="gateway", queue_s="per_request")
    assert upstream["sampled"] == NO_SAMPLES


def test_vllm_cached_tokens_with_one_sample() -> None:
    report = report_from_body(UpstreamKind.VLLM, {"usage": VLLM_USAGE})
    engine, upstream = engine_section("vllm", "metrics", report, None, ARRIVAL, None, None)
    assert engine == dict.fromkeys(ENGINE_KEYS) | {
        "prompt_tokens": 1024,
        "cached_tokens": 512,
        "batch_size_mean": 3.0,
        "batch_size_max": 3,
        "kv_cache_usage": 0.25,
        "queue_ahead": 1,
        "running_on_arrival": 3,
    }
    assert upstream["sources"] == sources(
        cached_tokens="per_request", batch_size="sampled", kv_cache_usage="sampled", queue_ahead="sampled"
    )
    assert upstream["sampled"] == {"arrival": SAMPLED["arrival"], "finish": None}


def test_a_plain_openai_upstream_without_samples_has_no_engine_part() -> None:
    report = report_from_body(UpstreamKind.OPENAI, {"usage": {"prompt_tokens": 7, "completion_tokens": 2}})
    engine, upstream = engine_section("openai", "default", report, None, None, None, None)
    assert engine is None
    assert upstream == {
        "kind": "openai",
        "kind_source": "default",
        "sources": sources(),
        "sampled": NO_SAMPLES,
    }
    # a request that reached no replica
    assert engine_section(None, None, None, None, None, None, None) == (
        None,
        {"kind": None, "kind_source": None, "sources": sources(), "sampled": NO_SAMPLES},
    )


def test_our_engine_object_is_the_engine_part_unchanged() -> None:
    obj = {"queue_s": 0.25, "prefill_s": 0.5, "decode_s": 1.0, "batch_size_mean": 2.0, "kv_cache_usage": 0.1}
    engine, upstream = engine_section("kvscope", "models", None, obj, ARRIVAL, FINISH, "gateway")
    assert engine is obj
    assert upstream["sources"] == sources(
        ttft_s="gateway",
        queue_s="per_request",
        prefill_s="per_request",
        decode_s="per_request",
        batch_size="per_request",
        kv_cache_usage="per_request",
    )
    assert upstream["sampled"] == SAMPLED


def test_stamp_ages_a_sample() -> None:
    sample = EngineSample(at=10.0, requests_running=2.5)
    assert stamp(sample, 10.75) == SampleStamp(sample, 0.75)
    assert stamp(sample, 9.0) == SampleStamp(sample, 0.0)  # scraped after the moment: age 0
    assert stamp(None, 10.0) is None
    engine, upstream = engine_section("sglang", "models", None, None, stamp(sample, 10.75), None, None)
    assert engine is not None and (engine["batch_size_max"], engine["running_on_arrival"]) == (2.5, 2.5)
    assert upstream["sampled"]["arrival"] == {
        "requests_running": 2.5,
        "requests_waiting": None,
        "kv_cache_usage": None,
        "age_s": 0.75,
    }
