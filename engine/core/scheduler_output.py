"""The core ↔ worker contract of one engine step, pure Python: what the scheduler hands the model runner
(:class:`SchedulerOutput`) and what the runner hands back (:class:`ModelRunnerOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvscope.engine.core.request import Request
from kvscope.engine.outputs import TokenLogprob


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: compute ``token_ids`` at positions
    ``num_computed_tokens … num_computed_tokens + len(token_ids) - 1``.

    The runner writes their K/V into the slots given by ``block_ids`` (the request's whole block table,
    block_size tokens per block) and samples a next token only when ``sample`` is true (the chunk reaches the
    end of the known tokens). ``prompt_logprobs_start`` is set when the chunk covers prompt positions whose
    logprobs were requested.
    """

    request: Request
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    sample: bool
    is_new: bool = False
    """True on the first step after (re)admission: the runner resets any per-request state it keeps."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Draft tokens (speculative decoding) appended to ``token_ids`` of a decode step: the runner verifies
    them and returns 1 + the accepted count tokens for the request (engine/spec_decode)."""

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """Everything one step does. ``scheduled`` lists running (decode or continuing chunks) before new ones."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    """Requests finished/aborted since the previous step: the runner drops their per-request state."""
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    scheduled_time: float = 0.0
    """The scheduler's clock when the step was scheduled (its duration ends when its output is applied)."""

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class ModelRunnerOutput:
    """What one ``ModelRunner.execute`` produced, keyed by request id."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """request_id → the tokens emitted this step (only requests whose chunk reached the end of their tokens):
    one, or for a request with drafts its accepted draft tokens then the target's own next token. The
    scheduler's ``update_from_output`` shortens a list after a stop (EOS, stop token, max_tokens), and the
    engine after a stop string, so what is left here is what the request keeps."""
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    """request_id → one logprob entry per emitted token, when logprobs were requested."""
    num_accepted_tokens: dict[str, int] = field(default_factory=dict)
    """request_id → draft tokens accepted this step (requests scheduled with ``spec_token_ids`` only)."""
    prompt_logprobs: dict[str, dict[int, TokenLogprob]] = field(default_factory=dict)
    """request_id → {prompt position → logprob of the prompt token at that position}."""
    structured_mask_s: dict[str, float] = field(default_factory=dict)
    """request_id → seconds computing its grammar mask this step (constrained requests only)."""
    structured_wait_s: float = 0.0
    """Seconds this step's sampling waited for the grammar masks after the forward pass."""
