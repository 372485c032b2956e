"""TorchAttentionBackend vs naive dense causal attention; AttentionMetadata.build; the forward context."""

from __future__ import annotations

import random

import pytest
import torch

from kvscope.engine.attention.backend import AttentionMetadata
from kvscope.engine.attention.forward_context import get_forward_context, set_forward_context
from kvscope.engine.attention.selector import get_attention_backend
from kvscope.engine.attention.torch_backend import TorchAttentionBackend

HEAD_DIM = 8


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [q_len, H, d] at the last q_len positions of k/v [seq_len, KVH, d]; float64 dense softmax."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    query_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


def allocate_blocks(seq_lens: list[int], block_size: int, rng: random.Random) -> tuple[list[list[int]], int]:
    """Shuffled, disjoint block tables covering each sequence; returns (tables, num_blocks)."""
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in needed:
        tables.append(ids[at : at + n])
        at += n
    return tables, num_blocks


def run_case(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache every request's K/V for positions < seq_len - q_len directly, write the new tokens through
    write_kv, attend; returns (backend output, naive output) for all packed queries."""
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = allocate_blocks(seq_lens, block_size, random.Random(seed))
    kv_cache = torch.randn(
        2, num_blocks, block_size, num_kv_heads, HEAD_DIM, generator=gen
    )  # garbage elsewhere
    backend = TorchAttentionBackend()
    scale = HEAD_DIM**-0.5
    dense_k = [torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen) for n in seq_lens]
    dense_v = [torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen) for n in seq_lens]
    queries = [torch.randn(q, num_heads, HEAD_DIM, generator=gen) for q in query_lens]
    for table, k, v, q_len in zip(tables, dense_k, dense_v, query_lens, strict=True):
        for pos in range(k.shape[0] - q_len):  # the cached prefix
            kv_cache[0, table[pos // block_size], pos % block_size] = k[pos]
            kv_cache[1, table[pos // block_size], pos % block_size] = v[pos]
    metadata = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
    new_k = torch.cat([k[k.shape[0] - q :] for k, q in zip(dense_k, query_lens, strict=True)])
    new_v = torch.cat([v[v.shape[0] - q :] for v, q in zip(dense_v, query_lens, strict=True)])
    backend.write_kv(new_k, new_v, kv_cache, metadata.slot_mapping)
    out = backend.forward(torch.cat(queries), kv_cache, metadata, scale)
    ref = torch.cat(
        [naive_attention(q, k, v, scale) for q, k, v in zip(queries, dense_k, dense_v, strict=True)]
    )
    return out, ref


# (query_lens, seq_lens): full prefills, chunked prefill over a cached prefix, decodes of different lengths.
RAGGED = ([5, 3, 1, 1, 7, 1], [5, 20, 17, 1, 40, 33])


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (8, 2)])
def test_matches_naive_ragged_batch(block_size: int, num_heads: int, num_kv_heads: int) -> None:
    out, ref = run_case(*RAGGED, num_heads, num_kv_heads, block_size)
    assert out.shape == (sum(RAGGED[0]), num_heads, HEAD_DIM)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("query_lens", "seq_lens"), [([12], [12]), ([4], [29]), ([1], [1]), ([1, 1, 1], [3, 64, 16])]
)
def test_matches_naive_single_shapes(query_lens: list[int], seq_lens: list[int]) -> None:
    out, ref = run_case(query_lens, seq_lens, num_heads=6, num_kv_heads=2, block_size=4, seed=7)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_build_metadata_slots_and_padding() -> None:
    meta = AttentionMetadata.build([3, 1], [5, 9], [[7, 2], [4, 0, 5]], block_size=4)
    # request 0: positions 2,3,4 → block 7 offsets 2,3 then block 2 offset 0; request 1: position 8 → block 5.
    assert meta.slot_mapping.tolist() == [30, 31, 8, 20]
    assert meta.query_start_loc.tolist() == [0, 3, 4]
    assert meta.seq_lens.tolist() == [5, 9]
    assert meta.block_tables.tolist() == [[7, 2, 0], [4, 0, 5]]
    assert (meta.max_query_len, meta.max_seq_len, meta.num_reqs, meta.num_tokens) == (3, 9, 2, 4)
    assert meta.slot_mapping.dtype == torch.int64 and meta.block_tables.dtype == torch.int32


def test_build_metadata_rejects_short_block_table() -> None:
    with pytest.raises(ValueError, match="num_blocks=1"):
        AttentionMetadata.build([2], [5], [[0]], block_size=4)


def test_write_kv_places_tokens_in_their_slots() -> None:
    kv_cache = torch.zeros(2, 3, 2, 1, 1)
    key = torch.tensor([1.0, 2.0, 3.0]).view(3, 1, 1)
    TorchAttentionBackend().write_kv(key, -key, kv_cache, torch.tensor([5, 0, 3]))
    assert kv_cache[0].flatten().tolist() == [2.0, 0.0, 0.0, 3.0, 0.0, 1.0]
    assert kv_cache[1].flatten().tolist() == [-2.0, 0.0, 0.0, -3.0, 0.0, -1.0]


def test_plan_is_rebuilt_for_new_metadata() -> None:
    """A backend reused across steps must not keep the previous step's plan."""
    backend = TorchAttentionBackend()
    kv_cache = torch.randn(2, 4, 4, 1, HEAD_DIM)
    q = torch.randn(1, 2, HEAD_DIM)
    first = backend.forward(q, kv_cache, AttentionMetadata.build([1], [3], [[1]], 4), 1.0)
    second = backend.forward(q, kv_cache, AttentionMetadata.build([1], [3], [[2]], 4), 1.0)
    ref = naive_attention(q, kv_cache[0, 2, :3], kv_cache[1, 2, :3], 1.0)
    torch.testing.assert_close(second, ref, atol=1e-5, rtol=0)
    assert not torch.allclose(first, second)


def test_forward_context_scoping() -> None:
    with pytest.raises(RuntimeError, match="no forward context"):
        get_forward_context()
    meta = AttentionMetadata.build([1], [1], [[0]], 1)
    backend = TorchAttentionBackend()
    with set_forward_context(meta, [], backend) as ctx:
        assert get_forward_context() is ctx
        assert ctx.attn_metadata is meta and ctx.backend is backend
    with pytest.raises(RuntimeError):
        get_forward_context()


def test_get_attention_backend_choices() -> None:
    assert get_attention_backend("auto", "cpu").name == "torch"
    assert get_attention_backend("torch", "cpu").name == "torch"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        get_attention_backend("triton", "cpu")
    with pytest.raises(ValueError, match="must be one of"):
        get_attention_backend("flash", "cpu")
