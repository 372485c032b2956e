"""Whole-engine check on CUDA: greedy decoding with the Triton backend gives the torch backend's tokens and
log-probabilities, on tiny random-weight models made on the device (tests/kernels/tiny_model.py: Llama and
Qwen2, float32, head_dim 32, GQA 2). A 64-token step budget chunks long prompts, so steps mix prefill chunks
with decodes; the cases are short prompts, a 51-request batch and a 4,097-token context. Run by
scripts/gpu_check.sh; skipped without CUDA (tests/conftest.py).

Parity: the same tokens, and each chosen token's log-probability within :data:`LOGPROB_ATOL` of the torch
backend's. Only where the torch backend's top two are within :data:`TIE_GAP` of each other (a tie that float32
summation order may break either way) may the tokens part; the rest of that sequence is then not compared."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvscope.engine.llm import LLM
from kvscope.engine.outputs import CompletionOutput
from kvscope.engine.sampling_params import SamplingParams
from tests.kernels.tiny_model import CONFIGS, build_tiny_model, random_prompts, tokenizer_source

pytestmark = pytest.mark.gpu
STEP_TOKENS = 64
LONG_CONTEXT = 4097
BATCH = 51
LOGPROB_ATOL = 1e-4
TIE_GAP = 1e-3


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, Path]:
    tokenizer = tokenizer_source(request)
    return {
        arch: build_tiny_model(tmp_path_factory.mktemp(arch), tokenizer, arch, seed=len(arch))
        for arch in CONFIGS
    }


@pytest.fixture(scope="module")
def engines(models: dict[str, Path]) -> Iterator[dict[tuple[str, str], LLM]]:
    """One engine per (architecture, backend), on cuda:0, each with room for every case of this module."""
    made = {
        (arch, backend): LLM(
            str(path),
            device="cuda",
            attention_backend=backend,
            dtype="float32",
            max_num_batched_tokens=STEP_TOKENS,
            max_num_seqs=64,
            num_blocks=2048,
            max_model_len=LONG_CONTEXT + 64,
        )
        for arch, path in models.items()
        for backend in ("torch", "triton")
    }
    for (_, backend), llm in made.items():
        assert llm.engine.runner.backend.name == backend
    yield made
    made.clear()
    torch.cuda.empty_cache()


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[CompletionOutput]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    return [out.outputs[0] for out in llm.generate(prompts, params)]


def assert_same_greedy(reference: list[CompletionOutput], candidate: list[CompletionOutput]) -> int:
    """Parity as the module doc says; returns how many tokens were compared."""
    compared = 0
    for i, (ref, got) in enumerate(zip(reference, candidate, strict=True)):
        assert ref.logprobs is not None and got.logprobs is not None
        assert len(got.token_ids) == len(ref.token_ids)
        for pos, (want, have) in enumerate(zip(ref.logprobs, got.logprobs, strict=True)):
            gap = want.top[0][1] - want.top[1][1]
            if have.token_id != want.token_id:
                assert gap < TIE_GAP, (
                    f"request {i} token {pos}: {have.token_id} != {want.token_id} (gap {gap})"
                )
                break
            assert abs(have.logprob - want.logprob) <= LOGPROB_ATOL, f"request {i} token {pos}"
            compared += 1
    return compared


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_greedy_tokens_match_the_torch_backend(engines: dict[tuple[str, str], LLM], arch: str) -> None:
    prompts = random_prompts([5, 17, 40, 150], seed=1)  # 150 > 64: two chunks before its first decode
    expected = greedy(engines[arch, "torch"], prompts, max_tokens=48)
    assert assert_same_greedy(expected, greedy(engines[arch, "triton"], prompts, 48)) >= 3 * 48


def test_a_51_request_batch(engines: dict[tuple[str, str], LLM]) -> None:
    lengths = torch.randint(1, 200, (BATCH,), generator=torch.Generator().manual_seed(2)).tolist()
    prompts = random_prompts(lengths, seed=3)
    expected = greedy(engines["llama", "torch"], prompts, max_tokens=16)
    assert assert_same_greedy(expected, greedy(engines["llama", "triton"], prompts, 16)) >= (BATCH - 2) * 16


def test_a_4097_token_context(engines: dict[tuple[str, str], LLM]) -> None:
    """A 4,097-token prompt (65 chunks of 64; its context passes 4,096 by one) beside a short one."""
    prompts = random_prompts([LONG_CONTEXT, 9], seed=4)
    expected = greedy(engines["llama", "torch"], prompts, max_tokens=24)
    assert assert_same_greedy(expected, greedy(engines["llama", "triton"], prompts, 24)) >= 24
