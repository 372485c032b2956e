"""kvscope's C++ elementwise kernels for bfloat16 activations (kernels/csrc/cpu_elementwise.cpp) against the
torch ops they replace (engine/models/layers.py, engine/models/llama.py), and where the model uses them.

Exactness: the residual add and RoPE round exactly where torch's ops do, and SwiGLU looks F.silu up in a table
that torch computed, so they are bit-identical; RMSNorm sums x² in another order, so a rare element may differ
from torch's by the rounding of one bfloat16 step: at most 2 units in the last place, ≥ 99.9 % of elements
equal.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvscope.common.models.cache import cache_root
from kvscope.engine.llm import LLM
from kvscope.engine.models.layers import RMSNorm, apply_rope, rope_tables
from kvscope.engine.models.llama import MLP, Attention
from kvscope.engine.platform.cpu import load_cpu_kernels
from kvscope.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.cpu_kernels
ROWS = (1, 3, 17, 128, 513)


@pytest.fixture(scope="module", autouse=True)
def cpu_kernels():
    result = load_cpu_kernels(cache_root())
    assert result.ok, result.detail
    return result


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance of two bfloat16 tensors in units in the last place (same-sign values: bit patterns differ
    by it)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def assert_near_torch(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == ref.dtype == torch.bfloat16 and got.shape == ref.shape
    distance = ulps(got, ref)
    assert distance.max().item() <= 2
    assert (distance == 0).float().mean().item() >= 0.999


@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_and_the_fused_residual_add(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = (3 * torch.randn(rows, 576, generator=gen)).bfloat16()
    residual = torch.randn(rows, 576, generator=gen).bfloat16()
    weight = (0.5 + torch.rand(576, generator=gen)).bfloat16()
    ops = torch.ops.kvscope_cpu
    assert_near_torch(ops.rms_norm(x, weight, 1e-5), F.rms_norm(x, (576,), None, 1e-5) * weight)
    total, normed = ops.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, x + residual)
    tiny = torch.full((rows, 576), 1e-39).bfloat16()  # float32 denormals: rounded as c10 does, not flushed
    assert (
        torch.equal(ops.add_rms_norm(tiny, tiny, weight, 1e-5)[0], tiny + tiny) and (tiny + tiny).ne(0).all()
    )
    assert_near_torch(normed, F.rms_norm(x + residual, (576,), None, 1e-5) * weight)


@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul_is_torchs_bit_for_bit(rows: int) -> None:
    gate_up = (4 * torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows))).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(torch.ops.kvscope_cpu.silu_and_mul(gate_up), F.silu(gate) * up)


def test_silu_and_mul_over_every_bfloat16_gate() -> None:
    """All 65,536 bfloat16 bit patterns as the gate (the lookup's whole table, its last entry included;
    denormal products, which VCVTNEPS2BF16 alone would flush to zero), times random up values: the same
    bits as torch's, NaN where torch's is NaN (the 254 NaN patterns and silu(-inf) = -inf · 0)."""
    gate = (
        torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32)
        .to(torch.int16)
        .view(torch.bfloat16)
        .view(-1, 1024)
    )
    up = torch.randn(gate.shape, generator=torch.Generator().manual_seed(7)).bfloat16()
    got = torch.ops.kvscope_cpu.silu_and_mul(torch.cat((gate, up), dim=1))
    ref = F.silu(gate) * up
    nan = ref.isnan()
    assert torch.equal(got.isnan(), nan) and nan.sum().item() == 255
    assert torch.equal(got[~nan], ref[~nan])


@pytest.mark.parametrize("tokens", ROWS)
def test_rope_is_apply_rope_bit_for_bit_on_the_qkv_view(tokens: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    qkv = (3 * torch.randn(tokens, 960, generator=gen)).bfloat16()
    qk = qkv[:, :768].view(tokens, 12, 64)  # q and k heads of the fused projection: rows 960 apart
    angles = 100 * torch.rand(tokens, 64, generator=gen)
    cos, sin = rope_tables(angles.cos().bfloat16(), angles.sin().bfloat16())
    got = torch.ops.kvscope_cpu.rope(qk, cos, sin)
    assert got.is_contiguous() and torch.equal(got, apply_rope(qk, cos, sin))


def test_bad_inputs_raise_instead_of_reading_out_of_bounds() -> None:
    ops = torch.ops.kvscope_cpu
    x = torch.randn(4, 576).bfloat16()
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.rms_norm(x.float(), torch.ones(576).bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(x, torch.ones(512).bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="same shape"):
        ops.add_rms_norm(x, x[:2], torch.ones(576).bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.silu_and_mul(torch.randn(4, 6144).bfloat16()[:, ::2])
    with pytest.raises(RuntimeError, match="tables"):
        ops.rope(
            x[:, :512].reshape(4, 8, 64), torch.ones(3, 1, 64).bfloat16(), torch.ones(4, 1, 64).bfloat16()
        )


def _flags(llm: LLM) -> set[bool]:
    return {m.cpu_op for m in llm.engine.model.modules() if isinstance(m, (RMSNorm, MLP, Attention))}


NOISE = 0.05
"""Largest logprob difference allowed between kvscope's ops and torch's in one bfloat16 model."""


@pytest.mark.onednn_bf16  # elsewhere (AVX2) the default dtype is float32, which runs none of these ops
def test_the_default_format_uses_them_and_its_tokens_match_torchs_ops() -> None:
    """bfloat16/gguf with kvscope's kernels turns the ops on. Teacher-forced over the prompt and a greedy
    continuation, the same model with the ops switched off gives every token a logprob within :data:`NOISE`,
    and the same top token at every position unless torch's top two are within :data:`NOISE` (a near-tie).

    Teacher-forced, not two greedy generations compared: generation decodes through the fused decode step (its
    Q8_0 LM head, kernels chosen by the start-up probe), and on the 2-vCPU AMD EPYC two runs of the old test
    disagreed at the sixth greedy token, where the top token leads the next two by 0.125. Prefix caching off:
    a cached block has no prompt logprobs."""
    llm = LLM(
        "smollm2-135m",
        dtype="bfloat16",
        quantization="gguf",
        kv_cache_memory=32 << 20,
        num_threads=2,
        enable_prefix_caching=False,
    )
    assert _flags(llm) == {True}
    model = llm.engine.model
    prompt = llm.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    continuation = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    tokens = prompt + continuation.outputs[0].token_ids
    forced = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    with_ops = llm.generate([tokens], forced)[0].prompt_logprobs[1:]
    for module in model.modules():
        if isinstance(module, (RMSNorm, MLP, Attention)):
            module.cpu_op = False
    assert _flags(llm) == {False}
    with_torch = llm.generate([tokens], forced)[0].prompt_logprobs[1:]
    assert len(with_ops) == len(with_torch) == len(tokens) - 1
    assert max(abs(a.logprob - b.logprob) for a, b in zip(with_ops, with_torch, strict=True)) < NOISE
    for ours, theirs in zip(with_ops, with_torch, strict=True):
        (top, best), (_, second) = theirs.top[:2]
        assert ours.top[0][0] == top or best - second < NOISE


def test_torch_kernels_and_float32_keep_torchs_ops() -> None:
    assert _flags(
        LLM(
            "smollm2-135m",
            dtype="bfloat16",
            quantization="gguf",
            kv_cache_memory=16 << 20,
            cpu_kernels="torch",
        )
    ) == {False}
    assert _flags(LLM("smollm2-135m", dtype="float32", quantization="none", kv_cache_memory=16 << 20)) == {
        False
    }
