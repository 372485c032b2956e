"""``kvscope logs why`` (gateway/logs/why.py) on records from upstreams without step attribution: it
explains what the line holds, with each number's source, and says what the kind cannot tell."""

from __future__ import annotations

import pytest

from kvscope.gateway.context import RequestContext
from kvscope.gateway.engines.kinds import UpstreamKind
from kvscope.gateway.engines.reports import report_from_body, upstream_report
from kvscope.gateway.engines.samples import EngineSample
from kvscope.gateway.engines.section import SampleStamp
from kvscope.gateway.logs.record import RecordBuilder, ServiceInfo
from kvscope.gateway.logs.why import explain, rank_causes
from tests.gateway.engines.payloads import LLAMACPP_CHAT, LLAMACPP_USAGE, TGI_HEADERS, TGI_USAGE

START = 1000.0
ARRIVAL = SampleStamp(
    EngineSample(at=1.0, requests_running=3.0, requests_waiting=1.0, kv_cache_usage=0.25), 0.4
)
FINISH = SampleStamp(
    EngineSample(at=2.0, requests_running=6.0, requests_waiting=0.0, kv_cache_usage=0.5), 0.125
)


def record(kind: str, *, report, usage, stream: bool, samples: bool) -> dict:
    """The gateway's record of a request of 2 s e2e whose one attempt took 1.5 s (1.25 s to its response
    headers, its last byte 1.75 s after arrival)."""
    c = RequestContext(
        request_id="why-1", method="POST", path="/v1/chat/completions", route="/v1/chat/completions",
        start=START, start_wall=1.7e9,
    )  # fmt: skip
    c.request.stream = stream
    c.upstream.started("http://upstream:8080")
    c.upstream.kind, c.upstream.kind_source = kind, "models"
    if samples:
        c.upstream.arrival_sample, c.upstream.finish_sample = ARRIVAL, FINISH
    c.attempt_ended(START + 0.25, START + 1.5, START + 1.75)
    c.answer.usage, c.answer.report, c.answer.finish_reasons = usage, report, ["length"]
    c.answer.upstream_end = START + 1.75
    if stream:
        c.answer.first_token_at = START + 0.5
    c.outcome.status, c.outcome.end_at = 200, START + 2.0
    return RecordBuilder(ServiceInfo("kvscope-gateway", "0.1.0", "gw")).build(c)


def test_a_llamacpp_json_answer_is_explained_from_its_timings_and_samples() -> None:
    rec = record(
        "llamacpp",
        report=report_from_body(UpstreamKind.LLAMACPP, LLAMACPP_CHAT),
        usage=LLAMACPP_USAGE,
        stream=False,
        samples=True,
    )
    why = explain(rec)
    kv = rec["kvscope"]
    ttft, tpot = kv["ttft_s"], kv["tpot_s"]
    assert ttft == START + 1.75 - 30.75 / 1000 - START
    lines = why.text.splitlines()
    assert lines[:4] == [
        f"upstream llamacpp (kind from models): TTFT {ttft:.3f} s (per_request); "
        "prefill 0.052 s (per_request) of a 25-token prompt, 9 from the prefix cache",
        f"decode 0.031 s at {tpot * 1000:.1f} ms/token (per_request)",
        "llamacpp sampled: batch of 4.5 (max 6); at arrival 3 running, 1 waiting, KV usage 25% "
        "(sampled 0.4 s before); at finish 6 running, 0 waiting, KV usage 50% (sampled 0.1 s before)",
        "llamacpp does not tell: queue time, per-step attribution (other requests' prefills, "
        "batched decodes, preemption)",
    ]
    assert lines[4].startswith("e2e 2.000 s at the gateway: ")
    causes = dict(why.causes)
    assert causes["prefill"] == 52.125 / 1000 and causes["decode"] == 30.75 / 1000
    # the answering attempt's 1.5 s less what llama.cpp timed: connect, tokenizing, a free slot, sending
    assert causes["upstream unattributed"] == pytest.approx(1.5 - 52.125 / 1000 - 30.75 / 1000)
    assert sum(causes.values()) == pytest.approx(2.0)
    assert why.verdict == "upstream unattributed"
    assert why.to_dict()["upstream"] == kv["upstream"]


def test_a_tgi_stream_says_it_has_no_per_request_timing() -> None:
    rec = record(
        "tgi",
        report=upstream_report(UpstreamKind.TGI, {"usage": TGI_USAGE}, {}),
        usage=TGI_USAGE,
        stream=True,
        samples=False,
    )
    lines = explain(rec).text.splitlines()
    assert lines[0] == (
        "upstream tgi (kind from models): TTFT 0.500 s (gateway); prefill ? of a ?-token prompt, ? from the "
        "prefix cache"
    )
    assert lines[1] == f"decode at {rec['kvscope']['tpot_s'] * 1000:.1f} ms/token (gateway)"
    assert lines[2] == (
        "tgi does not tell: queue time, prefill time, decode time, cached tokens, batch size, KV usage and "
        "queue depth (not sampled), per-step attribution (other requests' prefills, batched decodes, "
        "preemption)"
    )


def test_a_tgi_json_answer_has_its_queue_time() -> None:
    rec = record(
        "tgi", report=upstream_report(UpstreamKind.TGI, {"usage": TGI_USAGE}, TGI_HEADERS), usage=TGI_USAGE,
        stream=False, samples=False,
    )  # fmt: skip
    why = explain(rec)
    assert why.text.splitlines()[0] == (
        "upstream tgi (kind from models): TTFT unknown; 0.310 s queued (per_request); "
        "prefill ? of a 18-token prompt, ? from the prefix cache"
    )
    assert dict(why.causes)["queue"] == 0.31
    assert why.text.splitlines()[1].startswith(
        "tgi does not tell: TTFT, prefill time, decode time, cached tokens"
    )


def test_a_record_that_reached_no_upstream_is_still_refused() -> None:
    rec = record("openai", report=None, usage=None, stream=False, samples=False)
    rec["kvscope"]["upstream"]["kind"] = None
    with pytest.raises(ValueError, match="no kvscope.engine attribution"):
        explain(rec)


def test_rank_causes_of_a_reported_engine_part() -> None:
    engine = {"queue_s": 0.5, "prefill_s": 0.25, "decode_s": 1.0}
    assert rank_causes(engine) == [("decode", 1.0), ("queue", 0.5), ("prefill", 0.25)]


def test_sampled_state_without_kv_usage_says_so() -> None:
    """TGI exports its batch and queue sizes but no KV-cache usage."""
    rec = record(
        "tgi", report=upstream_report(UpstreamKind.TGI, {"usage": TGI_USAGE}, TGI_HEADERS), usage=TGI_USAGE,
        stream=False, samples=True,
    )  # fmt: skip
    sampled = rec["kvscope"]["upstream"]["sampled"]
    for moment in ("arrival", "finish"):
        sampled[moment]["kv_cache_usage"] = None
    rec["kvscope"]["engine"]["kv_cache_usage"] = None
    rec["kvscope"]["upstream"]["sources"]["kv_cache_usage"] = None
    lines = explain(rec).text.splitlines()
    assert lines[1] == (
        "tgi sampled: batch of 4.5 (max 6); at arrival 3 running, 1 waiting, KV usage ? (sampled 0.4 s "
        "before); at finish 6 running, 0 waiting, KV usage ? (sampled 0.1 s before)"
    )
    assert lines[2] == (
        "tgi does not tell: TTFT, prefill time, decode time, cached tokens, KV usage, per-step attribution "
        "(other requests' prefills, batched decodes, preemption)"
    )


def test_a_failed_request_says_how_it_ended_and_not_what_the_kind_withheld() -> None:
    """A 503 from an upstream that never answered: the first line is the status and error, and the
    explanation says there was no answer to read instead of listing what the kind "does not tell"."""
    c = RequestContext(
        request_id="why-down", method="POST", path="/v1/chat/completions", route="/v1/chat/completions",
        start=START, start_wall=1.7e9,
    )  # fmt: skip
    c.request.stream = False
    c.upstream.started("http://upstream:8080")
    c.upstream.kind, c.upstream.kind_source = "llamacpp", "models"
    c.attempt_ended(START + 0.01, None, START + 0.02)
    c.outcome.status, c.outcome.end_at = 503, START + 0.03
    c.outcome.error_type, c.outcome.error_message = "upstream_unavailable", "connection refused"
    rec = RecordBuilder(ServiceInfo("kvscope-gateway", "0.1.0", "gw")).build(c)
    lines = explain(rec).text.splitlines()
    assert lines[0] == "failed: status 503 — upstream_unavailable: connection refused"
    assert "the llamacpp upstream sent no answer to read, so nothing of its engine is known" in lines
    assert not any("does not tell" in line for line in lines)


OPENAI_USAGE = {
    "prompt_tokens": 18,
    "completion_tokens": 6,
    "total_tokens": 24,
    "prompt_tokens_details": {"cached_tokens": 16},
}
"""vLLM's, SGLang's and OpenAI's usage with cached tokens (vLLM: ``--enable-prompt-tokens-details``, SGLang:
``--enable-cache-report``): all these kinds report of a request."""
SAMPLED_LINE = (
    "sampled: batch of 4.5 (max 6); at arrival 3 running, 1 waiting, KV usage 25% (sampled 0.4 s before); at "
    "finish 6 running, 0 waiting, KV usage 50% (sampled 0.1 s before)"
)
STEPS = "per-step attribution (other requests' prefills, batched decodes, preemption)"


@pytest.mark.parametrize(
    ("kind", "stream", "samples", "expected"),
    [
        (
            "vllm",
            False,
            True,
            [
                "upstream vllm (kind from models): TTFT unknown; prefill ? of a 18-token prompt, 16 from the "
                "prefix cache",
                "vllm " + SAMPLED_LINE,
                f"vllm does not tell: TTFT, queue time, prefill time, decode time, {STEPS}",
            ],
        ),
        (
            "sglang",
            True,
            True,
            [
                "upstream sglang (kind from models): TTFT 0.500 s (gateway); prefill ? of a 18-token "
                "prompt, 16 from the prefix cache",
                "decode at 300.0 ms/token (gateway)",
                "sglang " + SAMPLED_LINE,
                f"sglang does not tell: queue time, prefill time, decode time, {STEPS}",
            ],
        ),
        (
            "openai",
            False,
            False,
            [
                "upstream openai (kind from models): TTFT unknown; prefill ? of a 18-token prompt, 16 "
                "from the prefix cache",
                "openai does not tell: TTFT, queue time, prefill time, decode time, batch size, KV usage and "
                f"queue depth (not sampled), {STEPS}",
            ],
        ),
    ],
    ids=["vllm-json", "sglang-stream", "openai-json"],
)
def test_usage_only_kinds_say_what_they_cannot_tell(
    kind: str, stream: bool, samples: bool, expected: list[str]
) -> None:
    """vLLM, SGLang and a plain OpenAI server report only token counts per request: the explanation gives
    the cached tokens (``per_request``), the sampled state where ``/metrics`` was scraped, the stream's
    TTFT and TPOT as the gateway measured them, and names everything else as unknown for that kind."""
    report = upstream_report(UpstreamKind(kind), {"usage": OPENAI_USAGE}, {})
    rec = record(kind, report=report, usage=OPENAI_USAGE, stream=stream, samples=samples)
    assert rec["kvscope"]["upstream"]["sources"]["cached_tokens"] == "per_request"
    why = explain(rec)
    lines = why.text.splitlines()
    assert lines[: len(expected)] == expected
    assert lines[len(expected)].startswith("e2e 2.000 s at the gateway: ")
    assert why.causes == (("upstream unattributed", 1.5), ("gateway other", 0.5))
