"""The planner's arithmetic: pure functions of a ModelShape, in bytes, FLOPs and seconds (no I/O, no torch).

- KV cache: ``2 (K and V) × layers × kv_heads × head_dim × bytes`` per token, the layout of
  ``engine/worker/kv_cache.py`` (one ``[2, num_blocks, block_size, kv_heads, head_dim]`` tensor per layer);
  paged, so a sequence holds ``ceil(tokens / block_size)`` whole blocks (vLLM's PagedAttention, Kwon et al.
  2023).
- Parameters: Llama-family decoder (q, k, v, o projections, SwiGLU gate/up/down, two RMSNorms per layer, a
  final norm, an embedding and an lm_head that may be tied to it).
- FLOPs per token: ``2 × matmul parameters`` (one multiply-add per weight) plus attention, ``QKᵀ`` and ``A·V``
  at ``2 × context × heads × head_dim`` each per layer (Kaplan et al. 2020, "Scaling Laws", Table 1, counting
  both products).
- Roofline lower bounds (Williams et al. 2009): a step takes at least ``max(bytes moved / bandwidth,
  FLOPs / peak FLOP/s)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvscope.plan.shape import ModelShape

DTYPE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "fp8": 1.0}
"""Bytes per element of the activation/KV dtypes."""

QUANT_BYTES = {
    "none": None,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5 + 2 / 128,
    "q8_0": 34 / 32,
    "q4_0": 18 / 32,
    "q4_1": 20 / 32,
    "q5_k": 176 / 256,
    "q4_k": 144 / 256,
    "q6_k": 210 / 256,
}
"""Bytes per weight of the linear layers by quantization (None: the model dtype). int4 is AWQ/GPTQ style,
one fp16 scale per group of 128; the ``q*`` formats are GGML blocks (``gguf.constants.GGML_QUANT_SIZES``:
Q8_0 34 B / 32, Q4_0 18 B / 32, Q4_1 20 B / 32, Q4_K 144 B / 256, Q5_K 176 B / 256, Q6_K 210 B / 256)."""

COMPUTE_FORMAT = {"fp8": "fp8", "int8": "int8"}
"""Quantizations whose matmuls run in their own format (W8A8); the others compute in the model dtype."""


@dataclass(frozen=True, slots=True)
class ParamCounts:
    """Parameter counts of a Llama-family decoder, by part."""

    embedding: int
    per_layer: int
    final_norm: int
    lm_head: int
    """0 when tied to the embedding."""
    linear: int
    """Weights of the q/k/v/o and MLP projections over all layers (what quantization applies to)."""
    num_layers: int

    @property
    def total(self) -> int:
        return self.embedding + self.per_layer * self.num_layers + self.final_norm + self.lm_head


def param_counts(shape: ModelShape) -> ParamCounts:
    """Parameters of ``shape`` by part (exact for Llama/Mistral/Qwen2/Qwen3 as engine/models/llama.py
    builds them)."""
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    attn = shape.hidden_size * (q + 2 * kv) + q * shape.hidden_size
    mlp = 3 * shape.hidden_size * shape.intermediate_size
    extra = (
        2 * shape.hidden_size
        + ((q + 2 * kv) if shape.qkv_bias else 0)
        + (2 * shape.head_dim if shape.qk_norm else 0)
    )
    embedding = shape.vocab_size * shape.hidden_size
    return ParamCounts(
        embedding=embedding,
        per_layer=attn + mlp + extra,
        final_norm=shape.hidden_size,
        lm_head=0 if shape.tie_word_embeddings else embedding,
        linear=(attn + mlp) * shape.num_layers,
        num_layers=shape.num_layers,
    )


def weight_bytes(shape: ModelShape, dtype: str, quantization: str = "none") -> int:
    """Bytes of all weights: linear layers at ``QUANT_BYTES[quantization]`` (the dtype when ``none``),
    embeddings, norms and biases at ``dtype``. Raises KeyError for an unknown dtype/quantization."""
    counts = param_counts(shape)
    dtype_b = DTYPE_BYTES[dtype]
    linear_b = QUANT_BYTES[quantization] or dtype_b
    rest = counts.total - counts.linear
    return math.ceil(counts.linear * linear_b + rest * dtype_b)


def streamed_weight_bytes(shape: ModelShape, dtype: str, quantization: str = "none") -> int:
    """Weight bytes one forward pass reads: all of them except an untied embedding table (a lookup reads
    only the rows of the batch's tokens)."""
    untied_embedding = 0 if shape.tie_word_embeddings else param_counts(shape).embedding * DTYPE_BYTES[dtype]
    return weight_bytes(shape, dtype, quantization) - int(untied_embedding)


def matmul_params(shape: ModelShape) -> int:
    """Weights used in a matmul per token: the linear layers plus the lm_head (tied or not)."""
    return param_counts(shape).linear + shape.vocab_size * shape.hidden_size


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str) -> int:
    """``2 × num_layers × num_kv_heads × head_dim × bytes(kv_dtype)`` (bytes). Raises KeyError for a bad
    dtype."""
    return int(2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * DTYPE_BYTES[kv_dtype])


def blocks_for(tokens: int, block_size: int) -> int:
    """Paged KV blocks a sequence of ``tokens`` holds: ``ceil(tokens / block_size)``."""
    return -(-tokens // block_size)


def kv_bytes_per_sequence(shape: ModelShape, kv_dtype: str, tokens: int, block_size: int) -> int:
    """Bytes of KV cache one sequence of ``tokens`` holds, whole blocks (bytes)."""
    return blocks_for(tokens, block_size) * block_size * kv_bytes_per_token(shape, kv_dtype)


def num_kv_blocks(budget_bytes: int, shape: ModelShape, kv_dtype: str, block_size: int) -> int:
    """KV blocks that fit ``budget_bytes`` (as engine_core sizes the cache: budget // bytes per block)."""
    return max(0, budget_bytes) // (block_size * kv_bytes_per_token(shape, kv_dtype))


def max_concurrent_sequences(num_blocks: int, tokens: int, block_size: int) -> int:
    """Sequences of ``tokens`` each that ``num_blocks`` hold at once (no prefix sharing)."""
    return num_blocks // blocks_for(tokens, block_size)


def decode_flops(shape: ModelShape, batch: int, context: int) -> float:
    """FLOPs of one decode step of ``batch`` sequences each attending to ``context`` tokens."""
    attention = 4 * shape.num_layers * shape.num_heads * shape.head_dim * context
    return batch * (2.0 * matmul_params(shape) + attention)


def prefill_flops(shape: ModelShape, tokens: int) -> float:
    """FLOPs of prefilling one prompt of ``tokens`` (causal attention: ``Σ position`` ≈ tokens²/2 pairs)."""
    attention = 2 * shape.num_layers * shape.num_heads * shape.head_dim * tokens * (tokens + 1)
    return 2.0 * matmul_params(shape) * tokens + attention


@dataclass(frozen=True, slots=True)
class Roofline:
    """One lower bound: the step cannot be faster than moving ``bytes`` or computing ``flops``."""

    bytes: float
    flops: float
    bandwidth: float
    """bytes/s"""
    peak_flops: float
    """FLOP/s"""

    @property
    def memory_s(self) -> float:
        return self.bytes / self.bandwidth

    @property
    def compute_s(self) -> float:
        return self.flops / self.peak_flops

    @property
    def seconds(self) -> float:
        return max(self.memory_s, self.compute_s)

    @property
    def bound(self) -> str:
        return "memory" if self.memory_s >= self.compute_s else "compute"


def decode_step(
    shape: ModelShape,
    batch: int,
    context: int,
    streamed_bytes: int,
    kv_dtype: str,
    bandwidth: float,
    peak_flops: float,
) -> Roofline:
    """Decode step bound: ``(streamed weight bytes + batch × context × KV bytes/token) / bandwidth`` vs
    ``decode_flops / peak``."""
    kv_read = batch * context * kv_bytes_per_token(shape, kv_dtype)
    return Roofline(streamed_bytes + kv_read, decode_flops(shape, batch, context), bandwidth, peak_flops)


def prefill(
    shape: ModelShape, tokens: int, streamed_bytes: int, bandwidth: float, peak_flops: float
) -> Roofline:
    """Prefill bound (the TTFT of a request alone on the device): ``2 × params × tokens / peak`` (plus
    attention) vs one pass over the weights."""
    return Roofline(streamed_bytes, prefill_flops(shape, tokens), bandwidth, peak_flops)
