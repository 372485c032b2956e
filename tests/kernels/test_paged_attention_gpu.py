"""Device-sized cases on CUDA (skipped elsewhere): long contexts, large batches, automatic split-KV, the
compiled fp16/bf16 numerics of both dot paths (the bf16 tensor-core dot and ``UPCAST_DOT``, which only the
interpreter runs otherwise), and grids large enough for programs to run at once, where a program writing
another's rows would show (the interpreter runs programs one after another: docs/kernels.md)."""

from __future__ import annotations

import pytest
import torch

from kvscope.kernels.paged_attention import (
    _paged_attention_kernel,
    choose_block_m,
    choose_num_segments,
    choose_num_warps,
    paged_attention,
    paged_attention_args,
    paged_attention_ref,
)
from kvscope.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref
from tests.kernels.paged_batch import TOLERANCES, BatchShape, PagedBatch, make_batch

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def _check(
    q_lens: list[int], seq_lens: list[int], shape: BatchShape, num_segments: int | None = None
) -> None:
    batch = make_batch(q_lens, seq_lens, shape, CUDA, seed=len(q_lens))
    reshape_and_cache(batch.key, batch.value, batch.kv_cache, batch.slot_mapping)
    args = (
        batch.query,
        batch.kv_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        batch.scale,
    )
    out = paged_attention(
        *args, max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len, num_segments=num_segments
    )
    atol, rtol = TOLERANCES[shape.dtype]
    torch.testing.assert_close(out.float(), paged_attention_ref(*args).float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"]
)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_large_mixed_batch(dtype: torch.dtype, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    decode_lens = torch.randint(1, 3000, (48,), generator=gen).tolist()
    q_lens = [1] * 48 + [512, 300, 1]
    seq_lens = decode_lens + [512, 2300, 4097]
    _check(q_lens, seq_lens, BatchShape(32, 8, head_dim, 16, dtype))


def test_automatic_split_kv_on_long_decodes() -> None:
    shape = BatchShape(32, 8, 128, 16, torch.bfloat16)
    assert choose_num_segments(CUDA, 2, 8, 1, 8192) > 1
    _check([1, 1], [8192, 5000], shape, num_segments=None)


def _inputs(batch: PagedBatch) -> tuple:
    return (
        batch.query,
        batch.kv_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        batch.scale,
    )


def _launch(batch: PagedBatch, upcast: bool) -> tuple[torch.Tensor, dict[str, object]]:
    """paged_attention's own launch (one segment) with ``UPCAST_DOT`` forced to ``upcast`` (fp32 operands and
    an IEEE dot when set); returns the output and the launcher's unforced arguments."""
    out = torch.full_like(batch.query, float("nan"))
    group = batch.query.shape[1] // batch.kv_cache.shape[3]
    block_m = choose_block_m(group, batch.max_query_len)
    args = paged_attention_args(out, *_inputs(batch), (out, out, out), block_m, 1)
    forced = args | ({"UPCAST_DOT": True, "DOT_PRECISION": "ieee"} if upcast else {})
    grid = (batch.query.shape[0] // args["BLOCK_Q"] + batch.seq_lens.shape[0], batch.kv_cache.shape[3], 1)
    num_warps = choose_num_warps(block_m, batch.query.shape[2], batch.query.dtype)
    _paged_attention_kernel[grid](**forced, num_warps=num_warps)
    return out, args


@pytest.mark.parametrize("upcast", [False, True], ids=["tensor-core-dot", "upcast-dot"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_compiled_half_precision_numerics(
    dtype: torch.dtype, upcast: bool, head_dim: int, record_property
) -> None:
    """Both dot paths, compiled, within the dtype's tolerance of the fp32 reference (paged_batch.TOLERANCES,
    docs/kernels.md "Tolerances"); the launcher picks the tensor-core dot on CUDA, and its result is the
    unforced launch's bit for bit. The largest error lands in the junit file (property max_abs_error)."""
    q_lens = [1] * 8 + [64, 130, 7]  # decodes, a block-aligned chunk, a long chunk, a short one
    seq_lens = [37, 1, 260, 16, 999, 512, 77, 3000] + [64, 700, 300]
    batch = make_batch(q_lens, seq_lens, BatchShape(12, 4, head_dim, 16, dtype), CUDA, seed=head_dim)
    reshape_and_cache(batch.key, batch.value, batch.kv_cache, batch.slot_mapping)
    out, args = _launch(batch, upcast)
    assert (args["UPCAST_DOT"], args["DOT_PRECISION"]) == (False, "tf32")
    if not upcast:
        default = paged_attention(
            *_inputs(batch), max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len, num_segments=1
        )
        assert torch.equal(out, default)
    expected = paged_attention_ref(*_inputs(batch)).float()
    record_property("max_abs_error", float((out.float() - expected).abs().max()))
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


def test_a_race_provoking_grid_is_complete_and_repeatable() -> None:
    """400 requests of 1-39 new tokens after 0-299 cached ones, 8 KV heads: q-blocks of 32 tokens that start
    mid-request, about 5,000 programs in flight at once. Written over a NaN output five times: every row is
    written, the five results are bit for bit the same, and they match the reference."""
    gen = torch.Generator().manual_seed(5)
    q_lens = torch.randint(1, 40, (400,), generator=gen).tolist()
    seq_lens = [
        q + c for q, c in zip(q_lens, torch.randint(0, 300, (400,), generator=gen).tolist(), strict=True)
    ]
    batch = make_batch(q_lens, seq_lens, BatchShape(16, 8, 64, 16, torch.float16), CUDA, seed=5)
    reshape_and_cache(batch.key, batch.value, batch.kv_cache, batch.slot_mapping)
    runs = []
    for _ in range(5):
        out = torch.full_like(batch.query, float("nan"))
        runs.append(
            paged_attention(
                *_inputs(batch), max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len, out=out
            )
        )
    assert all(torch.equal(runs[0], run) for run in runs[1:])
    atol, rtol = TOLERANCES[torch.float16]
    torch.testing.assert_close(
        runs[0].float(), paged_attention_ref(*_inputs(batch)).float(), atol=atol, rtol=rtol
    )


def test_split_kv_partials_of_many_programs_merge_repeatably() -> None:
    """64 decodes over 100-2,999 keys in 16 segments: 8,192 programs write partial states that the merge
    reads; five runs over a NaN output are the same bit for bit and match the reference."""
    gen = torch.Generator().manual_seed(6)
    seq_lens = torch.randint(100, 3000, (64,), generator=gen).tolist()
    batch = make_batch([1] * 64, seq_lens, BatchShape(32, 8, 128, 16, torch.bfloat16), CUDA, seed=6)
    reshape_and_cache(batch.key, batch.value, batch.kv_cache, batch.slot_mapping)
    runs = []
    for _ in range(5):
        out = torch.full_like(batch.query, float("nan"))
        runs.append(
            paged_attention(
                *_inputs(batch), max_query_len=1, max_seq_len=max(seq_lens), num_segments=16, out=out
            )
        )
    assert all(torch.equal(runs[0], run) for run in runs[1:])
    atol, rtol = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(
        runs[0].float(), paged_attention_ref(*_inputs(batch)).float(), atol=atol, rtol=rtol
    )


def test_a_large_cache_write_with_padding_equals_the_reference() -> None:
    """16,384 tokens, one program each, into shuffled distinct slots, one in ten padding (slot -1): the cache
    equals the indexed-assignment reference bit for bit, and slots no token names keep their old values."""
    gen = torch.Generator().manual_seed(7)
    num_tokens, num_blocks, block_size = 16384, 1500, 16
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.1] = -1
    key, value = torch.randn(2, num_tokens, 8, 128, generator=gen, dtype=torch.float32).to(
        CUDA, torch.bfloat16
    )
    before = torch.randn(2, num_blocks, block_size, 8, 128, generator=gen).to(CUDA, torch.bfloat16)
    cache, expected = before.clone(), before.clone()
    reshape_and_cache(key, value, cache, slots.to(CUDA))
    reshape_and_cache_ref(key, value, expected, slots.to(CUDA))
    assert torch.equal(cache, expected) and not torch.equal(cache, before)
