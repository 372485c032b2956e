"""``PlanRequest``: what to plan for (the ``kvscope plan`` options), validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

from kvscope.common import engine_defaults
from kvscope.plan import engine_formats as ef
from kvscope.plan import formulas as f
from kvscope.plan.devices import CPU

DEFAULT_MAX_NUM_BATCHED_TOKENS = engine_defaults.MAX_NUM_BATCHED_TOKENS
"""The engine's prefill token budget per step (declared once in kvscope.common.engine_defaults)."""
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", *f.QUANT_BYTES)


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """What to plan for (the ``kvscope plan`` options). ``auto`` values are decided per device by
    kvscope/plan/resolve.py before any figure is computed."""

    model: str
    device: str = CPU
    dtype: str = "auto"
    """``auto``: the checkpoint's dtype on a GPU, the probe's faster one on the CPU (resolve.py)."""
    quantization: str = "auto"
    """``auto``: none on a GPU, the engine's default weight format on the CPU (resolve.py)."""
    kv_cache_dtype: str = "auto"
    """``auto`` = the model dtype."""
    max_model_len: int | None = None
    """None = the model's max_position_embeddings, lowered to what fits (never below the workload)."""
    concurrency: int | None = None
    gpu_memory_utilization: float = engine_defaults.GPU_MEMORY_UTILIZATION
    kv_cache_memory: int | None = None
    """CPU KV budget (bytes); None = what ``concurrency`` (or the RAM) needs."""
    block_size: int = engine_defaults.BLOCK_SIZE
    prompt_len: int = 128
    output_len: int = 128
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    ttft_slo_s: float = 1.0
    weights_format: str | None = None
    """The kvscope engine's CPU weight format (``float32``, ``bfloat16``, ``int8``, ``int4``, ``gguf``):
    weights are counted as the engine holds them (kvscope/plan/engine_formats.py, compact formats with
    ``dtype`` as their dense dtype) and the recommended flags name ``--dtype``/``--quantization``. None:
    ``dtype``/``quantization`` as a generic format (formulas.weight_bytes)."""
    tensor_parallel_size: int = 1
    """GPUs of ``device`` the model is split over (vLLM's ``--tensor-parallel-size``): each holds 1/N of the
    weights and of the KV heads."""

    def __post_init__(self) -> None:
        _choice("dtype", self.dtype, DTYPES)
        if self.weights_format is not None:
            _choice("weights_format", self.weights_format, tuple(ef.ENGINE_FORMATS))
        _choice("quantization", self.quantization, QUANTIZATIONS)
        _choice("kv_cache_dtype", self.kv_cache_dtype, ("auto", *f.DTYPE_BYTES))
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two in [1, 128], got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("max_model_len", "concurrency", "kv_cache_memory"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if min(self.prompt_len, self.output_len, self.max_num_batched_tokens) < 1 or self.ttft_slo_s <= 0:
            raise ValueError("prompt_len, output_len, max_num_batched_tokens and ttft_slo_s must be positive")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")

    @property
    def kv_dtype(self) -> str:
        """The KV cache's dtype (the model dtype for ``auto``; call on a resolved request)."""
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
