"""reshape_and_cache writes each token's K/V to exactly its slot (bit-exact) and nothing else."""

from __future__ import annotations

import pytest
import torch

from kvscope.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref
from tests.kernels.devices import DEVICE
from tests.kernels.paged_batch import BatchShape, make_batch

SENTINEL = 1234.0  # stands in for NaN so torch.equal can compare the untouched slots too


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_writes_every_token_to_its_slot(dtype: torch.dtype, block_size: int) -> None:
    shape = BatchShape(num_heads=6, num_kv_heads=3, head_dim=64, block_size=block_size, dtype=dtype)
    batch = make_batch([3, 1, 9], [3, 20, 40], shape, DEVICE, seed=block_size)
    expected = batch.kv_cache.clone()
    reshape_and_cache_ref(batch.key, batch.value, expected, batch.slot_mapping)

    reshape_and_cache(batch.key, batch.value, batch.kv_cache, batch.slot_mapping)

    slots = batch.slot_mapping
    assert torch.equal(batch.kv_cache[0, slots // block_size, slots % block_size], batch.key)
    assert torch.equal(batch.kv_cache[1, slots // block_size, slots % block_size], batch.value)
    assert torch.equal(batch.kv_cache.nan_to_num(SENTINEL), expected.nan_to_num(SENTINEL))


def test_negative_slots_are_skipped() -> None:
    cache = torch.zeros(2, 4, 16, 2, 64, device=DEVICE)
    key = torch.randn(3, 2, 64, device=DEVICE)
    value = torch.randn(3, 2, 64, device=DEVICE)
    slots = torch.tensor([5, -1, 63], dtype=torch.int64, device=DEVICE)

    reshape_and_cache(key, value, cache, slots)

    assert torch.equal(cache[0, 0, 5], key[0]) and torch.equal(cache[1, 3, 15], value[2])
    written = (cache != 0).flatten(3).any(-1)  # [2, num_blocks, block_size]: slots touched in K and V
    assert written.sum().item() == 2 * 2  # K and V of two tokens, nothing for the padding token


def test_key_may_be_a_strided_view_of_a_fused_projection() -> None:
    qkv = torch.randn(5, (4 + 2 + 2) * 64, device=DEVICE)  # [tokens, (H + 2*KVH) * D] as a fused qkv linear
    key = qkv[:, 4 * 64 : 6 * 64].view(5, 2, 64)
    value = qkv[:, 6 * 64 :].view(5, 2, 64)
    assert not key.is_contiguous()
    cache = torch.zeros(2, 2, 16, 2, 64, device=DEVICE)
    slots = torch.tensor([0, 1, 2, 17, 31], dtype=torch.int64, device=DEVICE)

    reshape_and_cache(key, value, cache, slots)

    assert torch.equal(cache[0].view(-1, 2, 64)[slots], key)
    assert torch.equal(cache[1].view(-1, 2, 64)[slots], value)


def test_zero_tokens_is_a_no_op() -> None:
    cache = torch.zeros(2, 2, 16, 2, 64, device=DEVICE)
    empty = torch.empty(0, 2, 64, device=DEVICE)
    reshape_and_cache(empty, empty, cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.count_nonzero(cache).item() == 0
