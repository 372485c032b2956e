"""Spans where nothing exports them (gateway/tracing.py ``GatewayTracer.unexported``): no exporter and no OTLP
endpoint (the default) make the gateway's spans ids only, with the same trace ids, parentage and sampling
decisions as the SDK's spans, so the request log, the exemplars and the ``traceparent`` sent upstream carry
what they would with an exporter."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan

from kvscope.gateway.app import create_app
from kvscope.gateway.settings import TracingConfig, load_settings
from kvscope.gateway.tracing import GatewayTracer, build_tracer
from kvscope.testing.harness import GatewayThread, LoopThread, records_by_id, start_fake_thread

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SAMPLED = f"00-{TRACE}-00f067aa0ba902b7-01"
UNSAMPLED = f"00-{TRACE}-00f067aa0ba902b7-00"
pytestmark = pytest.mark.usefixtures("no_otel_environment")  # tests/conftest.py


def _tracers() -> tuple[GatewayTracer, GatewayTracer]:
    """(ids-only, the SDK's with an in-memory exporter), built the way the gateway builds its tracer."""
    unexported = build_tracer(TracingConfig(), "gw", "0", "n")
    exported = build_tracer(TracingConfig(), "gw", "0", "n", InMemorySpanExporter())
    return unexported, exported


def _outgoing(tracer: GatewayTracer, headers: dict[str, str]) -> tuple[str, str, str, str]:
    """(server span's trace id, flags; client span's traceparent, tracestate) for a request with
    ``headers``."""
    server = tracer.start_server_span("POST /v1/chat/completions", headers, 0, {})
    client = tracer.start_client_span(server, "chat", "m", {})
    sent: dict[str, str] = {}
    tracer.inject(client, sent)
    context, client_context = server.get_span_context(), client.get_span_context()
    assert client_context.trace_id == context.trace_id and client_context.span_id != context.span_id
    assert context.is_valid and client_context.is_valid
    return (
        f"{context.trace_id:032x}",
        f"{context.trace_flags:02x}",
        sent["traceparent"],
        sent.get("tracestate", ""),
    )


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"traceparent": SAMPLED},
        {"traceparent": UNSAMPLED},
        {"traceparent": SAMPLED, "tracestate": "congo=t61rcWkgMzE"},
        {"traceparent": "00-00000000000000000000000000000000-00f067aa0ba902b7-01"},  # invalid: a new trace
    ],
)
def test_ids_only_spans_carry_what_the_sdks_spans_carry(headers: dict[str, str]) -> None:
    unexported, exported = _tracers()
    assert (unexported.exporting, exported.exporting) == (False, True)
    ids_only, sdk = _outgoing(unexported, headers), _outgoing(exported, headers)
    assert isinstance(unexported.start_server_span("x", headers, 0, {}), NonRecordingSpan)
    # the trace id is the parent's where it is valid (a new random one otherwise), the flags the sampler's
    if "traceparent" in headers and TRACE in headers["traceparent"]:
        assert ids_only[0] == sdk[0] == TRACE
    else:
        assert ids_only[0] != sdk[0]  # two new random traces
    # sampled (01) or not (00) as the parent says, and the level-2 random-trace-id flag (02) on a new trace
    expected = {SAMPLED: "01", UNSAMPLED: "00"}.get(headers.get("traceparent", ""), "03")
    assert ids_only[1] == sdk[1] == expected
    version, trace_id, span_id, flags = ids_only[2].split("-")
    assert (version, trace_id, flags) == ("00", ids_only[0], ids_only[1]) and len(span_id) == 16
    assert ids_only[3] == sdk[3] == headers.get("tracestate", "")


def test_the_tracer_exports_where_an_endpoint_is_configured_and_stays_no_op_when_disabled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert build_tracer(TracingConfig(otlp_endpoint="http://127.0.0.1:1"), "gw", "0", "n").exporting
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    assert build_tracer(TracingConfig(), "gw", "0", "n").exporting
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert not build_tracer(TracingConfig(), "gw", "0", "n").exporting
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")  # the SDK's no-op tracer, as before: invalid ids
    disabled = build_tracer(TracingConfig(), "gw", "0", "n")
    assert disabled.exporting
    assert not disabled.start_server_span("x", {}, 0, {}).get_span_context().is_valid


def test_a_gateway_without_an_exporter_logs_and_forwards_the_trace(tmp_path: Path) -> None:
    """The in-process gateway with no span exporter: the log's trace id is the client's, its span id the
    server span's, and the upstream gets the client span's id in the same trace with the client's sampling
    decision; a request without a traceparent starts a trace the log and the upstream share."""
    loop = LoopThread()
    fake = start_fake_thread(loop, ("fake-model",))
    settings = load_settings(
        None, {"upstreams": [{"url": fake.url}], "logs": {"file": str(tmp_path / "requests.jsonl")}}, env={}
    )
    gateway = GatewayThread(create_app(settings))
    assert not gateway.state.tracer.exporting
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    sent: dict[str, str] = {}
    try:
        with gateway, httpx.Client(base_url=gateway.url, timeout=10) as client:
            for rid, traceparent in (("sampled", SAMPLED), ("unsampled", UNSAMPLED), ("new", None)):
                headers = {"x-request-id": rid, **({"traceparent": traceparent} if traceparent else {})}
                assert client.post("/v1/chat/completions", json=body, headers=headers).status_code == 200
                sent[rid] = fake.records[-1].headers["traceparent"]
    finally:
        loop.run(fake.close())
        loop.stop()
    records = {rid: found[0] for rid, found in records_by_id(tmp_path / "requests.jsonl", sent).items()}
    for rid, flags in (("sampled", "01"), ("unsampled", "00"), ("new", "03")):
        _, trace_id, span_id, sent_flags = sent[rid].split("-")
        logged = records[rid]
        assert trace_id == logged["trace"]["id"] and sent_flags == flags
        assert span_id != logged["span"]["id"] and len(logged["span"]["id"]) == 16  # client span ≠ server's
    assert records["sampled"]["trace"]["id"] == records["unsampled"]["trace"]["id"] == TRACE
    assert records["new"]["trace"]["id"] not in (TRACE, "0" * 32)
