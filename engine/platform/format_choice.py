"""``--quantization auto``: the fastest weight format this CPU runs among those verified for the model.

Candidates: the model's verified formats (``kvscope.common.models.registry.ModelSpec.verified_formats``, names
of :data:`FORMATS`; a model that is not registered: float32 and bfloat16,
``kvscope.common.models.registry.verified_formats``). Speed: the start-up kernel probe
(:func:`kvscope.engine.platform.kernel_probe.probe_cpu_kernels`), never the CPU's name, so an AMD EPYC without
AMX gets what *its* probe measured. A format's cost at ``n`` rows is the time of the kernel it runs there: its
dense dtype's for float32/bfloat16; for int8/gguf (int4) the compact kernel up to the crossover
``choice.max_rows``, for gguf then kvscope's AMX int4 matmul up to ``choice.batched_rows`` (where the probe
found it faster than the dense copy: ``int4_amx@n``), and the dense copy above, as
:class:`kvscope.engine.weights.quant.CompactLinearKernel` switches (``runs_batched``). Leaving the AMX rows
out scored gguf at the dense copy's cost there, level with int8 on an AMX Xeon, and the noise of one start-up
probe then picked int8 on some starts, several times slower a decode step (int8 runs neither the fused decode
step nor the AMX matmul). The score is the geometric mean over the probed row counts of cost / float32 cost
(every batch size weighs the same: batch 1 is the latency a lone user sees, batch 32+ the throughput under
load); the lowest score wins, ties go to the earlier (higher-precision) entry of :data:`FORMATS`.

The probe times matmuls, not decode steps. Where kvscope's CPU kernels are loaded (``cpu_kernels``: they hold
gguf's 4-bit blocks) and the probe found the compact int4 kernel faster than the dense one at one row or more,
gguf's decode step runs as one C++ call up to those rows (engine/platform/fused_decode.py) with paged decode
attention and fused norms around the matmuls above them: the eager step's many small torch ops are gone, which
no matmul timing shows. Then gguf is chosen whatever the matmul scores say (they are still logged): on an AMD
EPYC without AMX the scores of int8 and gguf tied and the tie went to int8, whose decode steps were several
times slower (docs/benchmarks.md "The format chooser on an AMD EPYC and an AMX Xeon").

Explicit flags win: ``--dtype X`` with ``--quantization auto`` means dense weights in X (no chooser), and an
explicit ``--quantization`` never reaches this module. Off CPU, auto is ``none`` (the compact kernels are
CPU-only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvscope.common.weight_formats import VERIFIABLE_FORMATS, format_flags
from kvscope.engine.platform.kernel_probe import KernelChoice

FORMATS = VERIFIABLE_FORMATS
"""The candidates, highest precision first; each runs with the flags of
``kvscope.common.weight_formats.format_flags``, compact formats (int8, gguf) in the probe's dense dtype (for
activations, the LM head and the dense copy used for batched rows: ``--dtype auto``)."""
_KERNEL = {"float32": "float32", "bfloat16": "bfloat16", "int8": "int8", "gguf": "int4"}


@dataclass(frozen=True, slots=True)
class FormatChoice:
    """The outcome of :func:`choose_format`, for the start-up log, /v1/models and the metrics."""

    format: str
    """A :data:`FORMATS` name."""
    dtype: str
    """``--dtype`` as resolved (``float32``/``bfloat16``)."""
    quantization: str
    """``--quantization`` as resolved (``none``/``int8``/``gguf``)."""
    reason: str
    """Why: the probe's scores, or the flag that decided."""
    scores: dict[str, float] = field(default_factory=dict)
    """Candidate → geometric-mean cost relative to float32 (1.0 = as fast as float32; lower is faster)."""


def format_cost_ms(fmt: str, choice: KernelChoice, rows: int) -> float:
    """Probe time (ms) of the kernel format ``fmt`` runs at ``rows`` rows (module doc). Raises KeyError when
    the probe has no timing for it."""
    kernel = _KERNEL[fmt]
    dense = str(choice.dense_dtype).removeprefix("torch.")
    if kernel in ("int4", "int8") and rows > choice.max_rows.get(kernel, 0):
        amx = f"int4_amx@{rows}"
        if kernel == "int4" and rows <= choice.batched_rows and amx in choice.timings_ms:
            return choice.timings_ms[amx]
        kernel = dense
    return choice.timings_ms[f"{kernel}@{rows}"]


def probe_rows(choice: KernelChoice) -> list[int]:
    """The row counts the probe timed (from its ``float32@N`` keys), ascending."""
    return sorted(int(key.split("@")[1]) for key in choice.timings_ms if key.startswith("float32@"))


def format_score(fmt: str, choice: KernelChoice) -> float:
    """Geometric mean over :func:`probe_rows` of ``format_cost_ms(fmt) / format_cost_ms("float32")``."""
    rows = probe_rows(choice)
    if not rows:
        raise ValueError("the kernel probe recorded no float32 timings")
    logs = [math.log(format_cost_ms(fmt, choice, n) / format_cost_ms("float32", choice, n)) for n in rows]
    return math.exp(sum(logs) / len(logs))


def choose_format(
    verified: tuple[str, ...],
    choice: KernelChoice | None,
    *,
    source: str = "",
    device_type: str = "cpu",
    has_gguf: bool = True,
    cpu_kernels: bool = False,
) -> FormatChoice:
    """The fastest of ``verified`` on this CPU by ``choice`` (module doc). ``source`` names where the
    verification comes from (logged); ``has_gguf``: False drops ``gguf`` (the model is not a GGUF);
    ``cpu_kernels``: kvscope's CPU kernels loaded, so gguf is preferred where the probe's compact int4 kernel
    wins at one row or more (module doc). Off CPU,
    or without a probe: bfloat16 on CUDA, float32 on CPU. Raises ValueError for an unknown format name."""
    unknown = [f for f in verified if f not in FORMATS]
    if unknown:
        raise ValueError(f"unknown weight formats {unknown}; known: {', '.join(FORMATS)}")
    if device_type != "cpu":
        return FormatChoice(
            "bfloat16", "bfloat16", "none", f"device {device_type}: compact formats are CPU-only"
        )
    candidates = [f for f in FORMATS if f in verified and (has_gguf or f != "gguf")]
    if choice is None or not candidates or not probe_rows(choice):
        return FormatChoice(
            "float32", "float32", "none", "no kernel probe timings or no verified format: float32"
        )
    # a format whose own kernel the probe could not time is not a candidate: bfloat16 where oneDNN does not
    # pack it (an AVX2-only CPU, kernel_probe.probe_cpu_kernels); float32 is always timed
    first = probe_rows(choice)[0]
    candidates = [f for f in candidates if f"{_KERNEL[f]}@{first}" in choice.timings_ms] or ["float32"]
    scores = {f: round(format_score(f, choice), 4) for f in candidates}
    best = min(candidates, key=lambda f: (scores[f], candidates.index(f)))
    listed = ", ".join(f"{f} {scores[f]:.2f}" for f in candidates)
    probe = (
        f"the start-up probe (cost vs float32, geometric mean over {len(probe_rows(choice))} batch sizes: "
        f"{listed})"
    )
    fused_rows = choice.max_rows.get("int4", 0)
    if cpu_kernels and "gguf" in candidates and fused_rows >= 1:
        best = "gguf"
        reason = (
            f"kvscope's CPU kernels run gguf's decode step (the probe's int4 kernel beats the dense one up "
            f"to {fused_rows} rows; the fused step's own row limit is timed on the model at start-up), "
            f"which the matmul probe does not time; {probe}"
        )
    else:
        reason = f"fastest verified format by {probe}"
    dtype, quantization = format_flags(best, str(choice.dense_dtype).removeprefix("torch."))
    reason += f"; verified: {', '.join(verified)}{f' ({source})' if source else ''}"
    return FormatChoice(best, dtype, quantization, reason, scores)


def pinned_format(dtype: str, quantization: str, reason: str) -> FormatChoice:
    """The FormatChoice of explicit flags (``dtype`` resolved), named after :data:`FORMATS` where one matches
    (``int4`` and float16 keep their own names)."""
    name = quantization if quantization != "none" else dtype
    return FormatChoice(name, dtype, quantization, reason)
