"""What each kind of inference server says about itself, for the fake upstream
(kvscope/testing/fake_upstream.py ``--kind``): its ``/v1/models`` card, its Prometheus text, llama.cpp's
``/props``, ``/slots`` and ``timings``, TGI's ``/info`` and timing headers, vLLM's ``/version``.

Every shape is the real server's: llama.cpp's as recorded from the ``llama-server`` that
bench/build_llama_server.sh builds (tests/fixtures/upstreams/llamacpp/, bench/record_llamacpp.py); vLLM's,
SGLang's and TGI's from their sources, cited in tests/fixtures/upstreams/README.md and beside each function.
The values come from the fake's own state (:class:`EngineState`): requests running (holding one of its
``slots``) and waiting for one, the KV blocks they hold, and the finished requests' phases (queue, prefill =
``first_token_delay_s``, decode = ``token_delay_s`` x (tokens - 1)), so a scrape during a test shows what
the fake is doing.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from kvscope.gateway.engines.kinds import UpstreamKind

KINDS: tuple[str, ...] = tuple(k.value for k in UpstreamKind)
"""The fake's ``--kind`` values."""

VLLM_VERSION = "0.11.0"
"""What the vLLM-kind fake's ``/version`` says."""
TGI_VERSION = "3.3.6-dev0"
"""What the TGI-kind fake's ``/info`` says (router/Cargo.toml's version of the TGI source cited)."""


@dataclass(frozen=True)
class Finished:
    """One finished request, as the fake ran it (seconds; tokens as the fake counts them: words)."""

    queue_s: float
    prefill_s: float
    decode_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    """Per choice."""
    token_gap_s: float
    n: int = 1
    max_tokens: int | None = None
    finish_reason: str = "length"

    @property
    def ttft_s(self) -> float:
        """Arrival to first token: queue + prefill."""
        return self.queue_s + self.prefill_s

    @property
    def e2e_s(self) -> float:
        return self.queue_s + self.prefill_s + self.decode_s

    @property
    def tpot_s(self) -> float:
        """decode / (tokens - 1); 0 for one token (vLLM's ``request_time_per_output_token_seconds``)."""
        return self.decode_s / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


@dataclass
class EngineState:
    """The fake's live engine state: what its ``/metrics``, ``/slots`` and headers report."""

    slots: int = 0
    """Requests generating at once (llama.cpp ``-np``, a batch limit); more wait. 0: no limit."""
    kv_blocks: int = 64
    block_size: int = 16
    running: dict[int, list[int]] = field(default_factory=dict)
    """Request key -> [prompt tokens, output tokens so far (all choices)] of requests holding a slot."""
    waiting: int = 0
    finished: list[Finished] = field(default_factory=list)
    http: Counter[tuple[str, str, int]] = field(default_factory=Counter)
    """(path, method, status) -> answers."""
    started: float = 0.0
    """Wall-clock start (``created`` of the cards)."""

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv_blocks * self.block_size

    def used_blocks(self) -> int:
        """KV blocks held by the running requests: ceil(tokens / block_size) each."""
        return sum(math.ceil((p + o) / self.block_size) for p, o in self.running.values())

    def used_tokens(self) -> int:
        return sum(p + o for p, o in self.running.values())

    def kv_usage(self) -> float:
        """Used / total KV blocks, at most 1."""
        return min(1.0, self.used_blocks() / self.kv_blocks) if self.kv_blocks else 0.0

    def prefix_hit_rate(self) -> float:
        """Cached / prompt tokens over the finished requests (0 before any)."""
        prompt = sum(f.prompt_tokens for f in self.finished)
        return sum(f.cached_tokens for f in self.finished) / prompt if prompt else 0.0


# --- /v1/models ---------------------------------------------------------------------------------------------
def model_card(
    kind: str, model: str, max_model_len: int, created: int, card_kvscope: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One ``/v1/models`` entry as ``kind`` writes it.

    kvscope: engine/server/protocol.py (``owned_by`` "kvscope", ``max_model_len``, the ``kvscope`` field when
    given). vLLM: ``vllm/entrypoints/openai/protocol.py`` ``ModelCard`` (``owned_by`` "vllm", ``root``,
    ``parent``, ``max_model_len``, ``permission``). SGLang: ``sglang/srt/entrypoints/openai/protocol.py``
    ``ModelCard`` (``owned_by`` "sglang", ``root``, ``max_model_len``). llama.cpp: recorded
    (``owned_by`` "llamacpp", ``meta``). TGI: ``router/src/server.rs`` ``openai_get_model_info``
    (``owned_by`` = the model id, ``created`` 0). openai: OpenAI's API (``owned_by`` "system").
    """
    base: dict[str, Any] = {"id": model, "object": "model", "created": created}
    if kind == "kvscope":
        return {
            **base,
            "created": 0,
            "owned_by": "kvscope",
            "max_model_len": max_model_len,
            **({"kvscope": card_kvscope} if card_kvscope is not None else {}),
        }
    if kind == "vllm":
        permission = {
            "id": f"modelperm-{created:x}",
            "object": "model_permission",
            "created": created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        return {
            **base,
            "owned_by": "vllm",
            "root": model,
            "parent": None,
            "max_model_len": max_model_len,
            "permission": [permission],
        }
    if kind == "sglang":
        return {**base, "owned_by": "sglang", "root": model, "max_model_len": max_model_len}
    if kind == "llamacpp":
        return llamacpp_model_card(model, max_model_len, created)
    if kind == "tgi":
        return {**base, "created": 0, "owned_by": model}
    return {**base, "owned_by": "system"}


def models_list(kind: str, cards: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``/v1/models`` answer around ``cards`` (llama.cpp adds its Ollama-style ``models`` list)."""
    if kind == "llamacpp":
        return llamacpp_models_list(cards)
    return {"object": "list", "data": cards}


# --- Prometheus text ----------------------------------------------------------------------------------------
class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


def exposition(families: list[Metric]) -> str:
    """``families`` in the Prometheus text format, rendered by prometheus_client (as vLLM and SGLang do)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry).decode()


def histogram(
    name: str, doc: str, labels: dict[str, str], buckets: Sequence[float], values: Iterable[float]
) -> HistogramMetricFamily:
    """A histogram family of ``values`` with bounds ``buckets`` (+Inf added), cumulative as Prometheus's."""
    observed = list(values)
    family = HistogramMetricFamily(name, doc, labels=list(labels))
    cumulative = [(floatToGoString(b), float(sum(v <= b for v in observed))) for b in buckets]
    family.add_metric(
        list(labels.values()),
        [*cumulative, ("+Inf", float(len(observed)))],
        sum_value=float(sum(observed)),
    )
    return family


def gauge(name: str, doc: str, labels: dict[str, str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def counter(name: str, doc: str, labels: dict[str, str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def one_two_five(max_value: int) -> list[float]:
    """vLLM's ``build_1_2_5_buckets``: 1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return out
            out.append(float(value))
        exponent += 1


VLLM_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
VLLM_TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
VLLM_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)  # fmt: skip
VLLM_ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
VLLM_FINISH_REASONS = ("stop", "length", "abort")
"""vLLM V1's ``FinishReason`` values: ``vllm:request_success_total`` has one series each from the start."""


def vllm_metrics(state: EngineState, model: str, max_model_len: int) -> str:
    """vLLM V1's ``/metrics`` (``vllm/v1/metrics/loggers.py`` ``PrometheusStatLogger``; labels ``model_name``
    and ``engine``; histogram bounds as there), the series docs/metrics.md maps to ours, over the fake's
    state. Per-step series (``iteration_tokens_total``) count one prefill step per request (its prompt) and
    one decode step per later token (n tokens, one per choice). The spec-decode counters are exported at 0
    (vLLM has them only with a speculative config); ``http_requests_total`` is
    prometheus-fastapi-instrumentator's (``handler``, ``method``, ``status`` as ``2xx``)."""
    lab = {"model_name": model, "engine": "0"}
    done = state.finished
    cache_info = {  # CacheConfig.metrics_info(): every field a label (vllm/config/cache.py)
        "block_size": str(state.block_size),
        "cache_dtype": "auto",
        "enable_prefix_caching": "True",
        "engine": "0",
        "gpu_memory_utilization": "0.9",
        "is_attention_free": "False",
        "kv_cache_size_tokens": str(state.kv_capacity_tokens),
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(state.kv_blocks),
        "num_gpu_blocks_override": "None",
        "prefix_caching_hash_algo": "sha256",
        "sliding_window": "None",
    }
    by_reason = GaugeMetricFamily(
        "vllm:num_requests_waiting_by_reason",
        "Number of waiting requests by reason. Sum of all reasons equals vllm:num_requests_waiting.",
        labels=[*lab, "reason"],
    )
    by_reason.add_metric([*lab.values(), "capacity"], state.waiting)
    by_reason.add_metric([*lab.values(), "deferred"], 0)
    families: list[Metric] = [
        gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            lab,
            len(state.running),
        ),
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", lab, state.waiting),
        by_reason,
        gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lab, state.kv_usage()
        ),
        gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", cache_info, 1.0),
        counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", lab, 0),
        counter(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            lab,
            sum(f.prompt_tokens for f in done),
        ),
        counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            lab,
            sum(f.output_tokens * f.n for f in done),
        ),
        counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            lab,
            sum(f.prompt_tokens for f in done),
        ),
        counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            lab,
            sum(f.cached_tokens for f in done),
        ),
    ]
    success = CounterMetricFamily(
        "vllm:request_success", "Count of successfully processed requests.", labels=[*lab, "finished_reason"]
    )
    for reason in VLLM_FINISH_REASONS:
        success.add_metric([*lab.values(), reason], sum(f.finish_reason == reason for f in done))
    families.append(success)
    for name, doc in (
        ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
        ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
        ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
    ):
        families.append(counter(name, doc, lab, 0))
    per_pos = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Accepted tokens per draft position.",
        labels=[*lab, "position"],
    )
    per_pos.add_metric([*lab.values(), "0"], 0)
    families.append(per_pos)
    lengths = one_two_five(max_model_len)
    steps = [float(f.prompt_tokens) for f in done] + [
        float(f.n) for f in done for _ in range(f.output_tokens - 1)
    ]
    families += [
        histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            lab,
            VLLM_ITERATION_TOKENS_BUCKETS,
            steps,
        ),
        histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            lab,
            lengths,
            (f.prompt_tokens for f in done),
        ),
        histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            lab,
            lengths,
            (f.output_tokens * f.n for f in done),
        ),
        histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            lab,
            lengths,
            (f.output_tokens for f in done),
        ),
        histogram(
            "vllm:request_params_n",
            "Histogram of the n request parameter.",
            lab,
            (1, 2, 5, 10, 20),
            (f.n for f in done),
        ),
        histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            lab,
            lengths,
            (f.max_tokens if f.max_tokens is not None else f.output_tokens for f in done),
        ),
        histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            lab,
            VLLM_TTFT_BUCKETS,
            (f.ttft_s for f in done),
        ),
        histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            lab,
            VLLM_TPOT_BUCKETS,
            (f.token_gap_s for f in done for _ in range(f.output_tokens - 1)),
        ),
        histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            lab,
            VLLM_TPOT_BUCKETS,
            (f.tpot_s for f in done),
        ),
        histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            lab,
            VLLM_REQUEST_LATENCY_BUCKETS,
            (f.e2e_s for f in done),
        ),
        histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            lab,
            VLLM_REQUEST_LATENCY_BUCKETS,
            (f.queue_s for f in done),
        ),
        histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            lab,
            VLLM_REQUEST_LATENCY_BUCKETS,
            (f.prefill_s + f.decode_s for f in done),
        ),
        histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            lab,
            VLLM_REQUEST_LATENCY_BUCKETS,
            (f.prefill_s for f in done),
        ),
        histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            lab,
            VLLM_REQUEST_LATENCY_BUCKETS,
            (f.decode_s for f in done),
        ),
    ]
    http = CounterMetricFamily(
        "http_requests",
        "Total number of requests by method, status and handler.",
        labels=["handler", "method", "status"],
    )
    for (path, method, status), count in sorted(state.http.items()):
        http.add_metric([path, method, f"{status // 100}xx"], count)
    families.append(http)
    return exposition(families)


SGLANG_TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
SGLANG_ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080, 0.100, 0.200,
    0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
)  # fmt: skip
SGLANG_E2E_BUCKETS = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400,
)  # fmt: skip
SGLANG_QUEUE_BUCKETS = (
    0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200, 300, 400, 500, 600,
    700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000,
)  # fmt: skip


def sglang_metrics(state: EngineState, model: str) -> str:
    """SGLang's ``/metrics`` (``python/sglang/srt/metrics/collector.py``: the scheduler's gauges labelled
    ``model_name``, ``engine_type``, ``tp_rank``, ``pp_rank``, ``moe_ep_rank``; the tokenizer manager's
    counters and histograms labelled ``model_name``; bounds as there) over the fake's state.
    ``sglang:token_usage`` is used / total KV tokens, ``sglang:max_total_num_tokens`` the pool size."""
    sched = {
        "model_name": model,
        "engine_type": "unified",
        "tp_rank": "0",
        "pp_rank": "0",
        "moe_ep_rank": "0",
    }
    tok = {"model_name": model}
    done = state.finished
    used = state.used_blocks() * state.block_size
    return exposition(
        [
            gauge("sglang:num_running_reqs", "The number of running requests.", sched, len(state.running)),
            gauge("sglang:num_used_tokens", "The number of used tokens.", sched, used),
            gauge("sglang:token_usage", "The token usage.", sched, state.kv_usage()),
            gauge("sglang:gen_throughput", "The generation throughput (token/s).", sched, 0.0),
            gauge(
                "sglang:num_queue_reqs", "The number of requests in the waiting queue.", sched, state.waiting
            ),
            gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", sched, state.prefix_hit_rate()),
            gauge(
                "sglang:max_total_num_tokens",
                "Maximum total number of tokens in the KV cache pool.",
                sched,
                state.kv_capacity_tokens,
            ),
            histogram(
                "sglang:queue_time_seconds",
                "Histogram of queueing time in seconds.",
                sched,
                SGLANG_QUEUE_BUCKETS,
                (f.queue_s for f in done),
            ),
            counter(
                "sglang:prompt_tokens",
                "Number of prefill tokens processed.",
                tok,
                sum(f.prompt_tokens for f in done),
            ),
            counter(
                "sglang:generation_tokens",
                "Number of generation tokens processed.",
                tok,
                sum(f.output_tokens * f.n for f in done),
            ),
            counter(
                "sglang:cached_tokens",
                "Number of cached prompt tokens.",
                tok,
                sum(f.cached_tokens for f in done),
            ),
            counter("sglang:num_requests", "Number of requests processed.", tok, len(done)),
            counter(
                "sglang:num_aborted_requests",
                "Number of requests aborted.",
                tok,
                sum(f.finish_reason == "abort" for f in done),
            ),
            histogram(
                "sglang:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                tok,
                SGLANG_TTFT_BUCKETS,
                (f.ttft_s for f in done),
            ),
            histogram(
                "sglang:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                tok,
                SGLANG_ITL_BUCKETS,
                (f.token_gap_s for f in done for _ in range(f.output_tokens - 1)),
            ),
            histogram(
                "sglang:e2e_request_latency_seconds",
                "Histogram of End-to-end request latency in seconds",
                tok,
                SGLANG_E2E_BUCKETS,
                (f.e2e_s for f in done),
            ),
        ]
    )


def kvscope_metrics(state: EngineState, model: str) -> str:
    """Our engine's scheduler gauges (engine/server/metrics.py ``_init_scheduler_state``): running, waiting,
    KV usage and blocks by state (no prefix cache in the fake: ``cached`` is 0)."""
    lab = {"model": model}
    used = min(state.used_blocks(), state.kv_blocks)
    blocks = GaugeMetricFamily(
        "kvscope_engine_kv_cache_blocks",
        "KV-cache blocks by state: used (held by requests), cached (free, reusable prefix), free (empty).",
        labels=["model", "state"],
    )
    for block_state, value in (("used", used), ("cached", 0), ("free", state.kv_blocks - used)):
        blocks.add_metric([model, block_state], value)
    return exposition(
        [
            gauge(
                "kvscope_engine_requests_running",
                "Requests in the running batch (scheduled in the engine step).",
                lab,
                len(state.running),
            ),
            gauge(
                "kvscope_engine_requests_waiting",
                "Requests waiting to be scheduled (queued or preempted).",
                lab,
                state.waiting,
            ),
            gauge(
                "kvscope_engine_kv_cache_usage_ratio",
                "Fraction of KV-cache blocks held by requests (0-1).",
                lab,
                state.kv_usage(),
            ),
            blocks,
        ]
    )


def tgi_duration_buckets() -> list[float]:
    """TGI's duration bounds (``router/src/server.rs`` ``start``): 35 values, 0.0001 x 1.5^i, i = 1..35."""
    out, value = [], 0.0001
    for _ in range(35):
        value *= 1.5
        out.append(value)
    return out


def _rust_number(value: float) -> str:
    """A value as metrics-exporter-prometheus writes it: integers without a fraction."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def tgi_metrics(state: EngineState, max_input_tokens: int, max_total_tokens: int) -> str:
    """TGI's ``/metrics`` (metrics-exporter-prometheus, unlabelled; names from ``router/src/server.rs`` and
    ``backends/v3/src/{backend,queue,lib}.rs``; counters without ``_total``, as that exporter writes them;
    bounds from ``router/src/server.rs`` ``start``). ``tgi_batch_current_size`` is the running requests,
    ``tgi_queue_size`` the waiting ones, ``tgi_batch_max_total_tokens`` the fake's KV tokens."""
    done = state.finished
    parts: list[str] = []

    def scalar(name: str, kind: str, doc: str, value: float) -> None:
        parts.append(f"# HELP {name} {doc}\n# TYPE {name} {kind}\n{name} {_rust_number(value)}\n")

    def hist(name: str, doc: str, bounds: Sequence[float], values: list[float]) -> None:
        lines = [f"# HELP {name} {doc}", f"# TYPE {name} histogram"]
        for bound in bounds:
            lines.append(f'{name}_bucket{{le="{bound!r}"}} {sum(v <= bound for v in values)}')
        lines += [
            f'{name}_bucket{{le="+Inf"}} {len(values)}',
            f"{name}_sum {_rust_number(sum(values))}",
            f"{name}_count {len(values)}",
        ]
        parts.append("\n".join(lines) + "\n")

    durations = tgi_duration_buckets()
    scalar(
        "tgi_request_count",
        "counter",
        "Total number of requests",
        len(done) + len(state.running) + state.waiting,
    )
    scalar("tgi_request_success", "counter", "Number of successful requests", len(done))
    scalar("tgi_queue_size", "gauge", "Current queue size", state.waiting)
    scalar("tgi_batch_current_size", "gauge", "Current batch size", len(state.running))
    scalar(
        "tgi_batch_current_max_tokens", "gauge", "Maximum tokens for the current batch", state.used_tokens()
    )
    scalar(
        "tgi_batch_max_total_tokens", "gauge", "Maximum amount of tokens in total.", state.kv_capacity_tokens
    )
    hist(
        "tgi_request_duration", "Total time spent processing the request", durations, [f.e2e_s for f in done]
    )
    hist(
        "tgi_request_validation_duration", "Time spent validating the request", durations, [0.0 for _ in done]
    )
    hist(
        "tgi_request_queue_duration",
        "Time spent in the queue per request",
        durations,
        [f.queue_s for f in done],
    )
    hist(
        "tgi_request_inference_duration",
        "Request inference duration",
        durations,
        [f.prefill_s + f.decode_s for f in done],
    )
    hist(
        "tgi_request_mean_time_per_token_duration",
        "Mean time per token per request",
        durations,
        [(f.prefill_s + f.decode_s) / max(1, f.output_tokens) for f in done],
    )
    hist(
        "tgi_request_input_length",
        "Input token length per request",
        [max_input_tokens / 100 * (x + 1) for x in range(100)],
        [float(f.prompt_tokens) for f in done],
    )
    hist(
        "tgi_request_generated_tokens",
        "Generated tokens per request",
        [max_total_tokens / 100 * (x + 1) for x in range(100)],
        [float(f.output_tokens) for f in done],
    )
    return "\n".join(parts)


# --- TGI ----------------------------------------------------------------------------------------------------
def tgi_info(model: str, max_model_len: int, slots: int) -> dict[str, Any]:
    """TGI's ``GET /info`` (``router/src/lib.rs`` ``struct Info``, field order as there)."""
    return {
        "model_id": model,
        "model_sha": None,
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": slots or 128,
        "max_best_of": 2,
        "max_stop_sequences": 4,
        "max_input_tokens": max_model_len - 1,
        "max_total_tokens": max_model_len,
        "validation_workers": 2,
        "max_client_batch_size": 4,
        "router": "text-generation-router",
        "version": TGI_VERSION,
        "sha": None,
        "docker_label": None,
    }


def tgi_timing_headers(
    *, chat: bool, queue_s: float, inference_s: float, prompt_tokens: int, output_tokens: int, characters: int
) -> list[tuple[str, str]]:
    """The headers TGI sets on a non-streamed answer (``router/src/server.rs``): ``generate_internal`` for
    ``/v1/chat/completions`` (x-compute-type, x-compute-time in seconds, x-compute-characters, then
    milliseconds truncated as ``Duration::as_millis``: x-total-time, x-validation-time, x-queue-time,
    x-inference-time, x-time-per-token = inference / generated tokens, then x-prompt-tokens,
    x-generated-tokens); ``/v1/completions`` sums those of its prompts and has no x-compute-time.
    Validation takes no time in the fake."""
    total_s = queue_s + inference_s
    per_token_s = inference_s / output_tokens if output_tokens else 0.0
    headers = [("x-compute-type", "gpu+optimized")]
    if chat:
        headers.append(("x-compute-time", repr(total_s)))
    return [
        *headers,
        ("x-compute-characters", str(characters)),
        ("x-total-time", str(int(total_s * 1e3))),
        ("x-validation-time", "0"),
        ("x-queue-time", str(int(queue_s * 1e3))),
        ("x-inference-time", str(int(inference_s * 1e3))),
        ("x-time-per-token", str(int(per_token_s * 1e3))),
        ("x-prompt-tokens", str(prompt_tokens)),
        ("x-generated-tokens", str(output_tokens)),
    ]


def tgi_stream_headers(characters: int) -> list[tuple[str, str]]:
    """A TGI stream's headers (``generate_stream_internal``): no timings, they are not known yet."""
    return [
        ("x-compute-type", "gpu+optimized"),
        ("x-compute-characters", str(characters)),
        ("x-accel-buffering", "no"),
    ]


# --- llama.cpp (shapes as recorded: tests/fixtures/upstreams/llamacpp/) -------------------------------------
LLAMACPP_BUILD = "b1-0c1e570"
"""``system_fingerprint`` / ``build_info`` of the recorded llama-server (llama.cpp commit 0c1e570, vendored in
llama-cpp-python 0.3.36)."""
LLAMACPP_HEADERS: tuple[tuple[str, str], ...] = (
    ("server", "llama.cpp"),
    ("access-control-allow-origin", ""),
    ("keep-alive", "timeout=5, max=100"),
)
"""Headers llama-server adds to every answer (besides content-type and length)."""
LLAMACPP_JSON_TYPE = "application/json; charset=utf-8"
LLAMACPP_METRICS_TYPE = "text/plain; version=0.0.4"
LLAMACPP_SAMPLING: dict[str, Any] = {
    "seed": 4294967295,
    "temperature": 0.800000011920929,
    "dynatemp_range": 0.0,
    "dynatemp_exponent": 1.0,
    "top_k": 40,
    "top_p": 0.949999988079071,
    "min_p": 0.05000000074505806,
    "top_n_sigma": -1.0,
    "xtc_probability": 0.0,
    "xtc_threshold": 0.10000000149011612,
    "typical_p": 1.0,
    "repeat_last_n": 64,
    "repeat_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "dry_multiplier": 0.0,
    "dry_base": 1.75,
    "dry_allowed_length": 2,
    "dry_penalty_last_n": 64,
    "mirostat": 0,
    "mirostat_tau": 5.0,
    "mirostat_eta": 0.10000000149011612,
    "adaptive_target": -1.0,
    "adaptive_decay": 0.8999999761581421,
    "max_tokens": -1,
    "n_predict": -1,
    "n_keep": 0,
    "n_discard": 0,
    "ignore_eos": False,
    "stream": False,
    "n_probs": 0,
    "min_keep": 0,
    "chat_format": "Content-only",
    "reasoning_format": "none",
    "reasoning_in_content": False,
    "generation_prompt": "",
    "samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"],
    "speculative.types": "none",
    "timings_per_token": False,
    "post_sampling_probs": False,
    "backend_sampling": False,
    "lora": [],
}
"""A task's sampling parameters as /props (``default_generation_settings.params``) and /slots show them
(``task_params::to_json``), recorded with the server's defaults."""
LLAMACPP_TEMPLATE_CAPS = {
    "supports_object_arguments": False,
    "supports_parallel_tool_calls": False,
    "supports_preserve_reasoning": False,
    "supports_reasoning_effort": False,
    "supports_string_content": True,
    "supports_system_role": True,
    "supports_tool_calls": False,
    "supports_tools": False,
    "supports_typed_content": False,
}
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def llamacpp_model_card(model: str, max_model_len: int, created: int) -> dict[str, Any]:
    """One ``data`` entry of llama-server's ``/v1/models`` (tools/server/server-context.cpp
    ``get_res_model_info``): ``meta.n_ctx`` is a slot's context (the fake: ``max_model_len``)."""
    return {
        "id": model,
        "aliases": [model],
        "tags": [],
        "object": "model",
        "created": created,
        "owned_by": "llamacpp",
        "meta": {
            "vocab_type": 2,
            "n_vocab": 49152,
            "n_ctx": max_model_len,
            "n_ctx_train": max_model_len,
            "n_embd": 576,
            "n_params": 134515008,
            "size": 96576768,
            "ftype": "Q4_1",
        },
    }


def llamacpp_models_list(cards: list[dict[str, Any]]) -> dict[str, Any]:
    """llama-server's ``/v1/models``: the Ollama-style ``models`` list, then OpenAI's ``object``, ``data``."""
    ollama = [
        {
            "name": card["id"],
            "model": card["id"],
            "modified_at": "",
            "size": "",
            "digest": "",
            "type": "model",
            "description": "",
            "tags": [""],
            "capabilities": ["completion"],
            "parameters": "",
            "details": {
                "parent_model": "",
                "format": "gguf",
                "family": "",
                "families": [""],
                "parameter_size": "",
                "quantization_level": "",
            },
        }
        for card in cards
    ]
    return {"models": ollama, "object": "list", "data": cards}


def llamacpp_props(up: Any) -> dict[str, Any]:
    """llama-server's ``GET /props`` (``get_res_props``) for the fake ``up``: ``total_slots`` = its slots
    (1 without a limit), ``default_generation_settings.n_ctx`` = ``max_model_len``."""
    model = up.models[0]
    return {
        "default_generation_settings": {"params": dict(LLAMACPP_SAMPLING), "n_ctx": up.max_model_len},
        "total_slots": max(1, up.slots),
        "model_alias": model,
        "model_ftype": "Q4_1",
        "model_path": f"/models/{model}.gguf",
        "modalities": {"vision": False, "video": False, "audio": False},
        "media_marker": "<__media_fake__>",
        "endpoint_slots": True,
        "endpoint_props": False,
        "endpoint_metrics": True,
        "ui": False,
        "ui_settings": {},
        "chat_template": CHATML,
        "chat_template_caps": dict(LLAMACPP_TEMPLATE_CAPS),
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "build_info": LLAMACPP_BUILD,
        "is_sleeping": False,
        "cors_proxy_enabled": False,
    }


def llamacpp_slots(up: Any) -> list[dict[str, Any]]:
    """llama-server's ``GET /slots`` (``server_slot::to_json``, without ``--slots-debug``), one entry per
    slot, ``n_ctx`` = ``max_model_len`` each (a split cache: ``-np N -c N x max_model_len``). A slot holding a
    request shows its task: ``n_prompt_tokens`` = the tokens in the slot's cache, the prompt and those
    generated so far; ``next_token[0].n_decoded`` = generated. An idle slot that ran shows its last task as
    the server's ``reset()`` leaves it (``task_prev``, stats zeroed, ``n_remain`` -1) with the tokens its
    cache keeps (the prompt and all generated tokens but the last, which nothing decoded); one that never ran
    only its id, n_ctx, speculative and is_processing. Slots: ``slots`` (at least 1; without a limit, as many
    as ever ran at once)."""
    running = {gen.slot_id: (gen, up.engine.running[key][1]) for key, gen in up.generations.items()}
    count = max(1, up.slots, *(i + 1 for i in (*running, *up.slot_last)))
    out: list[dict[str, Any]] = []
    for slot in range(count):
        entry: dict[str, Any] = {
            "id": slot,
            "n_ctx": up.max_model_len,
            "speculative": False,
            "is_processing": slot in running,
        }
        if slot in running:  # its task as it runs
            gen, decoded = running[slot]
            cache_n, processed = gen.llamacpp_cache_split()
            tokens, remain = gen.prompt_tokens + decoded, gen.num_tokens - decoded
        elif slot in up.slot_last:  # its last task, after reset(): stats zeroed, the cache kept
            gen, tokens = up.slot_last[slot]
            cache_n = processed = decoded = 0
            remain = -1
        else:
            out.append(entry)
            continue
        entry.update(
            id_task=gen.task_id,
            n_prompt_tokens=tokens,
            n_prompt_tokens_processed=processed,
            n_prompt_tokens_cache=cache_n,
            params={**LLAMACPP_SAMPLING, "max_tokens": gen.num_tokens, "n_predict": gen.num_tokens},
            next_token=[
                {
                    "has_next_token": slot in running,
                    "has_new_line": False,
                    "n_remain": remain,
                    "n_decoded": decoded,
                }
            ],
        )
        out.append(entry)
    return out


def llamacpp_metrics(up: Any) -> str:
    """llama-server's ``/metrics`` (tools/server/server-task.cpp ``to_metrics``, with ``--metrics``): the
    counters and gauges in its order, numbers as C++ ``ostream <<`` writes them (``%g``). Counted when a
    request finishes; prompt tokens exclude cached ones; one ``llama_decode`` per prompt and per later
    token; no KV-usage series in this version."""
    done, state = up.engine.finished, up.engine
    prompt_n = sum(p for _, p in (llamacpp_split(f.prompt_tokens, f.cached_tokens) for f in done))
    cached = sum(c for c, _ in (llamacpp_split(f.prompt_tokens, f.cached_tokens) for f in done))
    prompt_s = sum(f.prefill_s for f in done)
    decode_s = sum(f.decode_s for f in done)
    steps = sum(max(0, f.output_tokens - 1) for f in done)
    n_decode = sum(f.output_tokens for f in done)
    counters = [
        ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", prompt_n),
        ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", cached),
        ("prompt_seconds_total", "Total time spent processing prompts", prompt_s),
        (
            "tokens_predicted_total",
            "Number of generation tokens processed",
            sum(f.output_tokens for f in done),
        ),
        ("tokens_predicted_seconds_total", "Total time spent generating tokens", decode_s),
        (
            "n_decode_total",
            "Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding",
            n_decode,
        ),
        (
            "n_tokens_max",
            "Largest observed sequence length (prompt + generation)",
            max((f.prompt_tokens + f.output_tokens for f in done), default=0),
        ),
        ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated", 0),
        (
            "spec_decode_num_accepted_tokens_total",
            "Speculative: Total draft tokens accepted by the target model",
            0,
        ),
        ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps", 0),
    ]
    gauges = [
        (
            "prompt_tokens_seconds",
            "Average prompt throughput in tokens/s",
            prompt_n / prompt_s if prompt_s else 0,
        ),
        (
            "predicted_tokens_seconds",
            "Average generation throughput in tokens/s",
            steps / decode_s if decode_s else 0,
        ),
        ("requests_processing", "Number of requests processing", len(state.running)),
        ("requests_deferred", "Number of requests deferred", state.waiting),
        (
            "n_busy_slots_per_decode",
            "Average number of busy slots per llama_decode() call",
            1 if n_decode else 0,
        ),
    ]
    lines = []
    for kind, items in (("counter", counters), ("gauge", gauges)):
        for name, doc, value in items:
            lines += [
                f"# HELP llamacpp:{name} {doc}",
                f"# TYPE llamacpp:{name} {kind}",
                f"llamacpp:{name} {value:g}",
            ]
    return "\n".join(lines) + "\n"


def llamacpp_context_error(prompt_tokens: int, n_ctx: int) -> dict[str, Any]:
    """llama-server's 400 for a prompt longer than a slot's context (tools/server/server-common.cpp
    ``format_error_response``, ``ERROR_TYPE_EXCEED_CONTEXT_SIZE``): not OpenAI's shape (``code`` is the HTTP
    status as a number, no ``param``, two extra fields). Recorded from the llama-server this repo builds
    (b1-0c1e570, ``-c 2048 -np 2``, a 1,230-token prompt):
    ``{"error":{"code":400,"message":"request (1230 tokens) exceeds the available context size (1024 tokens),
    try increasing it","type":"exceed_context_size_error","n_prompt_tokens":1230,"n_ctx":1024}}``."""
    return {
        "error": {
            "code": 400,
            "message": f"request ({prompt_tokens} tokens) exceeds the available context size "
            f"({n_ctx} tokens), try increasing it",
            "type": "exceed_context_size_error",
            "n_prompt_tokens": prompt_tokens,
            "n_ctx": n_ctx,
        }
    }


def llamacpp_split(prompt_tokens: int, cached_tokens: int) -> tuple[int, int]:
    """(cache_n, prompt_n): cached prompt tokens and those evaluated. llama.cpp evaluates at least the last
    prompt token even on a full cache hit (recorded: 37 tokens, ``cache_n`` 36, ``prompt_n`` 1)."""
    cache_n = max(0, min(cached_tokens, prompt_tokens - 1))
    return cache_n, prompt_tokens - cache_n


def llamacpp_timings(gen: Any) -> dict[str, Any]:
    """The ``timings`` object (tools/server/server-common.cpp ``server_slot_stats::to_json``, -common.h) from
    the fake's delays, in microseconds as there: ``prompt_ms`` = slot start -> first token (prefill; a
    request's wait for a slot is not in it), ``predicted_ms`` = first -> last token (at least 1 us), per
    token over ``predicted_n - 1`` decode steps (the first token comes from the prompt batch)."""
    cache_n, prompt_n = gen.llamacpp_cache_split()
    prompt_ms = round(gen.prefill_s * 1e6) / 1e3
    predicted_n = gen.num_tokens
    steps = max(0, predicted_n - 1)
    predicted_ms = max(1, round(gen.decode_s * 1e6)) / 1e3 if predicted_n else 0.0
    return {
        "cache_n": cache_n,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1e3 / prompt_ms * prompt_n if prompt_ms > 0 else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / steps if steps else 0.0,
        "predicted_per_second": 1e3 / predicted_ms * steps if predicted_ms > 0 else 0.0,
    }


def llamacpp_usage(gen: Any) -> dict[str, Any]:
    """``usage_json_oaicompat``: completion, prompt, total tokens, then the cached ones."""
    cache_n, _ = gen.llamacpp_cache_split()
    return {
        "completion_tokens": gen.num_tokens,
        "prompt_tokens": gen.prompt_tokens,
        "total_tokens": gen.num_tokens + gen.prompt_tokens,
        "prompt_tokens_details": {"cached_tokens": cache_n},
    }


def llamacpp_id(gen: Any) -> str:
    """llama.cpp's completion id: ``chatcmpl-`` and 32 characters (both routes)."""
    return "chatcmpl-" + gen.id.split("-", 1)[1].rjust(32, "0")[-32:]


def llamacpp_completion(gen: Any, texts: list[str]) -> dict[str, Any]:
    """A non-streamed answer, keys in llama-server's order (server-task.cpp ``to_json_oaicompat_chat`` /
    ``to_json_oaicompat``), ``timings`` last."""
    if gen.chat:
        choice: dict[str, Any] = {
            "finish_reason": gen.finish,
            "index": 0,
            "message": {"role": "assistant", "content": texts[0]},
        }
    else:
        choice = {"text": texts[0], "index": 0, "logprobs": None, "finish_reason": gen.finish}
    return {
        "choices": [choice],
        "created": int(time.time()),
        "model": gen.model,
        "system_fingerprint": LLAMACPP_BUILD,
        "object": "chat.completion" if gen.chat else "text_completion",
        "usage": llamacpp_usage(gen),
        "id": llamacpp_id(gen),
        "timings": llamacpp_timings(gen),
    }


def llamacpp_choice(gen: Any, c: int, text: str | None, finish: str | None, role: bool) -> dict[str, Any]:
    """One stream choice: chat ``{finish_reason, index, delta}`` (the first, sent with the first token,
    ``{"role": "assistant", "content": null}``), text ``{text, index, logprobs, finish_reason}``."""
    if gen.chat:
        delta: dict[str, Any] = (
            {"role": "assistant", "content": None}
            if role
            else ({"content": text} if text is not None else {})
        )
        return {"finish_reason": finish, "index": c, "delta": delta}
    return {"text": text or "", "index": c, "logprobs": None, "finish_reason": finish}


def llamacpp_chunk(gen: Any, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """One stream event, keys in llama-server's order (chat: ``…, id, model, system_fingerprint, object``;
    text: ``…, model, system_fingerprint, object, id``)."""
    head: dict[str, Any] = {"choices": choices, "created": int(time.time())}
    if gen.chat:
        return {
            **head,
            "id": llamacpp_id(gen),
            "model": gen.model,
            "system_fingerprint": LLAMACPP_BUILD,
            "object": "chat.completion.chunk",
            **extra,
        }
    usage = {"usage": extra.pop("usage")} if "usage" in extra else {}
    return {
        **head,
        "model": gen.model,
        "system_fingerprint": LLAMACPP_BUILD,
        "object": "text_completion",
        **usage,
        "id": llamacpp_id(gen),
        **extra,
    }


def llamacpp_final_chunks(gen: Any) -> list[dict[str, Any]]:
    """The events after the last token (``to_json_oaicompat_chat_stream`` / ``to_json_oaicompat``): chat: the
    finish chunk (empty delta), with ``stream_options.include_usage`` then a usage chunk (no choices), and
    ``timings`` on the last of them; text: one finish chunk with usage (always) and ``timings``."""
    timings = llamacpp_timings(gen)
    if not gen.chat:
        return [
            llamacpp_chunk(
                gen,
                [llamacpp_choice(gen, 0, "", gen.finish, False)],
                usage=llamacpp_usage(gen),
                timings=timings,
            )
        ]
    events = [llamacpp_chunk(gen, [llamacpp_choice(gen, 0, None, gen.finish, False)])]
    if gen.include_usage:
        events.append(llamacpp_chunk(gen, [], usage=llamacpp_usage(gen)))
    events[-1]["timings"] = timings
    return events
