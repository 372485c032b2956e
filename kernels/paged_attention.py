"""paged_attention: causal attention of a packed varlen batch over the paged KV cache, in one kernel.

One launch serves a whole scheduler step: prefill chunks (with a cached prefix) and decodes mixed. Query token
``j`` of request ``r`` sits at position ``seq_lens[r] - query_len[r] + j`` and sees keys ``0 .. position``
(docs/architecture.md, "AttentionMetadata"). GQA: query head ``h`` reads KV head ``h // (num_heads //
num_kv_heads)``.

Grid ``(num_q_blocks, num_kv_heads, num_segments)``. A program owns ``BLOCK_Q`` consecutive query tokens of
one request times the ``GROUP`` query heads sharing one KV head (``BLOCK_M = BLOCK_Q * GROUP`` rows), so each
K/V tile is loaded once per group. Request ``r``'s q-blocks start at global index ``query_start_loc[r] //
BLOCK_Q + r``; a program finds its request by binary search, so the grid needs no host-side per-request
table (``num_q_blocks = num_tokens // BLOCK_Q + num_reqs``, surplus programs exit). Keys are walked in tiles
of ``TILE_N``, gathered token by token through ``block_tables`` (any block size, int64 offsets), with
FlashAttention-2's online softmax in fp32 (base-2 exponent, scale folded into ``log2(e)``). With
``num_segments`` > 1 (flash-decoding) each program covers one slice of the keys and writes its partial state;
:func:`kvscope.kernels.merge_attn_states.merge_attn_states` combines them.

Sources: Tri Dao, "FlashAttention-2" (2023), Algorithm 1; vLLM
``vllm/attention/ops/triton_unified_attention.py`` (q-block indexing, GQA row packing, 3D split-KV variant);
Triton tutorial 06 "Fused Attention".
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvscope.kernels._checks import (
    check_contiguous,
    check_float_dtypes,
    check_head_dim,
    check_index,
    check_innermost_contiguous,
    check_launchable,
    check_same_device,
    is_interpreted,
    next_power_of_2,
)
from kvscope.kernels.merge_attn_states import merge_attn_states

TILE_N = 32
"""Keys per inner-loop tile (>= 16 for tl.dot)."""
MAX_SEGMENTS = 16
LOG2E = 1.4426950408889634


@triton.jit
def _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q: tl.constexpr):
    """Binary search for the last request whose first q-block (``start // BLOCK_Q + r``) is <= ``q_block``."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _segment_range(kv_end, segment, NUM_SEGMENTS: tl.constexpr, TILE_N: tl.constexpr):
    """Keys ``[start, stop)`` of ``segment`` when ``[0, kv_end)`` is cut into equal runs of whole tiles."""
    tiles_per_segment = tl.cdiv(tl.cdiv(kv_end, TILE_N), NUM_SEGMENTS)
    start = segment * tiles_per_segment * TILE_N
    stop = tl.minimum(kv_end, start + tiles_per_segment * TILE_N)
    return start, stop


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """``tl.dot`` with fp32 accumulation; ``UPCAST_DOT`` feeds fp32 operands instead (exact for bf16 inputs).

    ``UPCAST_DOT`` is set only under the Triton interpreter with bf16, whose ``tl.dot`` multiplies the raw
    bf16 bit patterns (triton-lang/triton#11584; the interpreter documents bf16 arithmetic as unsupported).
    """
    if UPCAST_DOT:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, q_pos, start_n, kv_stop,
    key_cache_ptr, value_cache_ptr, block_table_ptr, head_offset, stride_cache_b, stride_cache_s, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over keys ``[start_n, start_n + TILE_N)``; returns the updated (acc, m, l)."""
    offs_n = start_n + tl.arange(0, TILE_N)
    n_mask = offs_n < kv_stop
    block_ids = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    rows = block_ids * stride_cache_b + (offs_n % BLOCK_SIZE) * stride_cache_s + head_offset
    dims = tl.arange(0, HEAD_DIM)
    k = tl.load(key_cache_ptr + rows[None, :] + dims[:, None], mask=n_mask[None, :], other=0.0)
    s = _dot(q, k, DOT_PRECISION, UPCAST_DOT) * qk_scale
    visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    v = tl.load(value_cache_ptr + rows[:, None] + dims[None, :], mask=n_mask[:, None], other=0.0)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return acc, m_new, l_i


@triton.jit
def _paged_attention_kernel(
    out_ptr, query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr,
    qk_scale, num_reqs,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_cache_b, stride_cache_s, stride_cache_h, stride_bt_r,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    """Program (q-block, kv-head, segment): ``BLOCK_Q`` tokens x ``GROUP`` heads against one key segment."""
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    req = _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + req)
    if local_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = local_block * BLOCK_Q + offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP
    row_mask = (offs_m // GROUP < BLOCK_Q) & (q_idx < q_len)
    tokens = (q_start + q_idx).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    q_ptrs = query_ptr + tokens[:, None] * stride_q_t + heads[:, None] * stride_q_h + dims[None, :]
    q = tl.load(q_ptrs, mask=row_mask[:, None], other=0.0)
    q_pos = context_len + q_idx
    kv_end = tl.minimum(seq_len, context_len + (local_block + 1) * BLOCK_Q)
    kv_start, kv_stop = _segment_range(kv_end, segment, NUM_SEGMENTS, TILE_N)
    block_table_ptr = block_tables_ptr + req.to(tl.int64) * stride_bt_r
    head_offset = kv_head.to(tl.int64) * stride_cache_h
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start_n in range(kv_start, kv_stop, TILE_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_pos, start_n, kv_stop,
            key_cache_ptr, value_cache_ptr, block_table_ptr, head_offset, stride_cache_b, stride_cache_s,
            qk_scale, HEAD_DIM, BLOCK_SIZE, TILE_N, DOT_PRECISION, UPCAST_DOT,
        )  # fmt: skip
    if NUM_SEGMENTS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = out_ptr + tokens[:, None] * stride_o_t + heads[:, None] * stride_o_h + dims[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        part = (tokens * NUM_HEADS + heads) * NUM_SEGMENTS + segment
        tl.store(part_m_ptr + part, m_i, mask=row_mask)
        tl.store(part_l_ptr + part, l_i, mask=row_mask)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_mask[:, None])


def _check_tensors(query, kv_cache, query_start_loc, seq_lens, block_tables, out) -> None:
    floats = {"query": query, "kv_cache": kv_cache} | ({"out": out} if out is not None else {})
    check_float_dtypes(**floats)
    check_index("query_start_loc", query_start_loc, torch.int32, 1)
    check_index("seq_lens", seq_lens, torch.int32, 1)
    check_index("block_tables", block_tables, torch.int32, 2)
    check_same_device(**floats, query_start_loc=query_start_loc, seq_lens=seq_lens, block_tables=block_tables)
    check_innermost_contiguous(**floats, block_tables=block_tables)
    check_contiguous(query_start_loc=query_start_loc, seq_lens=seq_lens)


def _check_shapes(query, kv_cache, query_start_loc, seq_lens, block_tables, out) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[4] != query.shape[2]:
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, {query.shape[2]}] to match query, "
            f"got {tuple(kv_cache.shape)}"
        )
    if query.shape[1] % kv_cache.shape[3]:
        raise ValueError(
            f"num_heads ({query.shape[1]}) must be a multiple of num_kv_heads ({kv_cache.shape[3]})"
        )
    check_head_dim(query.shape[2])
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_reqs + 1 or block_tables.shape[0] != num_reqs:
        raise ValueError(
            f"query_start_loc must be [num_reqs + 1] and block_tables [num_reqs, max_blocks] for {num_reqs} "
            f"requests, got {tuple(query_start_loc.shape)} and {tuple(block_tables.shape)}"
        )
    if out is not None and out.shape != query.shape:
        raise ValueError(f"out must have the query's shape {tuple(query.shape)}, got {tuple(out.shape)}")


def _check_scale(scale: float) -> None:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a Python float, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be finite and positive, got {scale}")


def choose_block_m(group: int, max_query_len: int) -> int:
    """Rows per program: 16 for decode-like batches, 64 once prefill chunks give rows to fill; >=
    ``group``."""
    rows = 16 if max_query_len * group <= 16 else 64
    return max(rows, next_power_of_2(group))


def choose_num_warps(block_m: int, head_dim: int, dtype: torch.dtype) -> int:
    """4 warps for small tiles, 8 once the fp32 accumulator and Q tile would spill registers.

    Measured with ptxas for sm_90 (docs/kernels.md): 4 warps spill at fp16 ``64 x 128`` and fp32 ``16 x 128``
    or ``64 x 64`` tiles, 8 warps spill in none of the shipped configurations.
    """
    weight = block_m * head_dim * (4 if dtype == torch.float32 else 1)
    return 4 if weight <= 4096 else 8


def choose_num_segments(
    device: torch.device, num_reqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int
) -> int:
    """Split-KV segments for a launch (a power of two, 1 = no split).

    Split only pure-decode steps (``max_query_len == 1``) on CUDA whose ``num_reqs * num_kv_heads`` programs
    leave streaming multiprocessors idle, aiming at ~2 programs per SM, keeping >= 4 key tiles per segment
    and at most ``MAX_SEGMENTS`` (the flash-decoding heuristic; vLLM splits the same way).
    """
    if device.type != "cuda" or max_query_len > 1:
        return 1
    programs = num_reqs * num_kv_heads
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= sm_count:
        return 1
    by_occupancy = next_power_of_2(-(-2 * sm_count // programs))
    by_length = 1 << max(max_seq_len // (4 * TILE_N), 1).bit_length() - 1
    return min(MAX_SEGMENTS, by_occupancy, by_length)


def paged_attention_args(
    out, query, kv_cache, query_start_loc, seq_lens, block_tables, scale, partials, block_m, num_segments
) -> dict[str, object]:
    """The kernel's keyword arguments (pointers, strides, constexprs) for already validated inputs."""
    group = query.shape[1] // kv_cache.shape[3]
    part_acc, part_m, part_l = partials
    upcast = query.dtype == torch.bfloat16 and is_interpreted(_paged_attention_kernel)
    return dict(
        out_ptr=out, query_ptr=query, key_cache_ptr=kv_cache[0], value_cache_ptr=kv_cache[1],
        block_tables_ptr=block_tables, seq_lens_ptr=seq_lens, query_start_loc_ptr=query_start_loc,
        part_acc_ptr=part_acc, part_m_ptr=part_m, part_l_ptr=part_l,
        qk_scale=float(scale) * LOG2E, num_reqs=seq_lens.shape[0],
        stride_q_t=query.stride(0), stride_q_h=query.stride(1),
        stride_o_t=out.stride(0), stride_o_h=out.stride(1),
        stride_cache_b=kv_cache.stride(1), stride_cache_s=kv_cache.stride(2),
        stride_cache_h=kv_cache.stride(3),
        stride_bt_r=block_tables.stride(0),
        NUM_HEADS=query.shape[1], GROUP=group, HEAD_DIM=query.shape[2], BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_M=block_m, BLOCK_Q=block_m // group, TILE_N=TILE_N, NUM_SEGMENTS=num_segments,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 or upcast else "tf32", UPCAST_DOT=upcast,
    )  # fmt: skip


def _partials(query: torch.Tensor, num_segments: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_tokens, num_heads, head_dim = query.shape
    shape = (num_tokens, num_heads, num_segments)
    acc = torch.empty(shape + (head_dim,), dtype=torch.float32, device=query.device)
    m = torch.empty(shape, dtype=torch.float32, device=query.device)
    return acc, m, torch.empty_like(m)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_segments: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA attention of a packed varlen batch over the paged KV cache.

    Args:
        query: ``[num_tokens, num_heads, head_dim]`` fp16/bf16/fp32, tokens packed request after request.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, same dtype and device; K/V of the
            new tokens must already be written (:func:`kvscope.kernels.reshape_and_cache.reshape_and_cache`).
        query_start_loc: int32 ``[num_reqs + 1]`` cumulative query lengths (``[0] == 0``). seq_lens: int32
        ``[num_reqs]`` context length after this step (cached + new), >= the query length. block_tables: int32
        ``[num_reqs, max_blocks]``; entries past ``cdiv(seq_len, block_size)`` are never read. scale: softmax
        scale (usually ``head_dim ** -0.5``). max_query_len, max_seq_len: host-side maxima (from
        AttentionMetadata); computed (a sync) when None. num_segments: split-KV segments (power of two <= 16);
        None picks :func:`choose_num_segments`. out: optional output buffer shaped like ``query``.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in the query dtype (``out`` when given).

    Raises:
        TypeError: a dtype is wrong (index tensors int32, float tensors fp16/bf16/fp32 and all equal) or
            ``scale`` is not a number.
        ValueError: inconsistent shapes, devices or layouts; num_heads not a multiple of num_kv_heads;
            head_dim not a power of two in [16, 256]; bad ``num_segments``; CPU tensors without
            ``TRITON_INTERPRET=1``.
    """
    _check_tensors(query, kv_cache, query_start_loc, seq_lens, block_tables, out)
    _check_shapes(query, kv_cache, query_start_loc, seq_lens, block_tables, out)
    _check_scale(scale)
    check_launchable(_paged_attention_kernel, query.device)
    out = torch.empty_like(query) if out is None else out
    num_tokens, num_reqs, num_kv_heads = query.shape[0], seq_lens.shape[0], kv_cache.shape[3]
    if num_tokens == 0 or num_reqs == 0:
        return out
    if max_query_len is None or max_seq_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
        max_seq_len = int(seq_lens.max())
    if num_segments is None:
        num_segments = choose_num_segments(query.device, num_reqs, num_kv_heads, max_query_len, max_seq_len)
    if num_segments < 1 or num_segments > MAX_SEGMENTS or num_segments & (num_segments - 1):
        raise ValueError(f"num_segments must be a power of two in [1, {MAX_SEGMENTS}], got {num_segments}")
    block_m = choose_block_m(query.shape[1] // num_kv_heads, max_query_len)
    partials = _partials(query, num_segments) if num_segments > 1 else (out, out, out)
    args = paged_attention_args(
        out, query, kv_cache, query_start_loc, seq_lens, block_tables, scale, partials, block_m, num_segments
    )
    grid = (num_tokens // args["BLOCK_Q"] + num_reqs, num_kv_heads, num_segments)
    num_warps = choose_num_warps(block_m, query.shape[2], query.dtype)
    _paged_attention_kernel[grid](**args, num_warps=num_warps)
    if num_segments > 1:
        merge_attn_states(out, *partials)
    return out


def paged_attention_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """PyTorch reference of :func:`paged_attention`: gather each request's K/V densely, fp32 softmax.

    Reads only the blocks each request uses (a sparse cache with huge block ids works). Same arguments and
    result as :func:`paged_attention`.
    """
    out = torch.empty_like(query)
    group = query.shape[1] // kv_cache.shape[3]
    block_size = kv_cache.shape[2]
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r, seq_len in enumerate(lens):
        q = query[starts[r] : starts[r + 1]].float()
        blocks = block_tables[r, : -(-seq_len // block_size)].long()
        k, v = (
            kv_cache[i, blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, 1) for i in (0, 1)
        )
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        positions = torch.arange(seq_len - q.shape[0], seq_len, device=query.device)
        hidden = torch.arange(seq_len, device=query.device)[None, :] > positions[:, None]
        probs = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
        out[starts[r] : starts[r + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
