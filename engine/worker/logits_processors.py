"""Batched logits transforms used by :class:`kvscope.engine.worker.sampler.Sampler`, in the order vLLM v1
applies them.

Every function takes ``logits`` of shape ``[num_reqs, vocab]`` (float32, one row per request) and per-row
parameter tensors of shape ``[num_reqs]``; rows whose parameter is neutral are left unchanged. Functions
ending in ``_`` modify ``logits`` in place; the others return a new tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


@dataclass(frozen=True, slots=True)
class SparseLogits:
    """``(rows[i], cols[i])`` entries of a ``[num_reqs, vocab]`` matrix; ``values`` may be None (a mask)."""

    rows: torch.Tensor
    """int64 ``[n]``, request row."""
    cols: torch.Tensor
    """int64 ``[n]``, token id."""
    values: torch.Tensor | None = None
    """float32 ``[n]``."""


@dataclass(frozen=True, slots=True)
class PenaltyTensors:
    """Per-row penalties and the token statistics they need (built by ``SamplingMetadata.build``)."""

    repetition: torch.Tensor
    """float32 ``[num_reqs]``, 1.0 = off."""
    presence: torch.Tensor
    """float32 ``[num_reqs]``, 0.0 = off."""
    frequency: torch.Tensor
    """float32 ``[num_reqs]``, 0.0 = off."""
    output_counts: torch.Tensor
    """float32 ``[num_reqs, vocab]``: how often each token occurs in the row's output so far."""
    prompt_mask: torch.Tensor | None
    """bool ``[num_reqs, vocab]``: token occurs in the prompt; None when no row has a repetition penalty."""


def apply_logit_bias_(logits: torch.Tensor, bias: SparseLogits) -> None:
    """Add OpenAI ``logit_bias`` values to the listed (row, token) logits, in place."""
    logits.index_put_((bias.rows, bias.cols), bias.values, accumulate=True)


def apply_bans_(logits: torch.Tensor, banned: SparseLogits) -> None:
    """Set the listed (row, token) logits to -inf, in place (``min_tokens`` bans EOS and stop_token_ids)."""
    logits[banned.rows, banned.cols] = NEG_INF


def apply_penalties(logits: torch.Tensor, penalties: PenaltyTensors) -> torch.Tensor:
    """Repetition, then frequency and presence penalties.

    Repetition (CTRL, Keskar et al. 2019, as in vLLM/HF): for tokens seen in the prompt or the output, a
    positive logit is divided by the penalty, a non-positive one multiplied by it. Frequency/presence
    (OpenAI, "Parameter details"): ``logit[j] -= c[j] * frequency + (c[j] > 0) * presence`` where ``c[j]``
    counts token ``j`` in the output only.
    """
    seen_in_output = penalties.output_counts > 0
    seen = seen_in_output if penalties.prompt_mask is None else seen_in_output | penalties.prompt_mask
    rep = penalties.repetition.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - penalties.frequency.unsqueeze(1) * penalties.output_counts
    return logits - penalties.presence.unsqueeze(1) * seen_in_output


def apply_min_p_(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Mask tokens whose probability is below ``min_p × p_max`` of their row (Nguyen et al. 2024, vLLM's
    MinPLogitsProcessor), in place. ``logits`` are already temperature-scaled."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    logits.masked_fill_(probs < threshold, NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Top-k then top-p (nucleus) masking with one ascending sort per row (vLLM ``apply_top_k_top_p``).

    ``top_k`` int64 ``[num_reqs]`` in [1, vocab] (vocab = off): keeps every token whose logit is ≥ the k-th
    largest (ties at the threshold are kept). ``top_p`` float32 ``[num_reqs]`` in (0, 1] (1 = off): keeps the
    smallest set of most likely tokens whose probability mass (after top-k) reaches ``top_p``; the most
    likely token is always kept. Returns the masked logits (-inf outside the kept set).
    """
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth = logits_sort.gather(1, (logits_sort.size(1) - top_k).unsqueeze(1))
        logits_sort.masked_fill_(logits_sort < kth, NEG_INF)
    if top_p is not None:
        cum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False
        logits_sort.masked_fill_(drop, NEG_INF)
    return logits_sort.scatter(1, logits_idx, logits_sort)
