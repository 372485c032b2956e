"""Choosing the attention backend for a device (vLLM's ``attention/selector.py``)."""

from __future__ import annotations

import torch

from kvscope.engine.attention.backend import AttentionBackend
from kvscope.engine.attention.torch_backend import TorchAttentionBackend

BACKEND_NAMES = ("auto", "torch", "triton")


def get_attention_backend(name: str = "auto", device: torch.device | str = "cpu") -> AttentionBackend:
    """``torch`` → TorchAttentionBackend; ``triton`` → TritonAttentionBackend (CUDA only, imported lazily);
    ``auto`` → Triton on CUDA, torch elsewhere. Raises ValueError for an unknown name or Triton off CUDA."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention backend must be one of {BACKEND_NAMES}, got {name!r}")
    on_cuda = torch.device(device).type == "cuda"
    if name == "torch" or (name == "auto" and not on_cuda):
        return TorchAttentionBackend()
    if not on_cuda:
        raise ValueError(f"the triton attention backend needs a CUDA device, got {device}")
    from kvscope.engine.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()
