"""reshape_and_cache: write the new tokens' keys and values into the paged KV cache.

Layout (docs/architecture.md, "KV cache layout"): ``kv_cache`` is ``[2, num_blocks, block_size, num_kv_heads,
head_dim]`` (``[0]`` keys, ``[1]`` values) and slot ``s`` is ``block_id * block_size + offset``. Token ``t``'s
K/V go to slot ``slot_mapping[t]``; a negative slot marks a padding token and is skipped. Same contract as
vLLM's ``reshape_and_cache_flash`` (csrc/cache_kernels.cu). Offsets are int64: ``block_id * stride`` passes
2**31 elements for a cache of a few GB.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscope.kernels._checks import (
    check_float_dtypes,
    check_head_dim,
    check_index,
    check_innermost_contiguous,
    check_launchable,
    check_same_device,
    next_power_of_2,
)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_cache_b,
    stride_cache_s,
    stride_cache_h,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """One program per token: copy its ``[num_kv_heads, head_dim]`` K and V rows to their slot."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_P2)
    dims = tl.arange(0, HEAD_DIM)
    mask = (heads < NUM_KV_HEADS)[:, None]
    block_id = slot // BLOCK_SIZE
    dst = block_id * stride_cache_b + (slot % BLOCK_SIZE) * stride_cache_s
    dst = dst + heads[:, None] * stride_cache_h + dims[None, :]
    key = tl.load(key_ptr + token * stride_key_t + heads[:, None] * stride_key_h + dims[None, :], mask=mask)
    value = tl.load(
        value_ptr + token * stride_value_t + heads[:, None] * stride_value_h + dims[None, :], mask=mask
    )
    tl.store(key_cache_ptr + dst, key, mask=mask)
    tl.store(value_cache_ptr + dst, value, mask=mask)


def _check_args(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    check_float_dtypes(key=key, value=value, kv_cache=kv_cache)
    check_index("slot_mapping", slot_mapping, torch.int64, 1)
    check_same_device(key=key, value=value, kv_cache=kv_cache, slot_mapping=slot_mapping)
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            "key and value must both be [num_tokens, num_kv_heads, head_dim], "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != key.shape[1:]:
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, {key.shape[1]}, {key.shape[2]}] to match key, "
            f"got {tuple(kv_cache.shape)}"
        )
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
    check_head_dim(key.shape[2])
    check_innermost_contiguous(key=key, value=value, kv_cache=kv_cache, slot_mapping=slot_mapping)


def reshape_and_cache_args(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> dict[str, object]:
    """The kernel's keyword arguments (pointers, strides and constexprs) for already validated inputs."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    return dict(
        key_ptr=key,
        value_ptr=value,
        key_cache_ptr=kv_cache[0],
        value_cache_ptr=kv_cache[1],
        slot_mapping_ptr=slot_mapping,
        stride_key_t=key.stride(0),
        stride_key_h=key.stride(1),
        stride_value_t=value.stride(0),
        stride_value_h=value.stride(1),
        stride_cache_b=kv_cache.stride(1),
        stride_cache_s=kv_cache.stride(2),
        stride_cache_h=kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_P2=next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_cache.shape[2],
    )


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``key``/``value`` into ``kv_cache`` at ``slot_mapping`` (in place).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]`` fp16/bf16/fp32, last dim contiguous (a view into
            a fused qkv projection is fine).
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, same dtype and device.
        slot_mapping: int64 ``[num_tokens]``; slot ``block_id * block_size + offset``, negative = skip.
            Slots must be below ``num_blocks * block_size`` (not checked: that would need a device sync).

    Raises:
        TypeError: a dtype is wrong or the float dtypes differ.
        ValueError: shapes disagree, tensors are on different devices, the last dim is strided, head_dim is
            not a power of two in [16, 256], or the tensors are on CPU without ``TRITON_INTERPRET=1``.
    """
    _check_args(key, value, kv_cache, slot_mapping)
    check_launchable(_reshape_and_cache_kernel, key.device)
    if key.shape[0] == 0:
        return
    args = reshape_and_cache_args(key, value, kv_cache, slot_mapping)
    _reshape_and_cache_kernel[(key.shape[0],)](**args, num_warps=1)


def reshape_and_cache_ref(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """PyTorch reference of :func:`reshape_and_cache`: indexed assignment of the non-negative slots."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    block_size = kv_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, offsets] = key[valid]
    kv_cache[1, blocks, offsets] = value[valid]
