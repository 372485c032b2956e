"""``kvscope engine …`` / ``python -m engine.server …``: serve one model over the OpenAI API with uvicorn.

``engine_main(argv) -> int`` parses the flags into an EngineConfig (engine.llm.build_engine_config) and
ServerSettings, warns loudly when it binds a non-loopback address without ``--api-key``, configures logging (request lines as JSON on stdout, everything else on stderr) and runs
uvicorn until SIGINT/SIGTERM. On shutdown in-flight requests fail at once with "engine shutting down"
(streams receive an in-band error event) instead of hanging until the graceful-shutdown timeout.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from engine.config import DEFAULT_MODEL
from engine.server.access_log import ACCESS_LOGGER, JsonLineHandler
from engine.server.metrics import MetricBuckets
from engine.server.settings import (
    ServerSettings,
    api_key_from,
    parse_buckets,
    parse_size,
    service_name,
    traces_endpoint,
)

_ENGINE_FLAGS = {  # flag dest → build_engine_config keyword
    "max_model_len": "max_model_len", "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens", "long_prefill_token_threshold": "long_prefill_token_threshold",
    "kv_cache_memory": "kv_cache_memory", "num_blocks": "num_blocks", "block_size": "block_size",
    "gpu_memory_utilization": "gpu_memory_utilization", "served_model_name": "served_model_name", "dtype": "dtype",
    "quantization": "quantization",
    "seed": "seed", "device": "device", "attention_backend": "attention_backend", "num_threads": "num_threads",
}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvscope engine", description="Serve a model with the kvscope engine.")
    p.add_argument("--model", default=DEFAULT_MODEL, help="registry name, HF folder or .gguf file")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="name in /v1/models and the `model` field (default: --model)")
    p.add_argument("--max-model-len", type=int, help="context length enforced (prompt + completion)")
    p.add_argument("--max-num-seqs", type=int, help="most requests in one engine step")
    p.add_argument("--max-num-batched-tokens", type=int, help="token budget of one engine step")
    p.add_argument("--long-prefill-token-threshold", type=int, help="cap one request's prefill chunk")
    p.add_argument("--kv-cache-memory", type=parse_size, help="KV cache bytes on CPU (e.g. 256M, 1GiB)")
    p.add_argument("--num-blocks", type=int, help="exact number of KV blocks (overrides the memory budget)")
    p.add_argument("--block-size", type=int, help="tokens per KV block")
    p.add_argument("--gpu-memory-utilization", type=float, help="CUDA: fraction of device memory to use")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
                   help="weights/activations (default float32; auto: bfloat16 where the CPU probe measures it faster)")
    p.add_argument("--quantization", choices=("none", "int8", "int4", "gguf"),
                   help="linear-layer weights on CPU: int8 weight-only, int4 (a Q4 GGUF's own blocks), gguf")
    p.add_argument("--seed", type=int)
    p.add_argument("--device", help="cpu or cuda[:N]")
    p.add_argument("--attention-backend", choices=("auto", "torch", "triton"))
    p.add_argument("--num-threads", type=int, help="torch intra-op threads on CPU")
    p.add_argument("--sse-keepalive-s", type=float, default=15.0, help="seconds between SSE keep-alive comments")
    p.add_argument("--max-concurrent-requests", type=int, default=0, help="429 above this many; 0 = unlimited")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but /health "
                   "(default: $KVSCOPE_ENGINE_API_KEY; none = no auth, warned about on a non-loopback --host)")
    p.add_argument("--enable-fault-injection", action="store_true",
                   help="honour the x-kvscope-fault: after_tokens=N header (tests only)")
    p.add_argument("--otlp-endpoint", help="OTLP/HTTP collector (base URL or …/v1/traces); "
                   "default: $OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, else no export")
    p.add_argument("--service-name", help="OTel service.name (default $OTEL_SERVICE_NAME or kvscope-engine)")
    p.add_argument("--ttft-buckets", type=parse_buckets, help="comma-separated TTFT histogram bounds (s)")
    p.add_argument("--tpot-buckets", type=parse_buckets, help="TPOT / inter-token latency bounds (s)")
    p.add_argument("--duration-buckets", type=parse_buckets, help="e2e/queue/prefill/decode bounds (s)")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up generation")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def engine_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine keyword arguments given on the command line (unset flags keep the config defaults)."""
    kwargs = {key: getattr(args, dest) for dest, key in _ENGINE_FLAGS.items() if getattr(args, dest) is not None}
    if args.no_prefix_caching:
        kwargs["enable_prefix_caching"] = False
    return kwargs


def server_settings(args: argparse.Namespace) -> ServerSettings:
    buckets = {name: value for name, value in (("ttft_s", args.ttft_buckets), ("token_latency_s", args.tpot_buckets),
                                               ("duration_s", args.duration_buckets)) if value is not None}
    return ServerSettings(
        host=args.host, port=args.port, sse_keepalive_s=args.sse_keepalive_s,
        enable_fault_injection=args.enable_fault_injection, max_concurrent_requests=args.max_concurrent_requests,
        otlp_endpoint=traces_endpoint(args.otlp_endpoint), service_name=service_name(args.service_name),
        buckets=MetricBuckets(**buckets), warmup=not args.no_warmup, log_level=args.log_level,
        api_key=api_key_from(args.api_key))


def configure_logging(level: str) -> None:
    """Request lines (JSON) on stdout; other logs on stderr."""
    root = logging.getLogger()
    root.setLevel(level.upper())
    errors = logging.StreamHandler(sys.stderr)
    errors.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(errors)
    access = logging.getLogger(ACCESS_LOGGER)
    access.propagate = False
    access.setLevel(logging.INFO)
    sys.stdout.flush()  # anything printed before goes out ahead of the first record
    lines = JsonLineHandler(sys.stdout.buffer)
    lines.setFormatter(logging.Formatter("%(message)s"))
    access.addHandler(lines)


def engine_main(argv: Sequence[str] | None = None) -> int:
    """Run the server; returns the process exit code (2 for invalid flags or configuration)."""
    args = build_parser().parse_args(argv)
    try:
        settings = server_settings(args)
        from engine.llm import build_engine_config

        config = build_engine_config(args.model, **engine_config_kwargs(args))
    except (ValueError, TypeError) as exc:
        print(f"kvscope engine: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    if (warning := settings.exposure_warning()) is not None:
        logging.getLogger("kvscope.engine").warning("%s\n%s\n%s", "!" * 100, warning, "!" * 100)
    return _serve(settings, config)


def _serve(settings: ServerSettings, config: Any) -> int:
    import uvicorn

    from engine.server.app import create_app

    app = create_app(settings, config)

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            await app.state.context.drain()
            await super().shutdown(sockets)

    server = DrainingServer(uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning",
                                           access_log=False, timeout_graceful_shutdown=5, lifespan="on"))
    server.run()
    return 0 if server.started else 1
