"""Random paged batches for the kernel tests: a scheduler step's tensors with a poisoned cache.

Every cache slot that no request owns (block 0, which the zero padding of ``block_tables`` points at, free
blocks and the tail of each request's last block) holds NaN, so a kernel that reads a key it should not see
produces NaN instead of a small error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOLERANCES = {
    # dtype: (atol, rtol) of kernel vs fp32 dense-gather reference; docs/kernels.md explains the choice.
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """One step: ``key``/``value`` of the new tokens are not yet in ``kv_cache`` (write them first)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    scale: float


@dataclass(frozen=True, slots=True)
class BatchShape:
    num_heads: int = 6
    num_kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    dtype: torch.dtype = torch.float32


def shuffled_block_ids(num_needed: int, num_blocks: int, generator: torch.Generator) -> list[int]:
    """``num_needed`` distinct block ids in random order, never block 0 (the padding target)."""
    return (torch.randperm(num_blocks - 1, generator=generator)[:num_needed] + 1).tolist()


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    shape: BatchShape,
    device: torch.device,
    *,
    seed: int = 0,
    kv_cache: torch.Tensor | None = None,
    block_ids: list[int] | None = None,
) -> PagedBatch:
    """Build a batch; ``kv_cache``/``block_ids`` may be given (a sparse cache), else a NaN cache is made."""
    gen = torch.Generator().manual_seed(seed)
    bs = shape.block_size
    per_req = [-(-n // bs) for n in seq_lens]
    if kv_cache is None:
        num_blocks = sum(per_req) + 4
        kv_cache = torch.full((2, num_blocks, bs, shape.num_kv_heads, shape.head_dim), float("nan"))
        kv_cache = kv_cache.to(device=device, dtype=shape.dtype)
    if block_ids is None:
        block_ids = shuffled_block_ids(sum(per_req), kv_cache.shape[1], gen)
    kv_cache[:, 0] = float("nan")
    tables = torch.zeros(len(q_lens), max(per_req) + 1, dtype=torch.int32)
    slots, first = [], 0
    for r, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        ids = block_ids[first : first + per_req[r]]
        first += per_req[r]
        tables[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        _fill_context(kv_cache, ids, seq_len - q_len, gen)
        slots += [ids[p // bs] * bs + p % bs for p in range(seq_len - q_len, seq_len)]
    return _assemble(q_lens, seq_lens, shape, device, gen, kv_cache, tables, slots)


def _fill_context(kv_cache: torch.Tensor, ids: list[int], context_len: int, gen: torch.Generator) -> None:
    """NaN over the request's blocks, then random K/V in its first ``context_len`` slots."""
    bs, device = kv_cache.shape[2], kv_cache.device
    kv_cache[:, torch.tensor(ids, dtype=torch.long, device=device)] = float("nan")
    positions = torch.arange(context_len)
    blocks = torch.tensor(ids, dtype=torch.long)[positions // bs].to(device)
    values = torch.randn((2, context_len, *kv_cache.shape[3:]), generator=gen)
    kv_cache[:, blocks, (positions % bs).to(device)] = values.to(device, kv_cache.dtype)


def _assemble(q_lens, seq_lens, shape, device, gen, kv_cache, tables, slots) -> PagedBatch:
    num_tokens = sum(q_lens)
    new = torch.randn(3, num_tokens, shape.num_heads, shape.head_dim, generator=gen)
    kv_heads = shape.num_kv_heads
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return PagedBatch(
        query=new[0].to(device, shape.dtype),
        key=new[1, :, :kv_heads].contiguous().to(device, shape.dtype),
        value=new[2, :, :kv_heads].contiguous().to(device, shape.dtype),
        kv_cache=kv_cache,
        query_start_loc=starts.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        scale=shape.head_dim**-0.5,
    )
