"""Settings of the engine HTTP server. The only module of ``kvscope.engine.server`` that reads the
environment.

Two msgspec Structs hold every default once: :class:`EngineOptions` (the engine flags; their defaults are
:class:`kvscope.engine.config.EngineConfig`'s) and :class:`ServerSettings`. The command line is derived from
their fields by :mod:`kvscope.common.settings_cli` (the gateway's settings use the same helper); precedence:
defaults < environment < flags.

Environment variables: ``OTEL_SERVICE_NAME`` names the service (default ``kvscope-engine``);
``KVSCOPE_ENGINE_API_KEY`` is the API key when ``--api-key`` is not given (a flag is visible in ``ps``, the
environment is not). The OpenTelemetry SDK reads its own ``OTEL_*`` variables (endpoints, protocol, export
interval, ``OTEL_SDK_DISABLED``; kvscope/common/otel_env.py); ``--otlp-endpoint`` overrides their endpoints
and an unsupported ``OTEL_EXPORTER_OTLP_PROTOCOL`` is rejected here.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Annotated, Literal

import msgspec

from kvscope.common.event_loop import EventLoop, resolve_event_loop
from kvscope.common.net import is_loopback
from kvscope.common.otel_env import protocol as otlp_protocol
from kvscope.common.read_timeouts import BODY_TIMEOUT_S, HEAD_TIMEOUT_S, ReadTimeouts
from kvscope.common.settings_cli import Flag, add_flags, from_env, given, load
from kvscope.engine.config import (
    DEFAULT_MODEL,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from kvscope.engine.server.metrics import MetricBuckets
from kvscope.engine.structured.params import CompileLimits

DEFAULT_SERVICE_NAME = "kvscope-engine"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_STRUCT = {"frozen": True, "kw_only": True, "forbid_unknown_fields": True}


def parse_size(text: str | int) -> int:
    """Bytes from ``"536870912"``, ``"512M"``, ``"512MiB"``, ``"1.5G"`` (binary units). Raises ValueError."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (examples: 268435456, 256M, 1GiB)")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * _UNITS[unit])


def config_default(cls: type, name: str) -> object:
    """The default of field ``name`` of the engine config dataclass ``cls`` (kvscope.engine.config holds each
    once; the ``kvscope engine --help`` texts below name it). Raises StopIteration for an unknown field."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def _size_text(size: object) -> str:
    """``1073741824`` → ``1GiB`` (a whole number of GiB or MiB, as ``--kv-cache-memory`` takes it)."""
    assert isinstance(size, int)
    return f"{size >> 30}GiB" if size % (1 << 30) == 0 else f"{size >> 20}MiB"


def api_key_from(explicit: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """``explicit`` (``--api-key``), else ``$KVSCOPE_ENGINE_API_KEY``, else None."""
    env = os.environ if environ is None else environ
    return explicit or env.get("KVSCOPE_ENGINE_API_KEY") or None


def _api_key_from_env(environ: Mapping[str, str]) -> str | None:
    return api_key_from(None, environ)


class EngineOptions(msgspec.Struct, **_STRUCT):
    """The engine options of ``kvscope engine`` (kvscope.engine.llm.build_engine_config keywords). None:
    the default of :class:`kvscope.engine.config.EngineConfig` (engine/config.py holds those defaults,
    once). The server's own defaults differ in one place: ``dtype``/``quantization`` are ``auto`` (the
    fastest verified weight format, engine/platform/format_choice.py), where the library keeps float32 for
    exact parity."""

    model: Annotated[str, Flag("registry name, HF folder or .gguf file")] = DEFAULT_MODEL
    served_model_name: Annotated[
        str | None,
        Flag(
            "name in /v1/models and the `model` field (default: the registry name, the .gguf file's name "
            "without "
            ".gguf, or the HF folder's name)"
        ),
    ] = None
    max_model_len: Annotated[
        int | None,
        Flag("context length enforced (prompt + completion) (default: the model's max_position_embeddings)"),
    ] = None
    max_num_seqs: Annotated[
        int | None,
        Flag(
            f"most requests in one engine step (default: {config_default(SchedulerConfig, 'max_num_seqs')})"
        ),
    ] = None
    max_num_batched_tokens: Annotated[
        int | None,
        Flag(
            "token budget of one engine step "
            f"(default: {config_default(SchedulerConfig, 'max_num_batched_tokens')})"
        ),
    ] = None
    long_prefill_token_threshold: Annotated[
        int | None, Flag("cap one request's prefill chunk (default: 0, no cap)")
    ] = None
    kv_cache_memory: Annotated[
        int | None,
        Flag(
            "KV cache bytes on CPU (e.g. 256M, 1GiB) "
            f"(default: {_size_text(config_default(CacheConfig, 'kv_cache_memory'))})",
            parse=parse_size,
        ),
    ] = None
    memory_budget: Annotated[
        int | None,
        Flag(
            "CPU: bytes for weights + KV cache (e.g. 2GiB); the KV cache gets it minus the loaded format's "
            "weights "
            "(overrides --kv-cache-memory; default: none)",
            parse=parse_size,
        ),
    ] = None
    num_blocks: Annotated[
        int | None,
        Flag("exact number of KV blocks (overrides the memory budget; default: what the budget holds)"),
    ] = None
    block_size: Annotated[
        int | None, Flag(f"tokens per KV block (default: {config_default(CacheConfig, 'block_size')})")
    ] = None
    gpu_memory_utilization: Annotated[
        float | None,
        Flag(
            "CUDA: fraction of device memory to use "
            f"(default: {config_default(CacheConfig, 'gpu_memory_utilization')})"
        ),
    ] = None
    enable_prefix_caching: Annotated[
        bool | None, Flag("disable the prefix cache", name="--no-prefix-caching", negate=True)
    ] = None
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        Flag(
            "weights/activations (default auto: with --quantization auto the chosen format's, else bfloat16 "
            "where "
            "the CPU probe measures it faster; float32 for exact parity with transformers)"
        ),
    ] = "auto"
    quantization: Annotated[
        Literal["auto", "none", "int8", "int4", "gguf"],
        Flag(
            "linear-layer weights on CPU: int8 weight-only, int4 (a Q4 GGUF's own blocks), gguf; default "
            "auto: the "
            "fastest format verified for the model, by the start-up probe (--dtype float32 alone: none)"
        ),
    ] = "auto"
    cpu_kernels: Annotated[
        Literal["auto", "torch"] | None,
        Flag(
            "CPU kernels of compact weights: auto = kvscope's own kernels and one-call decode step "
            "(AVX-512 VNNI, or AVX2 + FMA + F16C; built once with the system C++ compiler; torch's where "
            "they cannot build), torch = "
            "torch's only "
            f"(default: {config_default(ModelConfig, 'cpu_kernels')})"
        ),
    ] = None
    seed: Annotated[
        int | None,
        Flag(
            "vLLM's --seed, accepted; sampling is seeded per request, by its seed field "
            f"(default: {config_default(ModelConfig, 'seed')})"
        ),
    ] = None
    device: Annotated[
        str | None, Flag(f"cpu or cuda[:N] (default: {config_default(EngineConfig, 'device')})")
    ] = None
    attention_backend: Annotated[
        Literal["auto", "torch", "triton"] | None,
        Flag(
            "auto = Triton on CUDA, torch elsewhere "
            f"(default: {config_default(EngineConfig, 'attention_backend')})"
        ),
    ] = None
    num_threads: Annotated[
        int | None, Flag("torch intra-op threads on CPU (default: the usable CPUs minus one, at least 1)")
    ] = None
    # speculative decoding (engine/spec_decode): kvscope.engine.config.SpeculativeConfig's fields
    speculative: Annotated[
        Literal["none", "ngram"] | None,
        Flag(
            "speculative decoding: ngram = prompt-lookup drafts verified in one forward pass (default none)"
        ),
    ] = None
    num_speculative_tokens: Annotated[
        int | None, Flag("draft tokens per request per step with --speculative ngram (default 4)")
    ] = None
    prompt_lookup_min: Annotated[int | None, Flag("shortest suffix n-gram looked up (default 2)")] = None
    prompt_lookup_max: Annotated[int | None, Flag("longest suffix n-gram looked up first (default 4)")] = None
    # admission (engine/core/admission.py, issue 42)
    ttft_slo: Annotated[
        str | None,
        Flag(
            "TTFT objective (s) per tier: 2 for every tier, or priority=1,default=2,flex=30; a request "
            "predicted to miss its tier's is refused with 503 and Retry-After (default: none, admission off)"
        ),
    ] = None
    ttft_slo_quantile: Annotated[
        float | None,
        Flag(
            "share of admitted requests meant to meet their TTFT objective: predictions are scaled by the "
            "tier's recent actual/predicted ratio at this quantile (default 0.9)"
        ),
    ] = None

    def config_kwargs(self) -> dict[str, object]:
        """The options that were set, as build_engine_config keywords (``model`` is its first argument)."""
        return {
            name: getattr(self, name)
            for name in self.__struct_fields__
            if name != "model" and getattr(self, name) is not None
        }


class ServerSettings(msgspec.Struct, **_STRUCT):
    """How the HTTP server behaves (the engine itself is configured by
    :class:`kvscope.engine.config.EngineConfig`)."""

    host: Annotated[str, Flag("bind address")] = "127.0.0.1"
    port: Annotated[int, Flag("port")] = 8000
    sse_keepalive_s: Annotated[float, Flag("seconds between SSE keep-alive comments")] = 15.0
    """Send ``: keep-alive`` SSE comments when no event was sent for this long (below proxy idle timeouts)."""
    enable_fault_injection: Annotated[
        bool, Flag("honour the x-kvscope-fault: after_tokens=N header (tests only)")
    ] = False
    """Honour the ``x-kvscope-fault`` request header (tests of mid-stream failure, case S3). Off in
    production."""
    max_concurrent_requests: Annotated[int, Flag("429 above this many; 0 = unlimited")] = 0
    """Generation requests in flight before new ones get 429; 0 = unlimited."""
    max_sequences_per_request: Annotated[
        int, Flag("most sequences (prompts x n) one request may ask for; more is a 400 (default 256)")
    ] = 256
    """Sequences (prompts x ``n``) one generation request may queue; more is a 400 naming ``prompt`` or
    ``n`` before anything is queued. 256: one prompt at OpenAI's largest ``n`` (128) fits twice, and it is
    four full steps at the default ``max_num_seqs`` (64). Each sequence holds an engine request, a
    detokenizer and KV blocks for its prompt; a small body that asks for tens of thousands made a plain
    request wait minutes (docs/benchmarks.md "What the per-request limits cost and buy"). The scheduler's
    fairness (engine/core/fairness.py) keeps requests under the cap from starving others."""
    structured_output_max_grammar_size: Annotated[
        int,
        Flag(
            "largest grammar (llguidance symbols) a structured-output constraint may compile to; more is a "
            "400 "
            "naming the field (default 20000)"
        ),
    ] = CompileLimits().max_grammar_size
    """llguidance's ``max_grammar_size``: a bigger grammar is refused in milliseconds, before the expensive
    part of its compile (engine/structured/params.py CompileLimits says why 20,000; the compile times in
    docs/benchmarks.md "What the per-request limits cost and buy")."""
    structured_output_max_pending_compiles: Annotated[
        int,
        Flag("new grammars queued or compiling at once (one compile thread); one more is a 429 (default 16)"),
    ] = CompileLimits().max_pending
    """Distinct grammars waiting for or in the one compile thread; a request with yet another new grammar
    gets a 429 with ``Retry-After: 1`` (requests with a cached grammar, or none, never wait for compiles)."""
    otlp_endpoint: Annotated[
        str | None,
        Flag(
            "OTLP collector for traces and metrics (OTLP/HTTP base URL or …/v1/traces; a gRPC endpoint with "
            "OTEL_EXPORTER_OTLP_PROTOCOL=grpc); default: $OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]ENDPOINT, "
            "else no export"
        ),
    ] = None
    """OTLP endpoint overriding the ``OTEL_EXPORTER_OTLP_*`` environment (OTLP/HTTP: spans to
    ``/v1/traces``, metrics to ``/v1/metrics``); None = what the environment names, read by the OTel SDK
    (kvscope/common/otel_env.py)."""
    service_name: Annotated[
        str, Flag("OTel service.name (default $OTEL_SERVICE_NAME or kvscope-engine)", env="OTEL_SERVICE_NAME")
    ] = DEFAULT_SERVICE_NAME
    buckets: MetricBuckets = msgspec.field(default_factory=MetricBuckets)
    """Histogram buckets of the ``kvscope_engine_*`` metrics (``--ttft-buckets`` …,
    engine/server/metrics.py)."""
    gpu_telemetry_interval_s: Annotated[
        float,
        Flag(
            "seconds between samples of the CUDA device (NVML, torch allocator); CUDA only",
            name="--gpu-telemetry-interval",
        ),
    ] = 5.0
    """Seconds between GPU telemetry samples (engine/server/gpu_telemetry.py): the Prometheus scrape
    interval of the compose stack; a sample costs a few NVML calls (milliseconds, off the event loop)."""
    warmup: Annotated[bool, Flag("skip the warm-up generation", negate=True)] = True
    """Run one short generation before reporting healthy (first-call costs are paid before traffic)."""
    log_level: Annotated[Literal["debug", "info", "warning", "error"], Flag()] = "info"
    event_loop: Annotated[
        EventLoop,
        Flag(
            "the server's event loop: auto = uvloop where it is installed (an engine "
            "dependency), else asyncio"
        ),
    ] = "auto"
    """uvicorn's event loop (kvscope/common/event_loop.py says why uvloop; docs/benchmarks.md "uvloop under
    the engine's and the gateway's servers")."""
    request_head_timeout_s: Annotated[
        float,
        Flag(
            "a request head must be complete this long after the connection opened or the previous response "
            "ended "
            "(else 408 and close)",
            name="--request-head-timeout",
        ),
    ] = HEAD_TIMEOUT_S
    """Seconds for a whole request head; then a JSON 408 and the connection closed
    (kvscope/common/read_timeouts.py)."""
    request_body_timeout_s: Annotated[
        float,
        Flag(
            "longest silence while a request body arrives (else 408 and close)", name="--request-body-timeout"
        ),
    ] = BODY_TIMEOUT_S
    """Longest silence while a request body is being received; then a JSON 408 and the connection closed."""
    api_key: Annotated[
        str | None,
        Flag(
            "require 'Authorization: Bearer KEY' on every route but /health (default: "
            "$KVSCOPE_ENGINE_API_KEY; none = no auth, warned about on a non-loopback "
            "--host)",
            env=_api_key_from_env,
        ),
    ] = None
    """Bearer key required on every route but ``/health`` (engine/server/auth.py); None: no auth."""

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in [1, 65535], got {self.port}")
        if self.sse_keepalive_s <= 0:
            raise ValueError(f"sse_keepalive_s must be positive, got {self.sse_keepalive_s}")
        ReadTimeouts(self.request_head_timeout_s, self.request_body_timeout_s)  # each must be > 0
        if not self.gpu_telemetry_interval_s > 0:
            raise ValueError(
                f"gpu_telemetry_interval_s must be positive, got {self.gpu_telemetry_interval_s}"
            )
        if self.max_concurrent_requests < 0:
            raise ValueError(f"max_concurrent_requests must be >= 0, got {self.max_concurrent_requests}")
        if self.max_sequences_per_request < 1:
            raise ValueError(f"max_sequences_per_request must be >= 1, got {self.max_sequences_per_request}")
        CompileLimits(self.structured_output_max_grammar_size, self.structured_output_max_pending_compiles)
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")
        resolve_event_loop(self.event_loop)  # uvloop asked for where it is not installed: a config error

    def exposure_warning(self) -> str | None:
        """The warning for a non-loopback bind without an API key (None otherwise): the port serves
        generation, /tokenize, /detokenize, /metrics and /schema to anyone who reaches it, bypassing the
        gateway's keys and limits."""
        if self.api_key is not None or is_loopback(self.host):
            return None
        return (
            f"the engine listens on {self.host}:{self.port} WITHOUT an API key: anyone who can reach this "
            "port can generate (/v1/chat/completions, /v1/completions), tokenize and read /metrics and "
            "/schema, bypassing the gateway's API keys, rate limits and max_tokens ceilings. Bind to "
            "127.0.0.1, or pass --api-key (or set KVSCOPE_ENGINE_API_KEY) and give the gateway the same "
            "key as the upstream's api_key."
        )


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of :class:`EngineOptions` and :class:`ServerSettings` (kvscope.common.settings_cli derives
    them from the fields: ``--max-model-len``, ``--no-warmup`` …). Returns ``parser``."""
    return add_flags(add_flags(parser, EngineOptions), ServerSettings)


def engine_options(args: argparse.Namespace) -> EngineOptions:
    """The engine options of parsed flags (unset ones keep the EngineConfig defaults). Raises ValueError."""
    return load(EngineOptions, given(args, EngineOptions))


def server_settings(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ServerSettings:
    """The server settings of parsed flags, the environment (``environ``, default ``os.environ``) filling what
    the flags leave unset. Raises ValueError naming the invalid value."""
    env = os.environ if environ is None else environ
    for signal in ("traces", "metrics"):
        otlp_protocol(signal, env)  # an unsupported OTEL_EXPORTER_OTLP_PROTOCOL: exit 2 with one line
    return load(ServerSettings, from_env(ServerSettings, env), given(args, ServerSettings))
