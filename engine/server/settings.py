"""Settings of the engine HTTP server. The only module of ``engine.server`` that reads the environment.

Environment variables (standard OpenTelemetry names):
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (used as is) or ``OTEL_EXPORTER_OTLP_ENDPOINT`` (base URL,
``/v1/traces`` appended) switch on the OTLP/HTTP span exporter when ``--otlp-endpoint`` is not given;
``OTEL_SERVICE_NAME`` names the service (default ``kvscope-engine``); ``KVSCOPE_ENGINE_API_KEY`` is the API key
when ``--api-key`` is not given (a flag is visible in ``ps``, the environment is not).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.server.metrics import MetricBuckets
from kvscope.net import is_loopback

DEFAULT_SERVICE_NAME = "kvscope-engine"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """How the HTTP server behaves (the engine itself is configured by :class:`engine.config.EngineConfig`)."""

    host: str = "127.0.0.1"
    port: int = 8000
    sse_keepalive_s: float = 15.0
    """Send ``: keep-alive`` SSE comments when no event was sent for this long (below proxy idle timeouts)."""
    enable_fault_injection: bool = False
    """Honour the ``x-kvscope-fault`` request header (tests of mid-stream failure, case S3). Off in production."""
    max_concurrent_requests: int = 0
    """Generation requests in flight before new ones get 429; 0 = unlimited."""
    otlp_endpoint: str | None = None
    """Full OTLP/HTTP traces URL (``…/v1/traces``); None = no span export."""
    service_name: str = DEFAULT_SERVICE_NAME
    buckets: MetricBuckets = field(default_factory=MetricBuckets)
    """Histogram buckets of the ``kvscope_engine_*`` metrics."""
    warmup: bool = True
    """Run one short generation before reporting healthy (first-call costs are paid before traffic)."""
    log_level: str = "info"
    api_key: str | None = None
    """Bearer key required on every route but ``/health`` (engine/server/auth.py); None: no auth."""

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in [1, 65535], got {self.port}")
        if self.sse_keepalive_s <= 0:
            raise ValueError(f"sse_keepalive_s must be positive, got {self.sse_keepalive_s}")
        if self.max_concurrent_requests < 0:
            raise ValueError(f"max_concurrent_requests must be >= 0, got {self.max_concurrent_requests}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")

    def exposure_warning(self) -> str | None:
        """The warning for a non-loopback bind without an API key (None otherwise): the port serves
        generation, /tokenize, /detokenize, /metrics and /schema to anyone who reaches it, bypassing the
        gateway's keys and limits."""
        if self.api_key is not None or is_loopback(self.host):
            return None
        return (f"the engine listens on {self.host}:{self.port} WITHOUT an API key: anyone who can reach this "
                "port can generate (/v1/chat/completions, /v1/completions), tokenize and read /metrics and "
                "/schema, bypassing the gateway's API keys, rate limits and max_tokens ceilings. Bind to "
                "127.0.0.1, or pass --api-key (or set KVSCOPE_ENGINE_API_KEY) and give the gateway the same "
                "key as the upstream's api_key.")


def api_key_from(explicit: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """``explicit`` (``--api-key``), else ``$KVSCOPE_ENGINE_API_KEY``, else None."""
    env = os.environ if environ is None else environ
    return explicit or env.get("KVSCOPE_ENGINE_API_KEY") or None


def traces_endpoint(explicit: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The OTLP/HTTP traces URL: ``explicit`` (a base URL or a full ``…/v1/traces`` URL) wins over
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (as is) and ``OTEL_EXPORTER_OTLP_ENDPOINT`` (base). None when unset.

    Source: OpenTelemetry spec, "OTLP Exporter Configuration" (signal-specific URLs are used as is, the generic
    one gets ``v1/traces`` appended).
    """
    env = os.environ if environ is None else environ
    if explicit:
        return _with_traces_path(explicit)
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return _with_traces_path(base) if base else None


def service_name(explicit: str | None, environ: Mapping[str, str] | None = None) -> str:
    """``explicit``, else ``OTEL_SERVICE_NAME``, else ``kvscope-engine``."""
    env = os.environ if environ is None else environ
    return explicit or env.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME


def _with_traces_path(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1/traces") else f"{url}/v1/traces"


def parse_size(text: str | int) -> int:
    """Bytes from ``"536870912"``, ``"512M"``, ``"512MiB"``, ``"1.5G"`` (binary units). Raises ValueError."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (examples: 268435456, 256M, 1GiB)")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * _UNITS[unit])


def parse_buckets(text: str) -> tuple[float, ...]:
    """Bucket bounds from ``"0.01,0.1,1"`` (seconds or counts). Validation happens in MetricBuckets."""
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise ValueError(f"bucket bounds must be comma-separated numbers, got {text!r}") from exc
