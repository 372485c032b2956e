"""kvscope's C++ paged decode attention (kernels/csrc/cpu_attention.cpp) against SDPA on random paged caches,
and its use by the torch backend's decode path (engine/attention/torch_backend.py); its K/V cache write
against ``index_copy_``.

Tolerances: the reference is SDPA in float64 over the same (bfloat16-rounded where the inputs are) values, so
the only differences are the op's float32 arithmetic (summation order, the polynomial exp: relative error
< 2e-7 each, over ≤ 300 keys) and, for a bfloat16 query, the rounding of the output to bfloat16 (half a unit
in the last place: 2^-9 relative). Hence atol 2e-5 for float32 outputs and rtol 2^-8 (one bfloat16 ulp) for
bfloat16 ones.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kvscope.common.models.cache import cache_root
from kvscope.engine.attention.backend import AttentionMetadata
from kvscope.engine.attention.torch_backend import TorchAttentionBackend, paged_decode_applies
from kvscope.engine.platform.cpu import load_cpu_kernels

pytestmark = pytest.mark.cpu_kernels


@pytest.fixture(scope="module", autouse=True)
def cpu_kernels():
    """kvscope's CPU kernels, built (first run on a machine) and loaded from the model cache's
    cpu-kernels/."""
    result = load_cpu_kernels(cache_root())
    assert result.ok, result.detail
    return result


def paged_inputs(
    seq_lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    cache_dtype: torch.dtype,
    query_dtype: torch.dtype,
    seed: int,
    fill: float = float("nan"),
):
    """Shuffled block tables (padding entries point at block 0) over a cache whose every slot that no request
    holds, block 0 included, is ``fill`` (NaN: a read past a request's context would poison its output)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 2
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    width = max(needed) + 1
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), fill)
    at = 0
    for row, (n, k) in enumerate(zip(seq_lens, needed, strict=True)):
        tables[row, :k] = torch.tensor(ids[at : at + k], dtype=torch.int32)
        at += k
        for t in range(n):
            cache[:, tables[row, t // block_size], t % block_size] = torch.randn(
                2, kv_heads, head_dim, generator=gen
            )
    query = torch.randn(len(seq_lens), heads, head_dim, generator=gen)
    return query.to(query_dtype), cache.to(cache_dtype), tables, torch.tensor(seq_lens, dtype=torch.int32)


def sdpa_reference(query, cache, tables, seq_lens, scale) -> torch.Tensor:
    """float64 SDPA per request over its gathered K/V [1, KVH, S, d] (GQA via enable_gqa)."""
    block_size = cache.shape[2]
    rows = []
    for row, n in enumerate(seq_lens.tolist()):
        slots = [int(tables[row, t // block_size]) * block_size + t % block_size for t in range(n)]
        kv = cache.flatten(1, 2)[:, slots].double().transpose(1, 2)  # [2, KVH, S, d]
        q = query[row].double()[None, :, None]  # [1, H, 1, d]
        rows.append(
            F.scaled_dot_product_attention(q, kv[0][None], kv[1][None], scale=scale, enable_gqa=True)[0, :, 0]
        )
    return torch.stack(rows)


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor) -> None:
    if out.dtype == torch.bfloat16:
        torch.testing.assert_close(out.double(), ref, rtol=2**-8, atol=2e-5)
    else:
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (8, 1, 64), (8, 2, 128), (2, 1, 16)]
)
@pytest.mark.parametrize(
    ("cache_dtype", "query_dtype"),
    [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float32)],
)
def test_matches_sdpa_on_ragged_paged_caches(block_size, heads, kv_heads, head_dim, cache_dtype, query_dtype):
    seq_lens = [1, 15, 16, 17, 33, 130, 257]  # one key, tile and block edges, several tiles
    query, cache, tables, lens = paged_inputs(
        seq_lens,
        heads,
        kv_heads,
        head_dim,
        block_size,
        cache_dtype,
        query_dtype,
        seed=block_size * 100 + heads + head_dim,
    )
    scale = head_dim**-0.5
    out = torch.ops.kvscope_cpu.paged_decode_attention(query, cache, tables, lens, scale)
    assert out.dtype == query_dtype
    assert out.shape == (len(seq_lens), heads, head_dim)
    assert_close_to_reference(out, sdpa_reference(query, cache, tables, lens, scale))


def test_large_scores_and_a_non_contiguous_query():
    """Scores far from 0 (softmax dominated by a few keys: the exp's range reduction and the max subtraction)
    and a query that is a strided view (as the split of a fused qkv projection)."""
    query, cache, tables, lens = paged_inputs([40, 300], 9, 3, 64, 16, torch.float32, torch.float32, seed=7)
    wide = torch.zeros(2, 9, 2 * 64)
    wide[:, :, ::2] = query * 6.0
    strided = wide[:, :, ::2]
    out = torch.ops.kvscope_cpu.paged_decode_attention(strided, cache, tables, lens, 0.125)
    assert_close_to_reference(out, sdpa_reference(strided, cache, tables, lens, 0.125))


def test_bad_tables_are_errors():
    query, cache, tables, lens = paged_inputs([20, 5], 9, 3, 64, 16, torch.bfloat16, torch.bfloat16, seed=3)
    too_long = lens.clone()
    too_long[1] = tables.shape[1] * 16 + 1
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        torch.ops.kvscope_cpu.paged_decode_attention(query, cache, tables, too_long, 0.125)
    bad = tables.clone()
    bad[0, 1] = cache.shape[1]
    with pytest.raises(RuntimeError, match="block id out of range in row 0"):
        torch.ops.kvscope_cpu.paged_decode_attention(query, cache, bad, lens, 0.125)
    with pytest.raises(RuntimeError, match="head_dim must be 16, 32, 64 or 128"):
        torch.ops.kvscope_cpu.paged_decode_attention(
            query[..., :48], cache[..., :48].contiguous(), tables, lens, 0.1
        )


def backend_step(backend: TorchAttentionBackend, cache_dtype: torch.dtype, query_lens: list[int]):
    """One step of three requests (prefill rows where query_len > 1) through ``backend`` at SmolLM2's
    shapes."""
    seq_lens = [70, 19, 141]
    # SDPA reads the padded batch's masked slots too (NaN there would be NaN · 0); 100 would still dominate
    # the op's softmax if it read one
    query, cache, tables, lens = paged_inputs(
        seq_lens, 9, 3, 64, 16, cache_dtype, cache_dtype, seed=11, fill=100.0
    )
    metadata = AttentionMetadata.build(query_lens, seq_lens, [row[row > 0].tolist() for row in tables], 16)
    packed = torch.cat([query[r : r + 1].expand(q, -1, -1) for r, q in enumerate(query_lens)])
    return backend.forward(packed, cache, metadata, 0.125), (query, cache, tables, lens)


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [1, 19, 1]])
def test_backend_decode_rows_use_the_paged_op_on_bfloat16(query_lens):
    """With ``paged_prefill=False``: decode rows of a decode-only and of a mixed step run the op (no
    gather: no resident copy), prefill rows stay on SDPA (identical to the SDPA-only backend's); the decode
    rows are within one bfloat16 ulp of float64 and within 2^-7 of SDPA's path (outputs |x| < 1 here:
    SDPA's bfloat16 path on AMX rounds its probabilities to bfloat16, measured 1.5e-3 from the op at most)."""
    paged = TorchAttentionBackend(paged_decode=True, paged_prefill=False)
    sdpa = TorchAttentionBackend(paged_decode=False)
    out, (query, cache, tables, lens) = backend_step(paged, torch.bfloat16, query_lens)
    ref, _ = backend_step(sdpa, torch.bfloat16, query_lens)
    assert paged._plan.paged_decode is True and sdpa._plan.paged_decode is False
    assert paged._plan.token_rows is None
    assert paged.resident.full_gathers == paged.resident.incremental_updates == 0
    ends = torch.tensor(query_lens).cumsum(0) - 1
    decode_rows = [r for r, q in enumerate(query_lens) if q == 1]
    expected = sdpa_reference(query[decode_rows], cache, tables[decode_rows], lens[decode_rows], 0.125)
    assert_close_to_reference(out[ends[decode_rows]], expected)
    torch.testing.assert_close(
        out[ends[decode_rows]].double(), ref[ends[decode_rows]].double(), rtol=0, atol=2**-7
    )
    prefill = torch.ones(out.shape[0], dtype=torch.bool)
    prefill[ends[decode_rows]] = False
    assert torch.equal(out[prefill], ref[prefill])


@pytest.mark.parametrize("query_lens", [[1, 19, 1], [70, 19, 141], [5, 1, 33]])
@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float32])
def test_backend_prefill_rows_use_the_paged_op(query_lens, query_dtype):
    """With ``paged_prefill`` every token of a step with prefill rows (whole prompts, chunks after cached
    tokens, decode rows beside them) runs the op in one call: each token within one bfloat16 ulp (float32
    query: 2e-5) of float64 SDPA over the keys up to its own position, within 2^-7 + 2^-7·|x| of the SDPA
    backend's path, no gather, and the output in the query's dtype. The relative part is the op's own
    rounding to bfloat16 (outputs reach |x| ≈ 3 here, where one ulp is 2^-6); the absolute part is SDPA's:
    where AMX runs it in bfloat16 (probabilities and, for a float32 query, the query rounded to bfloat16)
    it is up to 8.8e-3 from float64 on these inputs (measured on a Sapphire Rapids; the op differs from
    float64 by 7.8e-3 at most, a float32 query's by 7.2e-7)."""
    seq_lens = [70, 19, 141]
    _, cache, tables, _ = paged_inputs(
        seq_lens, 9, 3, 64, 16, torch.bfloat16, query_dtype, seed=5, fill=100.0
    )
    metadata = AttentionMetadata.build(query_lens, seq_lens, [row[row > 0].tolist() for row in tables], 16)
    packed = torch.randn(sum(query_lens), 9, 64, generator=torch.Generator().manual_seed(6)).to(query_dtype)
    paged, sdpa = TorchAttentionBackend(paged_prefill=True), TorchAttentionBackend(paged_decode=False)
    out = paged.forward(packed, cache, metadata, 0.125)
    ref = sdpa.forward(packed, cache, metadata, 0.125)
    assert paged._plan.token_rows is not None and out.dtype == query_dtype
    rows = torch.repeat_interleave(torch.arange(3), torch.tensor(query_lens))
    positions = torch.cat([torch.arange(n - q, n) for q, n in zip(query_lens, seq_lens, strict=True)])
    assert paged._plan.token_rows.seq_lens.tolist() == (positions + 1).tolist()
    assert paged._plan.token_rows.tables.shape == (
        sum(query_lens),
        -(-max(seq_lens) // 16),
    )  # no padding columns
    expected = sdpa_reference(packed, cache, tables[rows], (positions + 1).to(torch.int32), 0.125)
    assert_close_to_reference(out, expected)
    torch.testing.assert_close(out.double(), ref.double(), rtol=2**-7, atol=2**-7)
    assert paged.resident.full_gathers == paged.resident.incremental_updates == 0
    assert paged._buffers == {}  # nothing gathered


def test_prefill_rows_default_to_the_op_where_sdpa_would_upcast():
    """The default follows the measurement (bench/prefill_attention_ab.py, docs/benchmarks.md): the op
    where SDPA attends in float32 (no AMX), SDPA where AMX's bfloat16 SDPA runs (0.80× the op's time at 128
    tokens, 0.25× at 1,024 on a Sapphire Rapids)."""
    assert TorchAttentionBackend(native_bf16=False).paged_prefill is True
    assert TorchAttentionBackend(native_bf16=True).paged_prefill is False
    assert TorchAttentionBackend(native_bf16=False, paged_prefill=False).paged_prefill is False


def test_float32_caches_keep_sdpa():
    """float32 caches are attended by SDPA exactly as with the op switched off (bit for bit)."""
    assert not paged_decode_applies(torch.zeros(2, 1, 16, 3, 64))
    assert paged_decode_applies(torch.zeros(2, 1, 16, 3, 64, dtype=torch.bfloat16))
    assert not paged_decode_applies(torch.zeros(2, 1, 16, 3, 8, dtype=torch.bfloat16))
    on, off = TorchAttentionBackend(paged_decode=True), TorchAttentionBackend(paged_decode=False)
    out, _ = backend_step(on, torch.float32, [1, 1, 1])
    ref, _ = backend_step(off, torch.float32, [1, 1, 1])
    assert on._plan.paged_decode is False
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_write_kv_puts_every_row_where_index_copy_would(dtype):
    """K and V as the model hands them (views of the fused qkv output: rows 960 apart) land in shuffled
    slots of both planes exactly as ``index_copy_`` puts them; no other slot changes."""
    gen = torch.Generator().manual_seed(9)
    tokens, slots = 37, 7 * 16
    qkv = torch.randn(tokens, 960, generator=gen).to(dtype)
    key, value = qkv[:, 576:768].view(tokens, 3, 64), qkv[:, 768:].view(tokens, 3, 64)
    slot_mapping = torch.randperm(slots, generator=gen)[:tokens]
    cache = torch.randn(2, 7, 16, 3, 64, generator=gen).to(dtype)
    expected = cache.clone()
    expected.view(2, -1, 3, 64).index_copy_(1, slot_mapping, torch.stack((key, value)))
    torch.ops.kvscope_cpu.write_kv(key, value, cache, slot_mapping)
    assert torch.equal(cache, expected)


def test_write_kv_rejects_what_it_cannot_copy_in_place():
    cache = torch.zeros(2, 2, 16, 3, 64, dtype=torch.bfloat16)
    key = torch.randn(4, 3, 64).bfloat16()
    slots = torch.arange(4)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.kvscope_cpu.write_kv(key, key, cache, torch.tensor([0, 1, 2, 32]))
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.kvscope_cpu.write_kv(key, key, cache, torch.tensor([0, -1, 2, 3]))
    with pytest.raises(RuntimeError, match="cache's dtype"):
        torch.ops.kvscope_cpu.write_kv(key.float(), key.float(), cache, slots)
    with pytest.raises(RuntimeError, match="contiguous within a token"):
        torch.ops.kvscope_cpu.write_kv(key.transpose(1, 2).contiguous().transpose(1, 2), key, cache, slots)
    with pytest.raises(RuntimeError, match="int64"):
        torch.ops.kvscope_cpu.write_kv(key, key, cache, slots.int())
    assert torch.equal(cache, torch.zeros_like(cache))  # a rejected call writes nothing


def test_backend_write_kv_and_a_fresh_prefill_read_the_same_values(monkeypatch):
    """The backend writes through the op where it applies, else stack + index_copy_: the same cache bits,
    and a fresh prompt's attention (SDPA over the K/V just written, no gather) is the same either way."""
    gen = torch.Generator().manual_seed(4)
    tokens = 40
    qkv = torch.randn(tokens, 960, generator=gen).bfloat16()
    roped = torch.randn(tokens, 12, 64, generator=gen).bfloat16()
    key, value = (
        roped[:, 9:],
        qkv[:, 768:].view(tokens, 3, 64),
    )  # as Attention.forward hands them: strided rows
    metadata = AttentionMetadata.build([tokens], [tokens], [[3, 1, 4]], 16)
    calls = []
    real = torch.ops.kvscope_cpu.write_kv
    monkeypatch.setattr(torch.ops.kvscope_cpu, "write_kv", lambda *a: calls.append(1) or real(*a))

    def step():
        backend = TorchAttentionBackend(paged_prefill=False)
        cache = torch.zeros(2, 5, 16, 3, 64, dtype=torch.bfloat16)
        backend.write_kv(key, value, cache, metadata.slot_mapping)
        return cache, backend.forward(roped[:, :9], cache, metadata, 0.125), backend

    with_op, out_op, backend = step()
    assert len(calls) == 1 and backend._buffers == {}  # nothing gathered back from the cache
    monkeypatch.setattr("kvscope.engine.attention.torch_backend.cpu_kernels_loaded", lambda: False)
    with_torch, out_torch, _ = step()
    assert len(calls) == 1
    expected = torch.zeros_like(with_op)
    expected.view(2, -1, 3, 64).index_copy_(1, metadata.slot_mapping, torch.stack((key, value)))
    assert torch.equal(with_op, expected) and torch.equal(with_torch, expected)
    assert torch.equal(out_op, out_torch)
