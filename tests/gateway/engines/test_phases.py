"""The gateway's queue/prefill/decode child spans (gateway/tracing.py ``upstream_phases``) from the upstream's
per-request timings, non-streamed answers too, or from the stream's token times."""

from __future__ import annotations

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvscope.gateway.engines.kinds import UpstreamKind
from kvscope.gateway.engines.reports import UpstreamReport, report_from_body, upstream_report
from kvscope.gateway.settings import TracingConfig
from kvscope.gateway.tracing import GatewayTracer, Phase, build_tracer_provider, upstream_phases
from tests.gateway.engines.payloads import LLAMACPP_CHAT, TGI_HEADERS

A = 100.0
"""The answering attempt's start (perf_counter seconds)."""
LLAMACPP = report_from_body(UpstreamKind.LLAMACPP, LLAMACPP_CHAT)
DECODE, PREFILL = 30.75 / 1000, 52.125 / 1000


def test_a_json_answer_from_llamacpp_gets_prefill_and_decode_from_its_timings() -> None:
    end = A + 0.5
    assert upstream_phases(A, None, None, end, LLAMACPP) == [
        Phase("prefill", end - DECODE - PREFILL, end - DECODE, "per_request"),
        Phase("decode", end - DECODE, end, "per_request"),
    ]


def test_a_stream_from_llamacpp_ends_its_decode_at_the_last_token() -> None:
    first, last, end = A + 0.1, A + 0.2, A + 0.21
    assert upstream_phases(A, first, last, end, LLAMACPP) == [
        Phase("prefill", last - DECODE - PREFILL, last - DECODE, "per_request"),
        Phase("decode", last - DECODE, last, "per_request"),
    ]


def test_tgi_reports_its_queue_and_the_stream_its_token_times() -> None:
    tgi = upstream_report(UpstreamKind.TGI, {}, TGI_HEADERS)
    assert upstream_phases(A, None, None, A + 2.0, tgi) == [Phase("queue", A, A + 0.31, "per_request")]
    assert upstream_phases(A, A + 0.5, A + 1.5, A + 1.6, tgi) == [
        Phase("queue", A, A + 0.31, "per_request"),
        Phase("prefill", A + 0.31, A + 0.5, "gateway"),
        Phase("decode", A + 0.5, A + 1.5, "gateway"),
    ]


def test_without_a_report_streams_are_measured_and_json_answers_have_none() -> None:
    assert upstream_phases(A, A + 0.5, A + 1.5, A + 1.6, None) == [
        Phase("prefill", A, A + 0.5, "gateway"),
        Phase("decode", A + 0.5, A + 1.5, "gateway"),
    ]
    assert upstream_phases(A, None, None, A + 1.6, None) == []
    assert (
        upstream_phases(A, None, None, A + 1.6, UpstreamReport(cached_tokens=3, source_fields=("x",))) == []
    )


def test_a_report_longer_than_the_attempt_starts_no_earlier_than_it() -> None:
    long = UpstreamReport(prefill_s=5.0, decode_s=0.5, source_fields=("x",))
    assert upstream_phases(A, None, None, A + 1.0, long) == [
        Phase("prefill", A, A + 0.5, "per_request"),
        Phase("decode", A + 0.5, A + 1.0, "per_request"),
    ]


def test_record_phases_makes_child_spans_with_their_source() -> None:
    exporter = InMemorySpanExporter()
    tracer = GatewayTracer(build_tracer_provider(TracingConfig(), "gw", "0", "n", exporter), "0")
    parent = tracer.start_client_span(None, "chat", "m", {})
    phases = upstream_phases(A, None, None, A + 0.5, LLAMACPP)
    tracer.record_phases(parent, phases, lambda t: int(t * 1e9))
    parent.end()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    for phase in phases:
        span = spans[phase.name]
        assert span.parent is not None and span.parent.span_id == parent.get_span_context().span_id
        assert (span.start_time, span.end_time) == (int(phase.start * 1e9), int(phase.end * 1e9))
        assert dict(span.attributes or {}) == {"kvscope.timing.source": "per_request"}
