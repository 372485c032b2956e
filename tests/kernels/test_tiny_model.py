"""tests/kernels/tiny_model.py on the CPU: the random-weight models the GPU check builds on the device (only a
tokenizer travels) load in the engine and decode greedily as transformers computes the same weights, so a
broken builder or loader shows here, in CI, and not first on a lent GPU (scripts/gpu_check.sh runs
tests/kernels/test_engine_triton_gpu.py on them).

Parity: every token the engine picks is transformers' argmax at that position (teacher-forced through the
whole sequence), or within :data:`TIE_GAP` of it, and its log-probability is within :data:`LOGPROB_ATOL` of
transformers' (float32 on both sides; only the summation order differs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from kvscope.engine.llm import LLM
from kvscope.engine.sampling_params import SamplingParams
from tests.kernels.tiny_model import (
    CONFIGS,
    SHAPE,
    TOKENIZER_ENV,
    TOKENIZER_FILES,
    VOCAB,
    build_tiny_model,
    random_prompts,
    tokenizer_source,
)

LOGPROB_ATOL = 1e-4
TIE_GAP = 1e-3
NEW_TOKENS = 12


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_a_tiny_model_decodes_as_transformers_does(
    tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    carried = tmp_path / "carried"  # what the GPU check carries: the tokenizer files alone
    carried.mkdir()
    source = tokenizer_source(request)
    for name in TOKENIZER_FILES:
        (carried / name).write_bytes((source / name).read_bytes())
    monkeypatch.setenv(TOKENIZER_ENV, str(carried))
    assert tokenizer_source(request) == carried
    path = build_tiny_model(tmp_path / arch, carried, arch, seed=len(arch))
    assert {"config.json", "model.safetensors", *TOKENIZER_FILES} <= {p.name for p in path.iterdir()}
    config = json.loads((path / "config.json").read_text())
    assert {
        k: config[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_key_value_heads")
    } == {k: SHAPE[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_key_value_heads")}
    assert config["model_type"] == arch

    prompts = random_prompts([5, 40], seed=1)
    llm = LLM(str(path), device="cpu", attention_backend="torch", dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    outputs = [out.outputs[0] for out in llm.generate(prompts, params)]

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outputs, strict=True):
        assert len(out.token_ids) == NEW_TOKENS and all(0 <= t < VOCAB for t in out.token_ids)
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + list(out.token_ids)])).logits[0].float()
        expected = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
        assert out.logprobs is not None
        for pos, (token, chosen) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            row = expected[pos]
            best = int(row.argmax())
            assert token == best or row[best] - row[token] < TIE_GAP, (arch, pos, token, best)
            assert chosen.token_id == token
            assert abs(chosen.logprob - row[token].item()) <= LOGPROB_ATOL, (arch, pos)
