"""Per-HTTP-request accounting: usage, the ``kvscope`` stats object, and what happens when a request ends
(histograms, spans, the access-log fields), with one set of numbers for all three.

Choice ``i`` of prompt ``k`` is OpenAI choice ``k * n + i``. Timings come from the engine's per-request stats
(:class:`kvscope.engine.core.stats.KvscopeStats`, the ``kvscope`` object of docs/engine-server.md) when the
engine finished the sequence; when the client left or the engine failed it, from the engine's live Request
stats snapshot, else from the server's own timestamps of the deltas it received.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvscope.engine.core.admission import DEFAULT_TIER
from kvscope.engine.core.attribution import cause_seconds
from kvscope.engine.core.request import child_request_id
from kvscope.engine.core.stats import KvscopeStats
from kvscope.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.server.generation import prompt_request_id
from kvscope.engine.server.logprobs import visible_entries
from kvscope.engine.server.protocol import PromptTokensDetails, Usage
from kvscope.engine.server.stat_logger import SequenceTimings, ServerMetrics
from kvscope.engine.server.tracing import RequestSpans, RequestTimeline, Tracing, spec_decode_attributes

_NO_STATS = KvscopeStats()


@dataclass(slots=True)
class ChoiceState:
    index: int
    prompt_index: int
    num_output_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stats: KvscopeStats | None = None
    first_token: float | None = None
    last_token: float | None = None


@dataclass(slots=True)
class Outcome:
    """How the request ended: ``success``, ``error`` or ``client_disconnected`` (+ phase, error text)."""

    kind: str
    status: int = 200
    error_type: str | None = None
    error_message: str | None = None
    phase: str | None = None


class StructuredKvscopeStats(KvscopeStats, frozen=True, kw_only=True):
    """The ``kvscope`` object of a structured-output request: the usual fields plus ``structured_output``,
    the constraint kind (json, json_object, regex, choice, grammar); other requests keep the plain field
    set."""

    structured_output: str


@dataclass(slots=True)
class RequestState:
    request_id: str
    operation: str
    """``chat`` or ``text_completion`` (gen_ai.operation.name)."""
    model: str
    params: SamplingParams
    prompts: list[list[int]]
    stream: bool
    metrics: ServerMetrics
    arrival: float = field(default_factory=time.monotonic)
    arrival_wall_ns: int = field(default_factory=time.time_ns)
    timeline: RequestTimeline = field(default_factory=RequestTimeline)
    choices: list[ChoiceState] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    _prompt_done: list[bool] = field(default_factory=list)
    finished: bool = False
    service_tier: str = DEFAULT_TIER
    """The tier it was queued in (engine/server/scheduling.py)."""
    shown_service_tier: str | None = None
    """The tier chat responses echo in ``service_tier`` (set when the caller named one); None: not shown."""
    structured_compile_s: float | None = None
    """Structured output only: the seconds it waited for its grammar before it was queued (the kvscope
    object's ``structured_compile_s``, kept here so a request that ends before the engine reports any stats
    still carries it)."""
    refused: KvscopeStats | None = None
    """Admission refused it: the ``kvscope`` object of the refusal (its prediction, tier and requests ahead),
    which :meth:`kvscope` answers instead of the choices' (none ever ran)."""

    def __post_init__(self) -> None:
        n = self.params.n
        self.choices = [ChoiceState(k * n + i, k) for k in range(len(self.prompts)) for i in range(n)]
        self.cached_tokens = [0] * len(self.prompts)
        self._prompt_done = [False] * len(self.prompts)

    def on_output(
        self, k: int, output: RequestOutput
    ) -> list[tuple[ChoiceState, CompletionOutput, list[TokenLogprob]]]:
        """Account one delta of prompt ``k``; returns (choice, delta, visible logprob entries) per choice."""
        now = time.monotonic()
        updates = []
        for delta in output.outputs:
            choice = self.choices[k * self.params.n + delta.index]
            if delta.token_ids:
                self._on_tokens(k, choice, len(delta.token_ids), now)
            if delta.index == 0:
                self.cached_tokens[k] = max(
                    self.cached_tokens[k], output.num_cached_tokens, delta.num_cached_tokens
                )
            choice.num_output_tokens = max(choice.num_output_tokens, delta.num_output_tokens)
            if delta.finish_reason is not None:
                choice.finish_reason, choice.stop_reason, choice.stats = (
                    delta.finish_reason,
                    delta.stop_reason,
                    delta.stats,
                )
            updates.append((choice, delta, visible_entries(delta, self.params.include_stop_str_in_output)))
        return updates

    def _on_tokens(self, k: int, choice: ChoiceState, num_tokens: int, now: float) -> None:
        if not self._prompt_done[k]:
            self._prompt_done[k] = True
            self.metrics.on_prompt_done(len(self.prompts[k]))
        gap = None if choice.last_token is None else now - choice.last_token
        self.metrics.on_tokens(num_tokens, gap)
        choice.first_token = now if choice.first_token is None else choice.first_token
        choice.last_token = now

    def usage(self) -> Usage:
        """OpenAI usage: prompt tokens once per prompt, completion tokens summed over choices."""
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(c.num_output_tokens for c in self.choices)
        cached = sum(min(c, len(p)) for c, p in zip(self.cached_tokens, self.prompts, strict=True))
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )

    def kvscope(self) -> KvscopeStats:
        """The response's ``kvscope`` object: the choices' stats merged (:meth:`KvscopeStats.merge`); a
        constrained request's also names its constraint kind (:class:`StructuredKvscopeStats`)."""
        if self.refused is not None:
            return self.refused
        merged = KvscopeStats.merge([c.stats for c in self.choices if c.stats is not None])
        constraint = self.params.structured_outputs
        if constraint is None:
            return merged
        merged = msgspec.structs.replace(merged, structured_compile_s=self.structured_compile_s)
        return StructuredKvscopeStats(**merged.to_dict(), structured_output=constraint.kind)

    # --- the end -------------------------------------------------------------------------------------------

    def finish(
        self,
        outcome: Outcome,
        tracing: Tracing,
        access: Any,
        snapshots: dict[int, KvscopeStats] | None = None,
    ) -> None:
        """Observe the histograms, write the spans and fill the access record. ``snapshots`` (choice index →
        live engine stats) stand in for the final stats of choices the engine did not finish. Idempotent;
        synchronous (runs in ``finally`` blocks of cancelled tasks)."""
        if self.finished:
            return
        self.finished = True
        now = time.monotonic()
        for choice in self.choices:
            if choice.stats is None and snapshots and choice.index in snapshots:
                choice.stats = snapshots[choice.index]
        timings = [self._timings(c, outcome, now) for c in self.choices]
        span = tracing.record(self._spans(outcome, now, timings), getattr(access, "server_span", None))
        exemplar = {"trace_id": span.trace_id} if span.sampled else None  # a trace the backend holds
        for t in timings:
            self.metrics.on_sequence_finished(t, exemplar)
        self.metrics.on_request_params(self.params.n, self.params.max_tokens)
        error_type = None if outcome.kind == "success" else (outcome.error_type or outcome.kind)
        self.metrics.on_request_done(self.operation, timings, error_type)
        if access is not None:
            access.set_request_details(self._log_fields(outcome, timings, span.trace_id, span.span_id))

    def _timings(self, choice: ChoiceState, outcome: Outcome, now: float) -> SequenceTimings:
        stats = choice.stats or _NO_STATS
        if outcome.kind == "success":
            reason = choice.finish_reason or "error"
        else:
            reason = "abort" if outcome.kind == "client_disconnected" else "error"
        ttft = stats.ttft_s
        if ttft is None and choice.first_token is not None:
            ttft = choice.first_token - self.arrival
        decode, tpot = stats.decode_s, stats.tpot_s
        if decode is None and choice.first_token is not None and choice.last_token is not None:
            decode = choice.last_token - choice.first_token
        if tpot is None and decode is not None and choice.num_output_tokens > 1:
            tpot = decode / (choice.num_output_tokens - 1)
        prefill = stats.prefill_s if ttft is not None else None
        return SequenceTimings(
            finish_reason=reason,
            num_output_tokens=choice.num_output_tokens,
            e2e_s=now - self.arrival,
            ttft_s=ttft,
            queue_s=stats.queue_s,
            prefill_s=prefill,
            decode_s=decode if ttft is not None else None,
            tpot_s=tpot,
            causes=cause_seconds(stats) if choice.stats is not None else None,
            predicted_ttft_s=stats.predicted_ttft_s if stats.ttft_s is not None else None,
            service_tier=self.service_tier,
        )

    def _spans(self, outcome: Outcome, now: float, timings: list[SequenceTimings]) -> RequestSpans:
        def earliest(values: list[float | None]) -> float | None:
            present = [v for v in values if v is not None]
            return self.arrival + min(present) if present else None

        first_token = earliest([t.ttft_s for t in timings])
        ends = [t.ttft_s + t.decode_s for t in timings if t.ttft_s is not None and t.decode_s is not None]
        for k, prompt in enumerate(self.prompts):
            for i in range(self.params.n):
                engine_id = prompt_request_id(self.request_id, k, len(self.prompts))
                child = child_request_id(engine_id, i, self.params.n)
                choice = self.choices[k * self.params.n + i]
                ttft = None if choice.stats is None else choice.stats.ttft_s
                token_time = None if ttft is None else self.arrival + ttft
                self.timeline.finish_prefill(child, len(prompt), token_time)
        # a client that left is not a failure of the server (HTTP semconv); kvscope.outcome says it
        error = (
            None
            if outcome.kind in ("success", "client_disconnected")
            else (outcome.error_message or outcome.kind)
        )
        return RequestSpans(
            timeline=self.timeline,
            arrival=self.arrival,
            arrival_wall_ns=self.arrival_wall_ns,
            end=now,
            first_scheduled=earliest([t.queue_s for t in timings]),
            first_token=first_token,
            last_token=self.arrival + max(ends) if ends else None,
            attributes=self._span_attributes(outcome),
            error=error,
            decode_attributes=self._decode_attributes(),
        )

    def _decode_attributes(self) -> dict[str, Any]:
        stats = self.kvscope()
        return spec_decode_attributes(
            stats.spec_drafts,
            stats.spec_draft_tokens,
            stats.spec_accepted_tokens,
            stats.spec_mean_accepted_length,
        )

    def _span_attributes(self, outcome: Outcome) -> dict[str, Any]:
        usage = self.usage()
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": self.operation,
            "gen_ai.provider.name": "kvscope",
            "gen_ai.request.model": self.model,
            "gen_ai.response.model": self.model,
            "gen_ai.response.id": self.request_id,
            "gen_ai.request.temperature": self.params.temperature,
            "gen_ai.request.top_p": self.params.top_p,
            "gen_ai.usage.input_tokens": usage.prompt_tokens,
            "gen_ai.usage.output_tokens": usage.completion_tokens,
            "gen_ai.usage.cache_read.input_tokens": usage.prompt_tokens_details.cached_tokens,
            "gen_ai.response.finish_reasons": [c.finish_reason or outcome.kind for c in self.choices],
            "kvscope.outcome": outcome.kind,
        }
        if self.params.max_tokens is not None:
            attrs["gen_ai.request.max_tokens"] = self.params.max_tokens
        if self.params.n > 1:
            attrs["gen_ai.request.choice.count"] = self.params.n
        if outcome.phase is not None:
            attrs["kvscope.phase"] = outcome.phase
        for name, value in self.kvscope().to_dict().items():
            if value is not None:
                attrs[f"kvscope.{name}"] = value
        return attrs

    def _log_fields(
        self, outcome: Outcome, timings: list[SequenceTimings], trace_id: str, span_id: str
    ) -> dict[str, Any]:
        usage = self.usage()
        ttfts = [t.ttft_s for t in timings if t.ttft_s is not None]
        tpots = [t.tpot_s for t in timings if t.tpot_s is not None]
        return {
            "trace": {"id": trace_id},
            "span": {"id": span_id},
            "gen_ai": {
                "operation": {"name": self.operation},
                "request": {
                    "model": self.model,
                    "max_tokens": self.params.max_tokens,
                    "temperature": self.params.temperature,
                    "stream": self.stream,
                },
                "response": {
                    "id": self.request_id,
                    "model": self.model,
                    "finish_reasons": [t.finish_reason for t in timings],
                },
                "usage": {
                    "input_tokens": usage.prompt_tokens,
                    "output_tokens": usage.completion_tokens,
                    "cache_read": {"input_tokens": usage.prompt_tokens_details.cached_tokens},
                },
            },
            "kvscope": {
                "outcome": outcome.kind,
                "ttft_s": min(ttfts) if ttfts else None,
                "tpot_s": sum(tpots) / len(tpots) if tpots else None,
                "e2e_s": timings[0].e2e_s,
                "client_disconnected": outcome.kind == "client_disconnected",
                "phase": outcome.phase,
                "num_preemptions": sum((c.stats or _NO_STATS).num_preemptions or 0 for c in self.choices),
                "engine": self.kvscope().to_dict(),
            },
        }
