"""CLI flags → EngineConfig/ServerSettings, env handling, and the small routes (models, tokenize, OpenAPI)."""

from __future__ import annotations

import pytest

from kvscope.engine.llm import build_engine_config
from kvscope.engine.server.cli import build_parser, engine_config_kwargs, engine_main, server_settings
from kvscope.engine.server.settings import parse_size


def test_flags_map_to_engine_config_and_settings(monkeypatch):
    monkeypatch.setenv(
        "OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/"
    )  # read by the OTel SDK, not here
    args = build_parser().parse_args(
        [
            "--model",
            "smollm2-135m",
            "--max-model-len",
            "2048",
            "--max-num-seqs",
            "4",
            "--kv-cache-memory",
            "160M",
            "--block-size",
            "8",
            "--served-model-name",
            "tiny",
            "--no-prefix-caching",
            "--sse-keepalive-s",
            "0.5",
            "--enable-fault-injection",
            "--ttft-buckets",
            "0.1,1,10",
        ]
    )
    config = build_engine_config(args.model, **engine_config_kwargs(args))
    assert (config.model.max_model_len, config.model.served_model_name) == (2048, "tiny")
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (4, 1024)
    assert (config.cache.kv_cache_memory, config.cache.block_size, config.cache.enable_prefix_caching) == (
        160 << 20,
        8,
        False,
    )
    settings = server_settings(args)
    assert settings.otlp_endpoint is None
    assert (settings.sse_keepalive_s, settings.enable_fault_injection) == (0.5, True)
    assert settings.buckets.ttft_s == (0.1, 1.0, 10.0)


def test_an_unsupported_otlp_protocol_is_a_settings_error(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_PROTOCOL must be one of http/protobuf, grpc"):
        server_settings(build_parser().parse_args([]))


def test_parse_size():
    assert [parse_size(s) for s in ("1024", "1k", "160M", "160MiB", "1.5G", "2gb")] == [
        1024,
        1024,
        160 << 20,
        160 << 20,
        3 << 29,
        2 << 30,
    ]
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")


def test_invalid_configuration_exits_2(capsys):
    assert engine_main(["--ttft-buckets", "2,1"]) == 2
    assert "strictly increasing" in capsys.readouterr().err


def test_models_reports_enforced_context_length(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [(m["id"], m["max_model_len"], m["object"]) for m in body["data"]] == [
        ("fake-model", 128, "model")
    ]


def test_tokenize_and_detokenize(client):
    body = client.post("/tokenize", json={"prompt": "hé", "return_token_strs": True}).json()
    assert body == {
        "count": 3,
        "max_model_len": 128,
        "tokens": [104, 195, 169],
        "token_strs": ["h", "bytes:\\xc3", "bytes:\\xa9"],
    }
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] == 20
    assert client.post("/detokenize", json={"tokens": [104, 195, 169]}).json() == {"prompt": "hé"}
    error = client.post("/detokenize", json={"tokens": [300]}).json()["error"]
    assert error["param"] == "tokens"
    assert client.post("/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404


def test_openapi_schema_documents_the_api(client):
    schema = client.get("/schema/openapi.json").json()
    assert {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/health",
        "/metrics",
    } <= set(schema["paths"])
    assert "ChatCompletionRequest" in str(schema["paths"]["/v1/chat/completions"]["post"]["requestBody"])
