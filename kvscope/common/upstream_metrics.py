"""Which Prometheus series each inference server exports for the state the gateway samples: requests
running, requests waiting, KV-cache usage and KV capacity. Data only, one table, in the shared leaf so that
the gateway's scraper (gateway/engines/samples.py) and the dashboards generator (kvscope.dashboards, which may
not import the gateway) read the same names.

Keys are the upstream kinds' values (gateway/engines/kinds.py ``UpstreamKind``); ``openai`` has no entry (a
plain OpenAI-compatible server exports nothing known). Each name was read in the server's own source:

- ``kvscope``: engine/server/metrics.py (``_init_scheduler_state``), label ``model``.
- ``vllm``: vllm/v1/metrics/loggers.py ``PrometheusStatLogger`` (labels ``model_name``, ``engine`` = the
  data-parallel engine index). ``vllm:kv_cache_usage_perc`` is a 0-1 fraction despite its name ("KV-cache
  usage. 1 means 100 percent usage."); releases before 0.9 called it ``vllm:gpu_cache_usage_perc`` (kept as
  a deprecated alias until 0.10). ``vllm:cache_config_info`` is an info gauge (value 1) whose labels are
  ``CacheConfig.metrics_info()`` = every CacheConfig field as a string (vllm/config/cache.py): ``block_size``,
  ``num_gpu_blocks`` (``None`` before profiling) and, in current releases, ``kv_cache_size_tokens`` ("Per-DP-
  engine KV cache capacity in tokens (group-aware)", right for hybrid models where ``num_gpu_blocks x
  block_size`` is not); one series per engine.
- ``sglang``: python/sglang/srt/observability/metrics_collector.py ``SchedulerMetricsCollector`` (older
  releases: srt/metrics/collector.py), labels ``model_name``, ``engine_type``, ``tp_rank``, ``pp_rank``,
  ``moe_ep_rank`` and ``dp_rank`` with data parallelism (scheduler_metrics_mixin.py ``init_metrics``).
  ``sglang:token_usage`` = used / ``max_total_num_tokens`` (0-1, rounded to 2 decimals on some paths);
  ``sglang:max_total_num_tokens`` = "Maximum total number of tokens in the KV cache pool". Only the
  scheduler with ``attn_tp_rank == 0`` of each data-parallel group reports unless
  ``--enable-metrics-for-all-schedulers``, when every TP/PP rank reports a copy of the same state: those
  labels are :attr:`SampleNames.replica_labels`.
  SGLang updates these gauges when it logs a prefill batch or every ``--decode-log-interval`` (40) decode
  steps, so they lag the scheduler by up to that many steps.
- ``llamacpp``: tools/server/server-context.cpp, the ``/metrics`` handler (only with ``--metrics``; else 501),
  no labels. ``requests_processing`` = busy slots, ``requests_deferred`` = tasks deferred until a slot frees.
  ``llamacpp:kv_cache_usage_ratio`` (= used KV cells / n_ctx) and ``llamacpp:kv_cache_tokens`` exist in
  older builds (tools/server/server.cpp before the handler moved) and are gone from current ones. Not in this
  table: the KV usage and capacity of current builds come from their ``GET /slots`` (on by default), read
  beside ``/metrics`` (gateway/engines/samples.py ``sample_from_slots``: Σ ``n_prompt_tokens`` / Σ
  ``n_ctx``, exact for a split KV cache, an underestimate by the number of slots for a unified one).
- ``tgi``: backends/v3/src/backend.rs (``tgi_batch_current_size`` = requests in the running batch),
  backends/v3/src/queue.rs (``tgi_queue_size`` = requests queued) and backends/v3/src/lib.rs
  (``tgi_batch_max_total_tokens`` = ``max_batch_total_tokens``, the token budget of a batch that warmup fit
  in memory: the KV capacity, set once at start); no labels. No KV-usage series:
  ``tgi_batch_current_max_tokens`` is the running batch's token reservation (what keeps the next batch
  waiting), not cache use, so it is not read as one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True, slots=True)
class SampleNames:
    """The series of one kind of server; in each tuple the first name present in a scrape counts (newer name
    first, then older releases' names)."""

    requests_running: tuple[str, ...]
    """Gauge: requests in the running batch (count)."""
    requests_waiting: tuple[str, ...]
    """Gauge: requests queued, not yet scheduled (count)."""
    kv_cache_usage: tuple[str, ...] = ()
    """Gauge: fraction of the KV cache in use, 0-1."""
    kv_capacity_tokens: tuple[str, ...] = ()
    """Gauge whose value is the KV capacity in tokens."""
    cache_config_info: str | None = None
    """Info gauge whose labels carry the capacity (vLLM: ``kv_cache_size_tokens``, else ``num_gpu_blocks`` x
    ``block_size``)."""
    replica_labels: tuple[str, ...] = ()
    """Labels whose values only number copies of one scheduler's state (SGLang's TP/PP/EP ranks): series that
    differ only in them count once."""


METRIC_PREFIXES: Mapping[str, str] = MappingProxyType(
    {
        "kvscope": "kvscope_engine_",
        "vllm": "vllm:",
        "sglang": "sglang:",
        "llamacpp": "llamacpp:",
        "tgi": "tgi_",
    }
)
"""Kind value → the prefix every series of that server starts with (the gateway's kind detection from metric
names, the dashboard variants' ``__name__`` regex); the sources: gateway/engines/kinds.py's docstring."""

UPSTREAM_METRIC_NAMES: Mapping[str, SampleNames] = MappingProxyType(
    {
        "kvscope": SampleNames(
            requests_running=("kvscope_engine_requests_running",),
            requests_waiting=("kvscope_engine_requests_waiting",),
            kv_cache_usage=("kvscope_engine_kv_cache_usage_ratio",),
        ),
        "vllm": SampleNames(
            requests_running=("vllm:num_requests_running",),
            requests_waiting=("vllm:num_requests_waiting",),
            kv_cache_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
            cache_config_info="vllm:cache_config_info",
        ),
        "sglang": SampleNames(
            requests_running=("sglang:num_running_reqs",),
            requests_waiting=("sglang:num_queue_reqs",),
            kv_cache_usage=("sglang:token_usage",),
            kv_capacity_tokens=("sglang:max_total_num_tokens",),
            replica_labels=("tp_rank", "pp_rank", "moe_ep_rank"),
        ),
        "llamacpp": SampleNames(
            requests_running=("llamacpp:requests_processing",),
            requests_waiting=("llamacpp:requests_deferred",),
            kv_cache_usage=("llamacpp:kv_cache_usage_ratio",),
        ),
        "tgi": SampleNames(
            requests_running=("tgi_batch_current_size",),
            requests_waiting=("tgi_queue_size",),
            kv_capacity_tokens=("tgi_batch_max_total_tokens",),
        ),
    }
)
"""Kind value → its series (module docstring: where each was read)."""


def sampled_names() -> frozenset[str]:
    """Every series name in :data:`UPSTREAM_METRIC_NAMES`: the lines of a scrape worth parsing."""
    names: set[str] = set()
    for entry in UPSTREAM_METRIC_NAMES.values():
        names.update(entry.requests_running, entry.requests_waiting, entry.kv_cache_usage)
        names.update(entry.kv_capacity_tokens)
        if entry.cache_config_info:
            names.add(entry.cache_config_info)
    return frozenset(names)
