"""Perplexity of a token sequence in sliding windows (Hugging Face, "Perplexity of fixed-length models",
https://huggingface.co/docs/transformers/perplexity, the strided method).

The sequence is cut into windows of at most ``context`` tokens that start ``stride`` tokens apart; a window
scores only the tokens after the previous window's end, so every token but the first (nothing predicts it)
is scored exactly once, and each one scored outside the first window sees at least ``context - stride``
tokens before it (= ``stride`` at the default 1024 / 512). Perplexity = exp(sum of NLL / tokens scored), the
NLL summed in float64. The guide's snippet weights each window's mean loss by ``valid labels - 1``, exact for
the first window only (later windows have no shifted-off label); here the tokens are counted one by one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

PromptLogprobs = Callable[[list[int]], Sequence[float]]
"""``f(tokens)`` → the log-probability (natural log) of ``tokens[i]`` given ``tokens[:i]``, for i = 1 …
n-1."""


@dataclass(frozen=True, slots=True)
class Window:
    """Tokens ``[begin, end)`` run as one forward; tokens ``[score_from, end)`` are scored."""

    begin: int
    end: int
    score_from: int

    @property
    def num_scored(self) -> int:
        return self.end - self.score_from


@dataclass(frozen=True, slots=True)
class PerplexityResult:
    """What :func:`score_windows` measured."""

    num_tokens: int
    """Tokens of the sequence."""
    num_scored: int
    """Tokens scored (``num_tokens - 1``)."""
    nll_sum: float
    """Sum of the negative log-likelihoods (nats)."""
    num_windows: int

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / self.num_scored

    @property
    def perplexity(self) -> float:
        """exp(mean NLL)."""
        return math.exp(self.mean_nll)


def sliding_windows(num_tokens: int, context: int, stride: int) -> list[Window]:
    """The windows of the strided method (module doc) over ``num_tokens`` tokens.

    Raises ValueError unless num_tokens ≥ 2, context ≥ 2 and 1 ≤ stride < context (a stride of ``context``
    would leave each window's first token without context, so it would never be scored).
    """
    if num_tokens < 2:
        raise ValueError(f"need at least 2 tokens to score, got {num_tokens}")
    if context < 2:
        raise ValueError(f"context must be at least 2 tokens, got {context}")
    if not 1 <= stride < context:
        raise ValueError(f"stride must be in [1, context - 1] = [1, {context - 1}], got {stride}")
    windows: list[Window] = []
    begin, scored_until = 0, 1
    while True:
        end = min(begin + context, num_tokens)
        windows.append(Window(begin=begin, end=end, score_from=scored_until))
        if end == num_tokens:
            return windows
        scored_until = end
        begin += stride


def score_windows(
    token_ids: Sequence[int],
    windows: Sequence[Window],
    prompt_logprobs: PromptLogprobs,
    on_window: Callable[[int, int], None] | None = None,
) -> PerplexityResult:
    """Sum the NLL of each window's scored tokens, ``prompt_logprobs`` giving a window's log-probabilities.

    ``on_window(i, total)`` is called after each window (progress). Raises ValueError when
    ``prompt_logprobs`` returns the wrong number of values.
    """
    ids = list(token_ids)
    nll = 0.0
    scored = 0
    for i, window in enumerate(windows):
        tokens = ids[window.begin : window.end]
        logprobs = list(prompt_logprobs(tokens))
        if len(logprobs) != len(tokens) - 1:
            raise ValueError(f"prompt_logprobs returned {len(logprobs)} values for {len(tokens)} tokens")
        # logprobs[j] scores tokens[j + 1], i.e. absolute token window.begin + j + 1
        for lp in logprobs[window.score_from - window.begin - 1 :]:
            nll -= float(lp)
        scored += window.num_scored
        if on_window is not None:
            on_window(i + 1, len(windows))
    return PerplexityResult(num_tokens=len(ids), num_scored=scored, nll_sum=nll, num_windows=len(windows))


def relative_change_pct(value: float, reference: float) -> float:
    """(value / reference − 1) · 100."""
    return (value / reference - 1.0) * 100.0
