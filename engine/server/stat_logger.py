"""Feeds the ``kvscope_engine_*`` collectors (engine/server/metrics.py) from the server.

Two sources, as in vLLM v1's ``StatLoggers``:

* the engine's step listener (engine thread): scheduler gauges (running, waiting, KV usage, blocks by state),
  per-step histograms (batch size, scheduled tokens), preemptions, prefix-cache and speculative-decoding
  counters (``StepResult.spec_decoding``). AsyncEngine also
  calls it after aborts, so the gauges return to baseline when a client leaves.
* the serving code (event loop), per request: prompt tokens (once per prompt, when its prefill completed, so
an
  abandoned prefill counts nothing), generated tokens and inter-token latency as they stream, and at the end
  the latency / length histograms and ``request_success{finish_reason}``, with the same numbers that go into
  the request's log line.

Labels stay bounded: ``model`` is the served model name only, ``route`` a route template of this app
(``unmatched`` otherwise), ``status`` the HTTP code.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from kvscope.common.otel_genai import GenAiServerMetrics
from kvscope.engine.core.stats import SchedulerStats
from kvscope.engine.engine_core import StepResult
from kvscope.engine.platform.kernel_probe import NO_DENSE
from kvscope.engine.server.metrics import EngineMetrics, MetricBuckets
from kvscope.engine.spec_decode.stats import SpecDecodingStats


@dataclass(frozen=True, slots=True)
class SequenceTimings:
    """One finished sequence (choice) as observed into the histograms; seconds, None = phase not reached."""

    finish_reason: str
    """``stop``, ``length``, ``abort`` (client left) or ``error``."""
    num_output_tokens: int
    e2e_s: float
    ttft_s: float | None = None
    queue_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    tpot_s: float | None = None
    causes: dict[tuple[str, str], float] | None = None
    """(phase, cause) → seconds (kvscope.engine.core.attribution.cause_seconds); None without engine stats."""
    predicted_ttft_s: float | None = None
    """The engine's TTFT prediction for it (engine/core/ttft.py), when both it and ``ttft_s`` are known."""
    service_tier: str | None = None
    """The tier it was queued in (engine/core/admission.py TIERS); None: not known (no tier histograms)."""


class ServerMetrics:
    """All engine-server metrics on one registry. Thread-safe: prometheus_client collectors lock internally;
    the prefix-cache counter bookkeeping is touched by the engine thread only."""

    def __init__(
        self,
        registry: CollectorRegistry,
        model: str,
        device: str = "cpu",
        buckets: MetricBuckets | None = None,
        genai: GenAiServerMetrics | None = None,
        num_speculative_tokens: int = 0,
    ) -> None:
        self.registry = registry
        self.model = model
        self.genai = genai
        """OTel ``gen_ai.server.*`` instruments (kvscope.common.otel_genai), None when not wired."""
        self.engine = EngineMetrics(registry, buckets, num_speculative_tokens)
        self.engine.initialize(model, device)
        self.http_requests = self.engine.http_requests
        self._prefix_queries_seen = 0
        self._prefix_hits_seen = 0

    # --- engine thread
    # ----------------------------------------------------------------------------------------

    def on_step(self, result: StepResult, stats: SchedulerStats | None = None) -> None:
        """Scheduler gauges and per-step histograms. ``batch_size`` 0 marks a notification without a step
        (an abort): gauges only."""
        m, model = self.engine, self.model
        m.requests_running.labels(model=model).set(result.num_running)
        m.requests_waiting.labels(model=model).set(result.num_waiting)
        m.kv_cache_usage_ratio.labels(model=model).set(result.kv_cache_usage)
        if result.batch_size > 0:
            m.batch_size.labels(model=model).observe(result.batch_size)
            m.step_tokens.labels(model=model).observe(result.num_scheduled_tokens)
        if result.num_preemptions:
            m.preemptions.labels(model=model).inc(result.num_preemptions)
        if result.spec_decoding is not None:
            self._on_spec_decoding(result.spec_decoding)
        if stats is not None:
            self._on_scheduler_stats(stats)

    def _on_spec_decoding(self, spec: SpecDecodingStats) -> None:
        """One step's verified drafts: the vLLM counters, accepted tokens per draft position (a draft with
        ``a`` accepted tokens counts once at positions 0 … a-1) and 1 + a per draft into the length
        histogram."""
        m, model = self.engine, self.model
        m.spec_decode_num_drafts.labels(model=model).inc(spec.num_drafts)
        m.spec_decode_num_draft_tokens.labels(model=model).inc(spec.num_draft_tokens)
        m.spec_decode_num_accepted_tokens.labels(model=model).inc(spec.num_accepted_tokens)
        per_position = [0] * max(spec.accepted_per_draft, default=0)
        for accepted in spec.accepted_per_draft:
            m.spec_decode_acceptance_length.labels(model=model).observe(1 + accepted)
            for position in range(accepted):
                per_position[position] += 1
        for position, count in enumerate(per_position):
            if count:
                m.spec_decode_num_accepted_tokens_per_pos.labels(model=model, position=str(position)).inc(
                    count
                )

    def _on_scheduler_stats(self, stats: SchedulerStats) -> None:
        m, model = self.engine, self.model
        for state, value in (
            ("used", stats.num_used_blocks),
            ("cached", stats.num_cached_blocks),
            ("free", stats.num_free_blocks),
        ):
            m.kv_cache_blocks.labels(model=model, state=state).set(value)
        if stats.prefix_cache_queries > self._prefix_queries_seen:
            m.prefix_cache_queries.labels(model=model).inc(
                stats.prefix_cache_queries - self._prefix_queries_seen
            )
            self._prefix_queries_seen = stats.prefix_cache_queries
        if stats.prefix_cache_hits > self._prefix_hits_seen:
            m.prefix_cache_hits.labels(model=model).inc(stats.prefix_cache_hits - self._prefix_hits_seen)
            self._prefix_hits_seen = stats.prefix_cache_hits

    # --- event loop: per request ---------------------------------------------------------------------------

    def on_prompt_done(self, num_prompt_tokens: int) -> None:
        """A prompt's prefill completed (its first token arrived): count its tokens once."""
        self.engine.prompt_tokens.labels(model=self.model).inc(num_prompt_tokens)
        self.engine.request_prompt_tokens.labels(model=self.model).observe(num_prompt_tokens)

    def on_tokens(self, num_tokens: int, inter_token_s: float | None) -> None:
        """Tokens of one delta; ``inter_token_s`` since the choice's previous delta (None for the first)."""
        self.engine.generation_tokens.labels(model=self.model).inc(num_tokens)
        if inter_token_s is not None:
            self.engine.inter_token_latency.labels(model=self.model).observe(inter_token_s)

    def on_sequence_finished(self, t: SequenceTimings, exemplar: dict[str, str] | None = None) -> None:
        """Latency and length histograms of one finished sequence plus ``request_success{finish_reason}``.
        ``exemplar`` (``{"trace_id": …}`` of the request's sampled trace) goes on the latency observations,
        so a slow bucket links to its trace (OpenMetrics exemplars, as the gateway's)."""
        m, model = self.engine, self.model
        m.request_success.labels(model=model, finish_reason=t.finish_reason).inc()
        m.e2e_request_latency.labels(model=model).observe(t.e2e_s, exemplar)
        m.request_generation_tokens.labels(model=model).observe(t.num_output_tokens)
        for histogram, value in (
            (m.time_to_first_token, t.ttft_s),
            (m.queue_time, t.queue_s),
            (m.prefill_time, t.prefill_s),
            (m.decode_time, t.decode_s),
            (m.time_per_output_token, t.tpot_s),
        ):
            if value is not None:
                histogram.labels(model=model).observe(value, exemplar)
        for (phase, cause), seconds in (t.causes or {}).items():
            if seconds > 0:
                m.latency_cause.labels(model=model, phase=phase, cause=cause).inc(seconds)
        if t.prefill_s is not None:
            m.request_inference_time.labels(model=model).observe(t.prefill_s + (t.decode_s or 0.0), exemplar)
        if t.predicted_ttft_s is not None and t.ttft_s:
            error = abs(t.predicted_ttft_s - t.ttft_s) / t.ttft_s
            m.ttft_prediction_error.labels(model=model).observe(error, exemplar)
        if t.service_tier is not None:
            if t.queue_s is not None:
                m.tier_queue_time.labels(model=model, tier=t.service_tier).observe(t.queue_s, exemplar)
            if t.ttft_s is not None:
                m.tier_time_to_first_token.labels(model=model, tier=t.service_tier).observe(
                    t.ttft_s, exemplar
                )

    def on_request_done(self, operation: str, timings: list[SequenceTimings], error_type: str | None) -> None:
        """The OTel GenAI server metrics of one request (semconv 1.41): duration = the longest choice's
        e2e, TTFT = the first choice's first token, TPOT = the mean over choices; TTFT/TPOT only on
        success."""
        if self.genai is None or not timings:
            return
        attrs = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": "kvscope",
            "gen_ai.request.model": self.model,
            "gen_ai.response.model": self.model,
        }
        if error_type is not None:
            attrs["error.type"] = error_type
        ttfts = [t.ttft_s for t in timings if t.ttft_s is not None]
        tpots = [t.tpot_s for t in timings if t.tpot_s is not None]
        self.genai.record(
            attrs,
            max(t.e2e_s for t in timings),
            min(ttfts) if ttfts else None,
            sum(tpots) / len(tpots) if tpots else None,
        )

    def on_request_params(self, n: int, max_tokens: int | None) -> None:
        """The request's ``n`` and ``max_tokens`` (once per request, as vLLM's ``request_params_*``)."""
        self.engine.request_params_n.labels(model=self.model).observe(n)
        if max_tokens is not None:
            self.engine.request_params_max_tokens.labels(model=self.model).observe(max_tokens)

    def on_stream_error(self, reason: str) -> None:
        """One stream that failed after its 200 (``kvscope_engine_stream_errors_total``); ``reason`` is one
        of kvscope.engine.server.metrics.STREAM_ERROR_REASONS (the caller maps anything else to
        ``internal_error``)."""
        self.engine.stream_errors.labels(model=self.model, reason=reason).inc()

    def on_shed(self, tier: str, reason: str) -> None:
        """One request refused at admission or dropped from the queue before its prefill
        (``kvscope_engine_requests_shed_total{tier, reason}``; reasons: engine/core/admission.py
        SHED_REASONS)."""
        self.engine.requests_shed.labels(model=self.model, tier=tier, reason=reason).inc()

    def on_http_request(self, route: str, status: int) -> None:
        self.http_requests.labels(route=route, status=str(status)).inc()

    def set_device_memory(self, device: str, used_bytes: int, total_bytes: int) -> None:
        self.engine.device_memory_used.labels(device=device).set(used_bytes)
        self.engine.device_memory_total.labels(device=device).set(total_bytes)

    def set_weights(self, dtype: str, quantization: str, weights_bytes: int) -> None:
        """``kvscope_engine_weights_bytes{model, dtype, quantization}``: the served weight format and its
        bytes."""
        self.engine.weights_bytes.labels(model=self.model, dtype=dtype, quantization=quantization).set(
            weights_bytes
        )

    def set_row_kernels(self, spans: Sequence[tuple[str, int, int]]) -> None:
        """``kvscope_engine_weights_kernel_info{model, kernel, first_row, last_row}`` = 1 per span of
        ``(kernel, first, last)`` (``last`` at or above ``NO_DENSE``: ``+Inf``)."""
        for kernel, first, last in spans:
            self.engine.weights_kernel_info.labels(
                model=self.model,
                kernel=kernel,
                first_row=str(first),
                last_row="+Inf" if last >= NO_DENSE else str(last),
            ).set(1)


def host_memory_bytes() -> int:
    """Physical memory of the host (``SC_PHYS_PAGES`` × page size); 0 when unknown."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0
