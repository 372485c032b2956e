"""Our paged Llama-family models vs HF transformers on tiny random-weight configs (float32, 1e-4 absolute)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import transformers

from kvscope.engine.attention.backend import AttentionMetadata
from kvscope.engine.attention.forward_context import set_forward_context
from kvscope.engine.attention.torch_backend import TorchAttentionBackend
from kvscope.engine.models import get_model_class
from kvscope.engine.models.llama import LlamaForCausalLM

BLOCK_SIZE = 4
NUM_BLOCKS = 24
ATOL = 1e-4
COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, tie_word_embeddings=False),
    "llama3-rope-bias-tied": lambda: transformers.LlamaConfig(
        **COMMON, tie_word_embeddings=True, attention_bias=True, mlp_bias=True, rope_parameters=LLAMA3_ROPE
    ),
    "mistral": lambda: transformers.MistralConfig(**COMMON, tie_word_embeddings=False, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False),
}


@dataclass
class Pair:
    hf: torch.nn.Module
    ours: LlamaForCausalLM
    num_kv_heads: int
    head_dim: int


def make_pair(name: str) -> Pair:
    """Seeded HF model with non-trivial weights (norms ≠ 1, biases ≠ 0) and our model loaded from it."""
    config = CONFIGS[name]()
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for pname, param in hf.named_parameters():
            param.normal_(1.0, 0.2) if "norm" in pname else param.normal_(0.0, 0.15)
    hf_config = config.to_dict()
    ours = get_model_class(hf_config)(hf_config).eval()
    assert type(ours).__name__ == type(hf).__name__
    used = ours.load_weights(hf.state_dict().items())
    assert "model.layers.1.mlp.up_proj.weight" in used
    head_dim = hf_config.get("head_dim") or config.hidden_size // config.num_attention_heads
    return Pair(hf, ours, config.num_key_value_heads, head_dim)


def new_caches(pair: Pair) -> list[torch.Tensor]:
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, pair.num_kv_heads, pair.head_dim)
    return [torch.zeros(shape) for _ in range(COMMON["num_hidden_layers"])]


@torch.inference_mode()
def paged_step(
    pair: Pair, caches: list[torch.Tensor], chunks: list[tuple[list[int], int, list[int]]]
) -> list[torch.Tensor]:
    """One packed step; each chunk is (token_ids, num_computed_tokens, block_ids). Returns per-chunk
    logits."""
    q_lens = [len(tokens) for tokens, _, _ in chunks]
    seq_lens = [done + len(tokens) for tokens, done, _ in chunks]
    meta = AttentionMetadata.build(q_lens, seq_lens, [blocks for _, _, blocks in chunks], BLOCK_SIZE)
    input_ids = torch.tensor([t for tokens, _, _ in chunks for t in tokens])
    positions = torch.cat([torch.arange(done, done + len(tokens)) for tokens, done, _ in chunks])
    with set_forward_context(meta, caches, TorchAttentionBackend()):
        hidden = pair.ours(input_ids, positions)
    logits = pair.ours.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (len(input_ids), COMMON["vocab_size"])
    return list(logits.split(q_lens))


@torch.inference_mode()
def hf_logits(pair: Pair, tokens: list[int]) -> torch.Tensor:
    return pair.hf(torch.tensor([tokens])).logits[0].float()


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(
        3, COMMON["vocab_size"], (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request: pytest.FixtureRequest) -> Pair:
    return make_pair(request.param)


def test_prefill_then_greedy_decode_matches_hf(pair: Pair) -> None:
    caches = new_caches(pair)
    blocks = [5, 2, 7, 0, 3, 9, 1, 11]  # 32 tokens, deliberately out of order
    tokens = prompt(1, 12)
    (logits,) = paged_step(pair, caches, [(tokens, 0, blocks)])
    torch.testing.assert_close(logits, hf_logits(pair, tokens), atol=ATOL, rtol=0)
    ours, reference = list(tokens), list(tokens)
    for _ in range(20):
        ours.append(int(logits[-1].argmax()))
        expected = hf_logits(pair, reference)[-1]
        reference.append(int(expected.argmax()))
        (logits,) = paged_step(pair, caches, [(ours[-1:], len(ours) - 1, blocks)])
        torch.testing.assert_close(logits[0], hf_logits(pair, ours)[-1], atol=ATOL, rtol=0)
    assert ours == reference
    assert len(set(ours[12:])) > 1  # the model is not degenerate: greedy output varies


def test_packed_batch_matches_solo(pair: Pair) -> None:
    """Step 1: A's first chunk (8) + B's prompt (7); step 2: A's last 4 prompt tokens + B decode;
    then 4 steps decoding both. Every logit row equals HF on that sequence alone."""
    caches = new_caches(pair)
    blocks_a, blocks_b = [1, 6, 3, 10, 12], [4, 0, 8]
    a, b = prompt(2, 12), prompt(3, 7)
    out_a, out_b = paged_step(pair, caches, [(a[:8], 0, blocks_a), (b, 0, blocks_b)])
    torch.testing.assert_close(out_a, hf_logits(pair, a[:8]), atol=ATOL, rtol=0)
    torch.testing.assert_close(out_b, hf_logits(pair, b), atol=ATOL, rtol=0)
    b.append(int(out_b[-1].argmax()))
    out_a, out_b = paged_step(pair, caches, [(a[8:], 8, blocks_a), (b[-1:], len(b) - 1, blocks_b)])
    torch.testing.assert_close(out_a, hf_logits(pair, a)[8:], atol=ATOL, rtol=0)
    torch.testing.assert_close(out_b[0], hf_logits(pair, b)[-1], atol=ATOL, rtol=0)
    for _ in range(4):
        a.append(int(out_a[-1].argmax()))
        b.append(int(out_b[-1].argmax()))
        out_a, out_b = paged_step(
            pair, caches, [(a[-1:], len(a) - 1, blocks_a), (b[-1:], len(b) - 1, blocks_b)]
        )
        torch.testing.assert_close(out_a[0], hf_logits(pair, a)[-1], atol=ATOL, rtol=0)
        torch.testing.assert_close(out_b[0], hf_logits(pair, b)[-1], atol=ATOL, rtol=0)
    assert (len(a), len(b)) == (16, 12)


def test_load_weights_reports_missing_and_unknown() -> None:
    pair = make_pair("llama")
    state = pair.hf.state_dict()
    model = type(pair.ours)(pair.hf.config.to_dict())
    partial = {k: v for k, v in state.items() if k != "model.layers.0.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match=r"missing 1 tensors.*qkv_proj.weight\[1\]"):
        model.load_weights(partial.items())
    with pytest.raises(KeyError, match="model.layers.9.mlp.up_proj.weight"):
        model.load_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(96, 64))])


def test_unsupported_configs_raise() -> None:
    config = transformers.LlamaConfig(
        **COMMON, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}
    )
    with pytest.raises(ValueError, match="unsupported rope scaling 'yarn'"):
        LlamaForCausalLM(config.to_dict())
    with pytest.raises(ValueError, match="unsupported architecture"):
        get_model_class({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
