"""The weight formats ``kvscope eval ppl`` compares, and the quality bound of each."""

from __future__ import annotations

from dataclasses import dataclass

from kvscope.common.weight_formats import VERIFIABLE_FORMATS, WEIGHT_FORMATS, format_flags

DTYPES = ("float32", "bfloat16", "auto")
QUANTIZATIONS = ("none", "int8", "int4", "gguf", "auto")
REFERENCE = "float32"
NAMED_FORMATS: dict[str, tuple[str, str]] = {
    **{name: format_flags(name, REFERENCE) for name in WEIGHT_FORMATS},
    "auto": ("auto", "auto"),
}
"""Format name → (``--dtype``, ``--quantization``) as the engine takes them: the engine's weight formats
(``kvscope.common.weight_formats``), compact ones with float32 activations (the reference, so a bound
measures the weights' quantization alone); ``auto`` is what ``kvscope serve`` and ``kvscope engine`` load by
default (the fastest verified format by the start-up probe, engine/platform/format_choice.py).
``DTYPE/QUANTIZATION`` (e.g. ``bfloat16/gguf``, ``auto/none``) names any other pair."""
DEFAULT_FORMATS = ("float32", "bfloat16", "int8", "gguf", "auto")

BOUND_PCT = {"bfloat16": 1.0, "int8": 1.0, "int4": 0.5, "gguf": 0.5, "float32": 0.0}
"""Largest perplexity increase over float32 (percent) each part of a format may add: bfloat16 and int8
+1 %, int4 from the GGUF's Q4_1 blocks +0.5 %; float32 is the reference itself (0). What each format
measured against them: docs/benchmarks.md "Quality of the weight formats"."""


class FormatError(ValueError):
    """A ``--formats`` entry that is not a known format."""


@dataclass(frozen=True, slots=True)
class FormatSpec:
    """One format: its name on the command line and the engine options it runs with."""

    name: str
    dtype: str
    quantization: str

    def bound_pct(self, resolved_dtype: str, resolved_quantization: str | None = None) -> float:
        """The bound for this format once ``auto`` is resolved (``resolved_dtype``: float32 or bfloat16;
        ``resolved_quantization``: what ``--quantization auto`` loaded, default this format's own): the
        quantization's bound when there is one (it dominates: int4/gguf +0.5 % also with bfloat16
        activations), else the dtype's."""
        quantization = resolved_quantization or self.quantization
        if quantization not in ("none", "auto"):
            return BOUND_PCT[quantization]
        return BOUND_PCT[resolved_dtype]

    @property
    def verified_name(self) -> str | None:
        """The name ``kvscope.common.models.registry.ModelSpec.verified_formats`` uses for it (float32,
        bfloat16, int8, gguf), or None for another pair."""
        return self.name if self.name in VERIFIABLE_FORMATS else None


def parse_format(text: str) -> FormatSpec:
    """A format name (:data:`NAMED_FORMATS`) or ``DTYPE/QUANTIZATION``. Raises FormatError listing the
    choices."""
    name = text.strip()
    if name in NAMED_FORMATS:
        return FormatSpec(name, *NAMED_FORMATS[name])
    dtype, sep, quant = name.partition("/")
    if sep and dtype in DTYPES and quant in QUANTIZATIONS:
        return FormatSpec(name, dtype, quant)
    raise FormatError(
        f"unknown format {name!r}: use one of {', '.join(NAMED_FORMATS)} or DTYPE/QUANTIZATION "
        f"with DTYPE in {', '.join(DTYPES)} and QUANTIZATION in {', '.join(QUANTIZATIONS)}"
    )


def parse_formats(text: str) -> list[FormatSpec]:
    """Comma-separated formats, duplicates dropped, float32 (the reference) first, added when missing.
    Raises FormatError for an unknown or empty list."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise FormatError("--formats is empty")
    specs: list[FormatSpec] = []
    for name in [REFERENCE, *names]:
        spec = parse_format(name)
        if spec not in specs:
            specs.append(spec)
    return specs
