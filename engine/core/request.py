"""A request inside the engine: token ids, progress and timing. Pure Python (kvscope.engine.core imports it).

Vocabulary follows vLLM v1: ``num_computed_tokens`` counts tokens whose KV is in the cache,
``num_cached_tokens`` the prompt tokens served from the prefix cache at first scheduling.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import msgspec

from kvscope.engine.core.admission import DEFAULT_TIER, tier_rank
from kvscope.engine.core.attribution import StepAttribution
from kvscope.engine.core.stats import KvscopeStats, spec_summary
from kvscope.engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI ``finish_reason`` (``abort``/``error`` are engine-internal and never sent as success)."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True)
class RequestStats:
    """Timestamps (``time.monotonic()`` seconds) and counters of one request; :meth:`summary` makes its
    :class:`~kvscope.engine.core.stats.KvscopeStats`."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_steps: int = 0
    """Engine steps that scheduled this request."""
    batch_size_sum: int = 0
    """Sum over those steps of the number of requests in the step."""
    batch_size_max: int = 0
    kv_blocks_peak: int = 0
    kv_cache_usage: float = 0.0
    """Engine-wide KV usage (0–1) when the request finished."""
    num_prompt_tokens: int | None = None
    num_cached_tokens: int | None = None
    predicted_ttft_s: float | None = None
    """Arrival → first token as predicted when it was queued (engine/core/ttft.py); None: no prediction."""
    service_tier: str | None = None
    """The tier it was queued in (set by the scheduler)."""
    attribution: StepAttribution = field(default_factory=StepAttribution)
    structured_mask_s: float | None = None
    """Seconds computing its grammar masks (structured output only; ModelRunnerOutput.structured_mask_s)."""
    structured_wait_s: float | None = None
    """Seconds its sampling waited for those masks after the forward pass
    (ModelRunnerOutput.structured_wait_s)."""
    structured_compile_s: float | None = None
    """Seconds it waited for its compiled grammar before arrival (EngineRequest.structured_compile_s)."""
    spec_num_drafts: int = 0
    """Speculative decoding: drafts of this request verified (one per verification step that had a draft)."""
    spec_num_draft_tokens: int = 0
    """Proposed tokens in those drafts."""
    spec_num_accepted_tokens: int = 0
    """Of those, tokens the rejection sampler accepted."""

    def on_scheduled(self, now: float, batch_size: int, num_blocks: int) -> None:
        """Record one engine step that scheduled the request (batch_size = requests in that step)."""
        if self.first_scheduled_time is None:
            self.first_scheduled_time = now
        self.num_steps += 1
        self.batch_size_sum += batch_size
        self.batch_size_max = max(self.batch_size_max, batch_size)
        self.kv_blocks_peak = max(self.kv_blocks_peak, num_blocks)

    def on_token(self, now: float) -> None:
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now

    def summary(self, num_output_tokens: int) -> KvscopeStats:
        """The request's ``kvscope`` object (seconds, requests, blocks, ratio, count) after
        ``num_output_tokens`` generated tokens."""
        first_sched, first_tok, last_tok = (
            self.first_scheduled_time,
            self.first_token_time,
            self.last_token_time,
        )
        decode_s = (last_tok - first_tok) if first_tok is not None and last_tok is not None else None
        attribution = self.attribution.summary(_diff(first_tok, first_sched), decode_s)
        prefill, decode = attribution.prefill, attribution.decode
        stats = KvscopeStats(
            queue_s=_diff(first_sched, self.arrival_time),
            ttft_s=_diff(first_tok, self.arrival_time),
            predicted_ttft_s=self.predicted_ttft_s,
            prefill_s=_diff(first_tok, first_sched),
            decode_s=decode_s,
            tpot_s=decode_s / (num_output_tokens - 1)
            if decode_s is not None and num_output_tokens > 1
            else None,
            batch_size_mean=self.batch_size_sum / self.num_steps if self.num_steps else None,
            batch_size_max=self.batch_size_max,
            kv_blocks=self.kv_blocks_peak,
            kv_cache_usage=self.kv_cache_usage,
            num_preemptions=self.num_preemptions,
            prompt_tokens=self.num_prompt_tokens,
            cached_tokens=self.num_cached_tokens,
            queue_ahead=attribution.queue_ahead,
            running_on_arrival=attribution.running_on_arrival,
            queue_limit=None if attribution.queue_limit is None else attribution.queue_limit.value,
            queue_blocked_steps=attribution.queue_blocked_steps,
            prefill_steps=prefill.steps,
            prefill_tokens=prefill.tokens,
            prefill_other_prefill_tokens=prefill.other_prefill_tokens,
            prefill_other_decode_tokens=prefill.other_decode_tokens,
            prefill_other_requests_max=prefill.other_requests_max,
            prefill_step_s_mean=prefill.step_s_mean,
            prefill_step_s_max=prefill.step_s_max,
            prefill_own_s=prefill.own_s,
            prefill_interference_s=prefill.interference_s,
            prefill_interference_prefill_s=prefill.interference_prefill_s,
            prefill_preempted_s=prefill.preempted_s,
            prefill_other_s=prefill.other_s,
            decode_steps=decode.steps,
            decode_tokens=decode.tokens,
            decode_other_prefill_tokens=decode.other_prefill_tokens,
            decode_other_decode_tokens=decode.other_decode_tokens,
            decode_other_requests_max=decode.other_requests_max,
            decode_step_s_mean=decode.step_s_mean,
            decode_step_s_max=decode.step_s_max,
            decode_own_s=decode.own_s,
            decode_interference_s=decode.interference_s,
            decode_interference_prefill_s=decode.interference_prefill_s,
            decode_preempted_s=decode.preempted_s,
            decode_other_s=decode.other_s,
            recomputed_tokens=attribution.recomputed_tokens,
            structured_mask_s=self.structured_mask_s,
            structured_wait_s=self.structured_wait_s,
            structured_compile_s=self.structured_compile_s,
            service_tier=self.service_tier,
        )
        if not self.spec_num_drafts:  # never speculated: the speculative fields stay None
            return stats
        spec = spec_summary(self.spec_num_drafts, self.spec_num_draft_tokens, self.spec_num_accepted_tokens)
        return msgspec.structs.replace(stats, **spec)

    def on_spec_verify(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Record one verified draft of this request: ``num_draft_tokens`` (k >= 1) proposed tokens, of which
        ``num_accepted_tokens`` (0 <= a <= k) were accepted. Raises ValueError outside those bounds."""
        if num_draft_tokens < 1 or not 0 <= num_accepted_tokens <= num_draft_tokens:
            raise ValueError(
                f"a verified draft has k >= 1 proposed and 0 <= a <= k accepted tokens, "
                f"got k={num_draft_tokens}, a={num_accepted_tokens}"
            )
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_draft_tokens
        self.spec_num_accepted_tokens += num_accepted_tokens

    def add_structured_time(self, mask_s: float, wait_s: float) -> None:
        """Add one step's grammar-mask seconds (compute, and the wait after the forward pass)."""
        self.structured_mask_s = (self.structured_mask_s or 0.0) + mask_s
        self.structured_wait_s = (self.structured_wait_s or 0.0) + wait_s

    def to_dict(self, num_output_tokens: int) -> dict[str, float | int | None]:
        """:meth:`summary` as its JSON object."""
        return self.summary(num_output_tokens).to_dict()


def _diff(end: float | None, start: float | None) -> float | None:
    return None if end is None or start is None else end - start


TENANT_KEY_PREFIX = "tenant:"
"""Starts the scheduler's key of a named tenant (Request.fairness_tenant_key)."""


def child_request_id(parent_id: str, index: int, n: int) -> str:
    """The engine request id of choice ``index`` of a request with ``n`` choices: the parent id itself when
    ``n == 1``, else ``{parent_id}-{index}`` (vLLM v1 parallel sampling runs choices as sibling requests)."""
    return parent_id if n == 1 else f"{parent_id}-{index}"


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated. ``n > 1`` requests are split into siblings before they get here."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    max_tokens: int = 16
    """Resolved max new tokens (SamplingParams.max_tokens or what is left of the context)."""
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    """Prompt tokens found in the prefix cache when first scheduled (-1 before that)."""
    block_hashes: list[int] = field(default_factory=list)
    """Hash chain over the request's full blocks (filled by the KV cache manager)."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the request."""
    stats: RequestStats = field(init=False)
    """Latency and token accounting, created with the request (from ``arrival_time``)."""
    trace_context: object | None = None
    """Opaque tracing context carried for the server (OTel); the core never reads it."""
    parent_id: str | None = None
    """The request id of an ``n > 1`` request whose choice this is (None for n == 1): the latency attribution
    counts its siblings' tokens as its own work, not as interference."""
    fairness_group: str | None = None
    """The client request this sequence belongs to (the server's response id, shared by all its prompts and
    choices); None: ``parent_id``, else the request's own id. The scheduler shares its slots and tokens
    between these groups (engine/core/fairness.py)."""
    fairness_tenant: str | None = None
    """Who sent the client request: the gateway's API key name (the ``x-kvscope-tenant`` header the server
    reads); None: its fairness group is its own tenant. The scheduler shares its slots between tenants first,
    then between each tenant's groups (engine/core/fairness.py)."""
    service_tier: str = DEFAULT_TIER
    """Its tier (engine/core/admission.py TIERS): the scheduler admits waiting requests by tier first."""
    priority: int = 0
    """vLLM's ``priority``: inside a tier, lower is admitted earlier (then the fairness rules)."""
    deadline: float | None = None
    """``time.monotonic()`` seconds after which, still waiting for its first admission, it is dropped
    before any prefill (its client's deadline); None: none."""
    foreseen_cached_tokens: int = 0
    """Prompt tokens the prefix cache held when it was queued (the TTFT prediction's view of it)."""
    prepared_sampling: object | None = None
    """Opaque to the core: the worker's per-request sampling tensors
    (kvscope.engine.worker.sampler.RequestSampling), built once at admission and shared by an ``n > 1``
    request's children."""

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        self.stats = RequestStats(arrival_time=self.arrival_time)

    @property
    def fairness_key(self) -> str:
        """The fairness group of engine/core/fairness.py: ``fairness_group``, else ``parent_id``, else the
        id."""
        return self.fairness_group or self.parent_id or self.request_id

    @property
    def fairness_tenant_key(self) -> str:
        """The tenant of engine/core/fairness.py: ``tenant:`` + ``fairness_tenant`` (the prefix keeps a tenant
        apart from group keys, which hold no ``:``), else the fairness group's key."""
        return TENANT_KEY_PREFIX + self.fairness_tenant if self.fairness_tenant else self.fairness_key

    @property
    def schedule_class(self) -> tuple[int, int]:
        """The admission class: (tier rank, priority), lower first (engine/core/admission.py)."""
        return (tier_rank(self.service_tier), self.priority)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens known so far."""
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Keep only the first ``num_output_tokens`` output tokens (a stop string ended the output inside a
        run of accepted draft tokens)."""
        drop = self.num_output_tokens - num_output_tokens
        if drop > 0:
            del self.output_token_ids[num_output_tokens:]
            del self.all_token_ids[len(self.all_token_ids) - drop :]
