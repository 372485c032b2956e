"""Host-memory accounting of the engine: the CPU KV-cache budget given the loaded weights, and process RSS."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from kvscope.engine.config import CacheConfig

if TYPE_CHECKING:
    import torch


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements: elements (the product of its shape) × element size. From the shape, so
    it also holds for opaque oneDNN tensors, which have no storage to ask."""
    return math.prod(t.shape) * t.element_size()


def cpu_kv_budget(cache: CacheConfig, weights_bytes: int) -> int:
    """KV-cache bytes on CPU: ``cache.memory_budget − weights_bytes`` when a total budget is set (weights
    of the loaded format: packed int4/int8 plus any dense copy kept for batched rows), else
    ``cache.kv_cache_memory``. Raises ValueError when the weights alone fill the total budget."""
    if cache.memory_budget is None:
        return cache.kv_cache_memory
    left = cache.memory_budget - weights_bytes
    if left <= 0:
        raise ValueError(
            f"--memory-budget {cache.memory_budget} B is not above the weights' {weights_bytes} B; "
            "raise it or use a more compact --quantization"
        )
    return left


def with_kv_budget(cache: CacheConfig, weights_bytes: int) -> CacheConfig:
    """``cache`` with ``kv_cache_memory`` = :func:`cpu_kv_budget` (what ``budget_num_blocks`` reads on
    CPU)."""
    return replace(cache, kv_cache_memory=cpu_kv_budget(cache, weights_bytes))


def process_memory_bytes(status: Path = Path("/proc/self/status")) -> tuple[int, int]:
    """(resident set size, peak resident set size) of this process in bytes, from ``VmRSS``/``VmHWM`` of
    /proc/self/status (Linux, proc(5)); (0, 0) where it cannot be read."""
    try:
        text = status.read_text()
    except OSError:
        return 0, 0
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)

    def kib(name: str) -> int:
        value = fields.get(name, "0 kB").split()
        return int(value[0]) * 1024 if value else 0

    return kib("VmRSS"), kib("VmHWM")
