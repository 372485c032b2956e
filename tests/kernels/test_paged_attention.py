"""paged_attention matches the dense-gather reference over a grid of batch shapes (docs/kernels.md).

Every batch comes from tests/kernels/paged_batch.py: shuffled block ids, block 0 (the padding target) and all
unowned slots NaN, so reading a key outside a request's causal window fails loudly.
"""

from __future__ import annotations

import pytest
import torch

from kvscope.kernels.paged_attention import paged_attention, paged_attention_ref
from kvscope.kernels.reshape_and_cache import reshape_and_cache
from tests.kernels.devices import DEVICE
from tests.kernels.paged_batch import TOLERANCES, BatchShape, PagedBatch, make_batch

# (query lens, seq lens): seq_len - query_len tokens are already cached.
MIXED = ([1, 7, 1, 20], [33, 7, 65, 50])  # decode, whole prompt, decode, chunk after a 30-token prefix
DECODES = ([1, 1, 1, 1], [1, 17, 96, 200])
CHUNKS = ([16, 33, 5], [48, 33, 100])  # prefill chunks only, one aligned to a block boundary


def _run(batch: PagedBatch, **kwargs) -> torch.Tensor:
    reshape_and_cache(batch.key, batch.value, batch.kv_cache, batch.slot_mapping)
    return paged_attention(
        batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, batch.scale,
        max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len, **kwargs,
    )  # fmt: skip


def _assert_matches_reference(batch: PagedBatch, out: torch.Tensor) -> None:
    expected = paged_attention_ref(
        batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, batch.scale
    )
    assert out.dtype == batch.query.dtype and out.shape == batch.query.shape
    atol, rtol = TOLERANCES[out.dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)


@DTYPES
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (6, 2)], ids=["mha", "gqa3"])
def test_mixed_batch_matches_reference(dtype, block_size, num_heads, num_kv_heads) -> None:
    shape = BatchShape(num_heads, num_kv_heads, 64, block_size, dtype)
    batch = make_batch(*MIXED, shape, DEVICE, seed=block_size + num_heads)
    _assert_matches_reference(batch, _run(batch))


@pytest.mark.parametrize(
    ("lens", "shape"),
    [
        (DECODES, BatchShape(9, 3, 64, 16, torch.float16)),  # SmolLM2 heads
        (CHUNKS, BatchShape(9, 3, 64, 16, torch.bfloat16)),
        (MIXED, BatchShape(4, 1, 128, 16, torch.float32)),
        (MIXED, BatchShape(2, 1, 16, 32, torch.float16)),
        (CHUNKS, BatchShape(32, 1, 64, 16, torch.float32)),  # group 32 > 16 rows: BLOCK_M 32, one token each
    ],
    ids=["decodes-smollm2", "chunks-smollm2", "head128", "head16", "group32"],
)
def test_shapes_match_reference(lens, shape) -> None:
    batch = make_batch(*lens, shape, DEVICE, seed=7)
    _assert_matches_reference(batch, _run(batch))


@pytest.mark.parametrize("num_segments", [2, 16])
@pytest.mark.parametrize("lens", [DECODES, MIXED], ids=["decodes", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_split_kv_matches_reference(num_segments, lens, dtype) -> None:
    """Flash-decoding split + merge; 16 segments leaves some segments empty (must weigh 0)."""
    batch = make_batch(*lens, BatchShape(6, 2, 64, 16, dtype), DEVICE, seed=num_segments)
    _assert_matches_reference(batch, _run(batch, num_segments=num_segments))


def test_chunked_prefill_equals_one_shot_prefill() -> None:
    """A 40-token prompt as chunks of 24 + 16 gives the one-shot rows: the second chunk sees the cached 24."""
    shape = BatchShape(6, 2, 64, 16, torch.float32)
    whole = make_batch([40], [40], shape, DEVICE, seed=3)
    out_whole = _run(whole)
    first = {"query_start_loc": [0, 24], "seq_lens": [24]}
    second = {"query_start_loc": [0, 16], "seq_lens": [40]}
    outs = []
    for rows, meta in ((slice(0, 24), first), (slice(24, 40), second)):
        outs.append(
            paged_attention(
                whole.query[rows],
                whole.kv_cache,
                torch.tensor(meta["query_start_loc"], dtype=torch.int32, device=DEVICE),
                torch.tensor(meta["seq_lens"], dtype=torch.int32, device=DEVICE),
                whole.block_tables,
                whole.scale,
            )  # fmt: skip
        )
    torch.testing.assert_close(torch.cat(outs), out_whole, atol=1e-5, rtol=1e-5)


def test_single_key_returns_its_value() -> None:
    """A 1-token prompt attends only to itself: the output is exactly its value row, per GQA group."""
    batch = make_batch([1], [1], BatchShape(6, 2, 64, 16, torch.float32), DEVICE, seed=1)
    out = _run(batch)
    assert torch.equal(out[0], batch.value[0].repeat_interleave(3, dim=0))


def test_out_buffer_is_filled_and_returned() -> None:
    batch = make_batch(*DECODES, BatchShape(6, 2, 64, 16, torch.float32), DEVICE)
    out = torch.full_like(batch.query, float("nan"))
    assert _run(batch, out=out) is out
    _assert_matches_reference(batch, out)


def test_empty_batch_returns_empty_output() -> None:
    query = torch.empty(0, 6, 64, device=DEVICE)
    cache = torch.zeros(2, 2, 16, 2, 64, device=DEVICE)
    no_reqs = torch.empty(0, dtype=torch.int32, device=DEVICE)
    out = paged_attention(
        query, cache, torch.zeros(1, dtype=torch.int32, device=DEVICE), no_reqs,
        torch.empty(0, 1, dtype=torch.int32, device=DEVICE), 0.125,
    )  # fmt: skip
    assert out.shape == (0, 6, 64)
