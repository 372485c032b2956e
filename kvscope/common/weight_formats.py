"""The engine's weight formats by name and the flags each runs with: one table for the format chooser
(engine/platform/format_choice.py), ``kvscope eval ppl`` (engine/eval/formats.py) and the capacity planner
(kvscope/plan/engine_formats.py).

A compact format quantizes the weights of the linear layers only (engine/config.py ``quantization``): int8
is weight-only with one scale per output channel, int4 groups of 32 (a Q4_0/Q4_1 GGUF's own blocks), gguf the
GGUF's Q4 tensors as int4. Activations, norms and any dense copy stay in the dense dtype, which a compact
format does not pin: the caller supplies it (the chooser: the start-up probe's; eval: float32, the reference
the quality bounds are measured against; the planner: the ``--dtype`` asked for).
"""

from __future__ import annotations

from types import MappingProxyType

WEIGHT_FORMATS = MappingProxyType(
    {
        "float32": ("float32", "none"),
        "bfloat16": ("bfloat16", "none"),
        "int8": (None, "int8"),
        "int4": (None, "int4"),
        "gguf": (None, "gguf"),
    }
)
"""Weight-format name → (the ``--dtype`` it pins, None for a compact format: the caller's dense dtype;
the ``--quantization`` it runs with)."""
VERIFIABLE_FORMATS = ("float32", "bfloat16", "int8", "gguf")
"""The names ``kvscope.common.models.registry.ModelSpec.verified_formats`` uses, highest precision first."""


def format_flags(name: str, dense_dtype: str) -> tuple[str, str]:
    """(``--dtype``, ``--quantization``) of weight format ``name``, ``dense_dtype`` standing for the dtype a
    compact format leaves open. Raises KeyError for a name not in :data:`WEIGHT_FORMATS`."""
    pinned, quantization = WEIGHT_FORMATS[name]
    return pinned or dense_dtype, quantization
