"""Whole-engine check on CUDA: greedy decoding with the Triton backend gives the torch backend's tokens.

SmolLM2-135M in float32; a 64-token step budget chunks the long prompt, so steps mix prefill chunks with
decodes. Run by scripts/gpu_check.sh; skipped without CUDA (tests/conftest.py).
"""

from __future__ import annotations

import gc

import pytest
import torch

PROMPTS = [
    "The capital of France is",
    "Write a haiku about paged attention.",
    "List the first ten prime numbers: 2, 3,",
    " ".join(["Once upon a time a tiny language model learned to count blocks."] * 10),  # > 64 tokens
]


def _generate(backend: str) -> list[list[int]]:
    from kvscope.engine.llm import LLM
    from kvscope.engine.sampling_params import SamplingParams

    llm = LLM(
        model="smollm2-135m",
        device="cuda",
        attention_backend=backend,
        max_num_batched_tokens=64,
        num_blocks=1024,
    )
    assert llm.engine.runner.backend.name == backend
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=64))
    token_ids = [list(out.outputs[0].token_ids) for out in outputs]
    del llm, outputs
    gc.collect()
    torch.cuda.empty_cache()
    return token_ids


@pytest.mark.gpu
@pytest.mark.slow
def test_triton_backend_generates_the_torch_backends_tokens() -> None:
    expected = _generate("torch")
    assert all(len(ids) > 0 for ids in expected)
    assert _generate("triton") == expected
