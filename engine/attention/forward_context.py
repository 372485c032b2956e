"""The forward context: what attention layers need during one model forward, carried by a contextvar.

``with set_forward_context(metadata, kv_caches, backend): hidden = model(input_ids, positions)`` — each
``Attention`` layer reads ``get_forward_context().kv_caches[layer_idx]`` (pattern of vLLM's
``vllm/forward_context.py``). A contextvar, not a module global, so threads and tasks stay isolated.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from kvscope.engine.attention.backend import AttentionBackend, AttentionMetadata


@dataclass(frozen=True, slots=True)
class ForwardContext:
    attn_metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]
    """One tensor per layer, [2, num_blocks, block_size, num_kv_heads, head_dim]."""
    backend: AttentionBackend


_forward_context: ContextVar[ForwardContext | None] = ContextVar("kvscope_forward_context", default=None)


@contextmanager
def set_forward_context(
    attn_metadata: AttentionMetadata, kv_caches: list[torch.Tensor], backend: AttentionBackend
) -> Iterator[ForwardContext]:
    """Install a ForwardContext for the duration of the ``with`` block (restores the previous one after)."""
    context = ForwardContext(attn_metadata=attn_metadata, kv_caches=kv_caches, backend=backend)
    token = _forward_context.set(context)
    try:
        yield context
    finally:
        _forward_context.reset(token)


def get_forward_context() -> ForwardContext:
    """The active ForwardContext. Raises RuntimeError outside ``set_forward_context``."""
    context = _forward_context.get()
    if context is None:
        raise RuntimeError(
            "no forward context: run the model inside "
            "kvscope.engine.attention.forward_context.set_forward_context()"
        )
    return context
