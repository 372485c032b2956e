"""What the engine hands back per request: token ids, text, logprobs and stats (vLLM's RequestOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvscope.engine.core.stats import KvscopeStats


@dataclass(slots=True)
class TokenLogprob:
    """Logprob detail of one position: the chosen token and the ``top`` most likely alternatives.

    ``logprob`` is the raw model log-probability (log_softmax of the logits, before penalties and
    temperature). ``top`` is sorted by logprob, descending; ``rank`` is the chosen token's 1-based rank.
    """

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class CompletionOutput:
    """One choice. In streaming (delta) outputs, ``token_ids``/``text``/``logprobs`` hold only what is new."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    """``stop``, ``length``, ``abort`` or ``error`` once finished, else None."""
    stop_reason: int | str | None = None
    num_output_tokens: int = 0
    """Total tokens generated for this choice so far (not just the delta)."""
    stats: KvscopeStats | None = None
    """The choice's ``kvscope`` object (docs/engine-server.md), set when the choice finished."""
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """Output of one request (all its choices). ``outputs`` lists the choices that changed in this step."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """One entry per prompt position (None for the first token), when prompt logprobs were requested."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (usage.prompt_tokens_details.cached_tokens)."""
