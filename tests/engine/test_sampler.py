"""kvscope.engine.worker.sampler / kvscope.engine.worker.logits_processors /
kvscope.engine.server.logprobs: exact values on hand-made logits."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from kvscope.engine.errors import InvalidParameterError
from kvscope.engine.outputs import TokenLogprob
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.server.logprobs import LOGPROB_FLOOR, LegacyLogprobs, chat_logprobs, token_text
from kvscope.engine.worker.logits_processors import apply_logit_bias_, apply_penalties, apply_top_k_top_p
from kvscope.engine.worker.sampler import Sampler, SamplingMetadata, compute_prompt_logprobs, first_argmax

NEG_INF = float("-inf")
P4 = torch.tensor([0.5, 0.3, 0.15, 0.05])


def build(params, vocab, outputs=None, prompts=None, generators=None, eos=None) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params=params,
        prompt_token_ids=prompts or [[]] * n,
        output_token_ids=outputs or [[]] * n,
        generators=generators or [None] * n,
        eos_token_ids=eos or [None] * n,
        vocab_size=vocab,
        device="cpu",
    )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def race(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Reference draw: argmax(p / q), q ~ Exp(1) from ``generator`` (one value per vocab entry)."""
    q = torch.empty_like(probs).exponential_(generator=generator).clamp_(min=torch.finfo(probs.dtype).tiny)
    return int((probs / q).argmax())


def sample(logits, params, **kwargs):
    return Sampler()(logits, build(params, logits.shape[1], **kwargs))


def test_greedy_is_argmax_of_unmodified_logits() -> None:
    logits = torch.randn(5, 64, generator=seeded(0))
    before = logits.clone()
    out = sample(logits, [SamplingParams(temperature=0.0)] * 5)
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    assert torch.equal(logits, before)
    assert out.top_token_ids.shape == (5, 0) and out.top_logprobs.shape == (5, 0)


def test_seeded_draws_follow_the_exponential_race_with_temperature() -> None:
    logits = torch.randn(1, 32, generator=seeded(1))
    for temperature in (0.3, 1.0, 1.7):
        ref_gen, gen = seeded(7), seeded(7)
        params = [SamplingParams(temperature=temperature, seed=7)]
        expected = [race((logits[0] / temperature).softmax(-1), ref_gen) for _ in range(25)]
        got = [int(sample(logits, params, generators=[gen]).sampled_token_ids) for _ in range(25)]
        assert got == expected
        assert len(set(got)) > 3  # really random, not greedy


def test_temperature_frequencies() -> None:
    torch.manual_seed(0)
    logits = P4.log().expand(20_000, 4).contiguous()
    out = sample(logits, [SamplingParams(temperature=2.0)] * 20_000)
    freq = torch.bincount(out.sampled_token_ids, minlength=4) / 20_000
    expected = P4.sqrt() / P4.sqrt().sum()  # softmax(log p / 2) ∝ p^(1/2)
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)


def test_unseeded_frequencies_match_distribution() -> None:
    torch.manual_seed(1234)
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    out = sample(probs.log().expand(20_000, 4).contiguous(), [SamplingParams()] * 20_000)
    freq = torch.bincount(out.sampled_token_ids, minlength=4) / 20_000
    assert torch.allclose(freq, probs, atol=0.012), freq


def test_top_k_one_equals_greedy() -> None:
    logits = torch.randn(6, 100, generator=seeded(2))
    for seed in range(3):
        torch.manual_seed(seed)
        out = sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 6)
        assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()


def test_top_p_and_top_k_masks_exact() -> None:
    logits = P4.log().repeat(5, 1)
    top_p = torch.tensor([0.75, 0.85, 1.0, 0.1, 1.0])
    top_k = torch.tensor([4, 4, 2, 4, 3])
    masked = apply_top_k_top_p(logits, top_k, top_p)
    kept = (masked > NEG_INF).tolist()
    assert kept == [
        [True, True, False, False],
        [True, True, True, False],
        [True, True, False, False],
        [True, False, False, False],
        [True, True, True, False],
    ]
    assert torch.equal(masked[0, :2], logits[0, :2])  # kept logits are unchanged


def test_top_p_and_min_p_through_the_sampler() -> None:
    logits = P4.log().unsqueeze(0)
    cases = [
        (SamplingParams(top_p=0.75, seed=3), torch.tensor([0.5, 0.3, 0.0, 0.0])),
        (SamplingParams(min_p=0.35, seed=3), torch.tensor([0.5, 0.3, 0.0, 0.0])),  # 0.15 < 0.35 * 0.5
        (SamplingParams(min_p=0.29, seed=3), torch.tensor([0.5, 0.3, 0.15, 0.0])),
        (SamplingParams(top_k=3, top_p=0.9, seed=3), torch.tensor([0.5, 0.3, 0.15, 0.0])),
    ]
    for params, kept in cases:
        ref_gen, gen = seeded(3), seeded(3)
        expected = [race(kept / kept.sum(), ref_gen) for _ in range(40)]
        got = [int(sample(logits, [params], generators=[gen]).sampled_token_ids) for _ in range(40)]
        assert got == expected, params
        assert set(got) == set(kept.nonzero().flatten().tolist()), params


def test_top_p_frequencies() -> None:
    torch.manual_seed(5)
    out = sample(P4.log().expand(20_000, 4).contiguous(), [SamplingParams(top_p=0.75)] * 20_000)
    freq = torch.bincount(out.sampled_token_ids, minlength=4) / 20_000
    assert freq[2:].tolist() == [0.0, 0.0]
    assert abs(float(freq[0]) - 0.625) < 0.015


def test_penalties_exact() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(),
    ]
    meta = build(params, 5, prompts=[[0, 1], [0, 1]], outputs=[[2, 2, 4], [2, 2, 4]])
    out = apply_penalties(logits, meta.penalties)
    # token 0: prompt, positive → /2; token 1: prompt, negative → *2; token 2: output ×2 → 0.5/2 - 2*0.5 -
    # 0.25; token 3: unseen; token 4: output ×1 → -2*2 - 0.5 - 0.25.
    assert out.tolist() == [[1.0, -2.0, -1.0, 3.0, -4.75], logits[1].tolist()]


def test_presence_frequency_ignore_prompt_tokens() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0]])
    meta = build(
        [SamplingParams(presence_penalty=-1.0, frequency_penalty=1.5)], 3, prompts=[[0]], outputs=[[1]]
    )
    assert meta.penalties.prompt_mask is None
    assert apply_penalties(logits, meta.penalties).tolist() == [[1.0, 1.0 - 1.5 + 1.0, 1.0]]


def test_presence_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    params = [SamplingParams(temperature=0.0, presence_penalty=0.5)]
    assert sample(logits, params, outputs=[[1]]).sampled_token_ids.tolist() == [0]
    assert sample(logits, params, outputs=[[0]]).sampled_token_ids.tolist() == [1]


def test_logit_bias() -> None:
    logits = torch.zeros(2, 6)
    params = [
        SamplingParams(temperature=0.0, logit_bias={3: 5.0, 1: -100.0}),
        SamplingParams(temperature=0.0, logit_bias={5: 0.5}),
    ]
    meta = build(params, 6)
    biased = logits.clone()
    apply_logit_bias_(biased, meta.logit_bias)
    assert biased.tolist() == [[0, -100.0, 0, 5.0, 0, 0], [0, 0, 0, 0, 0, 0.5]]
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [3, 5]


def test_min_tokens_bans_eos_and_stop_tokens() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0, 3.0]] * 4)
    params = [
        SamplingParams(temperature=0.0, min_tokens=2),
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3]),
        SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3]),
    ]
    out = sample(logits, params, outputs=[[1], [1], [1], [1, 1]], eos=[2, 2, 2, 2])
    assert out.sampled_token_ids.tolist() == [3, 4, 2, 2]
    assert out.logprobs[0].item() == logits.log_softmax(-1)[0, 3].item()


def test_seed_reproducible_and_independent_of_batch() -> None:
    vocab = 50
    logits = torch.randn(4, vocab, generator=seeded(9))
    params = [SamplingParams(seed=11), SamplingParams(), SamplingParams(seed=12, top_p=0.9), SamplingParams()]

    def run(rows: list[int], seeds: dict[int, int], steps: int = 20) -> list[list[int]]:
        gens = {row: seeded(seed) for row, seed in seeds.items()}
        draws = []
        for _ in range(steps):
            out = sample(logits[rows], [params[r] for r in rows], generators=[gens.get(r) for r in rows])
            draws.append(out.sampled_token_ids.tolist())
        return draws

    alone = [d[0] for d in run([2], {2: 12})]
    batched = [d[2] for d in run([0, 1, 2, 3], {0: 11, 2: 12})]
    assert alone == batched
    assert alone == [d[2] for d in run([0, 1, 2, 3], {0: 11, 2: 12})]
    assert len(set(alone)) > 5
    other = [d[0] for d in run([2], {2: 13})]
    assert other != alone


def test_logprobs_ranks_and_top_are_raw() -> None:
    logits = torch.randn(3, 40, generator=seeded(4))
    params = [
        SamplingParams(temperature=0.5, logprobs=2, logit_bias={7: 30.0}),
        SamplingParams(temperature=0.0, repetition_penalty=1.8),
        SamplingParams(temperature=0.0, logprobs=5),
    ]
    out = sample(logits, params, outputs=[[1], [int(logits[1].argmax())], []], prompts=[[0], [0], [0]])
    raw = logits.log_softmax(-1)
    sampled = out.sampled_token_ids
    assert sampled[0].item() == 7 and sampled[1].item() != logits[1].argmax().item()
    assert out.logprobs.tolist() == raw.gather(1, sampled.unsqueeze(1)).squeeze(1).tolist()
    top_lps, top_ids = raw.topk(5, dim=-1)
    assert out.top_token_ids.tolist() == top_ids.tolist() and out.top_logprobs.tolist() == top_lps.tolist()
    assert out.top_logprobs.shape == (3, 5)
    expected_ranks = [1 + int((raw[i] > raw[i, sampled[i]]).sum()) for i in range(3)]
    assert out.ranks.tolist() == expected_ranks and expected_ranks[2] == 1 and expected_ranks[1] == 2


def test_compute_prompt_logprobs() -> None:
    logits = torch.randn(4, 30, generator=seeded(5))
    targets = torch.tensor([3, 0, 29, 11])
    lps, top_ids, top_lps, ranks = compute_prompt_logprobs(logits, targets, 3)
    raw = logits.log_softmax(-1)
    assert lps.tolist() == [raw[i, t].item() for i, t in enumerate(targets.tolist())]
    assert (
        top_ids.tolist() == raw.topk(3).indices.tolist() and top_lps.tolist() == raw.topk(3).values.tolist()
    )
    assert ranks.tolist() == [1 + int((raw[i] > raw[i, t]).sum()) for i, t in enumerate(targets.tolist())]
    assert compute_prompt_logprobs(logits, targets, 0)[1].shape == (4, 0)
    with pytest.raises(InvalidParameterError) as info:
        compute_prompt_logprobs(logits, targets[:2], 3)
    assert info.value.param == "target_ids"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"generators": [None]}, "generators"),
        ({"params": [SamplingParams(logit_bias={10: 1.0})] * 2}, "logit_bias"),
        ({"params": [SamplingParams(stop_token_ids=[10])] * 2}, "stop_token_ids"),
        (
            {"params": [SamplingParams(frequency_penalty=1.0)] * 2, "output_token_ids": [[1], [12]]},
            "output_token_ids",
        ),
        (
            {"params": [SamplingParams(repetition_penalty=1.2)] * 2, "prompt_token_ids": [[-1], [2]]},
            "prompt_token_ids",
        ),
        ({"params": [SamplingParams(min_tokens=1)] * 2, "eos_token_ids": [2, 10]}, "eos_token_ids"),
        ({"vocab_size": 0}, "vocab_size"),
    ],
)
def test_invalid_metadata_names_the_parameter(kwargs: dict, param: str) -> None:
    args = {
        "params": [SamplingParams()] * 2,
        "prompt_token_ids": [[1], [2]],
        "output_token_ids": [[], []],
        "generators": [None, None],
        "eos_token_ids": [2, 2],
        "vocab_size": 10,
        "device": "cpu",
        **kwargs,
    }
    with pytest.raises(ValueError) as info:
        SamplingMetadata.build(**args)
    assert info.value.param == param


def test_logits_shape_checked() -> None:
    with pytest.raises(InvalidParameterError) as info:
        Sampler()(torch.zeros(2, 9), build([SamplingParams()] * 2, 10))
    assert info.value.param == "logits"


def test_openai_logprob_entries(tokenizer) -> None:
    ni = tokenizer.encode("你")  # two tokens, b"\xe4\xbd" + b"\xa0"
    hi = tokenizer.encode(" hi")[0]
    entries = [
        TokenLogprob(ni[0], -0.5, 1, [(ni[0], -0.5), (hi, -1.25)]),
        TokenLogprob(ni[1], NEG_INF, 7, []),
    ]
    assert (
        token_text(tokenizer, ni[0]) == ("bytes:\\xe4\\xbd", b"\xe4\xbd")
        and token_text(tokenizer, hi)[0] == " hi"
    )
    chat = msgspec.to_builtins(
        chat_logprobs(tokenizer, [TokenLogprob(ni[0], -0.5, 1, [(ni[0], -0.5)]), entries[1]])
    )
    assert chat["content"] == [
        {
            "token": "bytes:\\xe4\\xbd",
            "logprob": -0.5,
            "bytes": [0xE4, 0xBD],
            "top_logprobs": [{"token": "bytes:\\xe4\\xbd", "logprob": -0.5, "bytes": [0xE4, 0xBD]}],
        },
        {"token": "bytes:\\xa0", "logprob": LOGPROB_FLOOR, "bytes": [0xA0], "top_logprobs": []},
    ]
    legacy = msgspec.to_builtins(
        LegacyLogprobs(tokenizer, start_offset=10).build([hi, *ni], [None, *entries])
    )
    assert legacy == {
        "tokens": [" hi", "bytes:\\xe4\\xbd", "bytes:\\xa0"],
        "token_logprobs": [None, -0.5, LOGPROB_FLOOR],
        "top_logprobs": [None, {"bytes:\\xe4\\xbd": -0.5, " hi": -1.25}, {"bytes:\\xa0": LOGPROB_FLOOR}],
        "text_offset": [10, 13, 13],
    }
    assert math.isfinite(legacy["token_logprobs"][2])


@pytest.mark.parametrize("vocab", [49152, 4099, 100])
@pytest.mark.parametrize("rows", [1, 32])
def test_first_argmax_equals_torch_argmax_with_ties_and_nans(rows, vocab):
    """first_argmax (blocked amax, then argmax in the winning block) returns torch.argmax's index: the first
    maximum on ties across blocks, the first NaN in a row holding NaNs; 4099 (prime) takes the plain path."""
    gen = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=gen)
    logits[0, vocab - 7] = logits[0, 3] = 50.0  # a tie in different blocks: the first wins
    if rows > 1:
        logits[-1, vocab // 2] = float("nan")
        logits[-1, vocab - 1] = float("nan")
    got = first_argmax(logits)
    assert got.dtype == torch.int64
    assert got.tolist() == logits.argmax(dim=-1).tolist()
    assert got[0].item() == 3
    assert got[-1].item() == (vocab // 2 if rows > 1 else 3)
