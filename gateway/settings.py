"""Gateway configuration: frozen msgspec Structs, loaded from a YAML/TOML file, then env, then CLI overrides.

This is the only module of the gateway that reads the environment (besides the OpenTelemetry SDK, which reads
its own ``OTEL_*`` variables: kvscope/common/otel_env.py). Precedence (later wins): built-in defaults < config
file < ``KVSCOPE_GATEWAY_*`` env vars < CLI flags; for ``OTEL_SERVICE_NAME`` and the ``OTEL_EXPORTER_OTLP_*``
endpoints the config file and flags override the environment (OTel's variables are the defaults). Every struct
forbids unknown keys, so a typo in the config file is an error, not a silent default.

Defaults are written once, on the fields. A field that a flag or an environment variable sets says so with
``Annotated[..., Flag(...)]``; :mod:`kvscope.common.settings_cli` (shared with the engine server) derives the
``kvscope gateway`` flags and reads the variables from those annotations.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml

from kvscope.common.event_loop import EventLoop, resolve_event_loop
from kvscope.common.net import is_loopback
from kvscope.common.otel_env import protocol as otlp_protocol
from kvscope.common.read_timeouts import BODY_TIMEOUT_S, HEAD_TIMEOUT_S
from kvscope.common.settings_cli import Flag, from_env, merge
from kvscope.gateway.forwarded import parse_networks

_STRUCT = {"frozen": True, "forbid_unknown_fields": True, "kw_only": True}

TTFT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    320.0,
    640.0,
    1200.0,
    1800.0,
)
TPOT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
DURATION_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    900.0,
    1200.0,
    1800.0,
    3600.0,
)
"""Request durations reach the default ``timeouts.total_s`` (1800 s) in a finite bucket: a histogram whose
top bound is below the longest possible request reports every longer request as that bound (p99 reads 600 s
for a 1,500 s request). :class:`GatewaySettings` refuses TTFT/duration buckets that end below ``total_s``."""
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


def parse_key_hash(item: str) -> dict[str, str]:
    """``NAME:SHA256`` → ``{"name": NAME, "sha256": SHA256}``. Raises ValueError."""
    name, sep, digest = item.strip().partition(":")
    if not sep or not name:
        raise ValueError(f"expected NAME:SHA256, got {item!r}")
    return {"name": name, "sha256": digest}


def tokenizer_model(item: str) -> dict[str, str]:
    """``--tokenizer MODEL=PATH`` → ``{"name": MODEL, "tokenizer": PATH}``. Raises ValueError."""
    name, sep, path = item.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--tokenizer expects MODEL=PATH, got {item!r}")
    return {"name": name, "tokenizer": path}


def _upstream(url: str) -> dict[str, str]:
    return {"url": url}


def _positive(config: msgspec.Struct, names: tuple[str, ...] | None = None) -> None:
    """Raise ValueError unless every field in ``names`` (default: all) is a finite number > 0 (NaN compares
    false with everything: ``nan <= 0`` would pass, then ``asyncio.sleep(nan)`` or ``math.ceil`` fail
    later)."""
    for name in names or config.__struct_fields__:
        value = getattr(config, name)
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a finite number > 0, got {value}")


UpstreamKindSetting = Literal["auto", "kvscope", "vllm", "sglang", "llamacpp", "tgi", "openai"]
"""Which inference server an upstream is: ``auto`` (detected: its ``/v1/models`` card's ``owned_by``, then
the names in its ``/metrics``, then its ``/info`` or ``/props``, else ``openai``) or one of the kinds of
gateway/engines/kinds.py ``UpstreamKind`` (the same values; a test keeps them equal)."""


def _metrics_path(path: str | None) -> None:
    """Raises ValueError unless ``path`` is None or an absolute path (``/metrics``)."""
    if path is not None and (not path.startswith("/") or "://" in path):
        raise ValueError(f"metrics_path must be a path starting with /, or null, got {path!r}")


class UpstreamConfig(msgspec.Struct, **_STRUCT):
    """One OpenAI-compatible upstream replica (our engine, vLLM, llama.cpp, TGI …)."""

    url: str
    """Base URL without ``/v1``, e.g. ``http://127.0.0.1:8001``."""
    models: tuple[str, ...] = ()
    """Served model names; empty: whatever the upstream's ``/v1/models`` lists."""
    api_key: str | None = None
    """Bearer token the gateway sends to this upstream (e.g. vLLM ``--api-key``); never the client's key."""
    name: str | None = None
    """Label value in ``kvscope_gateway_upstream_*`` metrics; defaults to ``host:port``."""
    kind: UpstreamKindSetting = "auto"
    """The server it is (what its answers and ``/metrics`` say, docs/gateway.md "Upstream kinds"); ``auto``:
    detected at start and at every health check."""
    metrics_path: str | None = "/metrics"
    """Its Prometheus endpoint, sampled for the request log's batch size, queue and KV usage
    (``upstream_metrics``; llama.cpp's ``/slots`` beside it); null: neither is ever scraped (e.g. a hosted
    API)."""

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"upstream url must start with http:// or https://, got {self.url!r}")
        base = self.url.rstrip("/")
        if base.endswith("/v1"):
            raise ValueError(
                f"upstream url {self.url!r} ends in /v1: give the server's base URL, "
                f"{base.removesuffix('/v1')!r} (the gateway adds /v1/chat/completions, /v1/models …)"
            )
        _metrics_path(self.metrics_path)

    @property
    def label(self) -> str:
        return self.name or self.url.split("://", 1)[1].rstrip("/")


RoutingPolicy = Literal["auto", "cache_aware", "least_outstanding", "round_robin"]
"""How a request's replica is chosen (gateway/routing/): ``cache_aware`` (the replica most likely to hold the
prompt's prefix in its KV cache, within a load bound), ``least_outstanding`` (fewest requests in flight),
``round_robin``; ``auto``: cache_aware whenever the model has more than one replica, else
least_outstanding."""


class ModelConfig(msgspec.Struct, **_STRUCT):
    """Per-model settings the gateway cannot learn from the upstream."""

    name: str
    routing: RoutingPolicy | None = None
    """This model's routing policy; None: ``routing.policy``."""
    tokenizer: str | None = None
    """``tokenizer.json`` or a model folder holding it (+
    ``tokenizer_config.json``/``chat_template.jinja``)."""
    max_model_len: int | None = None
    """Context length in tokens; overrides ``max_model_len`` from the upstream's ``/v1/models``."""


class KeyLimits(msgspec.Struct, **_STRUCT):
    """Per-key limits; ``None`` means unlimited."""

    max_tokens: int | None = None
    """Ceiling on ``max_tokens``: larger requests get 400, requests without one get this value."""
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    """Prompt + completion tokens per minute (token bucket; settled with the real usage at the end)."""
    max_concurrent: int | None = None

    def __post_init__(self) -> None:
        for field in self.__struct_fields__:
            value = getattr(self, field)
            if value is not None and value < 1:
                raise ValueError(f"{field} must be >= 1 or null, got {value}")

    def merged(self, defaults: KeyLimits) -> KeyLimits:
        """These limits with unset fields taken from ``defaults``."""
        return KeyLimits(
            **{
                f: getattr(self, f) if getattr(self, f) is not None else getattr(defaults, f)
                for f in self.__struct_fields__
            }
        )


KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
"""An API key's name: 1-64 of letters, digits, ``.``, ``_``, ``@``, ``-`` (a safe ``user.id`` and
rate-limit key; no ``:``, which ``--api-key-hash NAME:SHA256`` uses as its separator)."""


def check_key_name(name: str) -> None:
    """Raises ValueError when ``name`` is not a valid API key name (:data:`KEY_NAME`)."""
    if not KEY_NAME.fullmatch(name):
        raise ValueError(
            f"api key name {name!r} must be 1-64 of A-Z a-z 0-9 . _ @ - (starting with a letter or digit)"
        )


class ApiKeyConfig(msgspec.Struct, **_STRUCT):
    """An API key, stored only as the sha256 hex digest of the key text (``kvscope keys create``)."""

    name: str
    """Key id: logged as ``user.id``; rate limits are kept per name."""
    sha256: str
    models: tuple[str, ...] | None = None
    """Models this key may use; ``None``: all served models."""
    limits: KeyLimits = KeyLimits()
    admin: bool = False
    """May open the console (``/console``, docs/console.md): with API keys configured, only admin keys do."""
    service_tier: Literal["priority", "default", "flex"] | None = None
    """The engine scheduler's tier of this key's requests (``x-kvscope-service-tier``, issue 42): their
    default and the best they get (a request's own ``service_tier`` may only ask for a worse one); ``flex``
    for batch keys. None: the request's own, else ``default``."""

    def __post_init__(self) -> None:
        check_key_name(self.name)
        digest = self.sha256.lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"api key {self.name!r}: sha256 must be 64 hex digits")


class TimeoutConfig(msgspec.Struct, **_STRUCT):
    """Timeouts in seconds: reading the client's request (head, body), then the upstream's answer."""

    request_head_s: Annotated[
        float,
        Flag(
            "a request head must be complete this long after the connection opened "
            "or the previous response ended (else 408 and close)",
            name="--request-head-timeout",
            metavar="S",
        ),
    ] = HEAD_TIMEOUT_S
    """A request head must be complete within this of the connection opening or the previous response
    ending: else a JSON 408 and the connection closed (an idle connection is closed silently).
    kvscope/common/read_timeouts.py."""
    request_body_s: Annotated[
        float,
        Flag(
            "longest silence while a request body arrives (else 408 and close)",
            name="--request-body-timeout",
            metavar="S",
        ),
    ] = BODY_TIMEOUT_S
    """Longest silence while a request body is being received: then a JSON 408 and the connection closed."""
    connect_s: float = 5.0
    first_token_s: Annotated[
        float,
        Flag("upstream request sent → first token (streams)", name="--first-token-timeout", metavar="S"),
    ] = 600.0
    """Upstream request sent → first token event (streams); covers queueing and prefill."""
    idle_s: float = 120.0
    """Longest silence between two upstream chunks after the first token."""
    total_s: Annotated[float, Flag("whole request, all attempts", name="--total-timeout", metavar="S")] = (
        1800.0
    )
    """Whole request, all attempts."""
    keepalive_s: Annotated[float, Flag("SSE keep-alive interval", name="--keepalive", metavar="S")] = 15.0
    """Send ``: keep-alive`` to a stream's client after this much silence (keep below proxies' idle
    timeouts)."""

    def __post_init__(self) -> None:
        _positive(self)


class CacheAwareConfig(msgspec.Struct, **_STRUCT):
    """The ``cache_aware`` policy's knobs (gateway/routing/router.py says how they are used)."""

    load_factor: float = 1.25
    """Bounded load (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded Loads", SODA 2018):
    a replica takes a request while its requests in flight + 1 <= ceil(load_factor x (in flight over the
    model's replicas + 1) / replicas), or while it is within ``load_slack`` of the least busy. 1.25 is the
    paper's and HAProxy's ``hash-balance-factor 125``."""
    load_slack: Annotated[int, msgspec.Meta(ge=0)] = 2
    """A replica also takes a request while it has at most this many requests in flight more than the least
    busy candidate, whatever ``load_factor`` says: at the handful of requests a CPU replica holds, the factor
    alone turns a replica away at one request above the mean (ceil(1.25 x 5 / 4) = 2), and the conversation
    it held is computed again elsewhere (gateway/routing/router.py; SGLang's router has an absolute threshold
    too, ``balance_abs_threshold``). 0: the factor alone."""
    block_size: int = 16
    """Tokens per hashed prefix block where a replica's ``/v1/models`` card does not say its own (vLLM's and
    kvscope's default KV block size)."""
    capacity_tokens: int = 131072
    """Tokens of prefix the gateway remembers per replica where its card does not report its KV capacity
    (``kvscope.num_gpu_blocks`` x ``kvscope.block_size``)."""

    def __post_init__(self) -> None:
        _positive(self, ("load_factor", "block_size", "capacity_tokens"))
        if self.load_slack < 0:
            raise ValueError(f"load_slack must be >= 0, got {self.load_slack}")
        if not self.load_factor >= 1:  # NaN too
            raise ValueError(f"load_factor must be >= 1, got {self.load_factor}")


class RoutingConfig(msgspec.Struct, **_STRUCT):
    """Replica selection, retries and health checking."""

    policy: Annotated[RoutingPolicy, Flag("replica routing policy", name="--routing")] = "auto"
    """Every model's routing policy unless its ``models`` entry sets ``routing``."""
    cache_aware: CacheAwareConfig = CacheAwareConfig()
    max_attempts: int = 3
    """Upstream attempts per request (retries happen only before the first byte reached the client)."""
    health_interval_s: Annotated[
        float, Flag("upstream health-check period", name="--health-interval", metavar="S")
    ] = 5.0
    health_timeout_s: float = 2.0
    """A health probe unanswered this long counts towards ``failure_threshold``."""
    failure_threshold: int = 3
    """Consecutive 5xx answers, or health probes unanswered within ``health_timeout_s``, that eject a replica
    until its next good health check (connect errors: 1)."""

    def __post_init__(self) -> None:
        _positive(self, ("max_attempts", "health_interval_s", "health_timeout_s", "failure_threshold"))


class UpstreamMetricsConfig(msgspec.Struct, **_STRUCT):
    """Sampling each upstream's Prometheus endpoint (its ``metrics_path``) for the request log's engine state
    (gateway/engines/scraper.py): often while it is busy, seldom while idle, never on a request's path."""

    interval_s: float = 1.0
    """Seconds between two scrapes of an upstream that has requests in flight or had one in the last 10 s."""
    idle_interval_s: float = 15.0
    """Seconds between two scrapes of an idle upstream (Prometheus' default scrape interval)."""
    timeout_s: float = 0.5
    """A scrape that has not fully answered within this fails (the last sample stays, its age grows); 3 in a
    row stop scraping that upstream until its health changes."""

    def __post_init__(self) -> None:
        _positive(self)
        if self.idle_interval_s < self.interval_s:
            raise ValueError(
                f"idle_interval_s ({self.idle_interval_s:g}) must be >= interval_s ({self.interval_s:g})"
            )
        if self.timeout_s > self.interval_s:
            raise ValueError(f"timeout_s ({self.timeout_s:g}) must be <= interval_s ({self.interval_s:g})")


DNS_PORT = 53


def parse_nameserver(item: str) -> tuple[str, int]:
    """``"host"`` or ``"host:port"`` (IPv6: ``"::1"`` or ``"[::1]:5353"``) → (IP address, port; 53 when not
    given). The host must be an IP address: a name server named by a name would need a resolver to find it.
    Raises ValueError."""
    host, port = item.strip(), str(DNS_PORT)
    if host.startswith("["):  # [v6] or [v6]:port
        inner, sep, rest = host[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"nameserver {item!r}: expected [IPv6]:port")
        host, port = inner, rest[1:] or port
    elif host.count(":") == 1:  # v4:port (a bare IPv6 address has two or more colons)
        host, port = host.split(":")
    try:
        address = ipaddress.ip_address(host)
        number = int(port)
    except ValueError:
        raise ValueError(f"nameserver {item!r}: expected an IP address, optionally with :port") from None
    if not 1 <= number <= 65535:
        raise ValueError(f"nameserver {item!r}: port must be 1-65535")
    return str(address), number


class DnsDiscoveryConfig(msgspec.Struct, **_STRUCT):
    """A DNS name whose A and AAAA records are upstream replicas, re-resolved every ``interval_s``: e.g. a
    Kubernetes headless Service (one record per ready pod). Each address becomes an upstream
    ``{scheme}://{address}:{port}`` (IPv6 in brackets) with this entry's ``models`` and ``api_key``."""

    name: Annotated[str, msgspec.Meta(min_length=1)]
    """The DNS name, e.g. ``kvscope-engine-headless.default.svc.cluster.local`` (a relative name goes through
    the system resolver's search domains, as getaddrinfo would)."""
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    scheme: Literal["http", "https"] = "http"
    models: tuple[str, ...] = ()
    """As :attr:`UpstreamConfig.models`: empty means whatever each replica's ``/v1/models`` lists."""
    api_key: str | None = None
    """As :attr:`UpstreamConfig.api_key`."""
    kind: UpstreamKindSetting = "auto"
    """As :attr:`UpstreamConfig.kind`."""
    metrics_path: str | None = "/metrics"
    """As :attr:`UpstreamConfig.metrics_path`."""

    def __post_init__(self) -> None:
        _metrics_path(self.metrics_path)

    @property
    def source(self) -> str:
        """The discovery source of its replicas (``dns:<name>``): the ``source`` label of
        ``kvscope_gateway_discovery_errors_total``."""
        return f"dns:{self.name}"

    def upstream(self, address: str) -> UpstreamConfig:
        """The upstream at ``address`` (an IPv4 or IPv6 address from an A/AAAA record). Its metric label is
        the default ``address:port``: the ``instance`` label Prometheus gives the same pod's engine metrics,
        so gateway and engine series of one replica join on it, and unique per replica."""
        host = f"[{address}]" if ":" in address else address
        return UpstreamConfig(
            url=f"{self.scheme}://{host}:{self.port}",
            models=self.models,
            api_key=self.api_key,
            kind=self.kind,
            metrics_path=self.metrics_path,
        )


class DiscoveryConfig(msgspec.Struct, **_STRUCT):
    """Replicas that come and go (gateway/proxy/discovery.py): DNS names re-resolved and the config file's
    ``upstreams`` re-read every ``interval_s``; a replica that joins gets traffic after one health probe, one
    that leaves stops getting new requests and finishes those in flight (docs/gateway.md "Replicas that come
    and go")."""

    interval_s: float = 5.0
    """Seconds between two re-resolutions / re-reads."""
    config_reload: bool = True
    """Re-read ``upstreams`` from the ``--config`` file when its content changes (other changed keys are
    logged: they need a restart)."""
    dns: tuple[DnsDiscoveryConfig, ...] = ()
    nameservers: tuple[str, ...] = ()
    """``"host"`` or ``"host:port"`` name servers (IP addresses); empty: the system resolver's
    (``/etc/resolv.conf``, with its search domains)."""

    def __post_init__(self) -> None:
        _positive(self, ("interval_s",))
        for item in self.nameservers:
            parse_nameserver(item)
        names = [entry.name for entry in self.dns]
        if len(names) != len(set(names)):
            raise ValueError("discovery.dns names must be unique")

    def nameserver_addresses(self) -> tuple[tuple[str, int], ...]:
        """:attr:`nameservers` as (IP address, port) pairs."""
        return tuple(parse_nameserver(item) for item in self.nameservers)


class LogConfig(msgspec.Struct, **_STRUCT):
    """Request-log sinks (one JSON line per request)."""

    file: Annotated[
        str | None,
        Flag("request log, JSON lines, rotated by size", name="--log-file", env="KVSCOPE_GATEWAY_LOG_FILE"),
    ] = None
    """Rotating JSONL file; ``None``: no file sink."""
    stdout: Annotated[bool, Flag("request log on stdout too", name="--log-stdout")] = False
    max_bytes: int = 100 * 1024 * 1024
    backup_count: int = 5
    queue_size: int = 10_000
    """Records waiting for a sink's writer thread; beyond it records are dropped (and counted)."""
    log_content: Annotated[bool, Flag("log prompts and completions")] = False
    """Also log prompts and completions (off by default: they may hold personal data)."""
    elasticsearch: dict[str, Any] | None = None
    """Ship records to Elasticsearch too: the fields of ``kvscope.gateway.logs.es_settings.EsLogSettings``
    (hosts, api_key, data_stream, spool_dir …); checked by :func:`load_settings`."""

    def elasticsearch_settings(self) -> Any:
        """The ``elasticsearch`` section as ``EsLogSettings`` (imports the client only when configured).
        Raises ValueError when it is invalid."""
        from kvscope.gateway.logs.es_settings import EsLogSettings

        try:
            return msgspec.convert(self.elasticsearch, EsLogSettings)
        except msgspec.ValidationError as exc:
            raise ValueError(f"invalid logs.elasticsearch: {exc}") from exc


class TracingConfig(msgspec.Struct, **_STRUCT):
    otlp_endpoint: Annotated[
        str | None,
        Flag("OTLP endpoint for traces and metrics (http://127.0.0.1:4318; default: $OTEL_EXPORTER_OTLP_*)"),
    ] = None
    """OTLP base URL, e.g. ``http://127.0.0.1:4318`` (OTLP/HTTP: spans to ``/v1/traces``, metrics to
    ``/v1/metrics``; gRPC: used as is). None: the ``OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]ENDPOINT``
    environment, read by the OTel SDK (kvscope/common/otel_env.py)."""
    metrics_export_interval_s: float | None = None
    """How often the OTel GenAI metrics (``gen_ai.client.*``) are pushed; None:
    ``$OTEL_METRIC_EXPORT_INTERVAL`` (ms), else 15 s."""
    gen_ai_provider: str = "kvscope"
    """``gen_ai.provider.name`` of the gen_ai CLIENT span and metrics (OTel GenAI semconv: required; a
    custom value where no well-known one applies). Set e.g. ``openai`` when the upstreams are OpenAI's."""


class ConsoleConfig(msgspec.Struct, **_STRUCT):
    """The built-in console at ``/console`` (gateway/console/, docs/console.md)."""

    enabled: Annotated[
        bool, Flag("do not serve the console at /console", name="--no-console", negate=True)
    ] = True
    trace_url: Annotated[
        str | None,
        Flag("trace UI link of the console's request page, {trace_id} filled in", metavar="URL"),
    ] = None
    """E.g. ``http://127.0.0.1:16686/trace/{trace_id}`` (Jaeger); None: the trace id is shown as text."""
    records: int = 1000
    """Newest request-log records the console keeps in memory (its request list)."""

    def __post_init__(self) -> None:
        if self.records < 1:
            raise ValueError(f"console.records must be >= 1, got {self.records}")
        if self.trace_url is not None and "{trace_id}" not in self.trace_url:
            raise ValueError("console.trace_url must contain {trace_id}")


class MetricsConfig(msgspec.Struct, **_STRUCT):
    """Histogram buckets in seconds."""

    ttft_buckets: tuple[float, ...] = TTFT_BUCKETS
    tpot_buckets: tuple[float, ...] = TPOT_BUCKETS
    duration_buckets: tuple[float, ...] = DURATION_BUCKETS
    overhead_buckets: tuple[float, ...] = OVERHEAD_BUCKETS


class GatewaySettings(msgspec.Struct, **_STRUCT):
    """Everything the gateway needs; build with :func:`load_settings`."""

    host: Annotated[str, Flag("bind address", env="KVSCOPE_GATEWAY_HOST")] = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535), Flag("port", env="KVSCOPE_GATEWAY_PORT")] = 4000
    """4000 (LiteLLM's default); the engine listens on 8000."""
    upstreams: Annotated[
        tuple[UpstreamConfig, ...],
        Flag(
            "upstream base URL (repeatable)",
            name="--upstream",
            metavar="URL",
            repeat=True,
            item=_upstream,
            env="KVSCOPE_GATEWAY_UPSTREAMS",
        ),
    ] = ()
    models: Annotated[
        tuple[ModelConfig, ...],
        Flag(
            "tokenizer.json or model folder for MODEL, for prompt limits at the edge (repeatable)",
            name="--tokenizer",
            metavar="MODEL=PATH",
            repeat=True,
            item=tokenizer_model,
        ),
    ] = ()
    api_keys: Annotated[
        tuple[ApiKeyConfig, ...],
        Flag(
            "an API key (repeatable)",
            name="--api-key-hash",
            metavar="NAME:SHA256",
            repeat=True,
            item=parse_key_hash,
            env="KVSCOPE_GATEWAY_API_KEY_HASHES",
        ),
    ] = ()
    allow_unauthenticated: Annotated[
        bool,
        Flag("serve without API keys on a non-loopback address", env="KVSCOPE_GATEWAY_ALLOW_UNAUTHENTICATED"),
    ] = False
    """Serve without API keys on a non-loopback address (loopback never needs it)."""
    metrics_public: Annotated[
        bool,
        Flag(
            "serve /metrics without an API key even when keys are configured",
            env="KVSCOPE_GATEWAY_METRICS_PUBLIC",
        ),
    ] = False
    """With ``api_keys``, ``/metrics`` (its series name every served model and upstream) needs a key that
    may use every model; set this for a Prometheus that scrapes without one (on a network only it can
    reach). Without keys ``/metrics`` is public anyway."""
    default_limits: KeyLimits = KeyLimits()
    """Limits for keys that do not set their own, and for anonymous clients when auth is off."""
    max_body_bytes: int = 8 * 1024 * 1024
    trusted_proxies: Annotated[
        tuple[str, ...],
        Flag(
            "trust Forwarded/X-Forwarded-For from this proxy address or network (repeatable)",
            name="--trusted-proxy",
            metavar="IP_OR_CIDR",
            repeat=True,
            env="KVSCOPE_GATEWAY_TRUSTED_PROXIES",
        ),
    ] = ()
    """Proxy addresses or CIDR networks whose ``Forwarded`` / ``X-Forwarded-For`` name the client
    (gateway/forwarded.py); empty: the TCP peer is the client, whatever the headers say."""
    redis_url: Annotated[
        str | None,
        Flag(
            "share rate limits between gateway replicas (redis://host:6379/0)",
            env="KVSCOPE_GATEWAY_REDIS_URL",
        ),
    ] = None
    """Share rate limits between gateway replicas through Redis; ``None``: in-memory."""
    workers: Annotated[
        int,
        msgspec.Meta(ge=1, le=256),
        Flag(
            "gateway processes serving the port (rate limits then need --redis-url)",
            metavar="N",
            env="KVSCOPE_GATEWAY_WORKERS",
        ),
    ] = 1
    """Processes serving ``port`` (gateway/workers.py; docs/gateway.md "Several worker processes"): one
    supervisor binds the port and starts this many workers. Above 1: rate limits need ``redis_url`` (the
    in-memory limiter is per process), ``/metrics`` adds up every worker (prometheus_client's multiprocess
    mode), the request log file is shared, and the console is off (it shows one process)."""
    timeouts: TimeoutConfig = TimeoutConfig()
    routing: RoutingConfig = RoutingConfig()
    upstream_metrics: UpstreamMetricsConfig = UpstreamMetricsConfig()
    """How often each upstream's ``/metrics`` is sampled (docs/gateway.md "Upstream kinds")."""
    discovery: DiscoveryConfig = DiscoveryConfig()
    """Replicas from DNS and config reload, besides ``upstreams`` (docs/gateway.md "Replicas that come and
    go")."""
    logs: LogConfig = LogConfig()
    tracing: TracingConfig = TracingConfig()
    metrics: MetricsConfig = MetricsConfig()
    console: ConsoleConfig = ConsoleConfig()
    event_loop: Annotated[
        EventLoop,
        Flag(
            "the server's event loop: auto = uvloop where it is installed (a gateway "
            "dependency), else asyncio",
            env="KVSCOPE_GATEWAY_EVENT_LOOP",
        ),
    ] = "auto"
    """uvicorn's event loop (kvscope/common/event_loop.py says why uvloop; docs/benchmarks.md "uvloop under
    the engine's and the gateway's servers")."""
    service_name: str = "kvscope-gateway"
    """OTel ``service.name`` of spans, metrics and logs; default ``$OTEL_SERVICE_NAME``, else
    ``kvscope-gateway``."""
    node_name: str | None = None
    """``service.node.name`` in logs and traces; defaults to the host name."""

    def __post_init__(self) -> None:
        if not self.upstreams and not self.discovery.dns:
            raise ValueError(
                "at least one upstream is required (--upstream URL, `upstreams:` in the config or "
                "`discovery.dns`)"
            )
        if not self.api_keys and not self.allow_unauthenticated and not is_loopback(self.host):
            raise ValueError(
                f"refusing to serve {self.host} without API keys: add keys (kvscope keys create) "
                "or pass --allow-unauthenticated"
            )
        parse_networks(self.trusted_proxies)
        resolve_event_loop(self.event_loop)  # uvloop asked for where it is not installed: a config error
        if self.workers > 1 and self.redis_url is None and self.rate_limited:
            raise ValueError(
                f"workers={self.workers} with rate limits needs redis_url (--redis-url redis://host:6379/0): "
                "the in-memory limiter is per process, so each worker would admit the whole limit; share "
                "the limits through Redis or run one worker"
            )
        names = [key.name for key in self.api_keys]
        if len(names) != len(set(names)):
            raise ValueError("api key names must be unique")
        urls_by_label: dict[str, set[str]] = {}
        for upstream in self.upstreams:
            urls_by_label.setdefault(upstream.label, set()).add(upstream.url.rstrip("/"))
        shared = sorted(label for label, urls in urls_by_label.items() if len(urls) > 1)
        if shared:  # one label, two replicas: their metric series and log lines could not be told apart
            raise ValueError(f"upstreams with different URLs share the name {', '.join(shared)}")
        for name in ("ttft_buckets", "duration_buckets"):
            bounds = getattr(self.metrics, name)
            if not bounds or bounds[-1] < self.timeouts.total_s:
                raise ValueError(
                    f"metrics.{name} must reach timeouts.total_s ({self.timeouts.total_s:g} s) so "
                    f"that no request lands in +Inf only; the last bound is {bounds[-1] if bounds else None}"
                )

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)

    @property
    def rate_limited(self) -> bool:
        """Whether any key (or anonymous client) has a limit with state: requests or tokens per minute or
        concurrent requests (``max_tokens`` is a per-request ceiling, kept by every worker alike)."""
        return any(
            limits.requests_per_minute or limits.tokens_per_minute or limits.max_concurrent
            for limits in (self.default_limits, *(key.limits for key in self.api_keys))
        )

    @property
    def node(self) -> str:
        return self.node_name or socket.gethostname()


MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus_client's multiprocess mode: set (to a folder) before the library is imported, every metric
value lives in a memory-mapped file there, one per process; the gateway's workers run under it
(gateway/workers.py sets it for them)."""


def multiprocess_dir(env: Mapping[str, str] | None = None) -> Path | None:
    """The folder of prometheus_client's multiprocess mode (``$PROMETHEUS_MULTIPROC_DIR``), or None when the
    process runs in the library's default, single-process mode. The library reads the same variable when it
    is imported, so the gateway exposes its metrics the library's way in either case (gateway/metrics.py)."""
    value = (os.environ if env is None else env).get(MULTIPROC_DIR_ENV)
    return Path(value) if value else None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The raw mapping of a ``.yaml``/``.yml``/``.toml``/``.json`` config file. Raises ValueError."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".toml":
        raw = tomllib.loads(text)
    else:
        raw = yaml.safe_load(text) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: the top level must be a mapping")
    return raw


def env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """Overrides from ``KVSCOPE_GATEWAY_{HOST,PORT,UPSTREAMS,REDIS_URL,WORKERS,LOG_FILE,ALLOW_UNAUTHENTICATED,
    METRICS_PUBLIC,API_KEY_HASHES,TRUSTED_PROXIES}`` (the ``env`` of the fields' Flags), in config-file shape;
    lists are comma-separated."""
    return from_env(GatewaySettings, env)


def load_settings(
    config_path: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> GatewaySettings:
    """Settings from defaults < file (``config_path`` or ``$KVSCOPE_GATEWAY_CONFIG``) < env < ``overrides``
    (``OTEL_SERVICE_NAME``: defaults < env < file < overrides).

    ``env`` defaults to ``os.environ``. Raises ValueError with the offending path on any invalid value.
    """
    env = os.environ if env is None else env
    config_path = config_path or env.get("KVSCOPE_GATEWAY_CONFIG")
    raw = read_config_file(config_path) if config_path else {}
    if "service_name" not in raw and env.get("OTEL_SERVICE_NAME"):  # OTel's variable; the config file wins
        raw = {**raw, "service_name": env["OTEL_SERVICE_NAME"]}
    raw = merge(merge(raw, env_overrides(env)), overrides or {})
    try:
        settings = msgspec.convert(raw, GatewaySettings)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid gateway config: {exc}") from exc
    if settings.logs.elasticsearch is not None:
        settings.logs.elasticsearch_settings().sink_config()
    for signal in ("traces", "metrics"):
        otlp_protocol(
            signal, env
        )  # an unsupported OTEL_EXPORTER_OTLP_PROTOCOL is a config error, not a crash later
    return settings


@dataclass(frozen=True, slots=True)
class SettingsSource:
    """Where the running settings came from, so that they can be read again (the config reload of
    gateway/proxy/discovery.py): the config file, the environment and the CLI overrides, in
    :func:`load_settings`'s precedence (a ``--upstream`` flag or ``$KVSCOPE_GATEWAY_UPSTREAMS`` still wins
    over the file's ``upstreams`` on every reload)."""

    config_path: Path | None
    """``--config`` or ``$KVSCOPE_GATEWAY_CONFIG``; None: no file (nothing to reload)."""
    overrides: Mapping[str, Any]
    env: Mapping[str, str] | None = None
    """None: ``os.environ``."""

    @classmethod
    def of(
        cls,
        config_path: str | Path | None,
        overrides: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> SettingsSource:
        path = config_path or (os.environ if env is None else env).get("KVSCOPE_GATEWAY_CONFIG")
        return cls(Path(path) if path else None, dict(overrides or {}), env)

    def load(self) -> GatewaySettings:
        """:func:`load_settings` from this source. Raises ValueError (invalid) or OSError (unreadable)."""
        return load_settings(self.config_path, self.overrides, self.env)
