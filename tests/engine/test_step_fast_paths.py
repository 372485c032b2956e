"""Issue 13 item 2 (per-step cost): the fewer-op paths give exactly the numbers of the paths they replace —
RMSNorm in low precision, decode attention through per-step K/V views and an additive mask, casts skipped in
the compact kernels."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kvscope.engine.attention.backend import AttentionMetadata
from kvscope.engine.attention.resident_kv import ResidentDecodeKV
from kvscope.engine.attention.torch_backend import TorchAttentionBackend, attention_compute_dtype
from kvscope.engine.models.layers import RMSNorm
from kvscope.engine.weights.quant import CompactLinearKernel, Int4Blocks, Int4Weight
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


def reference_decode(
    query: torch.Tensor,
    cache: torch.Tensor,
    tables: list[list[int]],
    seq_lens: list[int],
    compute_dtype: torch.dtype,
    scale: float,
) -> torch.Tensor:
    """The decode path as it was: gather each request's blocks (padded to the longest), bool key mask."""
    n, block_size = len(seq_lens), cache.shape[2]
    longest = max(seq_lens)
    num_blocks = -(-longest // block_size)
    blocks = torch.tensor(
        [t[:num_blocks] + [0] * (num_blocks - len(t[:num_blocks])) for t in tables]
    ).reshape(-1)
    both = cache.index_select(1, blocks).to(compute_dtype).flatten(1, 2)
    k = both[0].view(n, num_blocks * block_size, *cache.shape[3:])[:, :longest].transpose(1, 2)
    v = both[1].view(n, num_blocks * block_size, *cache.shape[3:])[:, :longest].transpose(1, 2)
    mask = None
    if n > 1:
        mask = (torch.arange(longest)[None, :] < torch.tensor(seq_lens)[:, None])[:, None, None, :]
    o = F.scaled_dot_product_attention(
        query.to(compute_dtype)[:, :, None, :], k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return o[:, :, 0, :].to(query.dtype)


@pytest.mark.parametrize(
    ("dtype", "native_bf16"), [(torch.float32, False), (torch.bfloat16, True), (torch.bfloat16, False)]
)
@pytest.mark.parametrize("seq_lens", [[9], [9, 30, 4]])
def test_decode_views_are_shared_by_layers_and_match_the_per_layer_gather(
    dtype: torch.dtype, native_bf16: bool, seq_lens: list[int]
) -> None:
    """Three layers (three caches) of two steps: every layer's output equals its own gather + SDPA, bit for
    bit, though all read through the views built on the first layer of the step."""
    block_size, heads, kv_heads, scale = 4, 6, 2, HEAD_DIM**-0.5
    tables, num_blocks = allocate_blocks([s + 1 for s in seq_lens], block_size, random.Random(len(seq_lens)))
    gen = torch.Generator().manual_seed(11)
    caches = [
        torch.randn(2, num_blocks, block_size, kv_heads, HEAD_DIM, generator=gen).to(dtype) for _ in range(3)
    ]
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
        assert (
            backend._views is not None and backend._views[0][0] is backend._plan
        )  # rebuilt for the new step


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
    expected = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.to(torch.bfloat16), kernel.compact.packed, 32, kernel.compact.scales_and_zeros
    ) + bias.to(torch.bfloat16)
    assert torch.equal(out, expected.to(dtype))


@pytest.mark.parametrize(
    ("dtype", "native_bf16"), [(torch.float32, False), (torch.bfloat16, True), (torch.bfloat16, False)]
)
def test_resident_decode_kv_updates_in_place_and_equals_a_full_gather(
    dtype: torch.dtype, native_bf16: bool
) -> None:
    """12 decode steps over 2 layers: rows cross block boundaries, a row joins (the batch changes), the
    longest row outgrows the padded width. Each step writes the new tokens' K/V first, as the model does;
    every output equals a fresh gather + SDPA bit for bit, and only steady steps update in place."""
    block_size, heads, kv_heads, scale = 4, 4, 2, HEAD_DIM**-0.5
    num_blocks = 40
    order = list(range(num_blocks))
    random.Random(2).shuffle(order)
    free = iter(order)
    tables = [[next(free) for _ in range(3)], [next(free) for _ in range(2)]]  # room for 12 and 8 tokens
    lens = [9, 5]
    gen = torch.Generator().manual_seed(4)
    caches = [
        torch.randn(2, num_blocks, block_size, kv_heads, HEAD_DIM, generator=gen).to(dtype) for _ in range(2)
    ]
    backend = TorchAttentionBackend(native_bf16=native_bf16)
    backend.resident = ResidentDecodeKV(max_bytes=1 << 30, min_bytes=0)
    compute_dtype = attention_compute_dtype(caches[0], native_bf16)
    kinds = []
    for step in range(12):
        if step == 5:  # a new request joins
            tables.append([next(free) for _ in range(2)])
            lens.append(3)
        lens = [n + 1 for n in lens]
        for table, n in zip(tables, lens, strict=True):
            while len(table) * block_size < n:
                table.append(next(free))
        meta = AttentionMetadata.build([1] * len(lens), lens, tables, block_size)
        before = (backend.resident.full_gathers, backend.resident.incremental_updates)
        for cache in caches:
            k, v = (torch.randn(len(lens), kv_heads, HEAD_DIM, generator=gen) for _ in range(2))
            backend.write_kv(k, v, cache, meta.slot_mapping)
            query = torch.randn(len(lens), heads, HEAD_DIM, generator=gen).to(dtype)
            out = backend.forward(query, cache, meta, scale)
            assert torch.equal(out, reference_decode(query, cache, tables, lens, compute_dtype, scale)), step
        full = backend.resident.full_gathers - before[0]
        kinds.append("full" if full else "in place")
        assert full + backend.resident.incremental_updates - before[1] == 2
    # step 0: first; 3: the longest row (13 tokens) needs a 4th block; 5: a row joins; 7: 17 tokens, 5th block
    assert kinds == [
        "full",
        "in place",
        "in place",
        "full",
        "in place",
        "full",
        "in place",
        "full",
        "in place",
        "in place",
        "in place",
        "full",
    ]


def test_resident_decode_kv_respects_its_byte_bounds() -> None:
    cache = torch.zeros(2, 8, 4, 1, HEAD_DIM)
    tables = torch.tensor([[1, 2]])
    resident = ResidentDecodeKV(max_bytes=1 << 20, min_bytes=1 << 20)
    resident.begin_step(tables, torch.tensor([5]), torch.tensor([8]), 4)
    assert resident.gathered(cache, torch.float32) is None  # 2 KB gather: below min_bytes
    resident = ResidentDecodeKV(max_bytes=3 * 2 * 2 * 4 * HEAD_DIM * 4, min_bytes=0)  # room for 3 layers
    resident.begin_step(tables, torch.tensor([5]), torch.tensor([8]), 4)
    layers = [torch.zeros(2, 8, 4, 1, HEAD_DIM) for _ in range(4)]
    assert [resident.gathered(c, torch.float32) is not None for c in layers] == [True, True, True, False]
    assert resident.nbytes == 3 * 2 * 2 * 4 * HEAD_DIM * 4
    resident.begin_step(None, None, None, 4)  # a prefill step: nothing resident is used
    assert resident.gathered(layers[0], torch.float32) is None


def test_a_step_continues_the_previous_one_only_one_token_longer_on_the_same_blocks() -> None:
    from kvscope.engine.attention.resident_kv import _continues, _StepState

    prev = _StepState(step=1, tables=torch.tensor([[3, 4, 0], [5, 6, 7]]), seq_lens=torch.tensor([8, 10]))
    assert _continues(
        prev, torch.tensor([[3, 4, 9], [5, 6, 7]]), torch.tensor([9, 11]), 4
    )  # row 0: new block
    assert not _continues(prev, torch.tensor([[3, 4, 0], [5, 6, 7]]), torch.tensor([10, 12]), 4)  # +2
    assert not _continues(
        prev, torch.tensor([[3, 4, 0], [5, 6, 7]]), torch.tensor([8, 10]), 4
    )  # same lengths
    assert not _continues(
        prev, torch.tensor([[3, 2, 0], [5, 6, 7]]), torch.tensor([9, 11]), 4
    )  # a held block moved
    assert not _continues(prev, torch.tensor([[3, 4], [5, 6]]), torch.tensor([9, 11]), 4)  # another width


@pytest.mark.slow
def test_engine_greedy_tokens_are_the_same_with_and_without_resident_decode_kv(llm) -> None:
    """SmolLM2 float32, 24 prompts decoding together (~5 MB of K/V per layer: resident): the same greedy
    tokens as with every layer gathering every step."""
    from kvscope.engine.bench import random_prompts
    from kvscope.engine.sampling_params import SamplingParams

    backend = llm.engine.runner.backend
    prompts = random_prompts(24, 40, llm.engine.vocab_size, 8)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    try:
        backend.resident = ResidentDecodeKV(min_bytes=1 << 62)  # never resident: the per-layer gather
        gathered = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        backend.resident = resident = ResidentDecodeKV()
        kept = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        backend.resident = ResidentDecodeKV()
    assert kept == gathered
    assert (
        resident.incremental_updates >= 30 * 10
    )  # most of the 19 decode steps updated all 30 layers in place
