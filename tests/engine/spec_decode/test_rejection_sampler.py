"""The one-hot speculative sampling rule (engine/spec_decode/rejection_sampler.py) preserves the target
distribution, is reproducible per seed, and draws the Sampler's own stream."""

from __future__ import annotations

import pytest
import torch

from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.spec_decode.rejection_sampler import greedy_verify, rejection_sample
from kvscope.engine.worker.sampler import Sampler, SamplingMetadata

VOCAB = 6
NUM_DRAWS = 20_000
CHI2_CRITICAL_DF5_P01 = 15.086
"""Upper 1 % point of the chi-square distribution with 5 degrees of freedom (VOCAB - 1): a statistic below it
means p > 0.01 (table value, e.g. NIST/SEMATECH e-Handbook of Statistical Methods, 1.3.6.7.4)."""


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _rows(seed: int = 0) -> torch.Tensor:
    """Three different target distributions (positions 0, 1, 2) over a 6-token vocabulary."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(3, VOCAB, generator=g) * 1.5, dim=-1)


def _draws(probs: torch.Tensor, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    generator = torch.Generator().manual_seed(seed)
    draft_gen = torch.Generator().manual_seed(seed + 1)
    drafts, emitted = [], []
    for _ in range(NUM_DRAWS):
        draft = torch.randint(0, VOCAB, (2,), generator=draft_gen).tolist()  # random one-hot drafts
        drafts.append(draft)
        emitted.append(rejection_sample(probs, draft, generator))
    return drafts, emitted


def test_emitted_tokens_follow_the_target_distribution_at_each_position():
    probs = _rows()
    drafts, emitted = _draws(probs, seed=1234)
    first = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=VOCAB).double()
    assert _chi2(first, probs[0].double()) < CHI2_CRITICAL_DF5_P01
    # given the first draft token was accepted, the next emitted token is a draw from p_1
    second = [e[1] for e in emitted if len(e) > 1]
    assert len(second) > 2_000
    counts = torch.bincount(torch.tensor(second), minlength=VOCAB).double()
    assert _chi2(counts, probs[1].double()) < CHI2_CRITICAL_DF5_P01
    # acceptance of the first draft token happens with probability p_0(draft[0])
    accepted = sum(len(e) > 1 for e in emitted)
    expected = sum(float(probs[0, d[0]]) for d in drafts)
    assert abs(accepted - expected) < 4 * expected**0.5
    assert all(len(e) <= 3 for e in emitted) and all(
        e[:-1] == d[: len(e) - 1] for e, d in zip(emitted, drafts, strict=True)
    )


def test_a_rejected_token_is_never_emitted_in_its_place():
    probs = _rows()
    for seed in range(200):
        emitted = rejection_sample(probs, [0, 1], torch.Generator().manual_seed(seed))
        if len(emitted) == 1:
            assert emitted[0] != 0  # residual: p_0 with the draft token removed
        elif len(emitted) == 2:
            assert emitted[1] != 1


def test_same_seed_same_draws_and_the_samplers_own_stream():
    probs = _rows()
    drafts = [[2, 3], [0, 0], [5, 1]] * 20
    run = [
        [rejection_sample(probs, d, g) for d in drafts]
        for g in (torch.Generator().manual_seed(7), torch.Generator().manual_seed(7))
    ]
    assert run[0] == run[1]
    other = [rejection_sample(probs, d, torch.Generator().manual_seed(8)) for d in drafts]
    assert other != run[0]
    # with no draft, one draw consumes the generator exactly as one Sampler step with that seed
    logits = torch.log(probs[:1])
    meta_gen, race_gen = torch.Generator().manual_seed(99), torch.Generator().manual_seed(99)
    params = [SamplingParams(temperature=1.0, seed=99)]
    for _ in range(30):
        meta = SamplingMetadata.build(
            params=params,
            prompt_token_ids=[[1]],
            output_token_ids=[[]],
            generators=[meta_gen],
            eos_token_ids=[None],
            vocab_size=VOCAB,
            device="cpu",
        )
        expected = int(Sampler()(logits, meta).sampled_token_ids[0])
        assert rejection_sample(torch.softmax(logits, -1), [], race_gen) == [expected]


def test_greedy_verify_accepts_the_matching_prefix_then_the_targets_token():
    assert greedy_verify([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]  # bonus after k accepts
    assert greedy_verify([4, 9, 6, 7], [4, 5, 6]) == [4, 9]
    assert greedy_verify([1, 2], [3]) == [1]
    assert greedy_verify([8], []) == [8]
    with pytest.raises(ValueError, match="need 3 target tokens"):
        greedy_verify([1], [2, 3])
    with pytest.raises(ValueError, match="probs must be"):
        rejection_sample(torch.ones(2, VOCAB) / VOCAB, [1, 2, 3])
