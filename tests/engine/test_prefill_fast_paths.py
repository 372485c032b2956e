"""Issue 13 (idle TTFT): the prefill paths give exactly the numbers of the paths they replace — packed
matmuls run with their rows padded to a multiple of 16 (bounded oneDNN shapes, warmed by
``LlamaForCausalLM.warm_up``), and a fresh prefill attends the K/V it just wrote instead of gathering them
back from the cache."""

from __future__ import annotations

import random

import pytest
import torch

import kvscope.engine.models.layers as layers
from kvscope.engine.attention.backend import AttentionMetadata
from kvscope.engine.attention.forward_context import set_forward_context
from kvscope.engine.attention.torch_backend import TorchAttentionBackend
from kvscope.engine.models.layers import Linear, aligned_rows, cpu_linear_kernel, packed_linear_kernel
from kvscope.engine.platform.cpu import prepare_for_cpu, warm_up_prefill
from kvscope.engine.weights.quant import CompactLinearKernel, Int8Weight
from tests.engine.test_attention_ref import allocate_blocks
from tests.engine.test_models_tiny import make_pair


def test_aligned_rows_pads_only_prefill_sizes_to_16() -> None:
    assert [aligned_rows(n) for n in (1, 4, 32, 64, 65, 80, 81, 100, 128, 129, 1000, 1024)] == [
        1,
        4,
        32,
        64,
        80,
        80,
        96,
        112,
        128,
        144,
        1008,
        1024,
    ]


class RecordingKernel:
    """A compact-style kernel (dense above ``max_compact_rows``) that records the rows it is called with."""

    def __init__(self, dense: layers.CpuLinearKernel) -> None:
        self.dense = dense
        self.max_compact_rows = 4
        self.rows: list[int] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return self.dense(x)


@pytest.mark.onednn_bf16
def test_linear_pads_rows_of_the_dense_path_and_slices_them_off() -> None:
    weight = torch.randn(48, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    kernel = RecordingKernel(packed_linear_kernel(weight, None))
    linear = Linear(32, 48, bias=False)
    linear.use_compact(kernel)
    with torch.inference_mode():
        shapes = [
            tuple(linear.forward(torch.randn(rows, 32).to(torch.bfloat16)).shape) for rows in (3, 64, 65, 100)
        ]
    assert shapes == [(3, 48), (64, 48), (65, 48), (100, 48)]
    assert kernel.rows == [3, 64, 80, 112]


def _padded_and_plain(dtype: torch.dtype, out_features: int, in_features: int):
    """(padded, unpadded) outputs of a packed SmolLM2-shaped matmul for every padded row count 65…300 (step
    9)."""
    gen = torch.Generator().manual_seed(out_features + in_features)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(dtype)
    kernel = cpu_linear_kernel(weight, None)
    linear = Linear(in_features, out_features, bias=False)
    linear.cpu_kernel = kernel
    with torch.inference_mode():
        for rows in range(65, 301, 9):
            x = torch.randn(rows, in_features, generator=gen).to(dtype)
            yield rows, linear.forward(x), kernel(x)


SHAPES = [(960, 576), (3072, 576), (576, 1536)]


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_padded_float32_matmul_is_bit_identical(out_features: int, in_features: int) -> None:
    """Rows of a matmul are independent; above 64 rows oneDNN's float32 result for a row does not depend on
    how many rows come with it (SmolLM2's projection shapes): the float32 path keeps its exact numbers."""
    for rows, padded, plain in _padded_and_plain(torch.float32, out_features, in_features):
        assert torch.equal(padded, plain), rows


@pytest.mark.onednn_bf16
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_padded_bfloat16_matmul_differs_by_at_most_one_rounding(out_features: int, in_features: int) -> None:
    """bfloat16: oneDNN may pick another blocking for the padded row count (seen at 245 → 256 rows of
    576×1536), i.e. another float32 summation order before the one rounding to bfloat16, so an output may
    land on the neighbouring bfloat16 value: at most one bfloat16 step (2⁻⁷ relative) apart, plus 2⁻¹⁶
    absolute for outputs near zero, where the float32 reordering error (~K·2⁻²⁴ of the terms' magnitude,
    seen: 6e-8 at 7e-7) exceeds the output's own step. Outputs here are O(1)…O(10)."""
    for rows, padded, plain in _padded_and_plain(torch.bfloat16, out_features, in_features):
        a, b = padded.float(), plain.float()
        bound = torch.maximum(a.abs(), b.abs()) * 2.0**-7 + 2.0**-16
        assert bool(((a - b).abs() <= bound).all()), rows


def test_compact_layer_padded_dense_path_is_bit_identical() -> None:
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(96, 64, generator=gen) * 0.1
    bias = torch.randn(96, generator=gen)
    dense = packed_linear_kernel(weight.to(torch.bfloat16), bias.to(torch.bfloat16))
    kernel = CompactLinearKernel(
        compact=Int8Weight.from_float(weight),
        bias=bias,
        dense=dense,
        dense_dtype=torch.bfloat16,
        max_compact_rows=4,
    )
    linear = Linear(64, 96)
    linear.use_compact(kernel)
    x = torch.randn(131, 64, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(linear.forward(x), kernel(x))


def _metadata_and_caches(
    query_lens: list[int], seq_lens: list[int], dtype: torch.dtype, block_size: int = 4
) -> tuple[AttentionMetadata, torch.Tensor]:
    tables, num_blocks = allocate_blocks(seq_lens, block_size, random.Random(sum(seq_lens)))
    metadata = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
    cache = (torch.randn(2, num_blocks, block_size, 2, 16, generator=torch.Generator().manual_seed(3))).to(
        dtype
    )
    return metadata, cache


@pytest.mark.parametrize(
    ("cache_dtype", "native_bf16"), [(torch.float32, False), (torch.bfloat16, True), (torch.bfloat16, False)]
)
def test_fresh_prefill_attention_equals_the_gathered_path(
    cache_dtype: torch.dtype, native_bf16: bool
) -> None:
    """A step with two fresh prefills, one prefill after a cached prefix (masked: still gathered) and a
    decode."""
    query_lens, seq_lens = [37, 5, 1, 12], [37, 21, 9, 12]
    metadata, cache = _metadata_and_caches(query_lens, seq_lens, cache_dtype)
    gen = torch.Generator().manual_seed(5)
    tokens = sum(query_lens)
    query_dtype = torch.float32 if cache_dtype == torch.float32 or not native_bf16 else torch.bfloat16
    query = torch.randn(tokens, 6, 16, generator=gen).to(query_dtype)
    key, value = (torch.randn(tokens, 2, 16, generator=gen).to(query_dtype) for _ in range(2))
    outputs = []
    for fresh in (True, False):
        backend = TorchAttentionBackend(native_bf16=native_bf16)
        layer_cache = cache.clone()
        backend.write_kv(key, value, layer_cache, metadata.slot_mapping)
        if not fresh:
            backend._written = None  # the path before: every prefill gathers its blocks back from the cache
        outputs.append(backend.forward(query, layer_cache, metadata, 0.25))
    assert outputs[0].dtype == query_dtype
    assert torch.equal(outputs[0], outputs[1])


def test_fresh_prefill_ignores_kv_written_for_another_cache() -> None:
    """K/V recorded by ``write_kv`` are only used by the next ``forward`` over the same cache and slots."""
    metadata, cache = _metadata_and_caches([9], [9], torch.float32)
    other = cache.clone()
    backend = TorchAttentionBackend(native_bf16=False)
    key, value = torch.randn(9, 2, 16), torch.randn(9, 2, 16)
    backend.write_kv(key, value, other, metadata.slot_mapping)
    query = torch.randn(9, 6, 16)
    reference = TorchAttentionBackend(native_bf16=False)
    assert torch.equal(
        backend.forward(query, cache, metadata, 0.25), reference.forward(query, cache, metadata, 0.25)
    )
    assert backend._written is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_model_prefill_of_100_tokens_is_bit_identical_padded(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole model on the CPU fast path: a 100-token prefill (matmuls padded to 112 rows, attention on the
    written K/V) gives the same hidden states as the unpadded, gathering path (at these tiny shapes oneDNN's
    bfloat16 blocking does not change with the row count either)."""
    model = make_pair("llama").ours.to(dtype)
    prepare_for_cpu(model)
    config = model.config
    metadata, _ = _metadata_and_caches([100], [100], dtype)
    num_blocks = int(metadata.block_tables.max()) + 1
    ids = torch.randint(0, config.vocab_size, (100,), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(100)
    hidden = []
    for padded in (True, False):
        if not padded:
            monkeypatch.setattr(layers, "ALIGN_MIN_ROWS", 1 << 62)
            monkeypatch.setattr(TorchAttentionBackend, "_fresh", None)
        backend = TorchAttentionBackend(native_bf16=dtype == torch.bfloat16)
        if not padded:
            monkeypatch.setattr(backend, "write_kv", _write_without_record(backend))
        caches = [
            torch.zeros(2, num_blocks, 4, config.num_key_value_heads, config.head_dim, dtype=dtype)
            for _ in range(config.num_hidden_layers)
        ]
        with torch.inference_mode(), set_forward_context(metadata, caches, backend):
            hidden.append(model(ids, positions))
    assert hidden[0].shape == (100, config.hidden_size)
    assert torch.equal(hidden[0], hidden[1])


def _write_without_record(backend: TorchAttentionBackend):
    write = backend.write_kv

    def write_kv(*args) -> None:
        write(*args)
        backend._written = None

    return write_kv


@pytest.mark.onednn_bf16
def test_warm_up_runs_each_distinct_projection_shape_at_each_padded_size() -> None:
    model = make_pair("llama").ours.to(torch.bfloat16)
    prepare_for_cpu(model)
    # 4 shapes (qkv 64→128, o 64→64, gate_up 64→192, down 96→64; the LM head is not a prefill matmul)
    # × 9 sizes (80, 96, …, 208 = aligned_rows(200))
    assert warm_up_prefill(model, 200) == 4 * 9
    assert warm_up_prefill(model, 64) == 0
