"""Request log records for tests, built independently of the gateway's record builder, per docs/gateway.md
"Request log"."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

T0 = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)
MODELS = ("smollm2-135m", "qwen3-0.6b")
KEYS = ("key-alice", "key-bob", "key-carol")
UPSTREAMS = ("engine-0:8000", "engine-1:8000")


def iso(ts: datetime) -> str:
    """ECS ``@timestamp``: ISO 8601 UTC with milliseconds and a ``Z``."""
    return ts.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def make_record(
    i: int,
    *,
    ts: datetime | None = None,
    model: str = MODELS[0],
    status: int = 200,
    ttft_s: float | None = 0.05,
    tpot_s: float | None = 0.01,
    e2e_s: float = 0.5,
    user: str = KEYS[0],
    upstream: str = UPSTREAMS[0],
    finish: str | None = "stop",
    input_tokens: int = 20,
    output_tokens: int = 40,
    engine: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One nested ECS-style request log record; request id ``req-{i:06d}``, the gateway's own ``event.id``
    (the Elasticsearch ``_id``) ``evt-{i:06d}``, trace id derived from ``i``."""
    ts = ts or T0 + timedelta(milliseconds=i)
    error = status >= 400
    record: dict[str, Any] = {
        "@timestamp": iso(ts),
        "ecs": {"version": "9.1.0"},
        "log": {"level": "error" if status >= 500 else "info", "logger": "kvscope.gateway.access"},
        "message": f"POST /v1/chat/completions {status}",
        "event": {
            "id": f"evt-{i:06d}",
            "kind": "event",
            "category": ["web"],
            "type": ["access"],
            "outcome": "failure" if error else "success",
            "dataset": "kvscope.gateway",
            "duration": int(e2e_s * 1e9),
            "start": iso(ts - timedelta(seconds=e2e_s)),
            "end": iso(ts),
        },
        "http": {
            "version": "1.1",
            "request": {"id": f"req-{i:06d}", "method": "POST", "body": {"bytes": 512}},
            "response": {"status_code": status, "body": {"bytes": 1024}},
        },
        "url": {"path": "/v1/chat/completions"},
        "client": {"ip": "127.0.0.1"},
        "user_agent": {"original": "OpenAI/Python 1.50.0"},
        "user": {"id": user},
        "server": {"address": upstream},
        "service": {"name": "kvscope-gateway", "version": "0.1.0", "node": {"name": "gw-0"}},
        "trace": {"id": f"{i:032x}"},
        "span": {"id": f"{i:016x}"},
        "gen_ai": {
            "operation": {"name": "chat"},
            "request": {"model": model, "max_tokens": 64, "temperature": 0.0, "stream": True},
            "response": {"model": model, "finish_reasons": [finish] if finish else []},
            "usage": {
                "input_tokens": input_tokens,
                "output_tokens": output_tokens,
                "cache_read": {"input_tokens": 0},
            },
        },
        "error": {"type": None, "message": None},
        "kvscope": {
            "route": "chat",
            "ttft_s": ttft_s,
            "tpot_s": tpot_s,
            "e2e_s": e2e_s,
            "gateway_overhead_s": 0.002,
            "upstream_s": e2e_s - 0.002,
            "gateway": {
                "auth_s": 0.0002,
                "rate_limit_s": 0.0003,
                "tokenize_s": 0.0005,
                "retry_s": 0.0,
                "upstream_connect_s": 0.001,
                "upstream_response_s": e2e_s - 0.003,
                "other_s": 0.001,
            },
            "engine": None,
            "upstream": upstream_part(ttft_s, engine, tpot_s),
            "attempts": 1,
            "client_disconnected": False,
            "disconnect_phase": None,
            "rate_limited": False,
            "rate_limit_reason": None,
            "stream_error": None,
            "prompt_tokens_counted": input_tokens,
            "routing": {
                "policy": "least_outstanding",
                "reason": "load",
                "replica": upstream,
                "predicted_cached_tokens": None,
                "cached_tokens": 0,
                "prefix_unit": None,
            },
        },
    }
    if error:
        record["error"] = {
            "type": "upstream_error" if status >= 500 else "invalid_request_error",
            "message": f"status {status}",
        }
    if engine is not None:
        record["kvscope"]["engine"] = engine
    return record


def upstream_part(
    ttft_s: float | None, engine: dict[str, Any] | None, tpot_s: float | None = None
) -> dict[str, Any]:
    """``kvscope.upstream`` of a streamed record answered by our engine (kind from its ``/v1/models`` card;
    docs/gateway.md "Request log"): each quantity ``per_request`` where ``engine`` has it, ``ttft_s`` and
    ``tpot_s`` measured by the gateway where given, no ``/metrics`` samples."""
    e = engine or {}

    def per_request(key: str) -> str | None:
        return "per_request" if e.get(key) is not None else None

    return {
        "kind": "kvscope",
        "kind_source": "models",
        "sources": {
            "ttft_s": "gateway" if ttft_s is not None else None,
            "tpot_s": "gateway" if tpot_s is not None else None,
            "queue_s": per_request("queue_s"),
            "prefill_s": per_request("prefill_s"),
            "decode_s": per_request("decode_s"),
            "cached_tokens": per_request("cached_tokens"),
            "batch_size": per_request("batch_size_mean"),
            "kv_cache_usage": per_request("kv_cache_usage"),
            "queue_ahead": per_request("queue_ahead"),
        },
        "sampled": {"arrival": None, "finish": None},
    }


def engine_stats(
    queue_s: float,
    prefill_s: float,
    decode_s: float,
    *,
    batch_mean: float = 4.0,
    batch_max: int = 8,
    kv_usage: float = 0.3,
    preemptions: int = 0,
) -> dict[str, Any]:
    """The ``kvscope.engine`` object (docs/engine-server.md, "The kvscope object")."""
    return {
        "queue_s": queue_s,
        "ttft_s": queue_s + prefill_s,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "tpot_s": decode_s / 39,
        "batch_size_mean": batch_mean,
        "batch_size_max": batch_max,
        "kv_blocks": 4,
        "kv_cache_usage": kv_usage,
        "num_preemptions": preemptions,
    }
