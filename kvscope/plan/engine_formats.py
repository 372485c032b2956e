"""Bytes the kvscope engine holds per weight format on CPU (``kvscope plan --weights-format``), exactly as
engine/models/layers.py, engine/weights/quant.py and engine/platform/compact.py build them
(``kvscope.engine.platform.compact.model_weight_bytes`` measures the same count;
tests/plan/test_engine_formats.py checks it against the loaded SmolLM2-135M).

Per matrix weight of the linear layers and the LM head (``d`` = bytes of the dense dtype, 4 float32 / 2
bfloat16):

- ``float32``/``bfloat16``: ``2·d`` — the weight re-pointed at its column-major copy plus oneDNN's packed copy
  (``Linear.prepare_for_cpu``); a tied embedding is that column-major copy, so it costs nothing more.
- ``int8``: ``1 + d`` plus 2 B (a bfloat16 scale) per output row — the int8 matrix and the dense packed copy
used
  above the probe's crossover (``CompactLinearKernel``); the LM head too (tied: an int8 copy beside the
  embedding, which stays dense for lookups).
- ``int4``/``gguf``: ``0.625 + d`` for the decoder projections — 4-bit codes plus a bfloat16 scale and zero
per
  group of 32 (the GGUF's Q4_0/Q4_1 block, 20 B / 32 weights) and the dense copy; the LM head stays dense
  (``2·d``) and, with kvscope's CPU kernels (kernels/cpu_decode.py, CPUs with AVX-512 VNNI or AVX2:
  ``q8_head``), also gets a Q8_0-style copy (32 codes + a float16 scale and min per block: 36 B / 32
  weights) for decode rows.
  ``gguf`` is planned as a Q4 GGUF (every projection Q4_0/Q4_1, as SmolLM2's).

Everything else (the untied embedding table, norms, biases) is ``d`` per parameter. ``dense_copy=False``
drops the ``+ d`` of compact layers: the engine keeps no dense copy when its probe finds the compact kernel
faster at every batch size (``kernel_probe.NO_DENSE``).
"""

from __future__ import annotations

from types import MappingProxyType

from kvscope.common.weight_formats import WEIGHT_FORMATS, format_flags
from kvscope.plan import formulas as f
from kvscope.plan.shape import ModelShape

ENGINE_FORMATS = WEIGHT_FORMATS
"""``--weights-format`` → (``--dtype`` it pins, None = the ``--dtype`` asked for; ``--quantization``): the
engine's own table, ``kvscope.common.weight_formats``."""
INT4_BYTES = 20 / 32
"""int4 groups of 32: 16 B of codes + a bfloat16 scale and zero (the GGUF Q4_1 block size)."""
SCALE_BYTES = 2
"""int8: one bfloat16 scale per output row."""
Q8_HEAD_BYTES = 36 / 32
"""The 8-bit LM-head copy of kvscope's CPU kernels: 32 codes + a float16 scale and min per block of 32."""
SPEED_QUANTIZATION = MappingProxyType({"none": "none", "int8": "q8_0", "int4": "q4_1", "gguf": "q4_1"})
"""The streamed-bytes model of the speed rows (formulas.QUANT_BYTES) closest to each engine format: GGML
Q4_1 is the engine's int4 byte for byte; Q8_0 (34 B / 32) stands in for int8 (1 B + 2 B per row)."""


def format_dtype(weights_format: str, dtype: str) -> str:
    """The dense dtype the engine runs ``weights_format`` in: its own for float32/bfloat16, else ``dtype``."""
    return format_flags(weights_format, dtype)[0]


def linear_rows(shape: ModelShape) -> int:
    """Output rows of every decoder projection (fused qkv, o, gate_up, down) over all layers."""
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return shape.num_layers * (
        q + 2 * kv + shape.hidden_size + 2 * shape.intermediate_size + shape.hidden_size
    )


def engine_weight_bytes(
    shape: ModelShape,
    weights_format: str,
    dtype: str = "bfloat16",
    dense_copy: bool = True,
    q8_head: bool = True,
    amx_copy: bool = False,
) -> int:
    """Bytes of weights the engine holds for ``weights_format`` (module doc); ``dtype``: the dense dtype of
    the compact formats (the engine's ``--dtype auto``: bfloat16 where its probe finds it faster, else
    float32); ``q8_head``: int4/gguf with kvscope's CPU kernels (the engine's default where they build;
    False for ``--cpu-kernels torch`` or a CPU with neither AVX-512 VNNI nor AVX2); ``amx_copy``: int4/gguf
    layers also hold the 4-bit copy of kvscope's AMX matmul (a CPU with AMX-BF16 whose start-up probe found it
    faster than the dense copy for batched rows). Raises KeyError for an unknown format or dtype."""
    quantization = ENGINE_FORMATS[weights_format][1]
    d = f.DTYPE_BYTES[format_dtype(weights_format, dtype)]
    counts = f.param_counts(shape)
    head = shape.vocab_size * shape.hidden_size  # the LM head matrix (tied: the embedding's)
    small = counts.total - counts.linear - counts.embedding - counts.lm_head  # norms, biases
    untied_embedding = 0 if shape.tie_word_embeddings else counts.embedding
    copy = d if dense_copy else 0
    if quantization == "none":
        matrices = 2 * d * (counts.linear + head)
    elif quantization == "int8":
        matrices = (1 + copy) * (counts.linear + head) + SCALE_BYTES * (linear_rows(shape) + shape.vocab_size)
        untied_embedding = counts.embedding  # the embedding stays dense beside the int8 LM head
    else:
        amx = INT4_BYTES if amx_copy else 0
        matrices = (INT4_BYTES + copy + amx) * counts.linear + (
            2 * d + (Q8_HEAD_BYTES if q8_head else 0)
        ) * head
    return round(matrices + d * (untied_embedding + small))


def bytes_per_linear_weight(weights_format: str, dtype: str = "bfloat16", dense_copy: bool = True) -> float:
    """Bytes per weight of a decoder projection in ``weights_format`` (the int8 row scales left out)."""
    quantization = ENGINE_FORMATS[weights_format][1]
    d = f.DTYPE_BYTES[format_dtype(weights_format, dtype)]
    copy = d if dense_copy else 0
    return {"none": 2 * d, "int8": 1 + copy}.get(quantization, INT4_BYTES + copy)
