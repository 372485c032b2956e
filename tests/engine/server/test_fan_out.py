"""Fan-out limit (issue 35, serving case N3): prompts x n of one request is capped by
``--max-sequences-per-request`` (default 256) with a 400 naming ``prompt`` or ``n`` before anything is queued,
and every engine request of one HTTP request carries the same fairness group (engine/core/fairness.py)."""

from __future__ import annotations

import pytest
from litestar.testing import TestClient
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from kvscope.engine.server.app import create_app
from kvscope.engine.server.cli import build_parser
from kvscope.engine.server.settings import ServerSettings, server_settings
from kvscope.engine.server.tracing import Tracing
from tests.engine.server.conftest import chat_body
from tests.engine.server.fakes import FakeEngine


def _error(response) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


@pytest.mark.parametrize(("num_prompts", "n", "param", "total"), [
    (400, 64, "prompt", 25600),  # the probe's 6 KB body: 400 prompts alone are over the limit
    (300, 1, "prompt", 300),
    (4, 128, "n", 512),
    (3, 86, "n", 258),
])  # fmt: skip
def test_over_the_limit_is_a_400_naming_it_and_nothing_is_queued(
    client, fake_engine, num_prompts, n, param, total
):
    body = {"model": "fake-model", "prompt": ["Say hi"] * num_prompts, "n": n, "max_tokens": 4}
    error = _error(client.post("/v1/completions", json=body))
    assert error["param"] == param
    assert error["message"] == (
        f"This request asks for {total} sequences ({num_prompts} prompt(s) x n={n}); the limit is 256 "
        "sequences per request (--max-sequences-per-request). Send fewer prompts or a smaller n, or split "
        "the request."
    )
    assert fake_engine.started == ["warmup"]  # the start-up generation only


def test_token_id_prompts_count_as_lists(client, fake_engine):
    error = _error(
        client.post("/v1/completions", json={"model": "fake-model", "prompt": [[1, 2]] * 129, "n": 2})
    )
    assert (error["param"], fake_engine.started) == ("n", ["warmup"])
    response = client.post(
        "/v1/completions", json={"model": "fake-model", "prompt": [1, 2] * 50, "n": 3, "max_tokens": 1}
    )
    assert response.status_code == 200, response.text  # one prompt of 100 token ids, not 100 prompts x n 3


def test_exactly_the_limit_is_served(client, fake_engine):
    body = {"model": "fake-model", "prompt": ["Say hi", "Say ho"], "n": 128, "max_tokens": 1}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 256
    assert len(fake_engine.started) == 3  # warmup, then one per prompt


def test_every_engine_request_of_one_http_request_shares_its_fairness_group(client, fake_engine):
    groups = []
    generate = fake_engine.generate

    def recording(request_id, request, **kwargs):
        groups.append((request_id, request.fairness_group))
        return generate(request_id, request, **kwargs)

    fake_engine.generate = recording
    body = {"model": "fake-model", "prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    rid = response.json()["id"]
    assert groups == [(f"{rid}-p0", rid), (f"{rid}-p1", rid), (f"{rid}-p2", rid)]


def test_the_limit_is_a_setting_and_chat_names_n():
    settings = ServerSettings(max_sequences_per_request=4)
    app = create_app(
        settings,
        engine=FakeEngine(),
        tracing=Tracing("test", InMemorySpanExporter(), batch=False),
        registry=CollectorRegistry(),
    )
    with TestClient(app) as client:
        error = _error(client.post("/v1/chat/completions", json=chat_body(n=5, max_tokens=1)))
        assert error["param"] == "n" and "the limit is 4 sequences per request" in error["message"]
        assert client.post("/v1/chat/completions", json=chat_body(n=4, max_tokens=1)).status_code == 200


def test_the_flag_and_its_bounds():
    assert ServerSettings().max_sequences_per_request == 256
    args = build_parser().parse_args(["--max-sequences-per-request", "32"])
    assert server_settings(args, {}).max_sequences_per_request == 32
    with pytest.raises(ValueError, match="max_sequences_per_request must be >= 1, got 0"):
        ServerSettings(max_sequences_per_request=0)
