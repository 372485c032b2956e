"""Device-sized cases on CUDA (skipped elsewhere): long contexts, large batches, automatic split-KV."""

from __future__ import annotations

import pytest
import torch

from kvscope.kernels.paged_attention import choose_num_segments, paged_attention, paged_attention_ref
from kvscope.kernels.reshape_and_cache import reshape_and_cache
from tests.kernels.paged_batch import TOLERANCES, BatchShape, make_batch

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
