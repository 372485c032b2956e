"""Statistics: the scheduler's point-in-time snapshot (the source of the ``kvscope_engine_*`` gauges) and one
request's ``kvscope`` object (:class:`KvscopeStats`, in responses, spans and the request log)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import msgspec


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Snapshot taken by :meth:`kvscope.engine.core.scheduler.Scheduler.get_stats`.

    The three block counts partition the pool: ``num_used_blocks + num_cached_blocks + num_free_blocks``
    equals the number of blocks (``kvscope_engine_kv_cache_blocks{state=used|cached|free}``).
    """

    num_running: int
    """Requests in the running list."""
    num_waiting: int
    """Requests waiting for admission (new or preempted)."""
    kv_cache_usage: float
    """Blocks in use / total blocks, in [0, 1] (vLLM ``kv_cache_usage``)."""
    num_used_blocks: int
    """Blocks held by at least one request."""
    num_cached_blocks: int
    """Free blocks that still hold a cached prefix (evictable, reusable on a hit)."""
    num_free_blocks: int
    """Free blocks holding nothing."""
    num_preemptions_total: int
    """Preemptions since start (counter)."""
    prefix_cache_queries: int
    """Prompt tokens looked up in the prefix cache, counted once per request at first scheduling (counter)."""
    prefix_cache_hits: int
    """Of those, tokens served from the prefix cache (counter)."""


@dataclass(frozen=True, slots=True)
class PhaseAttribution:
    """One phase's latency attribution: the :class:`KvscopeStats` fields ``prefill_*`` (before the first
    token) or ``decode_*`` (after it) without their prefix (meanings and units documented there; None: not
    reached). Built by engine/core/attribution.py; read back with :attr:`KvscopeStats.prefill_phase` and
    :attr:`KvscopeStats.decode_phase`."""

    steps: int | None = None
    tokens: int | None = None
    other_prefill_tokens: int | None = None
    other_decode_tokens: int | None = None
    other_requests_max: int | None = None
    step_s_mean: float | None = None
    step_s_max: float | None = None
    own_s: float | None = None
    interference_s: float | None = None
    interference_prefill_s: float | None = None
    preempted_s: float | None = None
    other_s: float | None = None


class KvscopeStats(msgspec.Struct, frozen=True):
    """One request's ``kvscope`` object (docs/engine-server.md, "The kvscope object"): where its time went
    and what it held, in seconds, requests, blocks and a 0–1 ratio. The field names are the JSON keys of
    the response's ``kvscope`` object and of the request log's ``kvscope.engine``; ``stats["ttft_s"]``
    reads a field by that name and iterating it gives the keys. None: not reached (e.g. no first token
    yet)."""

    queue_s: float | None = None
    """Arrival → first scheduled."""
    ttft_s: float | None = None
    """Arrival → first token."""
    predicted_ttft_s: float | None = None
    """Arrival → first token as predicted when the request was queued (engine/core/ttft.py); None while the
    engine's step-time model had no fit yet."""
    prefill_s: float | None = None
    """First scheduled → first token."""
    decode_s: float | None = None
    """First token → last token."""
    tpot_s: float | None = None
    """decode_s / (output tokens - 1)."""
    batch_size_mean: float | None = None
    """Mean number of requests in the engine steps that scheduled this one."""
    batch_size_max: int | None = None
    kv_blocks: int | None = None
    """Most KV blocks the request held at once."""
    kv_cache_usage: float | None = None
    """Engine-wide KV usage (0–1) when the request finished."""
    num_preemptions: int | None = None
    # --- attribution (engine/core/attribution.py; docs/logs.md "Why was this request slow?") ---------------
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    """Prompt tokens served from the prefix cache at first scheduling."""
    queue_ahead: int | None = None
    """Requests waiting ahead of this one when it arrived."""
    running_on_arrival: int | None = None
    """Requests running when it arrived."""
    queue_limit: str | None = None
    """What held the queue most often while it first waited: max_num_seqs, kv_cache, token_budget or
    preemption (None: it only waited for the step in flight)."""
    queue_blocked_steps: int | None = None
    """Steps that admitted nobody further while it first waited."""
    attributed_queue_s: float | None = None
    """Several choices (``n > 1``, several prompts) only: the queue seconds of the choice whose attribution
    the object carries (the one that finished last; :meth:`merge`), where ``queue_s`` is the earliest
    choice's. Its queue, prefill and decode causes add up to that choice's arrival → last token. None for
    one choice (``queue_s`` is its own)."""
    prefill_steps: int | None = None
    """Steps that scheduled it before its first token."""
    prefill_tokens: int | None = None
    """Its own tokens in those steps (prompt minus cache hits, plus any recomputation)."""
    prefill_other_prefill_tokens: int | None = None
    """Other requests' prefill tokens in those steps (summed over the steps)."""
    prefill_other_decode_tokens: int | None = None
    prefill_other_requests_max: int | None = None
    """Most other requests in one of those steps."""
    prefill_step_s_mean: float | None = None
    prefill_step_s_max: float | None = None
    prefill_own_s: float | None = None
    """Token-proportional share of those steps' seconds for its own tokens."""
    prefill_interference_s: float | None = None
    """The share for the other requests' tokens in those steps."""
    prefill_interference_prefill_s: float | None = None
    """Of that, the share for other requests' prefill tokens."""
    prefill_preempted_s: float | None = None
    """Seconds preempted before the first token."""
    prefill_other_s: float | None = None
    """prefill_s not covered by the three above (host time between steps, steps without it)."""
    decode_steps: int | None = None
    """Steps that scheduled it after its first token."""
    decode_tokens: int | None = None
    decode_other_prefill_tokens: int | None = None
    decode_other_decode_tokens: int | None = None
    decode_other_requests_max: int | None = None
    decode_step_s_mean: float | None = None
    decode_step_s_max: float | None = None
    decode_own_s: float | None = None
    decode_interference_s: float | None = None
    decode_interference_prefill_s: float | None = None
    decode_preempted_s: float | None = None
    decode_other_s: float | None = None
    recomputed_tokens: int | None = None
    """Tokens whose KV a preemption threw away (computed again on re-admission)."""
    structured_mask_s: float | None = None
    """Structured output only: seconds computing this request's grammar token masks
    (engine/structured/batch.py; on a helper thread, overlapped with the forward pass). None for
    unconstrained requests."""
    structured_wait_s: float | None = None
    """Structured output only: seconds its steps' sampling waited for the masks after the forward pass had
    finished (the latency the grammar added). None for unconstrained requests."""
    structured_compile_s: float | None = None
    """Structured output only: seconds it waited for its compiled grammar before its arrival in the engine
    (the compile, a wait behind other compiles, the first compile's grammar-tokenizer build; 0.0 when the
    grammar was cached). Not part of ``queue_s`` or ``ttft_s``, which start at arrival. None for
    unconstrained requests."""
    service_tier: str | None = None
    """The tier it was scheduled in: ``priority``, ``default`` or ``flex`` (engine/core/admission.py)."""
    # --- speculative decoding (vLLM's SpecDecodingStats per request). None: it never speculated -------------
    spec_drafts: int | None = None
    """Drafts verified (one per verification step in which it had proposed tokens)."""
    spec_draft_tokens: int | None = None
    """Tokens proposed in those drafts."""
    spec_accepted_tokens: int | None = None
    """Of those, tokens accepted by the rejection sampler."""
    spec_mean_accepted_length: float | None = None
    """vLLM's "mean acceptance length": 1 + spec_accepted_tokens / spec_drafts, the tokens emitted per
    verification step (1: nothing accepted; k + 1: every draft fully accepted)."""

    @property
    def prefill_phase(self) -> PhaseAttribution:
        """The ``prefill_*`` fields as one typed value."""
        return PhaseAttribution(
            steps=self.prefill_steps,
            tokens=self.prefill_tokens,
            other_prefill_tokens=self.prefill_other_prefill_tokens,
            other_decode_tokens=self.prefill_other_decode_tokens,
            other_requests_max=self.prefill_other_requests_max,
            step_s_mean=self.prefill_step_s_mean,
            step_s_max=self.prefill_step_s_max,
            own_s=self.prefill_own_s,
            interference_s=self.prefill_interference_s,
            interference_prefill_s=self.prefill_interference_prefill_s,
            preempted_s=self.prefill_preempted_s,
            other_s=self.prefill_other_s,
        )

    @property
    def decode_phase(self) -> PhaseAttribution:
        """The ``decode_*`` fields as one typed value."""
        return PhaseAttribution(
            steps=self.decode_steps,
            tokens=self.decode_tokens,
            other_prefill_tokens=self.decode_other_prefill_tokens,
            other_decode_tokens=self.decode_other_decode_tokens,
            other_requests_max=self.decode_other_requests_max,
            step_s_mean=self.decode_step_s_mean,
            step_s_max=self.decode_step_s_max,
            own_s=self.decode_own_s,
            interference_s=self.decode_interference_s,
            interference_prefill_s=self.decode_interference_prefill_s,
            preempted_s=self.decode_preempted_s,
            other_s=self.decode_other_s,
        )

    def __getitem__(self, name: str) -> Any:
        """The field called ``name`` (a JSON key above); KeyError for any other name."""
        if name not in self.__struct_fields__:
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        """The JSON keys, in order (as iterating the JSON object would give them)."""
        return iter(self.__struct_fields__)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object (field order), for encoders that do not know msgspec Structs (the request log)."""
        return msgspec.structs.asdict(self)

    @classmethod
    def merge(cls, stats: Sequence[KvscopeStats]) -> KvscopeStats:
        """One object for several choices (n > 1, several prompts): the one itself when there is one; else
        the min of the start-up times, the max of decode time, batch max and KV usage, the sum of blocks
        and preemptions, the mean of tpot and batch mean (each over the choices that have the field); the
        speculation counts are summed and the mean acceptance length recomputed from the sums. The latency
        attribution (prompt_tokens … structured_compile_s, with that choice's queue seconds as
        ``attributed_queue_s``) is the one of the choice that finished last, so
        that its parts add up to the request's end to end time and are not counted once per choice (``n >
        1`` choices count each other's tokens as their own: engine/core/scheduler.py ``_attribute_step``)."""
        if len(stats) == 1:
            return stats[0]
        if not stats:
            return cls()
        last = max(stats, key=lambda s: (s.queue_s or 0.0) + (s.prefill_s or 0.0) + (s.decode_s or 0.0))
        merged: dict[str, Any] = {}
        for name in cls.__struct_fields__:
            if name not in _REDUCE:
                merged[name] = getattr(last, name)
                continue
            values = [v for s in stats if (v := getattr(s, name)) is not None]
            merged[name] = _REDUCE[name](values) if values else None
        merged["attributed_queue_s"] = last.queue_s
        drafts = merged["spec_drafts"]
        if drafts:
            merged |= spec_summary(drafts, merged["spec_draft_tokens"], merged["spec_accepted_tokens"])
        return cls(**merged)


class SpecFields(TypedDict):
    """The speculative-decoding fields of :class:`KvscopeStats`, as :func:`spec_summary` gives them."""

    spec_drafts: int
    spec_draft_tokens: int
    spec_accepted_tokens: int
    spec_mean_accepted_length: float


def spec_summary(num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int) -> SpecFields:
    """The speculative-decoding fields of a kvscope object from the sums over its verified drafts; the mean
    acceptance length is vLLM's ``1 + accepted / drafts`` (vllm/v1/spec_decode/metrics.py). ``num_drafts``
    > 0."""
    return {
        "spec_drafts": num_drafts,
        "spec_draft_tokens": num_draft_tokens,
        "spec_accepted_tokens": num_accepted_tokens,
        "spec_mean_accepted_length": 1 + num_accepted_tokens / num_drafts,
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


_REDUCE: dict[str, Callable[[list[Any]], Any]] = {
    "queue_s": min, "ttft_s": min, "predicted_ttft_s": min, "prefill_s": min, "decode_s": max,
    "batch_size_max": max, "kv_cache_usage": max, "kv_blocks": sum, "num_preemptions": sum, "tpot_s": _mean,
    "batch_size_mean": _mean,
    "spec_drafts": sum, "spec_draft_tokens": sum, "spec_accepted_tokens": sum,
    "spec_mean_accepted_length": max,
}  # fmt: skip
"""How the timing and speculation fields merge over choices (the mean acceptance length is then recomputed
from the sums); every other field (the attribution) comes from one choice."""
