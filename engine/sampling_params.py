"""Per-request sampling parameters (OpenAI + vLLM vocabulary).

Validation raises :class:`kvscope.engine.errors.InvalidParameterError` (a ``ValueError``) whose ``param``
names the offending field, so the server can answer 400 with OpenAI's ``param``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvscope.engine.errors import InvalidParameterError
from kvscope.engine.structured.params import StructuredOutputsParams

MAX_LOGPROBS = 20
"""Largest ``logprobs``/``top_logprobs`` accepted (OpenAI documents 20)."""
MAX_LOGIT_BIAS = 300
"""Most ``logit_bias`` entries accepted: OpenAI's own limit. The bias is built into tensors once per request
(kvscope.engine.worker.sampler.RequestSampling) and added to every row of the request (its ``n`` children, its
speculative verification rows) on every step, so its size is per-step work too."""
MAX_STOP_TOKEN_IDS = 1024
"""Most ``stop_token_ids`` accepted (before de-duplication). Stop ids are end markers: every special token of
the common vocabularies (Llama 3 reserves 256) fits with room. The scheduler checks each sampled token against
them and ``min_tokens`` bans them on every step, so the list is bounded like any per-step input."""
MAX_STOP_STRINGS = 16
"""Most ``stop`` strings accepted (OpenAI allows 4; vLLM sets no limit)."""
MAX_STOP_STRING_CHARS = 256
"""Longest ``stop`` string accepted, in characters. A stream holds back up to this many characters minus one
while its tail could still become a stop string, so the cap bounds how late text may reach the client; real
stop strings are delimiters and role headers, tens of characters."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    n: int = 1
    """Number of completions for the prompt; run as sibling requests sharing the prompt's blocks."""
    temperature: float = 1.0
    """0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability mass reaches top_p, in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p × the top token's probability, in [0, 1]."""
    presence_penalty: float = 0.0
    """OpenAI: subtract this once from the logit of every token already generated, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """OpenAI: subtract this × count from the logit of every generated token, in [-2, 2]."""
    repetition_penalty: float = 1.0
    """CTRL (Keskar et al. 2019): divide positive / multiply negative logits of prompt+output tokens, > 0."""
    logit_bias: dict[int, float] | None = None
    """token id → bias added to the logit, each in [-100, 100]."""
    seed: int | None = None
    """Per-request RNG seed: same seed → same text, also when batched with other requests."""
    max_tokens: int | None = 16
    """Maximum new tokens; None means up to the context length."""
    min_tokens: int = 0
    """EOS and stop_token_ids are banned until this many tokens were generated."""
    stop: tuple[str, ...] = ()
    """Stop strings (a plain string is accepted and normalised to a 1-tuple)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (finish_reason "stop"); at most MAX_STOP_TOKEN_IDS, kept de-duplicated in
    their first order."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    """None: no logprobs. k ≥ 0: the sampled token's logprob plus the k most likely alternatives."""
    prompt_logprobs: int | None = None
    """Same for the prompt tokens (used by completions ``echo`` with ``logprobs``)."""
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    """Grammar constraint (JSON schema, regex, choice, grammar) enforced by a token mask
    (engine/structured)."""
    extra: dict = field(default_factory=dict)
    """Free-form per-request annotations (e.g. the OpenAI ``user``); never used by sampling."""
    stop_token_id_set: frozenset[int] = field(init=False, repr=False, compare=False)
    """``stop_token_ids`` as a set: the scheduler's per-token membership test (O(1), not O(len))."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        stop_ids = tuple(self.stop_token_ids or ())
        _check(
            len(stop_ids) <= MAX_STOP_TOKEN_IDS,
            "stop_token_ids",
            f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} token ids, got {len(stop_ids)}.",
        )
        _check(
            all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in stop_ids),
            "stop_token_ids",
            "stop_token_ids must be token ids (integers >= 0).",
        )
        object.__setattr__(self, "stop_token_ids", tuple(dict.fromkeys(stop_ids)))
        object.__setattr__(self, "stop_token_id_set", frozenset(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and 1 <= self.n <= 128, "n", f"n must be in [1, 128], got {self.n}.")
        _check(
            0.0 <= self.temperature <= 2.0,
            "temperature",
            f"temperature must be in [0, 2], got {self.temperature}.",
        )
        _check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        _check(
            isinstance(self.top_k, int) and self.top_k >= 0,
            "top_k",
            f"top_k must be -1 (disable) or at least 1, got {self.top_k}.",
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, f"{name} must be in [-2, 2], got {value}.")
        _check(
            0.0 < self.repetition_penalty <= 2.0,
            "repetition_penalty",
            f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}.",
        )
        bias = self.logit_bias or {}
        _check(
            len(bias) <= MAX_LOGIT_BIAS,
            "logit_bias",
            f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(bias)}.",
        )
        for token_id, value in bias.items():
            _check(
                isinstance(token_id, int) and not isinstance(token_id, bool) and token_id >= 0,
                "logit_bias",
                f"logit_bias keys must be token ids, got {token_id!r}.",
            )
            _check(
                isinstance(value, int | float) and not isinstance(value, bool) and -100.0 <= value <= 100.0,
                "logit_bias",
                f"logit_bias values must be in [-100, 100], got {value!r}.",
            )
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens",
            f"max_tokens must be at least 1, got {self.max_tokens}.",
        )
        _check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            "min_tokens",
            f"min_tokens must be at least 0, got {self.min_tokens}.",
        )
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "stop strings must be non-empty strings.",
        )
        _check(
            len(self.stop) <= MAX_STOP_STRINGS,
            "stop",
            f"at most {MAX_STOP_STRINGS} stop strings are allowed.",
        )
        longest = max(map(len, self.stop), default=0)
        _check(
            longest <= MAX_STOP_STRING_CHARS,
            "stop",
            f"stop strings may be at most {MAX_STOP_STRING_CHARS} characters long, got one of {longest}.",
        )
        _check(
            self.seed is None or (isinstance(self.seed, int) and -(2**63) <= self.seed < 2**64),
            "seed",
            f"seed must be in [-2^63, 2^64 - 1], got {self.seed}.",
        )
        _check(
            self.structured_outputs is None or not self.ignore_eos,
            "ignore_eos",
            "ignore_eos cannot be combined with structured outputs (the grammar ends with EOS).",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or 0 <= value <= MAX_LOGPROBS,
                name,
                f"{name} must be in [0, {MAX_LOGPROBS}], got {value}.",
            )

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax (temperature 0)."""
        return self.temperature == 0.0


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParameterError(param, message)
