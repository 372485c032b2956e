"""Exemplars from metrics to traces (issue 15, Build): /metrics is OpenMetrics when the scraper asks for it,
and the latency histograms carry the trace id of a sampled request, the same id its log record holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from kvscope.testing.harness import records_by_id
from tests.gateway.conftest import Stack

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
REPO = Path(__file__).resolve().parents[2]


def exemplars(text: str, family: str) -> list[tuple[dict[str, str], dict[str, str], float]]:
    """(bucket labels, exemplar labels, exemplar value) of every bucket of ``family`` that has one."""
    return [
        (s.labels, s.exemplar.labels, s.exemplar.value)
        for f in text_string_to_metric_families(text)
        if f.name == family
        for s in f.samples
        if s.name.endswith("_bucket") and s.exemplar is not None
    ]


def test_openmetrics_scrape_carries_the_trace_id_of_the_logged_request(own_stack: Stack) -> None:
    body = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "stream": True,
    }
    with own_stack.client() as c:
        assert (
            c.post("/v1/chat/completions", json=body, headers={"x-request-id": "ex-sampled"}).status_code
            == 200
        )
        unsampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
        assert (
            c.post(
                "/v1/chat/completions",
                json=body,
                headers={"x-request-id": "ex-unsampled", "traceparent": unsampled},
            ).status_code
            == 200
        )
        scraped = c.get("/metrics", headers={"accept": OPENMETRICS})
        plain = c.get("/metrics")
    record = records_by_id(own_stack.log, ["ex-sampled"])["ex-sampled"][0]
    trace_id = record["trace"]["id"]
    assert scraped.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert scraped.text.rstrip().endswith("# EOF")
    for family in (
        "kvscope_gateway_request_duration_seconds",
        "kvscope_gateway_time_to_first_token_seconds",
        "kvscope_gateway_time_per_output_token_seconds",
    ):
        found = exemplars(scraped.text, family)
        # one exemplar: the sampled request's; the unsampled one has no trace in the backend to link to
        assert [ex for _, ex, _ in found] == [{"trace_id": trace_id}], family
    ((bucket, _, value),) = exemplars(scraped.text, "kvscope_gateway_time_to_first_token_seconds")
    assert value == pytest.approx(record["kvscope"]["ttft_s"]) and value <= float(bucket["le"])
    assert plain.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"  # one charset
    assert "trace_id" not in plain.text


def test_grafana_links_exemplars_to_jaeger_and_prometheus_stores_them() -> None:
    sources = yaml.safe_load((REPO / "dashboards/provisioning/datasources/kvscope.yaml").read_text())[
        "datasources"
    ]
    prometheus, jaeger = (next(s for s in sources if s["type"] == kind) for kind in ("prometheus", "jaeger"))
    assert prometheus["jsonData"]["exemplarTraceIdDestinations"] == [
        {"name": "trace_id", "datasourceUid": jaeger["uid"]}
    ]
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    assert "--enable-feature=exemplar-storage" in compose["services"]["prometheus"]["command"]
