"""The tenant of a request (issue 35, engine/core/fairness.py): the ``x-kvscope-tenant`` header the gateway
sets to the caller's API key name reaches every sequence of the request (``Request.fairness_tenant``);
without it the request is its own tenant, and the body's ``user`` field (the client's pick) is never a
tenant."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from litestar.testing import TestClient
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from kvscope.engine.config import CacheConfig, EngineConfig, ModelConfig
from kvscope.engine.core.request import Request
from kvscope.engine.core.scheduler import Scheduler
from kvscope.engine.server.app import create_app
from kvscope.engine.server.serving import TENANT_HEADER
from kvscope.engine.server.settings import ServerSettings
from kvscope.engine.server.tracing import Tracing
from tests.engine.server.conftest import chat_body
from tests.engine.spec_distribution import TOKENIZER_FILES


def _recording(fake_engine) -> list[tuple[str, str | None, str | None]]:
    """(engine request id, fairness_group, fairness_tenant) of every EngineRequest the server queues."""
    seen = []
    generate = fake_engine.generate

    def recording(request_id, request, **kwargs):
        seen.append((request_id, request.fairness_group, request.fairness_tenant))
        return generate(request_id, request, **kwargs)

    fake_engine.generate = recording
    return seen


def test_the_header_is_the_tenant_of_every_prompt_and_user_is_not(client, fake_engine):
    seen = _recording(fake_engine)
    body = {"model": "fake-model", "prompt": ["a", "b"], "n": 2, "max_tokens": 1, "user": "someone-else"}
    response = client.post("/v1/completions", json=body, headers={TENANT_HEADER: "team-a@corp.example"})
    assert response.status_code == 200, response.text
    rid = response.json()["id"]
    assert seen == [(f"{rid}-p0", rid, "team-a@corp.example"), (f"{rid}-p1", rid, "team-a@corp.example")]
    seen.clear()
    response = client.post("/v1/chat/completions", json=chat_body(max_tokens=1, user="team-a"))
    assert response.status_code == 200, response.text
    assert seen == [(response.json()["id"], response.json()["id"], None)]  # no header: its own tenant


@pytest.mark.parametrize(
    "value", ["", "-starts-with-dash", "has space", "a" * 65, "tenant:x", "k\xe9y".encode("latin-1")]
)
def test_a_malformed_tenant_is_a_400_naming_the_header_and_nothing_is_queued(client, fake_engine, value):
    response = client.post(
        "/v1/completions",
        json={"model": "fake-model", "prompt": "hi", "max_tokens": 1},
        headers={TENANT_HEADER: value},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", TENANT_HEADER)
    assert error["message"].startswith("x-kvscope-tenant must be 1-64 of letters, digits")
    assert fake_engine.started == ["warmup"]


def _tiny_model(out: Path, tokenizer_dir: Path) -> Path:
    """Random weights, one layer, the test model's tokenizer and vocabulary (the server's start-up generation
    sends text): an engine that loads in a moment."""
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out / name)
    return out


def test_the_header_reaches_the_schedulers_requests_of_the_real_engine(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch
) -> None:
    tiny = _tiny_model(tmp_path / "tiny", tokenizer_dir)
    queued: list[Request] = []
    add_request = Scheduler.add_request

    def recording(self, request, prediction=None):
        queued.append(request)
        add_request(self, request, prediction)

    monkeypatch.setattr(Scheduler, "add_request", recording)
    config = EngineConfig(
        model=ModelConfig(model=str(tiny), dtype="float32"),
        num_threads=1,
        cache=CacheConfig(block_size=16, num_blocks=64),
    )
    app = create_app(
        ServerSettings(),
        config,
        tracing=Tracing("test", InMemorySpanExporter(), batch=False),
        registry=CollectorRegistry(),
    )
    with TestClient(app) as client:
        queued.clear()  # the start-up generation
        body = {"prompt": ["Hi", "Ho"], "n": 2, "max_tokens": 2}
        response = client.post("/v1/completions", json=body, headers={TENANT_HEADER: "key-a"})
        assert response.status_code == 200, response.text
        rid = response.json()["id"]
        assert [
            (r.request_id, r.fairness_group, r.fairness_tenant, r.fairness_tenant_key) for r in queued
        ] == [(f"{rid}-p{p}-{c}", rid, "key-a", "tenant:key-a") for p in range(2) for c in range(2)]
        queued.clear()
        response = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert response.status_code == 200, response.text
        rid = response.json()["id"]
        assert [(r.fairness_tenant, r.fairness_tenant_key) for r in queued] == [(None, rid)]
