"""N-gram prompt-lookup drafts: propose the tokens that followed the last occurrence of the sequence's suffix.

The method of vLLM v1's ``NgramProposer`` (``vllm/v1/spec_decode/ngram_proposer.py``), llama.cpp's lookup
decoding (``examples/lookup``) and Apoorv Saxena's prompt-lookup-decoding (github.com/apoorvumang/
prompt-lookup-decoding, 2023): no draft model; for the last ``n`` tokens (``n`` from ``prompt_lookup_max``
down to ``prompt_lookup_min``) find an earlier occurrence in prompt + output and propose the (up to ``k``)
tokens that followed it. Copy-heavy outputs (edits, quotes, extraction, repeated lists) are then verified
several tokens per forward pass.

Choice of match: the most recent earlier occurrence (vLLM takes the earliest): in generated text that repeats
itself the latest copy is the one being continued. Cost: one vectorised comparison over a window of the last
``window`` tokens per n tried (numpy), O(window) per n (docs/benchmarks.md "Speculative decoding").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

DEFAULT_WINDOW = 4096
"""Tokens searched back from the end (bounds the cost on long contexts)."""


class NgramProposer:
    """``propose(token_ids, max_draft)`` → up to ``min(k, max_draft)`` draft token ids (possibly none).

    Raises ValueError on construction when ``1 <= prompt_lookup_min <= prompt_lookup_max`` or ``k >= 1``
    does not hold.
    """

    def __init__(
        self,
        num_speculative_tokens: int,
        prompt_lookup_min: int,
        prompt_lookup_max: int,
        window: int = DEFAULT_WINDOW,
    ) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max "
                f"({prompt_lookup_max})"
            )
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {num_speculative_tokens}")
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.window = window

    def propose(self, token_ids: Sequence[int], max_draft: int | None = None) -> list[int]:
        """Draft tokens continuing ``token_ids`` (prompt + output so far), at most ``min(k, max_draft)``.

        Tries the longest suffix first; returns [] when no suffix of length in [min_n, max_n] occurred before
        or ``max_draft`` < 1.
        """
        limit = self.k if max_draft is None else min(self.k, max_draft)
        total = len(token_ids)
        if limit < 1 or total < self.min_n + 1:
            return []
        start = max(0, total - self.window)
        arr = np.asarray(token_ids[start:], dtype=np.int64)
        for n in range(min(self.max_n, len(arr) - 1), self.min_n - 1, -1):
            position = _last_match(arr, n)
            if position is not None:
                follow = position + n
                return arr[follow : follow + limit].tolist()
        return []


def _last_match(arr: np.ndarray, n: int) -> int | None:
    """Start of the last occurrence of ``arr[-n:]`` that ends before the final token (so at least one token
    follows it and it is not the suffix itself), or None."""
    suffix = arr[-n:]
    windows = sliding_window_view(arr[:-1], n)  # windows[i] = arr[i:i+n], i + n <= len(arr) - 1
    hits = np.flatnonzero((windows == suffix).all(axis=1))
    return int(hits[-1]) if hits.size else None
