"""Verification of a one-hot draft against the target model's distributions (speculative sampling).

The rule (Leviathan, Kalman, Matias 2023, "Fast Inference from Transformers via Speculative Decoding",
Algorithm 1; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling") for a
draft distribution ``q`` and target ``p``: accept draft token ``t`` with probability ``min(1, p(t) / q(t))``,
else sample from ``norm(max(0, p - q))``; after ``k`` accepts sample a bonus token from ``p`` at position
``k``. A prompt-lookup draft is one-hot (``q(t) = 1``), so the rule reduces to: accept ``t`` with probability
``p(t)``; on rejection sample from ``p`` with ``t`` removed and renormalised.

Realised by coupling (the exponential race the Sampler uses, "Gumbel-max"): at position ``i`` draw
``e ~ Exp(1)^vocab`` from the request's generator and let ``x = argmax(p_i / e)``, a draw from ``p_i``; accept
``draft[i]`` iff ``x == draft[i]`` (probability ``p_i(draft[i])``), else emit ``x`` (given ``x ≠ t`` it is
distributed as ``p_i`` without ``t``, renormalised): exactly the rule above. Each emitted token consumes
one ``vocab``-sized block of the generator, the same as one non-speculative step, so a seeded request
samples the very tokens it samples with speculation off (up to floating-point differences in the logits)
and the same seed gives the same text twice whatever was drafted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvscope.engine.worker.sampler import first_argmax


def rejection_sample(
    probs: torch.Tensor, draft_token_ids: Sequence[int], generator: torch.Generator | None = None
) -> list[int]:
    """Verify one request's draft under sampling.

    ``probs``: float32 ``[k + 1, vocab]``, row ``i`` the target's final sampling distribution (probabilities,
    each row summing to 1) after the prompt, the output so far and ``draft_token_ids[:i]``;
    ``draft_token_ids``: the ``k`` proposed ids (``k`` ≥ 0). ``generator``: the request's own (seeded) one, or
    None for torch's default. Returns the emitted tokens: the accepted draft prefix (``a`` tokens) then one
    token sampled at position ``a`` (from the residual on a rejection, from ``p_k`` after ``k`` accepts),
    ``a + 1`` ids in all. Raises ValueError when ``probs`` does not have ``k + 1`` rows.
    """
    if probs.dim() != 2 or probs.shape[0] != len(draft_token_ids) + 1:
        raise ValueError(f"probs must be [{len(draft_token_ids) + 1}, vocab], got {tuple(probs.shape)}")
    emitted: list[int] = []
    for i in range(probs.shape[0]):
        token = _race(probs[i], generator)
        emitted.append(token)
        if i == len(draft_token_ids) or token != draft_token_ids[i]:
            break
    return emitted


def greedy_verify(target_token_ids: Sequence[int], draft_token_ids: Sequence[int]) -> list[int]:
    """Verify one request's draft under greedy decoding: ``target_token_ids`` (``k + 1`` ids, the argmax at
    each position) against the ``k`` draft ids. Returns the accepted prefix and the target's token at the
    first mismatch (or the bonus token after ``k`` accepts): ``a + 1`` ids. Raises ValueError on a length
    mismatch."""
    if len(target_token_ids) != len(draft_token_ids) + 1:
        raise ValueError(f"need {len(draft_token_ids) + 1} target tokens, got {len(target_token_ids)}")
    emitted: list[int] = []
    for i, token in enumerate(target_token_ids):
        emitted.append(token)
        if i == len(draft_token_ids) or token != draft_token_ids[i]:
            break
    return emitted


def _race(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from ``probs`` (``[vocab]``) as ``argmax(probs / e)``, ``e ~ Exp(1)``
    (kvscope.engine.worker.sampler's exponential race: the same ``vocab`` draws from ``generator`` as one
    step of the Sampler)."""
    noise = (
        torch.empty_like(probs).exponential_(generator=generator).clamp_(min=torch.finfo(probs.dtype).tiny)
    )
    return int(first_argmax((probs / noise).unsqueeze(0))[0])
