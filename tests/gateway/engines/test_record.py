"""The request log record (gateway/logs/record.py) in front of each upstream kind: ``kvscope.engine``,
``kvscope.upstream``, and the TTFT/TPOT of a non-streamed answer from the upstream's report."""

from __future__ import annotations

from kvscope.gateway.context import RequestContext
from kvscope.gateway.engines.kinds import UpstreamKind
from kvscope.gateway.engines.reports import report_from_body, upstream_report
from kvscope.gateway.engines.samples import EngineSample
from kvscope.gateway.engines.section import SampleStamp
from kvscope.gateway.logs.es_setup import record_properties
from kvscope.gateway.logs.record import RecordBuilder, ServiceInfo
from tests.gateway.engines.payloads import LLAMACPP_CHAT, LLAMACPP_USAGE, TGI_HEADERS, TGI_USAGE

START = 1000.0
"""The request's arrival (perf_counter seconds)."""


def ctx(kind: str, stream: bool, *, finish_reasons: tuple[str, ...] = ("length",)) -> RequestContext:
    c = RequestContext(
        request_id="r", method="POST", path="/v1/chat/completions", route="/v1/chat/completions",
        start=START, start_wall=1.7e9,
    )  # fmt: skip
    c.request.stream = stream
    c.upstream.started("http://upstream:8080")
    c.upstream.kind, c.upstream.kind_source = kind, "models"
    c.answer.finish_reasons = list(finish_reasons)
    c.outcome.status, c.outcome.end_at = 200, START + 2.0
    return c


def build(c: RequestContext) -> dict:
    return RecordBuilder(ServiceInfo("kvscope-gateway", "0.1.0", "gw")).build(c)


def test_a_json_answer_from_llamacpp_gets_its_ttft_and_tpot_from_the_timings() -> None:
    c = ctx("llamacpp", stream=False)
    c.answer.usage = LLAMACPP_USAGE
    c.answer.report = report_from_body(UpstreamKind.LLAMACPP, LLAMACPP_CHAT)
    c.answer.upstream_end = START + 1.5
    arrival = SampleStamp(EngineSample(at=999.0, requests_running=1.0, requests_waiting=0.0), 0.5)
    c.upstream.arrival_sample, c.upstream.finish_sample = arrival, None
    record = build(c)
    kv = record["kvscope"]
    assert kv["ttft_s"] == START + 1.5 - 30.75 / 1000 - START
    assert kv["tpot_s"] == 30.75 / 1000 / 3
    assert c.ttft_s is None and c.tpot_s is None  # the TTFT/TPOT histograms stay measured (streams) only
    assert (kv["engine"]["prefill_s"], kv["engine"]["cached_tokens"], kv["engine"]["batch_size_max"]) == (
        52.125 / 1000,
        9,
        1,
    )
    assert kv["upstream"]["sources"]["ttft_s"] == kv["upstream"]["sources"]["tpot_s"] == "per_request"
    assert kv["upstream"]["sampled"] == {
        "arrival": {"requests_running": 1, "requests_waiting": 0, "kv_cache_usage": None, "age_s": 0.5},
        "finish": None,
    }
    assert record["gen_ai"]["usage"]["cache_read"] == {"input_tokens": 9}


def test_a_stream_keeps_the_gateway_measured_ttft() -> None:
    c = ctx("llamacpp", stream=True)
    c.answer.usage = LLAMACPP_USAGE
    c.answer.report = report_from_body(UpstreamKind.LLAMACPP, LLAMACPP_CHAT)
    c.answer.first_token_at, c.answer.upstream_end = START + 0.25, START + 1.5
    kv = build(c)["kvscope"]
    assert kv["ttft_s"] == 0.25
    assert kv["tpot_s"] == (2.0 - 0.25) / 3  # measured: (end - first token) / (4 tokens - 1)
    assert kv["upstream"]["sources"]["ttft_s"] == kv["upstream"]["sources"]["tpot_s"] == "gateway"
    assert kv["engine"]["decode_s"] == 30.75 / 1000


def test_a_json_answer_without_a_decode_time_has_no_ttft() -> None:
    c = ctx("tgi", stream=False)
    c.answer.usage = TGI_USAGE
    c.answer.report = upstream_report(UpstreamKind.TGI, {"usage": TGI_USAGE}, TGI_HEADERS)
    c.answer.upstream_end = START + 1.5
    kv = build(c)["kvscope"]
    assert (kv["ttft_s"], kv["tpot_s"]) == (None, None)
    assert kv["engine"]["queue_s"] == 0.31
    assert kv["upstream"]["sources"] == {
        "ttft_s": None,
        "tpot_s": None,
        "queue_s": "per_request",
        "prefill_s": None,
        "decode_s": None,
        "cached_tokens": None,
        "batch_size": None,
        "kv_cache_usage": None,
        "queue_ahead": None,
    }


def test_our_engine_json_answer_now_logs_its_ttft() -> None:
    """The kvscope object's decode_s gives a non-streamed answer its TTFT too (it was null before kinds)."""
    obj = {"queue_s": 0.125, "ttft_s": 0.5, "prefill_s": 0.375, "decode_s": 1.0, "tpot_s": 0.0625}
    c = ctx("kvscope", stream=False, finish_reasons=("stop", "stop"))
    c.answer.engine = obj
    c.answer.usage = {"prompt_tokens": 10, "completion_tokens": 34}
    c.answer.report = report_from_body(UpstreamKind.KVSCOPE, {"kvscope": obj, "usage": c.answer.usage})
    c.answer.upstream_end = START + 1.75
    kv = build(c)["kvscope"]
    assert (kv["ttft_s"], kv["tpot_s"]) == (0.75, 0.0625)
    assert kv["engine"] is obj
    c.answer.report = report_from_body(None, {"kvscope": {**obj, "tpot_s": None}, "usage": c.answer.usage})
    assert build(c)["kvscope"]["tpot_s"] == 1.0 / 16  # 17 tokens per choice


def test_a_decode_longer_than_the_request_is_not_this_requests() -> None:
    c = ctx("llamacpp", stream=False)
    c.answer.report = report_from_body(UpstreamKind.LLAMACPP, LLAMACPP_CHAT)
    c.answer.upstream_end = START + 0.01
    assert build(c)["kvscope"]["ttft_s"] is None


def test_every_upstream_field_of_a_built_record_is_mapped() -> None:
    c = ctx("vllm", stream=True)
    sample = SampleStamp(
        EngineSample(at=1.0, requests_running=2.0, requests_waiting=1.0, kv_cache_usage=0.5), 0.1
    )
    c.upstream.arrival_sample = c.upstream.finish_sample = sample
    record = build(c)
    upstream = record["kvscope"]["upstream"]
    mapped = record_properties()["kvscope"]["properties"]["upstream"]["properties"]
    assert set(upstream) == set(mapped) == {"kind", "kind_source", "sources", "sampled"}
    assert set(upstream["sources"]) == set(mapped["sources"]["properties"])
    for moment in ("arrival", "finish"):
        assert set(upstream["sampled"][moment]) == set(mapped["sampled"]["properties"][moment]["properties"])
    engine = record["kvscope"]["engine"]
    assert set(engine) <= set(record_properties()["kvscope"]["properties"]["engine"]["properties"])
