"""Block ids whose element offset ``block_id * stride_block`` passes 2**31 (int64 offsets, not int32).

The cache is real, just sparse: ``num_blocks`` blocks of ``16 * 1 * 64`` elements need 8.6 GB of fp16, so on
CPU it is an anonymous ``MAP_NORESERVE`` mapping (address space only; the few blocks the test writes are the
only pages ever touched), on CUDA a plain allocation. A kernel that computed offsets in int32 would wrap to
``offset - 2**32`` elements; on CPU a 4 GiB guard mapping below the cache turns that into a clean mismatch
(it reads zeros, writes land outside the checked slots) instead of a segfault of the test process.
"""

from __future__ import annotations

import mmap

import pytest
import torch

from kvscope.kernels.paged_attention import paged_attention, paged_attention_ref
from kvscope.kernels.reshape_and_cache import reshape_and_cache
from tests.kernels.devices import DEVICE
from tests.kernels.paged_batch import TOLERANCES, BatchShape, make_batch

SHAPE = BatchShape(num_heads=3, num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float16)
BLOCK_ELEMS = SHAPE.block_size * SHAPE.num_kv_heads * SHAPE.head_dim
FIRST_WRAPPING_BLOCK = 2**31 // BLOCK_ELEMS  # block_id * BLOCK_ELEMS >= 2**31 from here on
NUM_BLOCKS = FIRST_WRAPPING_BLOCK + 64
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux value; Python < 3.13 lacks the constant


def _sparse_cpu_cache() -> torch.Tensor:
    """Reserves (does not commit) ~8.6 GiB of address space: Linux MAP_NORESERVE. An OSError here fails the
    test."""
    numel, guard = 2 * NUM_BLOCKS * BLOCK_ELEMS, 2**32  # guard: 2**31 fp16 elements, where int32 would wrap
    buf = mmap.mmap(-1, guard + numel * 2, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
    cache = torch.frombuffer(buf, dtype=SHAPE.dtype, offset=guard, count=numel)
    return cache.view(2, NUM_BLOCKS, 16, 1, 64)


@pytest.fixture(scope="module")
def sparse_cache() -> torch.Tensor:
    if DEVICE.type == "cuda":
        return torch.empty(2, NUM_BLOCKS, 16, 1, 64, dtype=SHAPE.dtype, device=DEVICE)
    return _sparse_cpu_cache()


BLOCK_IDS = [
    FIRST_WRAPPING_BLOCK + 40,
    3,
    NUM_BLOCKS - 1,
    FIRST_WRAPPING_BLOCK + 1,
    9,
    FIRST_WRAPPING_BLOCK + 7,
    1,
]
LENS = ([1, 20], [40, 50])  # a decode over 3 blocks, a prefill chunk over 4 (shares none)


def test_offsets_really_pass_int32(sparse_cache: torch.Tensor) -> None:
    assert max(BLOCK_IDS) * sparse_cache.stride(1) >= 2**31
    assert FIRST_WRAPPING_BLOCK * sparse_cache.stride(1) >= 2**31 > (FIRST_WRAPPING_BLOCK - 1) * BLOCK_ELEMS


def test_write_and_attend_at_high_block_ids(sparse_cache: torch.Tensor) -> None:
    batch = make_batch(*LENS, SHAPE, DEVICE, seed=5, kv_cache=sparse_cache, block_ids=BLOCK_IDS)
    reshape_and_cache(batch.key, batch.value, batch.kv_cache, batch.slot_mapping)
    slots = batch.slot_mapping
    assert torch.equal(sparse_cache[0, slots // 16, slots % 16], batch.key)
    assert torch.equal(sparse_cache[1, slots // 16, slots % 16], batch.value)

    out = paged_attention(
        batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, batch.scale
    )
    expected = paged_attention_ref(
        batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, batch.scale
    )
    atol, rtol = TOLERANCES[SHAPE.dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
