"""Token bitmasks (32 tokens per int32 word, bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed),
the layout llguidance fills. Applied with plain torch ops (llguidance.torch's helper is ``torch.compile``-d,
which costs a C++ toolchain and seconds of compile time on CPU)."""

from __future__ import annotations

import torch

_BITS = torch.arange(32, dtype=torch.int32)


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row for ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """int32 ``[num_rows, words]`` filled with -1 (every token allowed), contiguous on the CPU."""
    return torch.full((num_rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool ``[rows, vocab_size]`` from an int32 ``[rows, words]`` bitmask."""
    bits = (bitmask.unsqueeze(-1) >> _BITS.to(bitmask.device)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` (``[num_reqs, vocab]`` float) with ``-inf`` on the tokens ``bitmask`` (``[len(rows),
    words]`` int32) forbids in the given ``rows`` (int64). Out of place: the caller's tensor is not
    modified; rows not listed are untouched (an unconstrained request pays nothing but the copy of its
    row)."""
    allowed = allowed_tokens(bitmask.to(logits.device), logits.shape[1])
    out = logits.clone()
    out[rows] = out[rows].masked_fill(~allowed, float("-inf"))
    return out
