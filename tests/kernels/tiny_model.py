"""A tiny random-weight Llama or Qwen2 saved as a model folder, for engine tests on a GPU machine that has no
network and no model cache (scripts/gpu_check.sh): only a tokenizer travels, the weights are made where the
test runs (as tests/engine/spec_distribution.py makes its model). Seeded, so both attention backends load
bit-identical weights.

The tokenizer folder is ``$KVSCOPE_TEST_TOKENIZER_DIR`` (tokenizer.json and tokenizer_config.json; the GPU
check sets it to the copy it carries), else the test model's converted folder (the ``model_dir`` fixture,
which pulls it on first use). The model's vocabulary is :data:`VOCAB` ids: prompts are token ids below it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import transformers

TOKENIZER_ENV = "KVSCOPE_TEST_TOKENIZER_DIR"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
VOCAB = 1024
MAX_POSITIONS = 8192
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,  # head_dim 32: the Triton kernels need a power of two in [16, 256]
    num_key_value_heads=2,  # GQA group 2
    max_position_embeddings=MAX_POSITIONS,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
CONFIGS = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}
"""The architectures :func:`build_tiny_model` makes (Qwen2: biases on q, k and v)."""
LM_HEAD_STD = 0.6
"""Spread of the output layer: next-token logits with a standard deviation of about 7, so the top two of
greedy decoding are rarely within float32 noise of each other."""


def tokenizer_source(request: pytest.FixtureRequest) -> Path:
    """The tokenizer folder to copy: ``$KVSCOPE_TEST_TOKENIZER_DIR`` when set (it must hold
    :data:`TOKENIZER_FILES`), else the ``model_dir`` fixture's folder."""
    carried = os.environ.get(TOKENIZER_ENV)
    if not carried:
        return request.getfixturevalue("model_dir")
    path = Path(carried)
    missing = [name for name in TOKENIZER_FILES if not (path / name).is_file()]
    assert not missing, f"${TOKENIZER_ENV}={path} lacks {missing}"
    return path


def build_tiny_model(out: Path, tokenizer_dir: Path, architecture: str = "llama", seed: int = 0) -> Path:
    """Seeded random weights of ``architecture`` (a key of :data:`CONFIGS`) saved at ``out`` as an HF folder
    (config.json, float32 model.safetensors) with ``tokenizer_dir``'s tokenizer files; returns ``out``."""
    config = CONFIGS[architecture](**SHAPE)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.2)
            else:
                param.normal_(0.0, LM_HEAD_STD if name == "lm_head.weight" else 0.15)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out / name)
    return out


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    """One prompt of token ids (below :data:`VOCAB`) per length."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]
