"""The ``kvscope`` object is one typed Struct (kvscope.engine.core.stats.KvscopeStats): the response's
``kvscope``, the request log's ``kvscope.engine`` and the span attributes carry the same keys and values."""

from __future__ import annotations

import json
import logging

import msgspec
import pytest

from kvscope.engine.core.request import RequestStats
from kvscope.engine.core.stats import KvscopeStats
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.server.access_log import ACCESS_LOGGER
from kvscope.engine.server.request_state import RequestState
from kvscope.engine.structured.params import StructuredOutputsParams

KEYS = [
    "queue_s",
    "ttft_s",
    "predicted_ttft_s",
    "prefill_s",
    "decode_s",
    "tpot_s",
    "batch_size_mean",
    "batch_size_max",
    "kv_blocks",
    "kv_cache_usage",
    "num_preemptions",
    "prompt_tokens",
    "cached_tokens",
    "queue_ahead",
    "running_on_arrival",
    "queue_limit",
    "queue_blocked_steps",
    "attributed_queue_s",
    *(
        f"{phase}_{name}"
        for phase in ("prefill", "decode")
        for name in (
            "steps",
            "tokens",
            "other_prefill_tokens",
            "other_decode_tokens",
            "other_requests_max",
            "step_s_mean",
            "step_s_max",
            "own_s",
            "interference_s",
            "interference_prefill_s",
            "preempted_s",
            "other_s",
        )
    ),
    "recomputed_tokens",
    "structured_mask_s",
    "structured_wait_s",
    "structured_compile_s",
    "service_tier",
    "spec_drafts",
    "spec_draft_tokens",
    "spec_accepted_tokens",
    "spec_mean_accepted_length",
]
"""The response's keys: the timings (with the TTFT predicted at queueing, issue 42), the latency attribution
(engine/core/attribution.py), the service tier (issue 42), then speculative decoding (issue 16)."""


def test_the_json_keys_are_the_fields_in_order() -> None:
    stats = RequestStats(
        arrival_time=1.0,
        first_scheduled_time=1.5,
        first_token_time=2.0,
        last_token_time=4.0,
        num_steps=4,
        batch_size_sum=6,
        batch_size_max=2,
        kv_blocks_peak=3,
        kv_cache_usage=0.25,
        num_preemptions=1,
    ).summary(num_output_tokens=5)
    assert (
        list(msgspec.json.decode(msgspec.json.encode(stats))) == KEYS == list(stats) == list(stats.to_dict())
    )
    as_dict = stats.to_dict()
    assert dict(list(as_dict.items())[:11]) == {
        "queue_s": 0.5,
        "ttft_s": 1.0,
        "predicted_ttft_s": None,  # no scheduler predicted it (hand-made stats)
        "prefill_s": 0.5,
        "decode_s": 2.0,
        "tpot_s": 0.5,
        "batch_size_mean": 1.5,
        "batch_size_max": 2,
        "kv_blocks": 3,
        "kv_cache_usage": 0.25,
        "num_preemptions": 1,
    }
    # no step records (the timestamps were set by hand): each phase's wall time is all "other"
    assert (as_dict["prefill_steps"], as_dict["prefill_other_s"], as_dict["decode_other_s"]) == (0, 0.5, 2.0)
    assert stats["tpot_s"] == 0.5
    with pytest.raises(KeyError):
        stats["merge"]


def test_merge_takes_min_max_sum_and_mean_per_field() -> None:
    a = KvscopeStats(
        queue_s=0.1,
        ttft_s=0.5,
        prefill_s=0.4,
        decode_s=1.0,
        tpot_s=0.1,
        batch_size_mean=2.0,
        batch_size_max=3,
        kv_blocks=2,
        kv_cache_usage=0.5,
        num_preemptions=1,
    )
    b = KvscopeStats(
        queue_s=0.2,
        ttft_s=0.3,
        prefill_s=None,
        decode_s=2.0,
        tpot_s=0.3,
        batch_size_mean=4.0,
        batch_size_max=5,
        kv_blocks=4,
        kv_cache_usage=0.25,
        num_preemptions=0,
    )
    assert KvscopeStats.merge([a, b]) == KvscopeStats(
        queue_s=0.1,
        ttft_s=0.3,
        prefill_s=0.4,
        decode_s=2.0,
        tpot_s=pytest.approx(0.2),
        batch_size_mean=3.0,
        batch_size_max=5,
        kv_blocks=6,
        kv_cache_usage=0.5,
        num_preemptions=1,
        attributed_queue_s=0.2,  # b's: it finished last (0.2 + 2.0 s against 0.1 + 0.4 + 1.0 s)
    )
    assert KvscopeStats.merge([b]) is b
    assert KvscopeStats.merge([]) == KvscopeStats()


def test_spec_verify_sums_drafts_and_gives_the_mean_acceptance_length() -> None:
    stats = RequestStats(arrival_time=0.0)
    assert [stats.summary(1)[k] for k in KEYS[-4:]] == [None, None, None, None]  # never speculated
    for k, a in ((3, 3), (3, 0), (2, 1)):
        stats.on_spec_verify(k, a)
    summary = stats.summary(num_output_tokens=10)
    assert {k: summary[k] for k in KEYS[-4:]} == {
        "spec_drafts": 3,
        "spec_draft_tokens": 8,
        "spec_accepted_tokens": 4,
        "spec_mean_accepted_length": 1 + 4 / 3,
    }
    for k, a in ((0, 0), (2, 3), (2, -1)):
        with pytest.raises(ValueError, match="k >= 1"):
            stats.on_spec_verify(k, a)
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (3, 8, 4)


def test_merge_sums_spec_counts_and_recomputes_the_length() -> None:
    a = KvscopeStats(
        spec_drafts=2, spec_draft_tokens=6, spec_accepted_tokens=6, spec_mean_accepted_length=4.0
    )
    b = KvscopeStats(
        spec_drafts=4, spec_draft_tokens=12, spec_accepted_tokens=0, spec_mean_accepted_length=1.0
    )
    merged = KvscopeStats.merge([a, b, KvscopeStats()])  # the third choice never speculated
    assert (
        merged.spec_drafts,
        merged.spec_draft_tokens,
        merged.spec_accepted_tokens,
        merged.spec_mean_accepted_length,
    ) == (6, 18, 6, 2.0)  # 1 + 6/6, not the mean 2.5 nor the max 4
    assert KvscopeStats.merge([KvscopeStats(), KvscopeStats()]).spec_mean_accepted_length is None


def test_a_constrained_request_keeps_its_grammar_wait_without_engine_stats() -> None:
    """A client that leaves after its grammar compiled but before the engine reported any stats (break-it:
    a 499 in phase ``queued`` logged ``structured_compile_s: null``, which reads as "no constraint"): the
    object still carries the wait the server measured; an unconstrained request's stays null."""
    constrained = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams("regex", "[0-9]+"))
    args = ("chatcmpl-1", "chat", "m", constrained, [[1, 2, 3]], False, None)
    kvscope = RequestState(*args, structured_compile_s=0.25).kvscope()  # type: ignore[arg-type]
    assert msgspec.structs.asdict(kvscope) == {
        **dict.fromkeys(KEYS),
        "structured_compile_s": 0.25,
        "structured_output": "regex",
    }
    plain = RequestState("chatcmpl-2", "chat", "m", SamplingParams(max_tokens=4), [[1]], False, None)  # type: ignore[arg-type]
    assert plain.kvscope() == KvscopeStats()


def test_response_and_log_carry_the_same_object(client, caplog) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    body = client.post(
        "/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 3, "n": 2}
    ).json()
    assert list(body["kvscope"]) == KEYS
    assert (body["kvscope"]["batch_size_max"], body["kvscope"]["kv_blocks"]) == (
        2,
        2,
    )  # max of 2, sum of 1 + 1
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == ACCESS_LOGGER]
    [line] = [line for line in lines if line["gen_ai"]["response"]["id"] == body["id"]]
    assert line["kvscope"]["engine"] == body["kvscope"]
