"""Harness of the speculative-sampling distribution test (tests/engine/test_spec_decode_distribution.py): a
tiny random-weight Llama with a 16-token vocabulary saved as a model folder, its exact conditional
probabilities of sampled tokens (HF transformers, teacher forcing) and a chi-square goodness-of-fit
p-value."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

VOCAB = 16
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
LM_HEAD_STD = 0.6
"""Spread of the output layer: peaked next-token distributions (a few likely tokens), so drafts copied from
the model's own greedy continuation are often accepted and runs of 2-3 accepted tokens occur."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class TinyModel:
    hf: transformers.PreTrainedModel
    path: Path


def build_tiny_model(out: Path, tokenizer_dir: Path, seed: int = 0) -> TinyModel:
    """Seeded random weights saved as an HF folder (config.json, model.safetensors) with the test model's
    tokenizer files (the engine needs one; only ids < VOCAB are ever produced)."""
    config = transformers.LlamaConfig(**CONFIG)
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
    return TinyModel(hf, out)


@torch.inference_mode()
def next_token_probs(hf: transformers.PreTrainedModel, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
    """``[len(contexts), VOCAB]`` float64 softmax of the last position's logits (temperature 1); the contexts
    have one length."""
    logits = hf(torch.tensor([list(c) for c in contexts])).logits[:, -1].double()
    return torch.softmax(logits, dim=-1)


def greedy_prompt(hf: transformers.PreTrainedModel, length: int) -> list[int]:
    """Every token once (so that the n-gram lookup always finds the last token earlier), then the model's
    greedy continuation up to ``length`` tokens: drafts copied from it are what the model tends to say."""
    tokens = list(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1)).tolist())
    while len(tokens) < length:
        tokens.append(int(next_token_probs(hf, [tokens])[0].argmax()))
    return tokens


@torch.inference_mode()
def conditional_probs(
    hf: transformers.PreTrainedModel, prompt: Sequence[int], outputs: Sequence[Sequence[int]]
) -> torch.Tensor:
    """``[len(outputs), m, VOCAB]`` float64: the model's distribution (temperature 1) of output token ``j`` of
    each sequence given the prompt and that sequence's tokens before it (teacher forcing, one batched pass);
    all outputs have ``m`` tokens."""
    m = len(outputs[0])
    ids = torch.tensor([list(prompt) + list(o) for o in outputs])
    logits = hf(ids).logits[:, len(prompt) - 1 : len(prompt) - 1 + m].double()
    return torch.softmax(logits, dim=-1)


def sequential_chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, float, int]:
    """Goodness of fit of sampled tokens to the distributions they were sampled from, one sample per
    (sequence, position). ``tokens``: ``[n]`` ids, ``probs``: ``[n, VOCAB]`` each sample's exact conditional
    distribution. Observed minus expected counts per token, ``S = Σ_i (onehot(t_i) − p_i)``, is a sum of
    martingale differences with conditional covariance ``diag(p_i) − p_i p_iᵀ``; with ``C`` their sum,
    ``Sᵀ C⁻¹ S`` over the first VOCAB−1 tokens (S sums to 0) is asymptotically chi-square with VOCAB−1 degrees
    of freedom (martingale CLT) — Pearson's statistic, generalised to per-sample probabilities (with one
    distribution for all samples it is exactly Pearson's). Returns (statistic, p-value, df)."""
    onehot = torch.nn.functional.one_hot(tokens, probs.shape[1]).double()
    s = (onehot - probs).sum(0)[:-1]
    p = probs[:, :-1]
    cov = torch.diag(p.sum(0)) - p.T @ p
    stat = float(s @ torch.linalg.solve(cov, s))
    df = probs.shape[1] - 1
    p_value = float(
        torch.special.gammaincc(
            torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
        )
    )
    return stat, p_value, df
