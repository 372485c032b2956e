"""Argument checks shared by the kernel launchers.

A Triton kernel reads raw pointers: a wrong dtype, device, layout or shape shows up as garbage or an illegal
memory access, far from its cause. Every launcher therefore validates its arguments here first and raises
``TypeError`` (wrong dtype) or ``ValueError`` (wrong shape, device, layout) with a message naming the
argument.
"""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 256


def check_float_dtypes(**tensors: torch.Tensor) -> torch.dtype:
    """Check that all ``tensors`` share one dtype among fp16/bf16/fp32 and return it.

    Raises:
        TypeError: a dtype is not floating fp16/bf16/fp32, or two tensors differ.
    """
    dtypes = {name: t.dtype for name, t in tensors.items()}
    for name, dtype in dtypes.items():
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {dtype}")
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{name}={dtype}" for name, dtype in dtypes.items())
        raise TypeError(f"dtypes must all be equal, got {listed}")
    return next(iter(dtypes.values()))


def check_index(name: str, tensor: torch.Tensor, dtype: torch.dtype, ndim: int) -> None:
    """Check an index tensor (``slot_mapping``, ``block_tables`` ...): exact integer dtype and rank.

    Raises:
        TypeError: wrong dtype.  ValueError: wrong number of dimensions.
    """
    if tensor.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {tensor.dtype}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(tensor.shape)}")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """Check that all ``tensors`` live on one device and return it. Raises ValueError."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{name}={device}" for name, device in devices.items())
        raise ValueError(f"tensors must be on one device, got {listed}")
    return next(iter(devices.values()))


def check_innermost_contiguous(**tensors: torch.Tensor) -> None:
    """Check ``stride(-1) == 1`` (the kernels vectorise along the last dimension). Raises ValueError."""
    for name, t in tensors.items():
        if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")


def check_contiguous(**tensors: torch.Tensor) -> None:
    """Check full contiguity (small index vectors read with unit stride). Raises ValueError."""
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got shape {tuple(t.shape)} strides {t.stride()}")


def check_head_dim(head_dim: int) -> None:
    """head_dim must be a power of two in [16, 256] (tl.arange and tl.dot tile sizes). Raises ValueError."""
    if head_dim < MIN_HEAD_DIM or head_dim > MAX_HEAD_DIM or head_dim & (head_dim - 1):
        raise ValueError(
            f"head_dim must be a power of two in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}] (e.g. 64 or 128), got "
            f"{head_dim}"
        )


def is_interpreted(kernel: object) -> bool:
    """True when ``kernel`` was decorated under ``TRITON_INTERPRET=1`` (it runs on CPU, in numpy)."""
    return isinstance(kernel, InterpretedFunction)


def check_launchable(kernel: object, device: torch.device) -> None:
    """A compiled kernel needs a CUDA tensor; CPU tensors only run under the interpreter (TRITON_INTERPRET=1).

    Raises:
        ValueError: ``device`` is not CUDA and ``kernel`` was not built by the Triton interpreter.
    """
    if device.type == "cuda" or is_interpreted(kernel):
        return
    raise ValueError(
        f"Triton kernels need CUDA tensors, got device {device}; "
        "set TRITON_INTERPRET=1 before importing kernels to run them on CPU (slow, for tests)"
    )


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(n - 1, 0).bit_length()
