"""The on-call overview: is the service healthy, and if not, is it traffic, the engine or a dependency?

Reading order top to bottom: SLO tiles → traffic and errors → latency (gateway | engine side by side, so
the gap is the gateway + network) → engine saturation (queue, batch, KV cache, preemptions, memory) →
dependencies (upstreams, log shipping, scrape targets) → request shapes.
"""

from __future__ import annotations

from kvscope.dashboards.alert_thresholds import alert_threshold
from kvscope.dashboards.engine_names import KIND_TITLES, VARIANT_KINDS, variant_uid
from kvscope.dashboards.grafana import Json, Target, dashboard, dashboard_link, heatmap, row, stat, timeseries
from kvscope.dashboards.promql import RATE, PromQL, up

UID = "kvscope-overview"
TTFT_SLO_S = 1.0
"""SLO: a request's first token within 1 s (gateway-measured). Alert KvscopeTTFTSLOBreach uses the same."""
TPOT_SLO_S = 0.1
"""SLO: at most 100 ms per output token after the first (gateway-measured). Alert KvscopeTPOTSLOBreach."""
P99_TPOT_S = 0.2
"""Alert KvscopeHighP99TimePerOutputToken: p99 time per output token above this (twice the TPOT SLO).
KvscopeHighP99Latency alerts on p99 TTFT above TTFT_SLO_S; no alert thresholds the end-to-end duration."""
SLO_OBJECTIVE = 0.95
"""Fraction of requests that must meet each latency SLO."""
SLO_STEPS = [("red", None), ("orange", 0.9), ("green", SLO_OBJECTIVE)]
AVAILABILITY_SLO = 0.995
"""SLO: 99.5 % of generation requests succeed over 30 days (no 5xx, no stream broken after its 200); the error
budget is 0.5 %. Alerts KvscopeHighErrorRate (gateway) and KvscopeEngineHighErrorRate (engine) burn it."""
BURN_RATE_WINDOWS = (
    ("1h", "5m", 14.4, "critical"),
    ("6h", "30m", 6.0, "critical"),
    ("1d", "2h", 3.0, "warning"),
    ("3d", "6h", 1.0, "warning"),
)
"""(long window, short window, burn rate, severity) of the error-budget alerts: Google SRE workbook,
"Alerting on SLOs", multiwindow multi-burn-rate; each fires above burn rate x (1 - AVAILABILITY_SLO) over
both windows."""
MIN_SLO_REQUESTS = 100
"""The error-budget alerts need at least this many generation requests in their long window (a minimum-traffic
guard: 1 failure in 20 requests is noise, not a burn)."""

GW = "kvscope_gateway_"
EN = "kvscope_engine_"


EXEMPLAR_HISTOGRAMS = frozenset(
    {
        f"{GW}time_to_first_token_seconds",
        f"{GW}time_per_output_token_seconds",
        f"{GW}request_duration_seconds",
        *(
            f"{EN}{n}_seconds"
            for n in (
                "time_to_first_token",
                "e2e_request_latency",
                "queue_time",
                "prefill_time",
                "decode_time",
                "time_per_output_token",
                "request_inference_time",
            )
        ),
    }
)
"""Histograms observed with an exemplar (the trace id of a sampled request): the gateway's
(gateway/observe.py) and the engine's latency histograms (engine/server/request_state.py)."""


def latency_targets(q: PromQL, hist: str) -> list[Target]:
    """p50, p95, p99 and mean of histogram family ``hist``; the p99 query also shows its exemplars (links to
    the traces of slow requests) where the histogram has them."""
    quantiles = [
        Target(q.quantile(p, hist), f"p{round(p * 100)}", exemplar=p == 0.99 and hist in EXEMPLAR_HISTOGRAMS)
        for p in (0.5, 0.95, 0.99)
    ]
    return [*quantiles, Target(q.mean(hist), "mean")]


GENERATION_ROUTES = 'route=~"/v1/chat/completions|/v1/completions"'
"""The generation routes: the availability SLO's requests (alerts/kvscope.rules.yaml), gateway and engine."""


def slo_failures(q: PromQL, requests: str, broken_streams: str, window: str = RATE) -> str:
    """Failed generation requests per second, as the SLO's recording rules count them: 5xx answers of
    ``requests`` plus ``broken_streams`` (streams broken after their 200). Joined with ``or`` inside the
    sum (the two families' label sets differ, so both sides stay): with ``+`` the sum would be empty, "No
    data", until the first 5xx creates its series."""
    fivexx = q.sel(requests, GENERATION_ROUTES, 'status=~"5.."')
    return f"sum(rate({fivexx}[{window}]) or rate({q.sel(broken_streams)}[{window}]))"


def _slo_tiles(q: PromQL) -> list[Json]:
    req = f"{GW}requests_total"
    generation = GENERATION_ROUTES
    failed = slo_failures(q, req, GW + "stream_errors_total", window="$__range")
    return [
        stat(
            f"TTFT ≤ {TTFT_SLO_S:g} s",
            f"Share of requests whose first token reached the client within "
            f"{TTFT_SLO_S:g} s over the dashboard range (gateway). Objective {SLO_OBJECTIVE:.0%}.",
            [
                Target(
                    q.attainment(f"{GW}time_to_first_token_seconds", TTFT_SLO_S, window="$__range"),
                    "attainment",
                )
            ],
            "percentunit",
            SLO_STEPS,
        ),
        stat(
            f"TPOT ≤ {TPOT_SLO_S * 1000:g} ms",
            f"Share of requests decoding at ≤ {TPOT_SLO_S * 1000:g} ms "
            f"per output token over the dashboard range (gateway). Objective {SLO_OBJECTIVE:.0%}.",
            [
                Target(
                    q.attainment(f"{GW}time_per_output_token_seconds", TPOT_SLO_S, window="$__range"),
                    "attainment",
                )
            ],
            "percentunit",
            SLO_STEPS,
        ),
        stat(
            "Availability",
            "Share of generation requests that succeeded over the dashboard range: no 5xx and no stream "
            f"broken after its 200 (the error-budget alerts' ratio). Objective {AVAILABILITY_SLO:.1%}.",
            [
                Target(
                    f"1 - {q.ratio(failed, q.sum_rate(req, generation, window='$__range'))}", "availability"
                )
            ],
            "percentunit",
            [("red", None), ("green", AVAILABILITY_SLO)],
            decimals=3,
        ),
        stat(
            "Healthy upstreams",
            "Upstreams whose last health check passed / upstreams configured.",
            [Target(q.ratio(q.gauge(f"{GW}upstream_up"), f"count({q.sel(f'{GW}upstream_up')})"), "healthy")],
            "percentunit",
            [("red", None), ("orange", 0.5), ("green", 1)],
        ),
    ]


def _traffic(q: PromQL) -> list[Json]:
    req = f"{GW}requests_total"
    return [
        row("Traffic and errors"),
        timeseries(
            "Requests / s",
            "Requests finished per second at the gateway, by model.",
            [Target(q.sum_rate(req, by=("model",)), "{{model}}")],
            "reqps",
            w=6,
        ),
        timeseries(
            "Error ratio",
            "Share of requests answered with a 5xx (server) and a 4xx (client) status. "
            f"The SLO allows {1 - AVAILABILITY_SLO:.1%} of 5xx and broken streams together; "
            "KvscopeHighErrorRate pages at 14.4x that over 1 h (and 5 m).",
            [
                Target(q.ratio(q.sum_rate(req, 'status=~"5.."'), q.sum_rate(req)), "5xx"),
                Target(
                    q.ratio(
                        slo_failures(q, req, GW + "stream_errors_total"), q.sum_rate(req, GENERATION_ROUTES)
                    ),
                    "5xx + streams broken after 200 on generation routes (the SLO's errors)",
                ),
                Target(q.ratio(q.sum_rate(req, 'status=~"4.."'), q.sum_rate(req)), "4xx"),
            ],
            "percentunit",
            w=6,
            threshold=alert_threshold("KvscopeHighErrorRate", long_window="1h"),
        ),
        timeseries(
            "Status breakdown",
            "Requests per second by HTTP status and route.",
            [Target(q.sum_rate(req, by=("status", "route")), "{{status}} {{route}}")],
            "reqps",
            stack=True,
            w=6,
        ),
        timeseries(
            "Tokens / s",
            "Tokens per second through the gateway: input (prompt) and output "
            "(completion), which add up to every token; cached is the part of input served from the "
            "engine's prefix cache (its own counter, not a third type).",
            [
                Target(q.sum_rate(f"{GW}tokens_total", by=("type",)), "{{type}}"),
                Target(q.sum_rate(f"{GW}cached_tokens_total"), "cached (part of input)"),
            ],
            "short",
            w=6,
        ),
        timeseries(
            "In-flight requests",
            "Requests the gateway is serving right now (admitted, not finished).",
            [Target(q.gauge(f"{GW}in_flight_requests", by=("instance",)), "{{instance}}")],
            "short",
            w=8,
        ),
        timeseries(
            "Rate-limited / s",
            "Requests refused with 429 by the gateway's limiter, by reason.",
            [Target(q.sum_rate(f"{GW}rate_limited_total", by=("reason",)), "{{reason}}")],
            "reqps",
            w=8,
        ),
        timeseries(
            "Stream errors / s",
            "Streams that failed after the 200 was sent (the error travels "
            "in-band, so the status breakdown cannot show it), by reason.",
            [Target(q.sum_rate(f"{GW}stream_errors_total", by=("reason",)), "{{reason}}")],
            "short",
            w=8,
        ),
    ]


def latency_panels(q: PromQL) -> list[Json]:
    """Row "Latency": gateway | engine pairs (TTFT, TPOT, e2e), gateway overhead, engine queue time and
    TTFT by cause."""
    pairs = [
        (
            "Time to first token",
            "time_to_first_token_seconds",
            "time_to_first_token_seconds",
            "Arrival to first token: at the gateway (what the client sees) and inside the engine.",
        ),
        (
            "Time per output token",
            "time_per_output_token_seconds",
            "time_per_output_token_seconds",
            "Decode time / (output tokens − 1), per request.",
        ),
        (
            "End-to-end latency",
            "request_duration_seconds",
            "e2e_request_latency_seconds",
            "Whole request: gateway request duration (last byte sent) and engine arrival → finish.",
        ),
    ]
    panels: list[Json] = [row("Latency — gateway | engine")]
    alerts = {
        "time_to_first_token_seconds": "KvscopeHighP99Latency",
        "time_per_output_token_seconds": "KvscopeHighP99TimePerOutputToken",
    }  # their p99s
    for title, gw, en, description in pairs:
        line = alert_threshold(alerts[gw]) if gw in alerts else None
        panels.append(
            timeseries(f"{title} (gateway)", description, latency_targets(q, GW + gw), "s", threshold=line)
        )
        panels.append(timeseries(f"{title} (engine)", description, latency_targets(q, EN + en), "s"))
    panels.append(
        timeseries(
            "Gateway overhead",
            "Time the gateway adds on top of the upstream "
            "(auth, limits, routing, proxying), p50/p95/p99/mean.",
            latency_targets(q, f"{GW}overhead_seconds"),
            "s",
        )
    )
    panels.append(
        timeseries(
            "Queue time (engine)",
            "Arrival to first scheduled: time requests wait for a slot in the running batch.",
            latency_targets(q, f"{EN}queue_time_seconds"),
            "s",
        )
    )
    panels.append(
        timeseries(
            "TTFT by cause (engine)",
            "Mean seconds of a finished request's TTFT by cause, "
            "from the scheduler's step records (stacked, they add up to the mean engine "
            "TTFT): queue, its own prefill tokens' share of its steps, other requests' "
            "prefill and decode tokens in those steps, time preempted, host time between "
            "steps. `kvscope logs why ID` explains one request the same way.",
            cause_targets(q, "ttft"),
            "s",
            stack=True,
            w=24,
        )
    )
    return panels


def cause_targets(q: PromQL, phase: str) -> list[Target]:
    """Mean seconds per finished request of ``phase`` (``ttft`` or ``decode``) by cause."""
    num = q.sum_rate(f"{EN}latency_cause_seconds_total", f'phase="{phase}"', by=("cause",))
    den = q.sum_rate(f"{EN}e2e_request_latency_seconds_count")
    return [Target(f"{num} / on() group_left() ({den} > 0)", "{{cause}}")]


def engine_panels(q: PromQL) -> list[Json]:
    """Row "Engine saturation": running vs waiting, batch size, KV-cache usage, preemptions, prefix-cache
    hit rate, device memory."""
    hits, queries = f"{EN}prefix_cache_hits_total", f"{EN}prefix_cache_queries_total"
    return [
        row("Engine saturation"),
        timeseries(
            "Running vs waiting",
            "Requests in the running batch and requests queued (waiting or "
            "preempted). A waiting line that never drains means the engine is saturated.",
            [
                Target(q.gauge(f"{EN}requests_running"), "running"),
                Target(q.gauge(f"{EN}requests_waiting"), "waiting"),
            ],
            "short",
            w=8,
        ),
        timeseries(
            "Batch size", "Requests per engine step.", latency_targets(q, f"{EN}batch_size"), "short", w=8
        ),
        timeseries(
            "KV-cache usage",
            "Fraction of KV blocks held by requests, per instance. Near 100 % the scheduler preempts.",
            [Target(q.gauge(f"{EN}kv_cache_usage_ratio", by=("instance",), agg="max"), "{{instance}}")],
            "percentunit",
            w=8,
            max_value=1,
            threshold=alert_threshold("KvscopeKVCachePressure"),
        ),
        timeseries(
            "Preemptions / s",
            "Requests preempted (recomputed later) because KV blocks ran out.",
            [Target(q.sum_rate(f"{EN}preemptions_total", by=("instance",)), "{{instance}}")],
            "short",
            w=8,
            threshold=alert_threshold("KvscopePreemptionStorm"),
        ),
        timeseries(
            "Prefix-cache hit rate",
            "Prompt tokens served from the prefix cache / prompt tokens looked up.",
            [Target(q.ratio(q.sum_rate(hits), q.sum_rate(queries)), "hit rate")],
            "percentunit",
            w=8,
            max_value=1,
        ),
        timeseries(
            "Device memory",
            "Memory used and total per device: VRAM on CUDA, KV cache + weights "
            "(used) and host memory (total) on CPU; the weights alone, by served dtype/quantization.",
            [
                Target(
                    q.gauge(f"{EN}device_memory_used_bytes", by=("instance", "device")),
                    "used {{instance}} {{device}}",
                ),
                Target(
                    q.gauge(f"{EN}device_memory_total_bytes", by=("instance", "device")),
                    "total {{instance}} {{device}}",
                ),
                Target(
                    q.gauge(f"{EN}weights_bytes", by=("instance", "dtype", "quantization")),
                    "weights {{instance}} {{dtype}}/{{quantization}}",
                ),
            ],
            "bytes",
            w=8,
        ),
        timeseries(
            "CPU kernels by decode rows",
            "Which kernel multiplies the int4 weights of a decode step of N requests on CPU (the start-up "
            "probe's crossovers): gemv, tiles_float32/tiles_bfloat16/tiles_int16 (the small-batch matmul), "
            "amx, "
            "dense_<dtype>; one line per kernel and row range, always 1. A restart that moves a range "
            "(another CPU, a loaded machine at start-up) shows as a new line.",
            [
                Target(
                    q.gauge(f"{EN}weights_kernel_info", by=("instance", "kernel", "first_row", "last_row")),
                    "{{instance}} {{kernel}}: rows {{first_row}} to {{last_row}}",
                )
            ],
            "short",
            w=8,
            max_value=1,
        ),
    ]


def _dependencies(q: PromQL) -> list[Json]:
    return [
        row("Dependencies"),
        timeseries(
            "Upstream health",
            "1 when the gateway's last health check of an upstream passed, per upstream and its kind "
            "(the inference server behind it: kvscope, vllm, sglang, llamacpp, tgi, openai; unknown before "
            "an auto-detected upstream first answers).",
            [
                Target(
                    q.gauge(f"{GW}upstream_up", by=("upstream", "kind"), agg="max"), "{{upstream}} ({{kind}})"
                )
            ],
            "short",
            w=8,
            max_value=1,
        ),
        timeseries(
            "Upstream kinds",
            "Upstreams per kind and the signal that decided it: config (set in the gateway config), models "
            "(/v1/models owned_by), metrics (its /metrics names), info or props (TGI's /info, llama.cpp's "
            "/props), default (no signal: a plain OpenAI-compatible server). The engine dashboard has a "
            "variant for vLLM's and SGLang's own metric names.",
            [
                Target(
                    q.gauge(f"{GW}upstream_info", by=("kind", "kind_source"), agg="count"),
                    "{{kind}} (from {{kind_source}})",
                )
            ],
            "short",
            w=8,
        ),
        timeseries(
            "Upstream errors / s",
            "Failed upstream calls (connect errors, timeouts, 5xx), by reason.",
            [
                Target(
                    q.sum_rate(f"{GW}upstream_errors_total", by=("upstream", "reason")),
                    "{{upstream}} {{reason}}",
                )
            ],
            "short",
            w=8,
        ),
        timeseries(
            "Outstanding requests per upstream",
            "Requests the gateway has in flight to each upstream (the least-outstanding balancer's input).",
            [
                Target(
                    q.gauge(f"{GW}upstream_outstanding_requests", by=("upstream", "kind")),
                    "{{upstream}} ({{kind}})",
                )
            ],
            "short",
            w=8,
        ),
        timeseries(
            "Scrape targets up",
            "Prometheus' scrape health of the selected targets.",
            [Target(up(), "{{job}} {{instance}}")],
            "short",
            w=8,
            max_value=1,
        ),
        timeseries(
            "Versions running",
            "Processes per kvscope and Python version (the build_info series): "
            "two versions at once during a rollout, one after it.",
            [
                Target(
                    q.gauge(f"{GW}build_info", by=("version", "python"), agg="count"),
                    "gateway {{version}} (Python {{python}})",
                ),
                Target(
                    q.gauge(f"{EN}build_info", by=("version", "python"), agg="count"),
                    "engine {{version}} (Python {{python}})",
                ),
            ],
            "short",
            w=8,
        ),
        timeseries(
            "Log records / s",
            "Request-log records per sink and final outcome: shipped, failed "
            "(refused for good) or dropped (lost). Every record ends in exactly one, so the stack is "
            "the records emitted.",
            [Target(q.sum_rate(f"{GW}log_records_total", by=("sink", "outcome")), "{{sink}} {{outcome}}")],
            "short",
            stack=True,
            w=8,
        ),
        timeseries(
            "Log records spooled / s",
            "Records written to the on-disk spool on their way to the sink "
            "(Elasticsearch slow or down); each also ends in a final outcome later.",
            [Target(q.sum_rate(f"{GW}log_records_spooled_total", by=("sink",)), "{{sink}}")],
            "short",
            w=4,
        ),
        timeseries(
            "Log spool size",
            "Bytes of request logs waiting on disk for Elasticsearch.",
            [Target(q.gauge(f"{GW}log_spool_bytes", by=("instance",)), "{{instance}}")],
            "bytes",
            w=4,
        ),
    ]


def shape_panels(q: PromQL) -> list[Json]:
    """Row "Request shapes": heatmaps of prompt and output lengths (engine histograms)."""

    def length_map(title: str, hist: str) -> Json:
        target = Target(q.sum_increase(f"{hist}_bucket", by=("le",)), "{{le}}", heatmap=True)
        return heatmap(
            title, f"Distribution of {title.lower()} per request (engine histogram).", target, "short"
        )

    return [
        row("Request shapes"),
        length_map("Prompt length (tokens)", f"{EN}request_prompt_tokens"),
        length_map("Output length (tokens)", f"{EN}request_generation_tokens"),
    ]


def _routing(q: PromQL) -> list[Json]:
    """Where the gateway sends requests across engine replicas, why, and how well it predicts their prefix
    caches (gateway/routing/)."""
    cached = f"{GW}routing_cached_tokens_total"
    hits, queries = f"{EN}prefix_cache_hits_total", f"{EN}prefix_cache_queries_total"
    in_flight = f"{GW}upstream_outstanding_requests"
    return [
        row("Routing across replicas"),
        timeseries(
            "Routing decisions / s",
            "Requests by routing policy and the reason their replica was chosen: prefix_match (it most "
            "likely holds the prompt's prefix), load (fewest in flight: no replica held the prefix within "
            "the load bound), round_robin, fallback (a retry after a failed attempt).",
            [
                Target(
                    q.sum_rate(f"{GW}routing_decisions_total", by=("policy", "reason")),
                    "{{policy}} {{reason}}",
                )
            ],
            "short",
            stack=True,
            w=8,
        ),
        timeseries(
            "Routing prediction accuracy",
            "Cache-aware routing: prompt tokens the upstreams reported cached / tokens the router predicted "
            "cached (1 = exact; below 1 the router credits replicas with prefixes they evicted), and the "
            "share of requests whose prediction was exact.",
            [
                Target(
                    q.ratio(
                        q.sum_rate(cached, 'source="reported"'), q.sum_rate(cached, 'source="predicted"')
                    ),
                    "reported / predicted",
                ),
                Target(
                    q.ratio(
                        q.sum_rate(f"{GW}routing_predictions_total", 'outcome="exact"'),
                        q.sum_rate(f"{GW}routing_predictions_total"),
                    ),
                    "exact share",
                ),
            ],
            "percentunit",
            w=8,
        ),
        timeseries(
            "Prefix-cache hit rate per replica",
            "Prompt tokens each engine served from its prefix cache / prompt tokens it looked up. Load-only "
            "routing spreads each prefix over every replica (one cold prefill per replica); cache-aware "
            "routing keeps a prefix where it is cached.",
            [
                Target(
                    q.ratio(q.sum_rate(hits, by=("instance",)), q.sum_rate(queries, by=("instance",))),
                    "{{instance}}",
                )
            ],
            "percentunit",
            w=8,
            max_value=1,
        ),
        timeseries(
            "Load spread: max / mean in flight",
            "Requests in flight on the busiest replica / the mean over replicas (1 = even). The cache-aware "
            "policy's load bound keeps it near routing.cache_aware.load_factor (1.25) under load; with few "
            "requests per replica, within routing.cache_aware.load_slack (2) of the least busy one.",
            [Target(q.ratio(q.gauge(in_flight, agg="max"), q.gauge(in_flight, agg="avg")), "max / mean")],
            "short",
            w=12,
        ),
        timeseries(
            "Replica discovery errors / s",
            "Failed re-resolutions of a discovery source (a DNS name's A/AAAA records, the config file): the "
            "gateway keeps the replicas it last knew until the source answers again.",
            [Target(q.sum_rate(f"{GW}discovery_errors_total", by=("source",)), "{{source}}")],
            "short",
            w=12,
        ),
    ]


def build(q: PromQL) -> Json:
    """The overview dashboard; raises KeyError/ValueError if a panel names something the catalog lacks."""
    panels = [
        *_slo_tiles(q),
        *_traffic(q),
        *latency_panels(q),
        *engine_panels(q),
        *_routing(q),
        *_dependencies(q),
        *shape_panels(q),
    ]
    links = [
        dashboard_link("Engine internals", "kvscope-engine"),
        *(dashboard_link(f"Engine internals ({KIND_TITLES[k]})", variant_uid(k)) for k in VARIANT_KINDS),
    ]
    return dashboard(
        UID, "kvscope / Overview", "Service health of the kvscope gateway and engine.", panels, links
    )
