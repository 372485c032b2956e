"""Speculative decoding per request (issue 16): the response's ``kvscope`` object, the engine's access-log
line and the spans carry the request's drafts, proposed/accepted tokens and mean acceptance length."""

from __future__ import annotations

import json
import logging

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvscope.engine.server.access_log import ACCESS_LOGGER
from kvscope.engine.server.tracing import RequestSpans, RequestTimeline, Tracing, spec_decode_attributes
from tests.engine.server.fakes import FakeEngine

DRAFTS = ((3, 3), (3, 1), (2, 0))
"""Per choice: three verified drafts, 8 proposed tokens, 4 accepted."""


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine(spec_drafts=DRAFTS)


def test_response_log_and_spans_carry_the_totals(client, spans, caplog) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    spans.clear()
    body = client.post(
        "/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 3, "n": 2}
    ).json()
    expected = {
        "spec_drafts": 6,
        "spec_draft_tokens": 16,
        "spec_accepted_tokens": 8,
        "spec_mean_accepted_length": 1 + 8 / 6,
    }  # two choices summed, the length from the sums
    assert {k: v for k, v in body["kvscope"].items() if k.startswith("spec_")} == expected
    [line] = [json.loads(r.getMessage()) for r in caplog.records if r.name == ACCESS_LOGGER]
    assert {k: v for k, v in line["kvscope"]["engine"].items() if k.startswith("spec_")} == expected
    named = {s.name: s for s in spans.get_finished_spans()}
    assert {k: v for k, v in named["decode"].attributes.items()} == {
        "kvscope.spec_decode.drafts": 6,
        "kvscope.spec_decode.draft_tokens": 16,
        "kvscope.spec_decode.accepted_tokens": 8,
        "kvscope.spec_decode.mean_accepted_length": 1 + 8 / 6,
    }
    assert named["decode"].events == ()  # totals, not one event per verification
    assert {k: v for k, v in named["llm_request"].attributes.items() if k.startswith("kvscope.spec_")} == {
        f"kvscope.{k}": v for k, v in expected.items()
    }


def test_without_speculation_the_decode_span_is_bare() -> None:
    assert spec_decode_attributes(None, None, None, None) == {}
    exporter = InMemorySpanExporter()
    Tracing("t", exporter, batch=False).record(
        RequestSpans(
            timeline=RequestTimeline(),
            arrival=1.0,
            arrival_wall_ns=10**12,
            end=3.0,
            first_scheduled=1.0,
            first_token=2.0,
            last_token=3.0,
            attributes={},
        )
    )
    decode = next(s for s in exporter.get_finished_spans() if s.name == "decode")
    assert dict(decode.attributes) == {}


def test_plain_request_has_null_spec_fields(caplog) -> None:
    from litestar.testing import TestClient
    from prometheus_client import CollectorRegistry

    from kvscope.engine.server.app import create_app
    from kvscope.engine.server.settings import ServerSettings

    app = create_app(
        ServerSettings(),
        engine=FakeEngine(),
        tracing=Tracing("t", InMemorySpanExporter(), batch=False),
        registry=CollectorRegistry(),
    )
    with TestClient(app) as client:
        body = client.post(
            "/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 2}
        ).json()
    assert {k: v for k, v in body["kvscope"].items() if k.startswith("spec_")} == dict.fromkeys(
        ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens", "spec_mean_accepted_length")
    )


def test_the_server_sizes_the_per_position_series_from_the_engine_config() -> None:
    from litestar.testing import TestClient
    from prometheus_client import CollectorRegistry

    from kvscope.engine.config import SpeculativeConfig
    from kvscope.engine.server.app import create_app
    from kvscope.engine.server.settings import ServerSettings

    engine = FakeEngine(speculative=SpeculativeConfig(num_speculative_tokens=3))
    with TestClient(create_app(ServerSettings(), engine=engine, registry=CollectorRegistry())) as client:
        text = client.get("/metrics").text
    name = "kvscope_engine_spec_decode_num_accepted_tokens_per_pos_total"
    assert [line for line in text.splitlines() if line.startswith(name)] == [
        f'{name}{{model="fake-model",position="{p}"}} 0.0' for p in range(3)
    ]
    assert [
        line.split("{")[1].split(",")[0]
        for line in text.splitlines()
        if line.startswith("kvscope_engine_spec_decode_acceptance_length_bucket")
    ] == [f'le="{b}"' for b in ("1.0", "2.0", "3.0", "4.0", "+Inf")]
