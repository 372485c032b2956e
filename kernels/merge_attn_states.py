"""merge_attn_states: combine split-KV partial attention results (the second pass of flash-decoding).

With ``num_segments`` > 1, :mod:`kvscope.kernels.paged_attention` splits each query's keys into segments and
writes, per (token, head, segment), the running softmax state of FlashAttention-2's online softmax: the row
max ``m`` (in log2 units, i.e. ``max_j s_j * log2(e)``), the sum ``l = sum_j 2**(s_j*log2(e) - m)`` and the
unnormalised output ``acc = sum_j 2**(...) v_j``. Merging them is exact:

    M = max_s m_s;  w_s = 2**(m_s - M);  out = (sum_s w_s acc_s) / (sum_s w_s l_s)

An empty segment has ``m = -inf, l = 0, acc = 0`` and weight 0. Sources: Tri Dao et al., "Flash-Decoding for
long-context inference" (2023); vLLM ``vllm/attention/ops/triton_merge_attn_states.py`` and the reduce step
of ``triton_unified_attention.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscope.kernels._checks import check_float_dtypes, check_head_dim, check_launchable, check_same_device


@triton.jit
def _merge_attn_states_kernel(
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    stride_o_t,
    stride_o_h,
    NUM_HEADS: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """One program per (token, head): weight the segments by ``2**(m_s - M)`` and normalise."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    rows = (token * NUM_HEADS + head) * NUM_SEGMENTS + tl.arange(0, NUM_SEGMENTS)
    dims = tl.arange(0, HEAD_DIM)
    m = tl.load(part_m_ptr + rows)
    l_sum = tl.load(part_l_ptr + rows)
    m_max = tl.max(m, axis=0)
    weight = tl.where(m == float("-inf"), 0.0, tl.math.exp2(m - m_max))
    acc = tl.load(part_acc_ptr + rows[:, None] * HEAD_DIM + dims[None, :])
    total = tl.sum(weight * l_sum, axis=0)
    out = tl.sum(acc * weight[:, None], axis=0) / total
    tl.store(out_ptr + token * stride_o_t + head * stride_o_h + dims, out.to(out_ptr.dtype.element_ty))


def _check_args(
    out: torch.Tensor, part_acc: torch.Tensor, part_m: torch.Tensor, part_l: torch.Tensor
) -> None:
    check_float_dtypes(out=out)
    for name, t in (("part_acc", part_acc), ("part_m", part_m), ("part_l", part_l)):
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    check_same_device(out=out, part_acc=part_acc, part_m=part_m, part_l=part_l)
    if part_acc.dim() != 4 or out.shape != part_acc.shape[:2] + part_acc.shape[3:]:
        raise ValueError(
            "part_acc must be [num_tokens, num_heads, num_segments, head_dim] matching out "
            f"[num_tokens, num_heads, head_dim], got {tuple(part_acc.shape)} and {tuple(out.shape)}"
        )
    if part_m.shape != part_acc.shape[:3] or part_l.shape != part_acc.shape[:3]:
        raise ValueError(f"part_m and part_l must be {tuple(part_acc.shape[:3])}")
    num_segments = part_acc.shape[2]
    if num_segments & (num_segments - 1):
        raise ValueError(f"num_segments must be a power of two, got {num_segments}")
    check_head_dim(out.shape[2])
    if out.stride(-1) != 1:
        raise ValueError("out must be contiguous in its last dimension")


def merge_attn_states(
    out: torch.Tensor, part_acc: torch.Tensor, part_m: torch.Tensor, part_l: torch.Tensor
) -> torch.Tensor:
    """Merge per-segment partial attention states into ``out`` (in place; returns ``out``).

    Args:
        out: ``[num_tokens, num_heads, head_dim]`` fp16/bf16/fp32, last dim contiguous.
        part_acc: fp32 ``[num_tokens, num_heads, num_segments, head_dim]``, unnormalised outputs, contiguous.
        part_m: fp32 ``[num_tokens, num_heads, num_segments]``, row max in log2 units (-inf: empty segment).
        part_l: fp32 ``[num_tokens, num_heads, num_segments]``, softmax denominators relative to ``part_m``.
            Every (token, head) needs at least one non-empty segment.

    Raises:
        TypeError: wrong dtypes.  ValueError: inconsistent shapes, devices or layouts, non power-of-two
            ``num_segments``, or CPU tensors without ``TRITON_INTERPRET=1``.
    """
    _check_args(out, part_acc, part_m, part_l)
    check_launchable(_merge_attn_states_kernel, out.device)
    num_tokens, num_heads, num_segments, head_dim = part_acc.shape
    if num_tokens == 0:
        return out
    _merge_attn_states_kernel[(num_tokens, num_heads)](
        out, part_acc, part_m, part_l, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, NUM_SEGMENTS=num_segments, HEAD_DIM=head_dim, num_warps=2,
    )  # fmt: skip
    return out


def merge_attn_states_ref(part_acc: torch.Tensor, part_m: torch.Tensor, part_l: torch.Tensor) -> torch.Tensor:
    """PyTorch reference of :func:`merge_attn_states`; returns fp32 ``[num_tokens, num_heads, head_dim]``."""
    m_max = part_m.amax(dim=2, keepdim=True)
    weight = torch.where(part_m == float("-inf"), 0.0, torch.exp2(part_m - m_max))
    total = (weight * part_l).sum(dim=2, keepdim=True)
    return (part_acc * weight.unsqueeze(-1)).sum(dim=2) / total
