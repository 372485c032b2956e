"""KV-cache sizing and allocation (layout: docs/architecture.md, "KV cache layout"). The formula is vLLM's
``AttentionSpec.page_size_bytes`` (vllm/v1/kv_cache_interface.py, https://github.com/vllm-project/vllm):
2 (K and V) × layers × block_size × kv_heads × head_dim × bytes per element."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvscope.engine.config import CacheConfig


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The shape of the paged KV cache of one model: one tensor per layer,
    ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` in ``dtype`` (vLLM's ``AttentionSpec``)."""

    num_layers: int
    block_size: int
    """Tokens per block."""
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def from_hf_config(cls, hf_config: dict, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """The spec of a HF ``config.json`` dict (``num_key_value_heads`` defaults to the attention heads,
        ``head_dim`` to hidden_size / heads)."""
        heads = hf_config["num_attention_heads"]
        return cls(
            num_layers=hf_config["num_hidden_layers"],
            block_size=block_size,
            num_kv_heads=hf_config.get("num_key_value_heads") or heads,
            head_dim=hf_config.get("head_dim") or hf_config["hidden_size"] // heads,
            dtype=dtype,
        )

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over all layers (:func:`kv_cache_bytes_per_block`)."""
        return kv_cache_bytes_per_block(
            self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype
        )

    def allocate(self, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
        """One zeroed tensor per layer (:func:`allocate_kv_caches`)."""
        return allocate_kv_caches(
            self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim, self.dtype, device
        )


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of one KV block over all layers: 2 (K and V) × layers × block_size × kv_heads × head_dim ×
    bytes."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """One zeroed tensor per layer, shape [2, num_blocks, block_size, num_kv_heads, head_dim]."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def budget_num_blocks(cache: CacheConfig, device: torch.device, per_block: int) -> int:
    """KV blocks that fit the budget: on CUDA, free memory after the model load minus
    ``total × (1 − gpu_memory_utilization)``; elsewhere ``cache.kv_cache_memory`` bytes.
    Raises ValueError when the budget is smaller than one block of ``per_block`` bytes."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(free - total * (1.0 - cache.gpu_memory_utilization))
    else:
        budget = cache.kv_cache_memory
    if budget < per_block:
        raise ValueError(f"KV cache budget of {budget} bytes is smaller than one block ({per_block} bytes)")
    return budget // per_block
