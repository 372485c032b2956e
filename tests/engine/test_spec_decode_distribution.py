"""Speculative sampling preserves the model's distribution (issue 16, "Done when"): a tiny random-weight Llama
(16-token vocabulary), temperature 1, a prompt on which the n-gram proposer always proposes; ≥ 20k sampled
tokens with speculation on fit the model's exact conditional probabilities (HF transformers, teacher forcing)
within a chi-square test at p > 0.01; a deliberately wrong acceptance rule fails the same test; and a seeded
request gives the same tokens twice with speculation on, alone and batched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvscope.engine.worker.model_runner as model_runner
from kvscope.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from kvscope.engine.llm import LLM
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.spec_decode import rejection_sampler
from tests.engine.spec_distribution import (
    VOCAB,
    TinyModel,
    build_tiny_model,
    conditional_probs,
    greedy_prompt,
    sequential_chi_square,
)

NUM_REQUESTS = 1300
MAX_TOKENS = 16
"""1300 × 16 = 20 800 sampled tokens."""
PROMPT_LEN = 24

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> TinyModel:
    return build_tiny_model(tmp_path_factory.mktemp("spec") / "tiny", tokenizer_dir)


@pytest.fixture(scope="module")
def prompt(tiny: TinyModel) -> list[int]:
    return greedy_prompt(tiny.hf, PROMPT_LEN)


def spec_llm(tiny: TinyModel) -> LLM:
    """Speculation always on: lookup from 1 token (every token occurs in the prompt, so every decode step with
    room for a draft proposes one), no adaptivity (a random model's low acceptance would pause it)."""
    speculative = SpeculativeConfig(
        num_speculative_tokens=4,
        prompt_lookup_min=1,
        prompt_lookup_max=3,
        adaptive=False,
        measure_batch_cost=False,
    )
    return LLM(
        config=EngineConfig(
            model=ModelConfig(model=str(tiny.path), dtype="float32"),
            num_threads=1,
            cache=CacheConfig(block_size=16, num_blocks=2048),
            scheduler=SchedulerConfig(max_num_seqs=512, max_num_batched_tokens=8192),
            speculative=speculative,
        )
    )


def sample_fit(tiny: TinyModel, prompt: list[int], num_requests: int) -> tuple[float, list]:
    """Sample ``num_requests`` × MAX_TOKENS tokens with speculation on (torch's default generator, seeded) and
    return the chi-square p-value of all of them against the exact conditionals, and the outputs."""
    llm = spec_llm(tiny)
    torch.manual_seed(0)
    outputs = [
        o.outputs[0]
        for o in llm.generate(
            [prompt] * num_requests, SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        )
    ]
    sequences = [o.token_ids for o in outputs]
    probs = conditional_probs(tiny.hf, prompt, sequences).reshape(-1, VOCAB)
    _, p_value, _ = sequential_chi_square(torch.tensor(sequences).reshape(-1), probs)
    return p_value, outputs


def test_the_statistic_is_pearsons_with_one_distribution() -> None:
    """With the same p for every sample, Sᵀ C⁻¹ S is Pearson's Σ (O − E)² / E (VOCAB − 1 df)."""
    probs = torch.softmax(torch.linspace(-1.0, 1.0, VOCAB, dtype=torch.float64), dim=0)
    tokens = torch.multinomial(probs, 3000, replacement=True, generator=torch.Generator().manual_seed(3))
    observed = torch.bincount(tokens, minlength=VOCAB).double()
    pearson = float(((observed - 3000 * probs) ** 2 / (3000 * probs)).sum())
    stat, p_value, df = sequential_chi_square(tokens, probs.expand(3000, VOCAB))
    assert (stat, df) == (pytest.approx(pearson, rel=1e-9), VOCAB - 1)
    assert p_value == pytest.approx(
        float(
            torch.special.gammaincc(
                torch.tensor(7.5, dtype=torch.float64), torch.tensor(pearson / 2, dtype=torch.float64)
            )
        )
    )


def test_sampled_tokens_fit_the_exact_distribution(tiny: TinyModel, prompt: list[int]) -> None:
    p_value, outputs = sample_fit(tiny, prompt, NUM_REQUESTS)
    assert len(outputs) * MAX_TOKENS >= 20_000
    assert p_value > 0.01
    stats = [o.stats for o in outputs]
    # every request speculated; each decode step emits 1 + its accepted draft tokens, so accepted + decode
    # steps is the 15 tokens after the first one for every request
    assert sorted({(s.spec_accepted_tokens or 0) + s.decode_steps for s in stats}) == [MAX_TOKENS - 1]
    assert sum(s.spec_drafts is not None for s in stats) == NUM_REQUESTS
    accepted, proposed = (
        sum(getattr(s, f) for s in stats) for f in ("spec_accepted_tokens", "spec_draft_tokens")
    )
    assert 0.05 < accepted / proposed < 0.5  # drafts are verified and some accepted, not all (a real test)


def test_a_wrong_acceptance_rule_fails_the_test(
    tiny: TinyModel, prompt: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Accept a draft token with probability p(t) but, on a rejection, sample from p instead of the residual
    (p without t): the draft token is then emitted with probability p + (1 − p)·p."""

    def resample_from_p(
        probs: torch.Tensor, draft: list[int], generator: torch.Generator | None = None
    ) -> list[int]:
        emitted = []
        for i in range(probs.shape[0]):
            if i < len(draft) and torch.rand((), generator=generator) < probs[i, draft[i]]:
                emitted.append(draft[i])
                continue
            emitted.append(rejection_sampler._race(probs[i], generator))  # noqa: SLF001
            break
        return emitted

    monkeypatch.setattr(model_runner, "rejection_sample", resample_from_p)
    p_value, _ = sample_fit(tiny, prompt, 400)
    assert p_value < 1e-4


def test_a_seeded_request_gives_the_same_tokens_twice(tiny: TinyModel, prompt: list[int]) -> None:
    llm = spec_llm(tiny)
    seeded = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=1234)
    alone = llm.generate([prompt], seeded)[0].outputs[0]
    others = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    batched = llm.generate([prompt] * 3, [others, seeded, others])[1].outputs[0]
    assert alone.stats.spec_drafts is not None and alone.stats.spec_drafts > 0
    assert (batched.token_ids, batched.text) == (alone.token_ids, alone.text)
    other_seed = llm.generate(
        [prompt], SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=4321)
    )[0].outputs[0]
    assert other_seed.token_ids != alone.token_ids


def test_step_metrics_add_up_to_the_requests_totals(tiny: TinyModel, prompt: list[int]) -> None:
    """The real engine's StepResult.spec_decoding feeds the counters (engine/server/stat_logger.py): over a
    run, they equal the sums of the requests' kvscope fields, and the length histogram has one observation
    per draft with sum = drafts + accepted tokens."""
    from prometheus_client import CollectorRegistry

    from kvscope.engine.server.stat_logger import ServerMetrics

    llm = spec_llm(tiny)
    registry = CollectorRegistry()
    metrics = ServerMetrics(registry, "tiny", num_speculative_tokens=4)
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=7)
    for i in range(24):
        llm.engine.add_engine_request(f"r{i}", llm.engine.input_processor.process(prompt, params))
    finished = []
    while llm.engine.has_unfinished_requests():
        result = llm.engine.step()
        metrics.on_step(result)
        finished += [c.stats for o in result.outputs for c in o.outputs if c.stats is not None]
    assert len(finished) == 24
    totals = [
        sum(getattr(s, f) for s in finished)
        for f in ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens")
    ]
    value = registry.get_sample_value
    m = {"model": "tiny"}
    sd = "kvscope_engine_spec_decode_"
    assert [
        value(f"{sd}{n}_total", m) for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    ] == totals
    assert (value(f"{sd}acceptance_length_count", m), value(f"{sd}acceptance_length_sum", m)) == (
        totals[0],
        totals[0] + totals[2],
    )
    per_position = [
        value(f"{sd}num_accepted_tokens_per_pos_total", {**m, "position": str(p)}) for p in range(4)
    ]
    assert sum(per_position) == totals[2] and per_position == sorted(per_position, reverse=True)
