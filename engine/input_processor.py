"""The one validation point of an engine request, where it enters the engine (vLLM v1's ``InputProcessor``,
vllm/v1/engine/input_processor.py).

A prompt and its :class:`~kvscope.engine.sampling_params.SamplingParams` (which checked their own ranges when
built) are checked here against the loaded model: token ids in the vocabulary, prompt + ``max_tokens`` within
the context. What passes is an :class:`EngineRequest`; the engine queues nothing else, so no layer below
checks again (the scheduler only asserts its own invariants). Callers: ``AsyncEngine.process_inputs`` (the
server, for every prompt before any of them starts) and ``EngineCore.add_request`` (the offline LLM).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvscope.engine.core.admission import DEFAULT_TIER
from kvscope.engine.errors import InvalidParameterError, PromptTooLongError
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.worker.sampler import RequestSampling


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A prompt that passed :meth:`InputProcessor.process`, with the limits resolved."""

    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    """New tokens at most: ``params.max_tokens``, else what is left of the context after the prompt."""
    sampling: RequestSampling | None = field(default=None, compare=False)
    """The request's constant sampling tensors (logit_bias, stop ids, prompt ids), built here once and shared
    by every step and every one of its ``n`` children (kvscope.engine.worker.sampler)."""
    fairness_group: str | None = None
    """The client request it belongs to (the server sets its response id, shared by all the request's
    prompts); the scheduler shares slots and tokens between such groups (engine/core/fairness.py). None:
    its own id."""
    fairness_tenant: str | None = None
    """Who sent it: the gateway's API key name (the server reads the ``x-kvscope-tenant`` header); the
    scheduler shares slots between tenants first, then between each tenant's groups. None: its group is its
    own tenant."""
    service_tier: str = DEFAULT_TIER
    """Its tier (engine/core/admission.py): ``priority``, ``default`` or ``flex``; the scheduler admits by
    tier first, and admission holds it to the tier's TTFT objective."""
    priority: int = 0
    """vLLM's ``priority``: inside a tier, lower is admitted earlier."""
    deadline: float | None = None
    """``time.monotonic()`` seconds after which, if still waiting for its first admission, it is dropped
    before any prefill (DeadlineExceededError); None: none."""
    structured_compile_s: float | None = None
    """Structured output only: seconds it waited for its compiled grammar before it entered the engine
    (0.0: the grammar was pinned or cached); the server sets its own wait, measured before tokenizing. None:
    no constraint."""


@dataclass(frozen=True, slots=True)
class InputProcessor:
    """Checks requests against the model's context length (tokens) and vocabulary size."""

    max_model_len: int
    vocab_size: int
    compile_constraint: Callable[..., float] | None = None
    """Compiles (and caches) a structured-output constraint on the grammar compiler's thread and pins it to
    the constraint the request carries (a no-op when the server already did, StructuredOutputsParams.pin),
    so no engine step compiles, and returns the seconds it waited (0.0 when pinned or cached); raises
    InvalidParameterError naming the field for an unsupported schema keyword, a bad regex/grammar, a grammar
    above the size limit or one the matcher cannot serve
    (kvscope.engine.structured.backend.StructuredOutputManager.wait_for)."""

    def process(self, prompt_token_ids: list[int], params: SamplingParams) -> EngineRequest:
        """The checked request. Raises InvalidParameterError (``param`` = ``prompt``, ``logit_bias``,
        ``stop_token_ids`` or ``min_tokens``) and PromptTooLongError (prompt + max_tokens beyond
        ``max_model_len``, or a prompt that leaves no room for one token)."""
        last_id = self.vocab_size - 1
        if not prompt_token_ids:
            raise InvalidParameterError("prompt", "The prompt is empty: it encodes to zero tokens.")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) > last_id:
            raise InvalidParameterError("prompt", f"Token ids must be in [0, {last_id}].")
        sampling = RequestSampling.build(params, prompt_token_ids, self.vocab_size)
        num_prompt = len(prompt_token_ids)
        left = self.max_model_len - num_prompt
        if (params.max_tokens or 0) > left or left <= 0:
            raise PromptTooLongError(
                max_model_len=self.max_model_len, num_prompt_tokens=num_prompt, max_tokens=params.max_tokens
            )
        if params.max_tokens is None and params.min_tokens > left:
            raise InvalidParameterError(
                "min_tokens",
                f"min_tokens ({params.min_tokens}) exceeds the {left} tokens "
                f"left in the context ({self.max_model_len} - {num_prompt} prompt tokens).",
            )
        waited = None
        if params.structured_outputs is not None and self.compile_constraint is not None:
            waited = self.compile_constraint(params.structured_outputs)
        return EngineRequest(
            list(prompt_token_ids), params, params.max_tokens or left, sampling, structured_compile_s=waited
        )
