"""Issue 13 item 2 (per-step cost): the fewer-op paths give exactly the numbers of the paths they replace —
RMSNorm in low precision, decode attention through per-step K/V views and an additive mask, casts skipped in
the compact kernels."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend, attention_compute_dtype
from engine.models.layers import RMSNorm
from engine.models.quant import CompactLinearKernel, Int4Blocks, Int4Weight
from tests.engine.test_attention_ref import HEAD_DIM, allocate_blocks


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm.forward, verbatim in operations (the 7-op form the engine used before)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 576), (32, 576), (7, 3, 64)])
def test_low_precision_rms_norm_is_bit_identical_to_hf(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    norm = RMSNorm(shape[-1], 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=gen) * 0.5 + 1.0)
    x = (torch.randn(shape, generator=gen) * 3.0).to(dtype)
    out = norm(x)
    assert out.dtype == dtype
    assert torch.equal(out, hf_rms_norm(x, norm.weight, 1e-5))


def reference_decode(query: torch.Tensor, cache: torch.Tensor, tables: list[list[int]], seq_lens: list[int],
                     compute_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """The decode path as it was: gather each request's blocks (padded to the longest), bool key mask."""
    n, block_size = len(seq_lens), cache.shape[2]
    longest = max(seq_lens)
    num_blocks = -(-longest // block_size)
    blocks = torch.tensor([t[:num_blocks] + [0] * (num_blocks - len(t[:num_blocks])) for t in tables]).reshape(-1)
    both = cache.index_select(1, blocks).to(compute_dtype).flatten(1, 2)
    k = both[0].view(n, num_blocks * block_size, *cache.shape[3:])[:, :longest].transpose(1, 2)
    v = both[1].view(n, num_blocks * block_size, *cache.shape[3:])[:, :longest].transpose(1, 2)
    mask = None
    if n > 1:
        mask = (torch.arange(longest)[None, :] < torch.tensor(seq_lens)[:, None])[:, None, None, :]
    o = F.scaled_dot_product_attention(query.to(compute_dtype)[:, :, None, :], k, v, attn_mask=mask, scale=scale,
                                       enable_gqa=True)
    return o[:, :, 0, :].to(query.dtype)


@pytest.mark.parametrize(("dtype", "native_bf16"), [(torch.float32, False), (torch.bfloat16, True),
                                                    (torch.bfloat16, False)])
@pytest.mark.parametrize("seq_lens", [[9], [9, 30, 4]])
def test_decode_views_are_shared_by_layers_and_match_the_per_layer_gather(
        dtype: torch.dtype, native_bf16: bool, seq_lens: list[int]) -> None:
    """Three layers (three caches) of two steps: every layer's output equals its own gather + SDPA, bit for bit,
    though all read through the views built on the first layer of the step."""
    block_size, heads, kv_heads, scale = 4, 6, 2, HEAD_DIM ** -0.5
    tables, num_blocks = allocate_blocks([s + 1 for s in seq_lens], block_size, random.Random(len(seq_lens)))
    gen = torch.Generator().manual_seed(11)
    caches = [torch.randn(2, num_blocks, block_size, kv_heads, HEAD_DIM, generator=gen).to(dtype) for _ in range(3)]
    backend = TorchAttentionBackend(native_bf16=native_bf16)
    compute_dtype = attention_compute_dtype(caches[0], native_bf16)
    for step in range(2):
        lens = [s + step for s in seq_lens]
        meta = AttentionMetadata.build([1] * len(lens), lens, tables, block_size)
        for cache in caches:
            query = torch.randn(len(lens), heads, HEAD_DIM, generator=gen).to(dtype)
            out = backend.forward(query, cache, meta, scale)
            assert out.dtype == dtype
            assert torch.equal(out, reference_decode(query, cache, tables, lens, compute_dtype, scale))
        assert backend._views is not None and backend._views[0][0] is backend._plan  # rebuilt for the new step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compact_kernel_output_does_not_depend_on_the_skipped_casts(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (32, 64), generator=gen, dtype=torch.uint8)
    blocks = Int4Blocks(codes, torch.rand(32, 2, generator=gen), torch.randn(32, 2, generator=gen))
    bias = torch.randn(32, generator=gen)
    kernel = CompactLinearKernel(compact=Int4Weight.from_blocks(blocks), bias=bias)
    x = torch.randn(3, 64, generator=gen).to(dtype)
    out = kernel(x)
    assert out.dtype == dtype
    expected = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), kernel.compact.packed, 32,
                                                          kernel.compact.scales_and_zeros) + bias.to(torch.bfloat16)
    assert torch.equal(out, expected.to(dtype))
