"""CPU fast paths: packed / column-major linears, the plain-greedy sampler path, float32 attention over a
bfloat16 cache and the default thread count."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import kvscope.engine.attention.torch_backend as engine_attention
from kvscope.common import engine_defaults
from kvscope.engine.attention.backend import AttentionMetadata
from kvscope.engine.attention.torch_backend import TorchAttentionBackend, attention_compute_dtype
from kvscope.engine.models.layers import Linear, cpu_linear_kernel
from kvscope.engine.platform.cpu import prepare_for_cpu
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.worker.sampler import Sampler, SamplingMetadata
from tests.engine.test_attention_ref import HEAD_DIM, allocate_blocks, naive_attention
from tests.engine.test_models_tiny import ATOL, COMMON, hf_logits, make_pair, new_caches, paged_step, prompt


@pytest.mark.parametrize("rows", [0, 1, 3, 40])
def test_cpu_linear_kernel_equals_f_linear(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(7, 5, generator=gen), torch.randn(7, generator=gen)
    kernel = cpu_linear_kernel(weight, bias)
    assert kernel is not None and kernel.column_major.stride() == (1, 7)
    assert torch.equal(kernel.column_major, weight)
    x = torch.randn(rows, 5, generator=gen)
    with torch.inference_mode():
        out = kernel(x)
    assert out.shape == (rows, 7)
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=1e-5, rtol=0)


@pytest.mark.onednn_bf16
def test_cpu_linear_kernel_dtypes() -> None:
    bf16 = cpu_linear_kernel(torch.ones(4, 3, dtype=torch.bfloat16), None)
    assert bf16 is not None and bf16.column_major is None  # packed for every size
    with torch.inference_mode():
        assert bf16(torch.ones(2, 3, dtype=torch.bfloat16)).tolist() == [[3.0] * 4] * 2
    assert cpu_linear_kernel(torch.ones(4, 3, dtype=torch.float16), None) is None


def test_linear_keeps_f_linear_when_grad_is_enabled() -> None:
    layer = Linear(3, 2, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, 2.0, 3.0], [0.0, -1.0, 0.5]]))
    assert layer.prepare_for_cpu() and layer.weight.stride() == (1, 2)
    x = torch.tensor([[1.0, 1.0, 2.0]])
    out = layer(x)  # grad enabled: autograd-friendly F.linear
    assert out.requires_grad and out.tolist() == [[9.0, 0.0]]
    with torch.inference_mode():
        assert layer(x).tolist() == [[9.0, 0.0]]


@pytest.mark.parametrize("name", ["llama", "llama3-rope-bias-tied", "qwen2", "qwen3"])
def test_prepared_model_matches_hf(name: str) -> None:
    """After prepare_for_cpu: a packed prefill (two prompts), a one-row decode (column-major GEMV) and a
    two-row decode (packed) all give HF's logits."""
    pair = make_pair(name)
    assert prepare_for_cpu(pair.ours) == COMMON["num_hidden_layers"] * 4 + 1
    assert pair.ours.model.layers[1].mlp.down_proj.weight.stride() == (1, COMMON["hidden_size"])
    caches = new_caches(pair)
    blocks_a, blocks_b = [5, 2, 7, 0], [1, 4]
    a, b = prompt(1, 12), prompt(2, 5)
    out_a, out_b = paged_step(pair, caches, [(a, 0, blocks_a), (b, 0, blocks_b)])
    torch.testing.assert_close(out_a, hf_logits(pair, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(out_b, hf_logits(pair, b), atol=ATOL, rtol=0)
    a.append(int(out_a[-1].argmax()))
    b.append(int(out_b[-1].argmax()))
    (one,) = paged_step(pair, caches, [(a[-1:], len(a) - 1, blocks_a)])
    torch.testing.assert_close(one[0], hf_logits(pair, a)[-1], atol=ATOL, rtol=0)
    a.append(int(one[0].argmax()))
    out_a, out_b = paged_step(pair, caches, [(a[-1:], len(a) - 1, blocks_a), (b[-1:], len(b) - 1, blocks_b)])
    torch.testing.assert_close(out_a[0], hf_logits(pair, a)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(out_b[0], hf_logits(pair, b)[-1], atol=ATOL, rtol=0)


def _sampling(params: list[SamplingParams], vocab: int) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params=params,
        prompt_token_ids=[[]] * n,
        output_token_ids=[[]] * n,
        generators=[None] * n,
        eos_token_ids=[None] * n,
        vocab_size=vocab,
    )


def test_plain_greedy_fast_path_skips_logprobs() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    meta = _sampling([SamplingParams(temperature=0.0)] * 3, 50)
    assert meta.is_plain_greedy and not meta.needs_logprobs
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None and out.ranks is None
    assert out.top_token_ids.shape == (3, 0) and out.top_logprobs.shape == (3, 0)


def test_logprobs_zero_leaves_the_fast_path() -> None:
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(4))
    meta = _sampling([SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=0)], 50)
    assert meta.needs_logprobs and not meta.is_plain_greedy
    out = Sampler()(logits, meta)
    chosen = logits.argmax(-1)
    assert out.logprobs.tolist() == logits.log_softmax(-1).gather(1, chosen[:, None])[:, 0].tolist()
    assert out.ranks.tolist() == [1, 1]


@pytest.mark.parametrize("native_bf16", [False, True])
def test_bfloat16_cache_attention(native_bf16: bool) -> None:
    """Decode + chunked prefill over a bfloat16 cache: float32 math on the bfloat16 values (no AMX), or bf16
    attention itself (native_bf16, the AMX choice) within bf16 rounding; output in bf16 either way."""
    query_lens, seq_lens, block_size, heads, kv_heads = [1, 4, 1], [9, 13, 30], 4, 6, 2
    tables, num_blocks = allocate_blocks(seq_lens, block_size, random.Random(5))
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, HEAD_DIM, generator=gen).to(torch.bfloat16)
    expected_dtype = torch.bfloat16 if native_bf16 else torch.float32
    assert attention_compute_dtype(cache, native_bf16) == expected_dtype
    query = torch.randn(sum(query_lens), heads, HEAD_DIM, generator=gen).to(torch.bfloat16)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
    backend = TorchAttentionBackend(native_bf16=native_bf16)
    out = backend.forward(query, cache, meta, HEAD_DIM**-0.5)
    assert out.dtype == torch.bfloat16
    assert sorted(map(str, backend._buffers)) == sorted({"torch.bfloat16", str(expected_dtype)})
    refs, start = [], 0
    for q_len, seq_len, table in zip(query_lens, seq_lens, tables, strict=True):
        slots = [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        keys = cache[0].reshape(-1, kv_heads, HEAD_DIM)[slots].float()
        values = cache[1].reshape(-1, kv_heads, HEAD_DIM)[slots].float()
        refs.append(naive_attention(query[start : start + q_len].float(), keys, values, HEAD_DIM**-0.5))
        start += q_len
    atol, rtol = (2e-2, 2**-6) if native_bf16 else (1e-6, 2**-8)  # bf16 math / bf16 rounding of the output
    torch.testing.assert_close(out.float(), torch.cat(refs), atol=atol, rtol=rtol)


@pytest.mark.parametrize(("cpus", "expected"), [({0}, 1), ({0, 1}, 1), (set(range(8)), 7)])
def test_default_num_threads_leaves_one_cpu(
    monkeypatch: pytest.MonkeyPatch, cpus: set[int], expected: int
) -> None:
    monkeypatch.setattr(engine_defaults.os, "sched_getaffinity", lambda pid: cpus)
    assert engine_defaults.default_num_threads() == expected


def test_gather_buffers_are_reused_and_large_ones_released(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = torch.randn(2, 12, 4, 1, HEAD_DIM, generator=torch.Generator().manual_seed(6))
    backend = TorchAttentionBackend(native_bf16=False)
    query = torch.randn(2, 2, HEAD_DIM)
    backend.forward(query, cache, AttentionMetadata.build([1, 1], [9, 5], [[3, 1, 7], [2, 0]], 4), 1.0)
    kept = backend._buffers[torch.float32]
    assert kept.shape == (2 * 6 * 4 * HEAD_DIM,)  # K and V of 2 requests x 3 blocks (the longest) x 4 slots
    backend.forward(query[:1], cache, AttentionMetadata.build([1], [2], [[5]], 4), 1.0)
    assert backend._buffers[torch.float32] is kept  # a smaller step reuses it
    monkeypatch.setattr(engine_attention, "MAX_RETAINED_GATHER_BYTES", 0)
    backend.forward(query[:1], cache, AttentionMetadata.build([1], [2], [[5]], 4), 1.0)
    assert backend._buffers[torch.float32].shape == (
        2 * 1 * 4 * HEAD_DIM,
    )  # the large one dropped, a fitting one made


@pytest.mark.slow
def test_bfloat16_engine_answers_like_float32(llm) -> None:
    """The bf16 option (packed bf16 matmuls, float32 attention) on the real model: same greedy answer."""
    from kvscope.engine.llm import LLM

    params = SamplingParams(temperature=0.0, max_tokens=24)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    bf16 = LLM("smollm2-135m", kv_cache_memory=32 << 20, dtype="bfloat16")
    assert bf16.engine.model.model.embed_tokens.weight.dtype == torch.bfloat16
    [out] = bf16.chat(messages, params)
    [reference] = llm.chat(messages, params)
    assert out.outputs[0].text == "The capital of France is Paris."
    assert (
        out.outputs[0].token_ids == reference.outputs[0].token_ids == [504, 3575, 282, 4649, 314, 7042, 30, 2]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_is_bit_identical_to_rotate_half(dtype: torch.dtype) -> None:
    """The 4-op RoPE (roll + signed sin, tables built once per step) gives exactly HF's x·cos +
    rotate_half(x)·sin."""
    from kvscope.engine.models.layers import (
        RopeConfig,
        RotaryEmbedding,
        apply_rope,
        apply_rotary,
        rope_tables,
    )

    positions = torch.tensor([0, 1, 5, 37, 200])
    cos, sin = RotaryEmbedding(HEAD_DIM, RopeConfig(theta=100000.0))(positions, dtype)
    x = torch.randn(5, 3, HEAD_DIM, generator=torch.Generator().manual_seed(9)).to(dtype)
    got = apply_rope(x, *rope_tables(cos, sin))
    assert got.dtype == dtype
    assert torch.equal(got, apply_rotary(x, cos, sin))
